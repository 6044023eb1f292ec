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
  histogram; per model on demand: whether it is loaded, its loads, evictions, failed loads,
  requests answered 503, and its last load's seconds. ``GET /health``: 200.
- Models on demand: a backend whose engine is a systemd unit on this node, not running until a
  request names its model. The gateway loads it in a thread of its own, one load at a time:
  first it stops other models on demand (``evict_order``: loaded ones with no request in
  flight, the least recently used first; used = a request's start or end) until what the units
  running hold together, this one's ``need_bytes`` included, is within ``budget_bytes`` and
  ``need_bytes`` is within the node's ``MemAvailable`` plus what the stopped ones held (no such
  choice: the load fails); then it starts the unit and asks the engine's ``/v1/models`` every
  0.5 s until it lists the model (or answers 401: a keyed engine asked without the key),
  ``load_s`` at most (then the unit is stopped and the load failed). A request waits for the
  load ``wait_s`` at most, then gets a 503 with ``Retry-After`` (the model's last load's seconds
  less those this load has run, at least 1; ``wait_s`` when it never loaded; 10 and why, after a
  failed load); the load goes on. A unit already active when the gateway starts counts as
  loaded once its engine lists the model (``load_s`` at most, else it is stopped). ``GET
  /v1/models`` never asks the engine of a model on demand that is not loaded: it lists the model
  from the configuration. A loaded one whose engine cannot be reached (502) and whose unit is
  not active is no longer loaded (the next request loads it again). Each load, eviction and
  failed load is a line on stderr and an entry in ``record`` (a JSON list of the last 200, each
  beginning with its UTC time ``at``; written to a new file that then replaces the old).

Configuration: ``--config FILE`` (JSON: ``{"listen": "HOST:PORT", "backends": [{"url": URL,
"models": [NAME, ...], "on_demand": {"unit": UNIT, "need_bytes": N}}, ...], "api_key_sha256":
HEX, "backend_timeout": S, "on_demand": {"budget_bytes": N, "wait_s": S, "load_s": S,
"record": FILE, "systemctl": [ARG, ...], "meminfo": FILE}}``; ``models`` optional: names routed
there before the backend answers ``/v1/models``; a backend's ``on_demand`` makes it a model on
demand: ``unit`` its engine's systemd service on this node, ``need_bytes`` the memory its
engine takes, ``models`` then naming its one model; the top ``on_demand``, every key optional:
``budget_bytes`` what the models on demand may hold together (null: no cap but memory),
``wait_s`` a request's wait for a load (60), ``load_s`` a load's own deadline (600), ``record``
the file of loads and evictions (none by default), ``systemctl`` the argv that runs systemctl
(``["systemctl"]``: ``ARGV VERB -- UNIT``, never through a shell), ``meminfo`` where
``MemAvailable`` is read (``/proc/meminfo``; unreadable: no memory check)) and/or ``--listen``,
``--backend URL`` (repeated). Once listening it prints one JSON line on stdout,
``{"listening": "http://HOST:PORT", "models": {...}}``; a log line per request goes to stderr
(method, path, model, status, seconds: never a header).

``start_in_thread(config)`` serves from a daemon thread (tests, the perf figures);
``Config(units=...)`` replaces systemctl by an object with ``start(unit) -> error line or None``,
``stop(unit)``, ``active(unit) -> bool`` (tests).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import http.client
import json
import math
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple, Protocol
from urllib.parse import urlsplit

try:  # in the package (the controller, the tests)
    from . import protocol
except ImportError:  # a script: protocol.py beside it (serve.gateway puts it there, a checkout)
    sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
    import protocol  # type: ignore[import-not-found, no-redef]

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
WAIT_S = 60.0
"""A request's wait for its model on demand to load, by default."""
LOAD_S = 600.0
"""A load's own deadline (the unit started, the engine listing the model), by default."""
LOAD_POLL_S = 0.5
"""A loading engine's ``/v1/models`` is asked this often."""
FAILED_RETRY_S = 10
"""``Retry-After`` after a failed load."""
RECORD_KEEP = 200
"""Entries kept in the record of loads."""
MEMINFO = "/proc/meminfo"
START_STOP_TIMEOUT_S = 180.0
IS_ACTIVE_TIMEOUT_S = 10.0
UNIT_NAME = re.compile(r"[A-Za-z0-9@._:-]+\.service")
"""A systemd service's name, matched whole."""
ON_DEMAND_KEYS = ("budget_bytes", "wait_s", "load_s", "record", "systemctl", "meminfo")
UNLOADED, LOADING, LOADED = "unloaded", "loading", "loaded"


