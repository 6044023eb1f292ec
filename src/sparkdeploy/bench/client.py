"""The load generator: worker threads, one persistent HTTP/1.1 connection each.

Why this shape (measured on a 2-core machine, see docs/notes/bench-figures.md): each worker owns an
``http.client`` connection that it opens before the clock starts and reuses for every request
(a pool sized to the concurrency, no connection set-up inside a measurement). While a stream is
read, the only work per chunk is ``read1`` (which returns one HTTP chunk = one SSE event as soon
as it arrives), ``perf_counter()``, and appending ``(time, bytes)`` to a list; JSON is parsed
after the run (``metrics.analyse``). The GIL switch interval is lowered during the run so a
worker that wakes up with data waits at most ~1 ms for the interpreter.

The client measures its own overhead: the time spent between a read returning and the next
read starting (per event), the lateness of request starts against their schedule, the lateness
of a probe thread's 5 ms sleeps (how late any thread here wakes up under this load), and the
client process's CPU use.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from sparkdeploy.bench.metrics import Timeline, analyse, met_slo, stats, summarize
from sparkdeploy.core import checks
from sparkdeploy.core.errors import UsageError
from sparkdeploy.core.events import EventSink, Progress
from sparkdeploy.core.outside import ModelList, OutsideError, Watch, parsed, request, watchdog
from sparkdeploy.node.endpoint import headers as auth_headers

DAY_S = 86400.0
"""The longest a timeout or a deadline of the client may be."""


class BenchError(UsageError):
    """A benchmark that cannot run (unreachable endpoint, bad arguments): one line."""


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str
    port: int
    prefix: str  # path before /v1, usually ""

    @classmethod
    def parse(cls, url: str) -> Target:
        try:
            checks.http_url(url if "://" in url else "http://" + url)
        except ValueError as e:
            raise BenchError(f"not an http(s) URL: {e}") from None
        u = urlsplit(url if "://" in url else "http://" + url)
        assert u.hostname is not None  # http_url checked it
        prefix = u.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[:-3]
        port = u.port or (443 if u.scheme == "https" else 80)
        return cls(u.scheme, u.hostname, port, prefix)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        return f"{self.scheme}://{host}:{self.port}{self.prefix}"

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=timeout)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn


@dataclass(kw_only=True)
class Settings:
    """One request's shape (the defaults of the sizes and the timeout: the profile's ``bench``
    section, ``sparkdeploy.profile.config.Bench``)."""

    api: str = "chat"  # chat | completions
    model: str | None = None
    input_tokens: int
    output_tokens: int
    thinking: bool | None = None  # None: leave the server's default
    ignore_eos: bool = True
    timeout: float
    """Seconds without an SSE data event (or, before the answer, without its headers) before
    a request fails: a stalled stream, or one that trickles bytes and never a whole event."""
    deadline: float
    """Seconds the whole of one request may take (a server that trickles bytes ends on time)."""
    seed: int = 0
    gates: tuple[tuple[str, tuple[tuple[str, str], ...], int, str], ...] = ()
    """The recipes' coherence gates, (model repo, (prompt, answer) pairs, answer token cap,
    source) each (``recipes.gates``): a model named here is checked against its own."""

    def as_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "gates"}


def default_model(target: Target, deadline: float = 10.0) -> str:
    """The first model ``/v1/models`` lists; one BenchError line naming the URL otherwise."""
    url = f"{target.url}/v1/models"
    try:
        r = request("GET", url, headers=auth_headers(), deadline=deadline)
        if r.status != 200:
            raise BenchError(f"{url}: HTTP {r.status} {r.body[:200]!r}")
        return r.json(ModelList, url).data[0].id
    except OutsideError as e:
        raise BenchError(f"{e} (pass --model to name the model)" if "data" in str(e)
                         else str(e)) from None


_VOCAB = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
          "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
          "zulu").split()


def synthetic_prompt(n_words: int, index: int, seed: int) -> str:
    """About ``n_words`` tokens (one common word is about one token), unique per request so no
    prefix cache can serve it."""
    rng = random.Random(seed * 1_000_003 + index)
    words = [f"r{index}"] + [rng.choice(_VOCAB) for _ in range(max(0, n_words - 1))]
    return " ".join(words)


def request_body(s: Settings, index: int) -> bytes:
    return prompt_body(s, synthetic_prompt(s.input_tokens, index, s.seed))


def prompt_body(s: Settings, prompt: str, **extra: Any) -> bytes:
    """A streamed request for ``prompt`` (usage included), shaped by ``s``: its API, model,
    ``max_tokens`` (= ``s.output_tokens``, with ``ignore_eos`` when ``s.ignore_eos``) and
    thinking switch; ``extra`` fields as given (``temperature=0``)."""
    body: dict = {"model": s.model, "max_tokens": s.output_tokens, "stream": True,
                  "stream_options": {"include_usage": True}, **extra}
    if s.ignore_eos:
        body["ignore_eos"] = True
    if s.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        if s.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": s.thinking}
    else:
        body["prompt"] = prompt
    return json.dumps(body).encode()


@dataclass
class Overhead:
    handling_s: list[float] = field(default_factory=list)
    events: int = 0


MAX_EVENT = 1024 * 1024
"""The most one SSE event may hold (a chunk of one token is well under 1 kB)."""


def _stream(conn, target: Target, path: str, body: bytes, tl: Timeline, ov: Overhead,
            watch: Watch | None = None) -> None:
    """Send one request, record every SSE data payload with its arrival time; each one is
    progress for ``watch`` (a server that trickles bytes without whole events is cut off)."""
    # the API key (SPARKDEPLOY_API_KEY) as the readiness checks send it: a header, never argv
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream",
               **auth_headers()}
    perf = time.perf_counter
    # format the request first, take the start time, then send: the timestamp covers only
    # the send itself
    conn.putrequest("POST", target.prefix + path, skip_accept_encoding=True)
    for k, v in headers.items():
        conn.putheader(k, v)
    conn.putheader("Content-Length", str(len(body)))
    tl.start = perf()
    conn.endheaders(body)
    resp = conn.getresponse()
    if resp.status != 200:
        raw = resp.read(64 * 1024)  # an error body's first 64 kB say what went wrong
        tl.end = perf()
        try:
            d = parsed(raw, "an error body")
            msg = d.get("message") or (d.get("error") or {}).get("message") or ""
        except (OutsideError, AttributeError):
            msg = raw[:120].decode(errors="replace")
        tl.error = f"HTTP {resp.status}: {msg}".rstrip(": ")
        return
    kind = resp.getheader("Content-Type") or ""
    if "json" in kind.lower():  # a whole answer: the server ignored "stream": true
        resp.read(64 * 1024)
        tl.end = perf()
        tl.error = (f"not a stream: HTTP 200 with one {kind.split(';')[0]} answer, not server-sent "
                    "events (the server ignores \"stream\": true)")
        return
    events = tl.events
    buf = b""
    handling = ov.handling_s
    read1 = resp.read1
    while True:
        try:
            data = read1(65536)
        except (http.client.IncompleteRead, ConnectionError):
            data = b""
        t = perf()
        if not data:
            break
        buf += data
        while True:
            i = buf.find(b"\n\n")
            if i < 0:
                break
            ev, buf = buf[:i], buf[i + 2:]
            for line in ev.split(b"\n"):
                if line.startswith(b"data:"):
                    events.append((t, line[5:].strip()))
                    if watch is not None:
                        watch.touch()
        handling.append(perf() - t)
        if len(buf) > MAX_EVENT:
            tl.end = perf()
            tl.error = f"an SSE event larger than {MAX_EVENT} bytes"
            return
        if events and events[-1][1] == b"[DONE]":
            # drain the chunked terminator so the connection can be reused
            while read1(65536):
                pass
            break
    tl.end = perf()
    if not events or events[-1][1] != b"[DONE]":
        tl.error = f"stream closed midway (after {len(events)} events)"


class _Probe(threading.Thread):
    """Sleeps 5 ms again and again and records how late it wakes up (client-side lag)."""

    def __init__(self):
        super().__init__(daemon=True, name="bench-probe")
        self.lags: list[float] = []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            t = time.perf_counter()
            time.sleep(0.005)
            self.lags.append((time.perf_counter() - t - 0.005) * 1000.0)


def _join_reporting(threads: list[threading.Thread], finished: list[int], requests: int,
                    events: EventSink | None, step: str, note: str) -> None:
    """Join the workers; meanwhile (every 0.5 s, from this thread, so rendering never runs on
    a worker) report how many requests finished, and always the final count."""
    last = -1
    for th in threads:
        while th.is_alive():
            th.join(0.5)
            if events is not None and finished[0] != last:
                last = finished[0]
                events.emit(Progress(step, None, last, requests, "req", note))
    if events is not None and last != requests:
        events.emit(Progress(step, None, finished[0], requests, "req", note))


def _arrivals(s: Settings, requests: int, concurrency: int | None,
              rate: float | None) -> tuple[int, list[float]]:
    """The workers, and when each request is due (seconds after the start): at once for a
    fixed concurrency, Poisson arrivals at ``rate`` req/s."""
    if rate is None:
        return min(requests, concurrency or 1), [0.0] * requests
    rng = random.Random(s.seed + 7)
    offsets, t = [], 0.0
    for _ in range(requests):
        offsets.append(t)
        t += rng.expovariate(rate)
    return min(requests, concurrency or 256), offsets


class _Level:
    """One level under way, the state its workers share: the requests' bodies and schedule,
    the next request to take, the timelines recorded, how many finished (progress is emitted by
    the main thread from that count, never by a worker)."""

    def __init__(self, target: Target, s: Settings, path: str, bodies: list[bytes],
                 offsets: list[float], workers: int, paced: bool):
        self.target, self.s, self.path, self.bodies, self.offsets = target, s, path, bodies, offsets
        self.paced = paced
        self.timelines: list[Timeline | None] = [None] * len(bodies)
        self.lock = threading.Lock()
        self.nxt = 0
        self.ov = [Overhead() for _ in range(workers)]
        self.ready = threading.Barrier(workers + 1)
        self.t0 = 0.0
        self.connect_errors: list[str] = []
        self.finished = [0]

    def _take(self) -> int | None:
        with self.lock:
            i, self.nxt = self.nxt, self.nxt + 1
        return i if i < len(self.bodies) else None

    def _connect(self) -> Any:
        try:
            return self.target.connect(self.s.timeout)
        except (OSError, ValueError, OverflowError) as e:
            self.connect_errors.append(str(e))
            return None

    def worker(self, k: int) -> None:
        conn = self._connect()
        try:
            self.ready.wait()
            self.ready.wait()  # the main thread sets t0 in between
        except threading.BrokenBarrierError:
            return  # the main thread gave up on the workers' connections
        prev_end = 0.0
        while (i := self._take()) is not None:
            # a fixed-concurrency worker is due as soon as its previous request ended
            sched = max(self.t0 + self.offsets[i], prev_end)
            delay = sched - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            tl = self.timelines[i] = Timeline(start=time.perf_counter(), scheduled=sched)
            conn = self._request(conn, i, k, tl)
            with self.lock:
                self.finished[0] += 1
            prev_end = 0.0 if self.paced else (tl.end or 0.0)
        if conn is not None:
            conn.close()

    def _request(self, conn: Any, i: int, k: int, tl: Timeline) -> Any:
        """Request ``i`` on ``conn``; the connection to use next (a new one after an error)."""
        return guarded_request(conn, self.target, self.s, self.path, self.bodies[i], tl, self.ov[k])


def guarded_request(conn: Any, target: Target, s: Settings, path: str, body: bytes, tl: Timeline,
                    ov: Overhead) -> Any:
    """One streamed request on ``conn`` (None: connect first) within ``s.deadline``, an SSE event
    at least every ``s.timeout``; whatever goes wrong is ``tl.error`` (one line). Returns the
    connection to use next (a new one after an error, or None)."""
    late = None
    try:
        if conn is None:
            conn = target.connect(s.timeout)
        # the whole request within the deadline, and an SSE event at least every timeout
        with watchdog(conn.sock, s.deadline, idle=s.timeout) as late:
            _stream(conn, target, path, body, tl, ov, late)
    except TimeoutError:
        tl.error = f"timeout: no data for {s.timeout:g}s"
    except (OSError, ValueError, http.client.HTTPException) as e:
        tl.error = f"{type(e).__name__}: {e}".rstrip(": ")
    if late is not None and late.is_set():
        tl.error = (f"deadline: not done within {s.deadline:g}s" if late.why == "deadline"
                    else f"timeout: no data for {s.timeout:g}s")
    if tl.end is None:
        tl.end = time.perf_counter()
    if tl.error is not None and conn is not None:
        conn.close()
        try:
            conn = target.connect(s.timeout)
        except OSError:
            conn = None
    return conn


def run_level(target: Target, s: Settings, requests: int, concurrency: int | None = None,
              rate: float | None = None, path: str | None = None, first_index: int = 0,
              events: EventSink | None = None, step: str = "bench.run", note: str = "",
              slo: dict[str, float] | None = None, keep: list | None = None,
              bodies: list[bytes] | None = None) -> dict:
    """Run ``requests`` requests at a fixed concurrency, or Poisson arrivals at ``rate`` req/s
    (then ``concurrency`` caps the workers, default min(requests, 256)). Returns
    ``{"summary", "requests"}`` (``summary["client"]``: the client's overhead; with ``slo``,
    ``summary["goodput"]`` and each request's ``slo_met``); ``keep`` gets the requests'
    ``RequestMetrics`` (to pool repeated runs). With ``events``, each finished request is a
    ``Progress(step, None, finished, requests, "req", note)``. ``bodies``: the requests' bodies
    (one per request; default: synthetic prompts of ``s.input_tokens`` words)."""
    if requests < 1 or (concurrency is not None and concurrency < 1) or (rate is not None and rate <= 0):
        raise BenchError(f"nothing to run: {requests} request(s), concurrency {concurrency}, "
                         f"rate {rate}")
    if s.model is None:
        raise BenchError("no model")
    for name, secs in (("timeout", s.timeout), ("deadline", s.deadline)):
        if not 0 < secs <= DAY_S:  # a socket or a wait cannot take more (nor nan)
            raise BenchError(f"{name} {secs!r} is not within (0, {DAY_S:g}] seconds")
    path = path or ("/v1/chat/completions" if s.api == "chat" else "/v1/completions")
    workers, offsets = _arrivals(s, requests, concurrency, rate)
    if bodies is None:
        bodies = [request_body(s, first_index + i) for i in range(requests)]
    level = _Level(target, s, path, bodies, offsets, workers, paced=rate is not None)
    old_switch = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    probe = _Probe()
    threads = [threading.Thread(target=level.worker, args=(k,), daemon=True)
               for k in range(workers)]
    try:
        for th in threads:
            th.start()
        try:  # each worker's connect ends within s.timeout
            level.ready.wait(s.timeout + 5)
        except threading.BrokenBarrierError:
            raise BenchError(f"{target.url}: the workers did not connect within "
                             f"{s.timeout:g}s") from None
        level.t0 = time.perf_counter() + 0.01
        cpu0, wall0 = time.process_time(), time.perf_counter()
        probe.start()
        level.ready.wait()
        _join_reporting(threads, level.finished, requests, events, step, note)
        cpu1, wall1 = time.process_time(), time.perf_counter()
    finally:
        probe.stop.set()
        sys.setswitchinterval(old_switch)
    parse0 = time.perf_counter()
    timelines = [tl for tl in level.timelines if tl is not None]  # all: every worker ran to the end
    metrics = [analyse(tl) for tl in timelines]
    parse_s = time.perf_counter() - parse0
    summary = summarize(metrics, slo=slo)
    if keep is not None:
        keep.extend(metrics)
    handling = [x * 1e6 for o in level.ov for x in o.handling_s]
    lateness = [max(0.0, tl.start - tl.scheduled) * 1000.0 for tl in timelines
                if tl.scheduled is not None]
    summary["client"] = {
        "workers": workers,
        "connections_failed": len(level.connect_errors),
        "event_handling_us": stats(handling),
        "start_lateness_ms": stats(lateness),
        "probe_wake_lag_ms": stats(probe.lags),
        "cpu_pct": 100.0 * (cpu1 - cpu0) / max(wall1 - wall0, 1e-9),
        "parse_after_s": parse_s,
    }
    rows = [m.as_json() for m in metrics]
    if slo:
        for row, m in zip(rows, metrics, strict=True):
            row["slo_met"] = met_slo(m, slo)
    return {"summary": summary, "requests": rows}
