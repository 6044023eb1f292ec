"""sparkdeploy's node-side helper for measuring the fast link (standard library only).

Subcommands (each prints one JSON object on stdout):

  tools
      {"iperf3": PATH | null}: whether this node has ``iperf3``.
  serve --bind ADDR --port P [--wait S]
      Listen on ADDR:P (the node's fast-link address), take one connection within S seconds,
      read until the sender closes it, then answer {"bytes", "seconds"}: what arrived, from the
      first byte to the last (the receiver's count is the measurement).
  send --to ADDR --port P --seconds S [--bind ADDR]
      Connect to ADDR:P from ADDR (retrying while the receiver is not listening yet), send as
      fast as the link takes it for S seconds, close, wait for the receiver to close; answer
      {"bytes", "seconds"} as sent.

A failure prints one line on stderr and exits 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import time

try:  # in the package (the controller, the tests)
    from . import protocol
except ImportError:  # a script: protocol.py beside it (a checkout) or a directory up (staged on a node)
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [_here, os.path.dirname(_here)]
    import protocol  # type: ignore[import-not-found, no-redef]

CHUNK = 1 << 20
CONNECT_S = 8.0


def tools() -> dict:
    return {"iperf3": shutil.which("iperf3")}


def serve(bind: str, port: int, wait: float) -> dict:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((bind, port))
        srv.listen(1)
        srv.settimeout(wait)
        conn, _ = srv.accept()
    with conn:
        conn.settimeout(max(wait, 30.0))
        buf = bytearray(CHUNK)
        got, first, last = 0, None, None
        while True:
            n = conn.recv_into(buf)
            if not n:
                break
            last = time.monotonic()
            if first is None:
                first = last
            got += n
    secs = (last - first) if first is not None and last is not None else 0.0
    return {"bytes": got, "seconds": round(secs, 6)}


def _connect(to: str, port: int, bind: str | None) -> socket.socket:
    def attempt() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if bind:
                s.bind((bind, 0))
            s.settimeout(5)
            s.connect((to, port))
        except OSError:
            s.close()
            raise
        return s

    # refused: the receiver is not listening yet
    return protocol.retry(attempt, errors=(ConnectionRefusedError,),
                          deadline=protocol.Deadline(CONNECT_S), pause=lambda n: 0.05)


def send(to: str, port: int, seconds: float, bind: str | None) -> dict:
    data = memoryview(bytes(CHUNK))
    sent = 0
    with _connect(to, port, bind) as s:
        s.settimeout(30)
        start = time.monotonic()
        end = protocol.Deadline(seconds)
        while not end.passed():
            s.sendall(data)
            sent += len(data)
        s.shutdown(socket.SHUT_WR)
        while s.recv(CHUNK):  # the receiver closes once it has read everything
            pass
        took = time.monotonic() - start
    return {"bytes": sent, "seconds": round(took, 6)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="link_stream.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("tools")
    sv = sub.add_parser("serve")
    sv.add_argument("--bind", required=True)
    sv.add_argument("--port", type=int, required=True)
    sv.add_argument("--wait", type=float, default=15.0)
    sd = sub.add_parser("send")
    sd.add_argument("--to", required=True)
    sd.add_argument("--port", type=int, required=True)
    sd.add_argument("--seconds", type=float, required=True)
    sd.add_argument("--bind")
    a = p.parse_args(argv)
    try:
        if a.cmd == "tools":
            out = tools()
        elif a.cmd == "serve":
            out = serve(a.bind, a.port, a.wait)
        else:
            out = send(a.to, a.port, a.seconds, a.bind)
    except OSError as e:
        what = f"{a.bind}:{a.port}" if a.cmd == "serve" else f"{a.to}:{a.port}"
        return protocol.fail(f"{a.cmd} {what}: {e.strerror or e}")
    protocol.answer(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