class HTTPStatus(OSError):
    """A backend's answer other than 200."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


def _positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _positive(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


class Backend:
    """One engine's endpoint: its address and a pool of kept-alive connections. With
    ``on_demand`` (``{"unit": UNIT, "need_bytes": N}``) a model on demand: ``unit`` is its
    engine's systemd service, ``need_bytes`` the memory the engine takes, ``models`` its one
    model."""

    def __init__(self, url: str, models: list[str] | None = None,
                 on_demand: dict | None = None) -> None:
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
        self.unit: str | None = None
        self.need_bytes = 0
        if on_demand is not None:
            self._on_demand(on_demand)

    def _on_demand(self, spec: object) -> None:
        where = f"backend {self.url}: on_demand"
        if not isinstance(spec, dict):
            raise ValueError(f"{where}: not an object")
        for key in spec:
            if key not in ("unit", "need_bytes"):
                raise ValueError(f"{where}: unknown key {key!r}")
        unit, need = spec.get("unit"), spec.get("need_bytes")
        if not isinstance(unit, str) or not UNIT_NAME.fullmatch(unit):
            raise ValueError(f"{where}.unit: {unit!r} is not a systemd service's name")
        if not isinstance(need, int) or not _positive_int(need):
            raise ValueError(f"{where}.need_bytes: {need!r} is not a positive integer")
        if len(self.static) != 1 or not isinstance(self.static[0], str) or not self.static[0]:
            raise ValueError(f"backend {self.url}: models must name the one model on demand")
        self.unit, self.need_bytes = unit, need

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
                raise HTTPStatus(r.status)
            data = json.loads(body).get("data")
            if not isinstance(data, list):
                raise ValueError("no data list")
            return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        finally:
            conn.close()

    def ready(self, model: str, auth: str | None, timeout: float) -> bool:
        """Whether its ``/v1/models`` lists ``model``, or answers 401 (an engine that wants a
        key the gateway was not given: it answers, so its model is loaded)."""
        try:
            return any(m["id"] == model for m in self.models(auth, timeout))
        except HTTPStatus as e:
            return e.status == 401
        except (OSError, ValueError, http.client.HTTPException):
            return False


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
    """What a gateway serves. ``on_demand``: the configuration's top ``on_demand`` object (how
    models on demand are loaded; ValueError naming a key that is wrong); ``units``: what starts,
    stops and asks after their units (a ``Systemctl`` of ``on_demand``'s ``systemctl`` by
    default)."""

    def __init__(self, listen: str = "127.0.0.1:0", backends: list[Backend] | None = None,
                 api_key: str | None = None, backend_timeout: float = BACKEND_TIMEOUT_S,
                 log: bool = True, api_key_sha256: str | None = None,
                 on_demand: dict | None = None, units: Units | None = None) -> None:
        self.listen = listen
        self.backends = list(backends or [])
        self.api_key_sha256 = (hashlib.sha256(api_key.encode()).hexdigest() if api_key
                               else (api_key_sha256 or "").lower() or None)
        self.backend_timeout = backend_timeout
        self.log = log
        spec = {} if on_demand is None else on_demand
        if not isinstance(spec, dict):
            raise ValueError("on_demand: not an object")
        for key in spec:
            if key not in ON_DEMAND_KEYS:
                raise ValueError(f"on_demand: unknown key {key!r}")
        budget = spec.get("budget_bytes")
        if budget is not None and not _positive_int(budget):
            raise ValueError(f"on_demand.budget_bytes: {budget!r} is not a positive integer or null")
        self.budget_bytes: int | None = budget
        for key, default in (("wait_s", WAIT_S), ("load_s", LOAD_S)):
            v = spec.get(key, default)
            if not _positive(v):
                raise ValueError(f"on_demand.{key}: {v!r} is not a positive number of seconds")
        self.wait_s = float(spec.get("wait_s", WAIT_S))
        self.load_s = float(spec.get("load_s", LOAD_S))
        self.record: str | None = spec.get("record")
        if self.record is not None and not (isinstance(self.record, str) and self.record):
            raise ValueError(f"on_demand.record: {self.record!r} is not a file name or null")
        self.meminfo: str = spec.get("meminfo", MEMINFO)
        if not (isinstance(self.meminfo, str) and self.meminfo):
            raise ValueError(f"on_demand.meminfo: {self.meminfo!r} is not a file name")
        argv = spec.get("systemctl", ["systemctl"])
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) and a for a in argv)):
            raise ValueError(f"on_demand.systemctl: {argv!r} is not a list of arguments")
        self.units: Units = units if units is not None else Systemctl(argv)
        seen: dict[tuple[str, str], str] = {}
        for b in self.backends:
            if b.unit is None:
                continue
            for key, name in (("unit", b.unit), ("model", b.static[0])):
                if (key, name) in seen:
                    raise ValueError(f"backend {b.url}: on_demand {key} {name!r} is also "
                                     f"{seen[key, name]}'s")
                seen[key, name] = b.url


class Units(Protocol):
    """Starts, stops and asks after the units of models on demand."""

    def start(self, unit: str) -> str | None:
        """Start ``unit`` and wait for systemd's answer: None, else why it failed (one line)."""

    def stop(self, unit: str) -> None:
        """Stop ``unit`` (an error is logged, not raised)."""

    def active(self, unit: str) -> bool:
        """Whether ``unit`` is active."""


