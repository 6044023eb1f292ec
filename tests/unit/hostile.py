"""A small HTTP server on loopback that misbehaves on purpose: it answers every request the way
it is told (a body, malformed JSON, a stream that trickles, nothing at all) and records the
headers of each request, so a test can assert what reached it."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from sparkdeploy.bench.gate import PROMPTS


@dataclass
class Hostile:
    """``mode``: ``answer`` (status + body), ``silent`` (accept, read, never answer),
    ``trickle`` (headers, then one body byte every ``gap`` seconds, never ending),
    ``trickle-headers`` (one byte of the status line every ``gap`` seconds, never ending)."""

    mode: str = "answer"
    status: int = 200
    body: bytes = b"{}"
    ctype: str = "application/json"
    gap: float = 0.05
    routes: dict[str, bytes] = field(default_factory=dict)
    """Paths answered 200 with this JSON body whatever the mode (``/v1/models``, say)."""
    coherent: bool = False
    """Answer the coherence gate's prompts right (a stream as vLLM sends it), whatever the mode:
    what the server then does wrong reaches the measured requests."""
    gate_tokens: Callable[[str], int] = lambda prompt: 20
    """The ``usage.prompt_tokens`` a coherent answer reports for a gate prompt."""
    seen: list[dict[str, str]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            f = conn.makefile("rb")
            while not self._stop.is_set():
                line = f.readline(65536)
                if not line:
                    return
                self.paths.append(line.decode(errors="replace").split(" ")[1:2][0]
                                  if b" " in line else "")
                headers, length = {}, 0
                while True:
                    h = f.readline(65536).strip()
                    if not h:
                        break
                    k, _, v = h.decode(errors="replace").partition(":")
                    headers[k.strip().lower()] = v.strip()
                    if k.strip().lower() == "content-length":
                        length = int(v)
                body = f.read(length) if length else b""
                self.seen.append(headers)
                if self.coherent and (answer := _gate_answer(body, self.gate_tokens)) is not None:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Content-Length: %d\r\n\r\n" % len(answer) + answer)
                    continue
                if self.paths[-1] in self.routes:
                    body = self.routes[self.paths[-1]]
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
                    continue
                if self.mode == "silent":
                    self._stop.wait()
                    return
                if self.mode == "trickle-headers":
                    while not self._stop.wait(self.gap):
                        conn.sendall(b"H")
                    return
                if self.mode == "trickle":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Content-Length: 100000000\r\n\r\n")
                    while not self._stop.wait(self.gap):
                        conn.sendall(b":")
                    return
                conn.sendall(b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
                             % (self.status, self.ctype.encode(), len(self.body)) + self.body)
        except OSError:
            return
        finally:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _gate_answer(body: bytes, tokens: Callable[[str], int]) -> bytes | None:
    """The right answer, as a stream, when ``body`` asks one of the coherence gate's prompts."""
    try:
        asked = json.loads(body)["messages"][-1]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    want = dict(PROMPTS).get(asked)
    if want is None:
        return None
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"index": 0, "delta": {"content": want}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": tokens(asked), "completion_tokens": 1}}]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
