"""link_stream.py, the timed TCP stream link.check measures with when a node lacks iperf3: run
as the nodes run it (``python3 link_stream.py ...``), receiver and sender on this machine."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from sparkdeploy.core.packaged import helper

HELPER = str(helper("link_stream.py"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_what_the_receiver_counts_is_what_was_sent():
    port = free_port()
    # the sender starts first: it waits for the receiver to listen, as on the nodes
    send = subprocess.Popen([sys.executable, HELPER, "send", "--to", "127.0.0.1", "--port",
                             str(port), "--seconds", "0.3", "--bind", "127.0.0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.2)
    got = subprocess.run([sys.executable, HELPER, "serve", "--bind", "127.0.0.1", "--port",
                          str(port), "--wait", "10"], capture_output=True, text=True, timeout=60)
    out, err = send.communicate(timeout=60)
    assert got.returncode == 0 and send.returncode == 0, (got.stderr, err)
    received, sent = json.loads(got.stdout), json.loads(out)
    assert received["bytes"] == sent["bytes"] > 0
    assert 0 < received["seconds"] <= sent["seconds"]


def test_a_port_in_use_or_nobody_listening_is_one_line_and_exit_1():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, HELPER, "serve", "--bind", "127.0.0.1", "--port",
                            str(port), "--wait", "1"], capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == f"error: serve 127.0.0.1:{port}: Address already in use\n"
    r = subprocess.run([sys.executable, HELPER, "serve", "--bind", "127.0.0.1", "--port",
                        str(free_port()), "--wait", "0.2"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and r.stderr.endswith(": timed out\n") and r.stderr.count("\n") == 1


def test_tools_says_whether_iperf3_is_there(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("link_stream", HELPER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod.shutil, "which", lambda n: "/usr/bin/iperf3" if n == "iperf3" else None)
    assert mod.tools() == {"iperf3": "/usr/bin/iperf3"}
    monkeypatch.setattr(mod.shutil, "which", lambda n: None)
    assert mod.tools() == {"iperf3": None}