class Systemctl:
    """``Units`` by systemctl: ``[*argv, VERB, "--", UNIT]``, never through a shell."""

    def __init__(self, argv: list[str] | None = None) -> None:
        self.argv = list(argv or ["systemctl"])

    def _run(self, verb: str, unit: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([*self.argv, verb, "--", unit], capture_output=True, text=True,
                              timeout=timeout, check=False)

    def start(self, unit: str) -> str | None:
        try:
            r = self._run("start", unit, START_STOP_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            return f"systemctl start {unit}: {e}"
        if r.returncode == 0:
            return None
        lines = [line.strip() for line in (r.stderr or r.stdout or "").splitlines() if line.strip()]
        return f"systemctl start {unit}: exit {r.returncode}" + (f": {lines[-1]}" if lines else "")

    def stop(self, unit: str) -> None:
        try:
            r = self._run("stop", unit, START_STOP_TIMEOUT_S)
            why = f"exit {r.returncode}: {_printable((r.stderr or '').strip())}" if r.returncode else ""
        except (OSError, subprocess.SubprocessError) as e:
            why = str(e)
        if why:
            sys.stderr.write(f"gateway: systemctl stop {unit}: {why}\n")

    def active(self, unit: str) -> bool:
        try:
            return self._run("is-active", unit, IS_ACTIVE_TIMEOUT_S).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False


class Held(NamedTuple):
    """Another model on demand whose unit runs, as an eviction sees it."""

    model: str
    need: int
    last_used: float
    in_flight: int
    loaded: bool


def evict_order(need: int, budget: int | None, available: int | None,
                others: list[Held]) -> list[str] | None:
    """The models to stop before a model taking ``need`` bytes starts, least recently used
    first, as many as it takes for what ``others`` still hold plus ``need`` to be within
    ``budget`` (None: no budget) and ``need`` to be within ``available`` (None: not known) plus
    what the stopped ones held. Only a loaded model with no request in flight may be stopped.
    None: stopping all of those is not enough."""
    candidates = sorted((h for h in others if h.loaded and h.in_flight == 0),
                        key=lambda h: h.last_used)
    held = sum(h.need for h in others)
    freed = 0
    chosen: list[str] = []
    while not ((budget is None or held + need <= budget)
               and (available is None or need <= available + freed)):
        if not candidates:
            return None
        h = candidates.pop(0)
        chosen.append(h.model)
        held -= h.need
        freed += h.need
    return chosen


def mem_available(path: str) -> int | None:
    """``MemAvailable`` in bytes from a ``/proc/meminfo``-like file; None when it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:.1f} GB"


class Record:
    """The record of loads, evictions and failed loads: a JSON list (the last ``RECORD_KEEP``),
    each entry's first key ``at`` (UTC, seconds). Written whole to a new file in the same
    directory that then replaces it (mode 0644); a failure is a line on stderr, never raised."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.lock = threading.Lock()

    def add(self, entry: dict) -> None:
        if not self.path:
            return
        with self.lock:
            try:
                self._write({"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **entry})
            except (OSError, ValueError) as e:
                sys.stderr.write(f"gateway: the record {self.path} is not written: {e}\n")

    def _write(self, entry: dict) -> None:
        assert self.path is not None
        try:
            with open(self.path, encoding="utf-8") as f:
                entries = json.load(f)
        except FileNotFoundError:
            entries = []
        except ValueError:
            entries = []  # not JSON (a hand's edit): begun again
        if not isinstance(entries, list):
            entries = []
        entries = (entries + [entry])[-RECORD_KEEP:]
        protocol.write_atomic(self.path, json.dumps(entries, indent=1) + "\n", 0o644)


class Demand:
    """A model on demand's state (changed under ``OnDemand.cond``)."""

    def __init__(self, backend: Backend) -> None:
        assert backend.unit is not None
        self.backend = backend
        self.model = backend.static[0]
        self.unit = backend.unit
        self.need = backend.need_bytes
        self.state = UNLOADED
        self.holds = False  # its unit runs (loaded, or found active at the start)
        self.last_used = 0.0
        self.in_flight = 0
        self.attempt = 0  # loads begun
        self.ended = 0  # the last load that ended
        self.load_started: float | None = None  # when the running load took the load lock
        self.why = ""  # the last failed load's
        self.loads = self.evictions = self.load_failures = self.unavailable = 0
        self.last_load_s: float | None = None


class OnDemand:
    """The models on demand of one gateway: their states, loads (one at a time, each in a thread
    of its own) and evictions."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.units = cfg.units
        self.demands = [Demand(b) for b in cfg.backends if b.unit is not None]
        self.by_backend = {d.backend: d for d in self.demands}
        self.cond = threading.Condition()
        self.load_lock = threading.Lock()
        self.record = Record(cfg.record)

    def say(self, line: str) -> None:
        sys.stderr.write(f"gateway: {line}\n")

    def of(self, b: Backend) -> Demand | None:
        return self.by_backend.get(b)

    def asleep(self) -> set[Backend]:
        """The backends of models on demand not loaded (not to be asked)."""
        with self.cond:
            return {d.backend for d in self.demands if d.state != LOADED}

    def adopt(self) -> None:
        """At the start: a unit already active is loaded once its engine answers (at once, or
        in a thread within ``load_s``)."""
        for d in self.demands:
            if not self.units.active(d.unit):
                continue
            with self.cond:
                d.holds = True
            if d.backend.ready(d.model, None, self.cfg.backend_timeout):
                with self.cond:
                    d.state = LOADED
                self.say(f"{d.model}: its unit {d.unit} is active: loaded")
                continue
            with self.cond:
                d.state, d.attempt, d.load_started = LOADING, d.attempt + 1, time.monotonic()
            threading.Thread(target=self._adopt, args=(d,), daemon=True,
                             name=f"adopt {d.model}").start()

    def _adopt(self, d: Demand) -> None:
        assert d.load_started is not None
        deadline = protocol.Deadline(self.cfg.load_s - (time.monotonic() - d.load_started))
        while not deadline.passed():
            time.sleep(LOAD_POLL_S)
            if d.backend.ready(d.model, None, self.cfg.backend_timeout):
                with self.cond:
                    d.state, d.ended = LOADED, d.attempt
                    self.cond.notify_all()
                self.say(f"{d.model}: its unit {d.unit} was active: loaded")
                return
        self.units.stop(d.unit)
        self._failed(d, f"its unit {d.unit} was active at the gateway's start but the engine did "
                        f"not list the model within {self.cfg.load_s:g} s (stopped)")

    def enter(self, d: Demand, auth: str | None) -> tuple[str, int] | None:
        """A request for ``d`` begins (``leave`` after it, whatever happens): None once the model
        is loaded, else the 503's message and its ``Retry-After`` (its load failed, or
        ``wait_s`` passed). Begins a load when none runs."""
        with self.cond:
            now = time.monotonic()
            d.last_used = now
            d.in_flight += 1
            if d.state == UNLOADED:
                d.state, d.attempt, d.load_started = LOADING, d.attempt + 1, None
                threading.Thread(target=self._load, args=(d, auth), daemon=True,
                                 name=f"load {d.model}").start()
            attempt, end = d.attempt, now + self.cfg.wait_s
            while d.state != LOADED:
                if d.ended >= attempt:
                    d.unavailable += 1
                    return (f"model `{d.model}` is on demand and could not be loaded: {d.why}",
                            FAILED_RETRY_S)
                left = end - time.monotonic()
                if left <= 0:
                    d.unavailable += 1
                    retry = self._retry_after(d)
                    return (f"model `{d.model}` is loading on demand (its engine is starting); "
                            f"try again in {retry} s", retry)
                self.cond.wait(left)
            return None

    def _retry_after(self, d: Demand) -> int:
        if d.last_load_s is None:
            return max(1, math.ceil(self.cfg.wait_s))
        ran = 0.0 if d.load_started is None else time.monotonic() - d.load_started
        return max(1, math.ceil(d.last_load_s - ran))

    def leave(self, d: Demand) -> None:
        with self.cond:
            d.in_flight -= 1
            d.last_used = time.monotonic()

    def unreachable(self, b: Backend) -> None:
        """A loaded model's engine cannot be reached: not loaded if its unit is not active."""
        d = self.of(b)
        if d is None or d.state != LOADED or self.units.active(d.unit):
            return
        with self.cond:
            if d.state != LOADED:
                return
            d.state, d.holds = UNLOADED, False
        self.say(f"{d.model}: its engine is unreachable and its unit {d.unit} is not active: "
                 "unloaded")

    def _load(self, d: Demand, auth: str | None) -> None:
        with self.load_lock:
            try:
                self._load_locked(d, auth)
            except Exception as e:  # a load never stays "loading"
                self._failed(d, f"{type(e).__name__}: {e}")

    def _load_locked(self, d: Demand, auth: str | None) -> None:
        started = time.monotonic()
        available = mem_available(self.cfg.meminfo)
        budget = self.cfg.budget_bytes
        with self.cond:
            d.load_started = started
            others = {o.model: o for o in self.demands if o is not d and o.holds}
            held = [Held(o.model, o.need, o.last_used, o.in_flight, o.state == LOADED)
                    for o in others.values()]
            chosen = evict_order(d.need, budget, available, held)
            if chosen is not None:
                for name in chosen:
                    o = others[name]
                    o.state, o.holds = UNLOADED, False
                    o.evictions += 1
        why = _room(d.need, budget, available, sum(h.need for h in held))
        if chosen is None:
            self._failed(d, f"no room: {why}, and what could make room is in use or loading")
            return
        for name in chosen:
            self.units.stop(others[name].unit)
            self.record.add({"event": "evict", "model": name, "for": d.model, "why": why})
            self.say(f"evicted {name} for {d.model} ({why})")
        with self.cond:
            d.holds = True
        error = self.units.start(d.unit)
        if error is not None:
            self.units.stop(d.unit)
            self._failed(d, error)
            return
        deadline = protocol.Deadline(self.cfg.load_s - (time.monotonic() - started))
        while not d.backend.ready(d.model, auth, self.cfg.backend_timeout):
            if deadline.passed():
                self.units.stop(d.unit)
                self._failed(d, f"its engine did not list the model within {self.cfg.load_s:g} s "
                                f"(unit {d.unit} stopped)")
                return
            time.sleep(LOAD_POLL_S)
        seconds = time.monotonic() - started
        # recorded before the waiting requests go on: the record holds what they were answered by
        self.record.add({"event": "load", "model": d.model, "seconds": round(seconds, 1),
                         "evicted": chosen})
        self.say(f"loaded {d.model} in {seconds:.1f}s"
                 + (f" (evicted {', '.join(chosen)})" if chosen else ""))
        with self.cond:
            d.state, d.ended = LOADED, d.attempt
            d.loads += 1
            d.last_load_s = seconds
            self.cond.notify_all()

    def _failed(self, d: Demand, why: str) -> None:
        self.record.add({"event": "load-failed", "model": d.model, "why": why})
        self.say(f"could not load {d.model}: {why}")
        with self.cond:
            d.state, d.holds, d.ended, d.why = UNLOADED, False, d.attempt, why
            d.load_failures += 1
            self.cond.notify_all()

    FAMILIES = (("loaded", "gauge", "1 while the model on demand is loaded, else 0."),
                ("loads_total", "counter", "Loads of the model on demand."),
                ("evictions_total", "counter", "Times the model on demand was stopped to make room."),
                ("load_failures_total", "counter", "Loads of the model on demand that failed."),
                ("unavailable_total", "counter",
                 "Requests for the model on demand answered 503 (loading, or its load failed)."),
                ("last_load_seconds", "gauge", "The model on demand's last load's seconds."))

    def text(self) -> str:
        """The ``/metrics`` families of the models on demand ("" when there are none)."""
        if not self.demands:
            return ""
        out: list[str] = []
        with self.cond:
            rows = {d.model: {"loaded": int(d.state == LOADED), "loads_total": d.loads,
                              "evictions_total": d.evictions,
                              "load_failures_total": d.load_failures,
                              "unavailable_total": d.unavailable,
                              "last_load_seconds": d.last_load_s} for d in self.demands}
        for key, kind, help_ in self.FAMILIES:
            name = f"sparkdeploy_gateway_{key}"
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
            for model, row in sorted(rows.items()):
                v = row[key]
                if v is not None:  # a model never loaded has no last load
                    out.append(f"{name}{{model={_label(model)}}} {v:g}")
        return "\n".join(out) + "\n"


def _room(need: int, budget: int | None, available: int | None, held: int) -> str:
    """Why a load needs room, in words (what it would exceed)."""
    parts = []
    if budget is not None and held + need > budget:
        parts.append(f"{_gb(need)} needed, {_gb(held)} held, budget {_gb(budget)}")
    if available is not None and need > available:
        parts.append(f"{_gb(need)} needed, MemAvailable {_gb(available)}")
    return "; ".join(parts) or f"{_gb(need)} needed"


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
        self.on_demand = OnDemand(cfg)
        self.on_demand.adopt()
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
        """Every backend's models at once: (the merged list, the backends that did not answer).
        A model on demand that is not loaded is listed from the configuration, its engine not
        asked."""
        asleep = self.on_demand.asleep()
        found: list[list[dict] | None] = [
            [{"id": name, "object": "model", "created": 0, "owned_by": "sparkdeploy"}
             for name in b.static] if b in asleep else None for b in self.cfg.backends]

        def ask(i: int, b: Backend) -> None:
            try:
                found[i] = b.models(auth, self.cfg.backend_timeout)
            except (OSError, ValueError, http.client.HTTPException):
                found[i] = None

        threads = [threading.Thread(target=ask, args=(i, b), daemon=True)
                   for i, b in enumerate(self.cfg.backends) if b not in asleep]
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

    def _error(self, code: int, message: str, kind: str, param: str | None = None,
               extra: dict | None = None) -> None:
        err = {"message": message, "type": kind, "param": param, "code": code}
        self._json(code, {"object": "error", **err, "error": err}, extra)

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
            data = (self.server.figures.text() + self.server.on_demand.text()).encode()
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
        demand = self.server.on_demand.of(backend)
        if demand is None:
            status = self._forward(backend, model, path, raw, started)
        else:
            status = self._on_demand(demand, model, path, raw, started, auth)
        self._log(model, status, started)

    def _on_demand(self, d: Demand, model: str, path: str, raw: bytes, started: float,
                   auth: str | None) -> int:
        """A request for a model on demand: forwarded once it is loaded, else a 503 with
        ``Retry-After``; in flight (never evicted) from its start to its answer's end."""
        od = self.server.on_demand
        try:
            unavailable = od.enter(d, auth)
            if unavailable is None:
                return self._forward(d.backend, model, path, raw, started)
            message, retry = unavailable
            self._error(503, message, "ServiceUnavailable", extra={"Retry-After": str(retry)})
            return 503
        finally:
            od.leave(d)

    def _forward(self, b: Backend, model: str, path: str, raw: bytes, started: float) -> int:
        figs = self.server.figures
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["Content-Length"] = str(len(raw))
        try:
            conn, resp = self._send(b, path, raw, headers)
        except (OSError, http.client.HTTPException) as e:
            figs.add(model, requests=1, errors=1)
            self.server.on_demand.unreachable(b)  # before the answer: the client's next request
            # finds the model loaded or not as it is
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
    backends = [Backend(b["url"], b.get("models"), b.get("on_demand"))
                for b in doc.get("backends", [])]
    backends += [Backend(u) for u in ns.backend or []]
    digest = doc.get("api_key_sha256")
    if digest is not None and not (isinstance(digest, str) and len(digest) == 64
                                   and all(ch in "0123456789abcdefABCDEF" for ch in digest)):
        raise ValueError("api_key_sha256: not a SHA-256 in hex")
    return Config(listen=ns.listen or doc.get("listen") or "127.0.0.1:8000", backends=backends,
                  api_key_sha256=digest,
                  backend_timeout=float(doc.get("backend_timeout", BACKEND_TIMEOUT_S)),
                  log=not ns.quiet, on_demand=doc.get("on_demand"))


def start_in_thread(cfg: Config) -> Gateway:
    gw = Gateway(cfg)
    threading.Thread(target=gw.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                     name="gateway").start()
    return gw


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="a JSON file: listen, backends, api_key_sha256, on_demand")
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
