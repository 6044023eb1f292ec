"""Run ``inv ARGS`` with an audit hook that records every socket the process connects to (and
every host name it resolves) as JSON lines in ``$SPARKDEPLOY_AUDIT_LOG``.

Used by the lab tests to prove a step run against the lab profile talks only to the lab."""

import json
import os
import sys

LOG = os.environ["SPARKDEPLOY_AUDIT_LOG"]


def _hook(event: str, args: tuple) -> None:
    if event == "socket.connect":
        addr = args[1]
        rec = {"event": "connect",
               "address": addr if isinstance(addr, (str, bytes)) else list(addr[:2])}
    elif event == "socket.getaddrinfo":
        rec = {"event": "getaddrinfo", "host": args[0], "port": args[1]}
    else:
        return
    with open(LOG, "a") as fh:
        fh.write(json.dumps(rec, default=lambda b: b.decode(errors="replace")) + "\n")


sys.addaudithook(_hook)

from invoke.main import program  # noqa: E402

sys.argv = ["inv", *sys.argv[1:]]
program.run()
