"""sparkdeploy's gateway: one OpenAI-compatible endpoint in front of every model served
(standard library only: the head's python3 runs it, as ``serve_unit.py`` is run).

Routes by the request's ``model``:

- ``GET /v1/models``: every model behind it, merged from each backend's own ``/v1/models``
  (asked again on every call, at once, each within ``--backend-timeout``; a backend that does
  not answer is left out and named in ``X-Sparkdeploy-Unreachable``).
- ``POST /v1/chat/completions``, ``/v1/completions`` (and any other ``POST /v1/...`` whose body
  names a ``model``): forwarded to the backend serving that model on a kept-alive connection;
  the answer goes back as it comes, each piece read from the backend written to the client at
  once (SSE streams are relayed chunk by chunk, never buffered).
- An unknown model: 404 with an OpenAI-style error body naming the models that exist (the
  table is read again from the backends first, at most once a second). No ``model``: 400.
- A backend that cannot be reached: 502 naming the model and the backend's address; a backend
  that fails midway closes the client's stream (its chunked answer never ends).
- With an API key, ``/v1/*`` needs ``Authorization: Bearer <key>`` (401 otherwise). The gateway
  holds only the key's SHA-256 (``api_key_sha256`` in ``--config``: the node never stores the
  key itself) and compares the digest of what the client sent (``hmac.compare_digest``);
  ``/health`` and ``/metrics`` stay open, as vLLM's do. The client's Authorization header is
  passed to the backend as it came (the engines hold the deployment's key). Nothing of the key is
  logged, in ``/metrics`` or on the command line.
- ``GET /metrics``: Prometheus text, per model: requests, errors (an answer >= 400, or a backend
  that failed), prompt and completion tokens (from ``usage`` when an answer carries one), and
  the time to first byte (the request read to the backend's first byte of the answer) as a
  histogram. ``GET /health``: 200.

Configuration: ``--config FILE`` (JSON: ``{"listen": "HOST:PORT", "backends": [{"url": URL,
"models": [NAME, ...]}, ...], "api_key_sha256": HEX}``; ``models`` optional: names routed
there before the backend answers ``/v1/models``) and/or ``--listen``, ``--backend URL``
(repeated). Once listening it prints one JSON line on stdout,
``{"listening": "http://HOST:PORT", "models": {...}}``; a log line per request goes to stderr
(method, path, model, status, seconds: never a header).

``start_in_thread(config)`` serves from a daemon thread (tests, the perf figures).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import http.client
import json
import os
import queue
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

REFRESH_MIN_S = 1.0
"""An unknown model asks the backends again at most this often."""
BACKEND_TIMEOUT_S = 5.0
"""Connecting to a backend, and its ``/v1/models`` answer, within this."""
READ_TIMEOUT_S = 600.0
"""Seconds without a byte from a backend answering a generation before it counts as failed."""
IDLE_PER_BACKEND = 256
"""Kept-alive connections per backend (one per concurrent request is reused)."""
TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0)
HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "trailers", "transfer-encoding", "upgrade",
                        "content-length", "host"))
MAX_BODY = 64 * 1024 * 1024


class Backend:
    """One engine's endpoint: its address and a pool of kept-alive connections."""

    def __init__(self, url: str, models: list[str] | None = None) -> None:
        u = urlsplit(url if "://" in url else "http://" + url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"backend {url!r}: not an http://HOST:PORT URL")
        self.url = f"http://{u.netloc}{u.path.rstrip('/')}"
        self.host, self.port = u.hostname, u.port or 80
        self.prefix = u.path.rstrip("/")
        if self.prefix.endswith("/v1"):
            self.prefix = self.prefix[:-3]
        self.static = list(models or [])
        self._idle: queue.LifoQueue[http.client.HTTPConnection] = queue.LifoQueue()

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def take(self) -> tuple[http.client.HTTPConnection, bool]:
        """A kept-alive connection (True: reused, may have been closed by the backend) or a
        new one."""
        try:
            return self._idle.get_nowait(), True
        except queue.Empty:
            return self.connect(BACKEND_TIMEOUT_S), False

    def give_back(self, conn: http.client.HTTPConnection) -> None:
        if self._idle.qsize() < IDLE_PER_BACKEND:
            self._idle.put(conn)
        else:
            conn.close()

    def models(self, auth: str | None, timeout: float) -> list[dict]:
        conn = self.connect(timeout)
        try:
            conn.request("GET", self.prefix + "/v1/models",
                         headers={"Authorization": auth} if auth else {})
            r = conn.getresponse()
            body = r.read()
            if r.status != 200:
                raise OSError(f"HTTP {r.status}")
            data = json.loads(body).get("data")
            if not isinstance(data, list):
                raise ValueError("no data list")
            return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        finally:
            conn.close()


class Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(TTFB_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, v: float) -> None:
        i = 0
        while i < len(TTFB_BUCKETS) and v > TTFB_BUCKETS[i]:
            i += 1
        self.counts[i] += 1
        self.total += v


class Figures:
    """The per-model counters behind ``/metrics``."""

    COUNTERS = (("requests", "Requests routed to the model."),
                ("errors", "Requests answered >= 400 by the backend, or whose backend failed."),
                ("prompt_tokens", "Prompt tokens in the answers' usage."),
                ("completion_tokens", "Completion tokens in the answers' usage."))

    REFUSED = (("unknown_model", "Requests naming a model served by no backend (404)."),
               ("unauthorized", "Requests without the API key (401)."))

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.refused = {k: 0 for k, _ in self.REFUSED}
        self.counts: dict[str, dict[str, float]] = {}
        self.ttfb: dict[str, Histogram] = {}

    def add(self, model: str, **counts: float) -> None:
        with self.lock:
            row = self.counts.setdefault(model, {k: 0 for k, _ in self.COUNTERS})
            for k, v in counts.items():
                row[k] += v

    def refuse(self, why: str) -> None:
        with self.lock:
            self.refused[why] += 1

    def first_byte(self, model: str, seconds: float) -> None:
        with self.lock:
            self.ttfb.setdefault(model, Histogram()).observe(seconds)

    def text(self) -> str:
        out: list[str] = []
        with self.lock:
            for key, help_ in self.REFUSED:
                name = f"sparkdeploy_gateway_{key}_total"
                out += [f"# HELP {name} {help_}", f"# TYPE {name} counter",
                        f"{name} {self.refused[key]}"]
            for key, help_ in self.COUNTERS:
                name = f"sparkdeploy_gateway_{key}_total"
                out += [f"# HELP {name} {help_}", f"# TYPE {name} counter"]
                for model, row in sorted(self.counts.items()):
                    out.append(f"{name}{{model={_label(model)}}} {row[key]:g}")
            name = "sparkdeploy_gateway_time_to_first_byte_seconds"
            out += [f"# HELP {name} From the request read to the backend's first byte.",
                    f"# TYPE {name} histogram"]
            for model, h in sorted(self.ttfb.items()):
                m = _label(model)
                cum = 0
                les = [f"{b:g}" for b in TTFB_BUCKETS] + ["+Inf"]
                for i, le in enumerate(les):  # no zip(strict=): that needs 3.10
                    cum += h.counts[i]
                    out.append(f'{name}_bucket{{model={m},le="{le}"}} {cum}')
                out.append(f"{name}_sum{{model={m}}} {h.total:.6f}")
                out.append(f"{name}_count{{model={m}}} {cum}")
        return "\n".join(out) + "\n"


def _printable(v: str) -> str:
    """A client's text fit for one log line (no line breaks or control characters, 200 at most)."""
    return "".join(c if c.isprintable() else "?" for c in v[:200])


def _label(v: str) -> str:
    return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class Config:
    def __init__(self, listen: str = "127.0.0.1:0", backends: list[Backend] | None = None,
                 api_key: str | None = None, backend_timeout: float = BACKEND_TIMEOUT_S,
                 log: bool = True, api_key_sha256: str | None = None) -> None:
        self.listen = listen
        self.backends = list(backends or [])
        self.api_key_sha256 = (hashlib.sha256(api_key.encode()).hexdigest() if api_key
                               else (api_key_sha256 or "").lower() or None)
        self.backend_timeout = backend_timeout
        self.log = log


