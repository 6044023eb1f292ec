"""The HTTP server base the lab's hub and package index share: threaded, served from a
background thread (``start``/``stop``), its ``url``; a daemon's main loop; a readiness wait."""

from __future__ import annotations

import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from sparkdeploy.core.wait import WaitTimeout, wait_for

ACCEPT_TIMEOUT_S = 0.5


class LabServer(ThreadingHTTPServer):
    """A lab HTTP server served from a background thread (the hub and the package index)."""

    daemon_threads = True
    allow_reuse_address = True
    thread_name = "lab-server"

    def __init__(self, addr: tuple[str, int], handler: type[BaseHTTPRequestHandler]):
        super().__init__(addr, handler)
        # a connection the client dropped between select and accept leaves accept waiting for
        # the next one, and ``stop`` waiting for it: the wait is bounded (connections accepted
        # are blocking as before)
        self.socket.settimeout(ACCEPT_TIMEOUT_S)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else host
        host = host if ":" not in host else f"[{host}]"
        return f"http://{host}:{port}"

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self) -> Self:
        self._thread = threading.Thread(target=self.serve_forever, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread:
            self._thread.join(timeout=5)


def wait_ready(url: str, timeout: float = 60.0) -> bool:
    """Poll GET <url>/_lab/health until it answers 200 (True) or timeout passes (False)."""
    def healthy() -> bool:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/_lab/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        return wait_for(healthy, deadline=timeout, interval=0.2, what=f"{url} to answer")
    except WaitTimeout:
        return False


def serve_until_stopped(server: Any, url: str) -> int:
    """A lab daemon's main loop: say READY, serve until interrupted, stop cleanly."""
    print(f"READY {url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