class Gateway(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 512

    def __init__(self, cfg: Config) -> None:
        host, _, port = cfg.listen.rpartition(":")
        self.cfg = cfg
        self.figures = Figures()
        self.routes: dict[str, Backend] = {}
        self.routes_lock = threading.Lock()
        self.refreshed = 0.0
        for b in cfg.backends:
            for name in b.static:
                self.routes.setdefault(name, b)
        super().__init__((host.strip("[]") or "127.0.0.1", int(port)), Handler)

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        host = self.server_address[0]
        host = host.decode() if isinstance(host, bytes) else host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def ask_backends(self, auth: str | None) -> tuple[list[dict], list[str]]:
        """Every backend's models at once: (the merged list, the backends that did not answer)."""
        found: list[list[dict] | None] = [None] * len(self.cfg.backends)

        def ask(i: int, b: Backend) -> None:
            try:
                found[i] = b.models(auth, self.cfg.backend_timeout)
            except (OSError, ValueError, http.client.HTTPException):
                found[i] = None

        threads = [threading.Thread(target=ask, args=(i, b), daemon=True)
                   for i, b in enumerate(self.cfg.backends)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        merged: list[dict] = []
        down: list[str] = []
        routes: dict[str, Backend] = {}
        for i, b in enumerate(self.cfg.backends):  # no zip(strict=): that needs 3.10
            models = found[i]
            if models is None:
                down.append(b.url)
                for name in b.static:
                    routes.setdefault(name, b)
                continue
            for m in models:
                if m["id"] not in routes:
                    routes[m["id"]] = b
                    merged.append(m)
            for name in b.static:
                routes.setdefault(name, b)
        with self.routes_lock:
            # a backend that did not answer keeps the models it had
            for name, b in self.routes.items():
                if b.url in down:
                    routes.setdefault(name, b)
            self.routes = routes
            self.refreshed = time.monotonic()
        return merged, down

    def route(self, model: str, auth: str | None) -> Backend | None:
        b = self.routes.get(model)
        if b is None and time.monotonic() - self.refreshed >= REFRESH_MIN_S:
            self.ask_backends(auth)
            b = self.routes.get(model)
        return b


class _ClientGone(Exception):
    pass


class Handler(BaseHTTPRequestHandler):
    """One client connection (kept alive, HTTP/1.1: a stream is chunked); each SSE event is
    sent at once (no Nagle delay)."""

    server: Gateway
    server_version, sys_version = "sparkdeploy-gateway", ""
    protocol_version, disable_nagle_algorithm = "HTTP/1.1", True

    def log_message(self, format, *args):  # noqa: A002  (BaseHTTPRequestHandler's name)
        """Silent: one line per request of our own (``_log``), never a header."""

    def _log(self, model: str | None, status: int, started: float) -> None:
        if self.server.cfg.log:
            path = _printable(self.path.split("?", 1)[0])
            sys.stderr.write(f"gateway: {self.command} {path} model={_printable(model or '-')} {status} "
                             f"{time.monotonic() - started:.3f}s\n")

    def _json(self, code: int, obj: dict, extra: dict | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str, kind: str, param: str | None = None) -> None:
        err = {"message": message, "type": kind, "param": param, "code": code}
        self._json(code, {"object": "error", **err, "error": err})

    def _authorized(self) -> bool:
        want = self.server.cfg.api_key_sha256
        if not want:
            return True
        given = self.headers.get("Authorization", "")
        token = given[len("Bearer "):] if given.startswith("Bearer ") else ""
        if token and hmac.compare_digest(hashlib.sha256(token.encode()).hexdigest(), want):
            return True
        self.server.figures.refuse("unauthorized")
        self._error(401, "missing or wrong API key (Authorization: Bearer ...)",
                    "AuthenticationError")
        return False

    def do_GET(self):  # noqa: N802
        """``/health`` and ``/metrics`` (open, not logged: scraped often), ``/v1/models``."""
        started = time.monotonic()
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if path == "/metrics":
            data = self.server.figures.text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if path.startswith("/v1/") and not self._authorized():
            status = 401
        elif path == "/v1/models":
            merged, down = self.server.ask_backends(self.headers.get("Authorization"))
            extra = {"X-Sparkdeploy-Unreachable": ", ".join(down)} if down else None
            self._json(200, {"object": "list", "data": merged}, extra)
            status = 200
        else:
            self._error(404, f"no route {path}", "NotFoundError")
            status = 404
        self._log(None, status, started)

    def do_POST(self):  # noqa: N802
        started = time.monotonic()
        path = self.path.split("?", 1)[0]
        if not path.startswith("/v1/"):
            self._error(404, f"no route {path}", "NotFoundError")
            self._log(None, 404, started)
            return
        if not self._authorized():
            self._log(None, 401, started)
            return
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if not 0 <= n <= MAX_BODY or "Transfer-Encoding" in self.headers:
            self.close_connection = True
            self._error(400, "a request body needs a Content-Length (at most 64 MiB)",
                        "BadRequestError")
            return
        raw = self.rfile.read(n) if n else b""
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = None
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model:
            self._error(400, "the request body must be a JSON object naming a model",
                        "BadRequestError", "model")
            self._log(None, 400, started)
            return
        auth = self.headers.get("Authorization")
        backend = self.server.route(model, auth)
        if backend is None:
            names = sorted(self.server.routes)
            self.server.figures.refuse("unknown_model")
            self._error(404, f"The model `{model}` does not exist here; models: "
                        f"{', '.join(names) or 'none'}", "NotFoundError", "model")
            self._log(model, 404, started)
            return
        status = self._forward(backend, model, path, raw, started)
        self._log(model, status, started)

    def _forward(self, b: Backend, model: str, path: str, raw: bytes, started: float) -> int:
        figs = self.server.figures
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["Content-Length"] = str(len(raw))
        try:
            conn, resp = self._send(b, path, raw, headers)
        except (OSError, http.client.HTTPException) as e:
            figs.add(model, requests=1, errors=1)
            self._error(502, f"model `{model}`: its backend {b.url} cannot be reached "
                        f"({type(e).__name__}: {e})", "BadGateway")
            return 502
        figs.first_byte(model, time.monotonic() - started)
        status = resp.status
        chunked = resp.chunked
        self.send_response_only(status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in HOP_BY_HOP:
                self.send_header(k, v)
        if chunked or resp.length is None:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(resp.length))
        self.end_headers()
        usage = Usage(stream=chunked or resp.length is None)
        try:
            failed = not (self._pass_chunked(resp, usage) if chunked
                          else self._relay(resp, usage))
        except _ClientGone:
            failed = True
        if failed:
            self.close_connection = True  # the answer never ends well: the client sees it
        if failed or resp.will_close or not resp.isclosed():
            conn.close()
        else:
            b.give_back(conn)
        prompt, completion = usage.tokens()
        figs.add(model, requests=1, errors=1 if failed or status >= 400 else 0,
                 prompt_tokens=prompt, completion_tokens=completion)
        return status

    def _pass_chunked(self, resp: http.client.HTTPResponse, usage: Usage) -> bool:
        """A chunked answer passed on as its raw bytes come (the backend's own chunks: one SSE
        event each), its framing followed to know its end. False: it did not end well."""
        frame, fp = Framing(), resp.fp
        while fp is not None and not frame.done:
            try:
                data = fp.read1(65536)
                if not data:
                    return False
                frame.feed(data)
            except (OSError, ValueError):
                return False
            usage.feed(data)
            self._write(data)
        resp.close()  # the connection itself stays open, for the next request
        return frame.done

    def _relay(self, resp: http.client.HTTPResponse, usage: Usage) -> bool:
        """An answer of a known length passed on as it comes; one of no length (ended by the
        backend closing) sent chunked, each piece a chunk."""
        framed = resp.length is None
        while True:
            try:
                data = resp.read1(65536)
            except (OSError, http.client.HTTPException):
                return False
            if not data:
                break
            usage.feed(data)
            self._write(b"%x\r\n%s\r\n" % (len(data), data) if framed else data)
        if framed:
            self._write(b"0\r\n\r\n")
        elif resp.length:
            return False  # the backend closed before the whole of its answer
        resp.close()  # read1 leaves it open at the end; the connection stays, for the next one
        return True

    def _send(self, b: Backend, path: str, raw: bytes, headers: dict):
        """The backend's answer (its headers read), on a kept-alive connection when one is idle;
        a kept-alive connection the backend closed meanwhile is replaced once."""
        for _ in range(2):
            conn, reused = b.take()
            try:
                conn.sock.settimeout(READ_TIMEOUT_S)
                conn.request("POST", b.prefix + path, body=raw, headers=headers)
                return conn, conn.getresponse()
            except (OSError, http.client.HTTPException):
                conn.close()
                if not reused:
                    raise
        raise OSError("unreachable")  # pragma: no cover  (the second try raises or returns)

    def _write(self, data: bytes) -> None:
        try:
            self.wfile.write(data)
        except OSError as e:
            raise _ClientGone() from e


class Framing:
    """Follows a chunked body's framing (RFC 9112, 7.1) as its raw bytes pass: ``done`` once
    the last chunk and the trailer section are through; ValueError on what is not chunked."""

    def __init__(self) -> None:
        self.left = 0  # bytes of the current chunk's data and its CRLF not yet passed
        self.line = b""  # the start of a size or trailer line
        self.last = False  # the zero-size chunk passed: trailer lines until an empty one
        self.done = False

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n:
            if self.done:
                raise ValueError("bytes after the end of a chunked body")
            if self.left:
                step = min(self.left, n - i)
                self.left -= step
                i += step
                continue
            j = data.find(b"\n", i)
            if j < 0:
                self.line += data[i:]
                if len(self.line) > 4096:
                    raise ValueError("a chunk line of more than 4096 bytes")
                return
            line, self.line, i = (self.line + data[i:j]).rstrip(b"\r"), b"", j + 1
            if self.last:
                self.done = not line
                continue
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size < 0:
                raise ValueError(f"a negative chunk size {line!r}")
            self.last, self.left = size == 0, size + 2 if size else 0


class Usage:
    """The answer's ``usage`` (prompt and completion tokens), when it carries one: the JSON
    body, or the SSE event that holds it (looked for only in pieces that name it)."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.buf = bytearray()
        self.found: dict | None = None
        self.tail = b""

    def feed(self, data: bytes) -> None:
        if not self.stream:
            if len(self.buf) < MAX_BODY:
                self.buf += data
            return
        text = self.tail + data
        # keep the last incomplete event for the next piece (an event may span two)
        cut = text.rfind(b"\n\n")
        whole, self.tail = (text[:cut], text[cut + 2:]) if cut >= 0 else (b"", text[-65536:])
        if b'"usage"' not in whole:
            return
        for line in whole.split(b"\n"):
            if line.startswith(b"data:") and b'"usage"' in line:
                self._take(line[5:])

    def _take(self, raw: bytes) -> None:
        try:
            u = json.loads(raw).get("usage")
        except (ValueError, AttributeError):
            return
        if isinstance(u, dict):
            self.found = u

    def tokens(self) -> tuple[int, int]:
        if not self.stream and self.buf:
            self._take(bytes(self.buf))
        elif self.stream and b'"usage"' in self.tail:
            for line in self.tail.split(b"\n"):
                if line.startswith(b"data:"):
                    self._take(line[5:])
        u = self.found or {}
        p, c = u.get("prompt_tokens"), u.get("completion_tokens")
        return (p if isinstance(p, int) else 0, c if isinstance(c, int) else 0)


def load_config(ns: argparse.Namespace) -> Config:
    doc: dict = {}
    if ns.config:
        with open(ns.config, encoding="utf-8") as f:
            doc = json.load(f)
        if not isinstance(doc, dict):
            raise ValueError(f"{ns.config}: not a JSON object")
    backends = [Backend(b["url"], b.get("models")) for b in doc.get("backends", [])]
    backends += [Backend(u) for u in ns.backend or []]
    digest = doc.get("api_key_sha256")
    if digest is not None and not (isinstance(digest, str) and len(digest) == 64
                                   and all(ch in "0123456789abcdefABCDEF" for ch in digest)):
        raise ValueError("api_key_sha256: not a SHA-256 in hex")
    return Config(listen=ns.listen or doc.get("listen") or "127.0.0.1:8000", backends=backends,
                  api_key_sha256=digest,
                  backend_timeout=float(doc.get("backend_timeout", BACKEND_TIMEOUT_S)),
                  log=not ns.quiet)


def start_in_thread(cfg: Config) -> Gateway:
    gw = Gateway(cfg)
    threading.Thread(target=gw.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                     name="gateway").start()
    return gw


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="a JSON file: listen, backends, api_key_sha256")
    p.add_argument("--listen", help="HOST:PORT (default 127.0.0.1:8000)")
    p.add_argument("--backend", action="append", help="an engine's URL (repeat)")
    p.add_argument("--quiet", action="store_true", help="no line per request on stderr")
    ns = p.parse_args(argv)
    try:
        cfg = load_config(ns)
        gw = Gateway(cfg)
    except (OSError, ValueError, KeyError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    gw.ask_backends(None)  # keyed engines answer 401 here: the config's models route them
    print(json.dumps({"listening": gw.url,
                      "models": {m: b.url for m, b in sorted(gw.routes.items())}}), flush=True)
    try:
        gw.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        gw.server_close()
    return 0


if __name__ == "__main__":
    os.environ.pop("PYTHONWARNINGS", None)
    raise SystemExit(main())
