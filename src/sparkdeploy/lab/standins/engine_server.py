"""Engine stand-in: an OpenAI-compatible server that behaves like SGLang or vLLM, without a GPU.

STANDARD LIBRARY ONLY: this one file is copied into the lab's engine images (Debian bookworm's
python3 3.11, nothing else installed) and also runs on the controller::

    python3 -m sparkdeploy.lab.standins.engine_server --port 8000 --ttft-ms 200
    python3 path/to/engine_server.py --port 8000

Entry points (what the image shims call)
-----------------------------------------
``main(argv=None)``
    The generic server (flags below). Returns an exit code.
``sglang_main(argv=None)``
    ``python3 -m sglang.launch_server ...``: takes SGLang's flags (``--model-path --tp[-size]
    --nnodes --node-rank --dist-init-addr --host --port --trust-remote-code ...``; unknown flags
    tolerated). With ``--nnodes`` > 1 it hangs forever in "NCCL init" (NCCL-style log lines, port
    never opened) unless ``SPARKDEPLOY_STANDIN_SGLANG_MULTINODE=ok``; then rank 0 serves and the
    other ranks block like SGLang's non-zero ranks. A shim ``sglang/launch_server.py``::

        import sys; sys.path.insert(0, "/opt/standin")
        from engine_server import sglang_main
        if __name__ == "__main__":
            raise SystemExit(sglang_main())

``vllm_main(argv=None)``
    The ``vllm`` console script: ``vllm serve MODEL --tensor-parallel-size N
    --pipeline-parallel-size P --distributed-executor-backend ray --host H --port P ...``
    (unknown flags tolerated). With ``--distributed-executor-backend ray`` it joins the real Ray
    cluster (``ray.init(address="auto")``, ``ray`` imported lazily: it exists only in the lab's
    vLLM image) and refuses to start unless the cluster has >= N*P GPUs and >= N*P alive nodes.
``run_server(config)`` / ``start_in_thread(config)``
    In-process use (tests): build a ``Config``, serve forever, or start in a daemon thread and get
    the ``StandinServer`` back (``.port``, ``.shutdown()``).

Behaviour
---------
``/health`` (200), ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``; non-streaming
and SSE streaming. A streamed chat answer is: a role chunk (``delta: {"role": "assistant",
"content": ""}``), then ``reasoning_content`` chunks (unless
``chat_template_kwargs.enable_thinking`` is false), then ``content`` chunks, one token per
chunk, then a usage chunk when ``stream_options.include_usage``, then ``data: [DONE]``.
Token i (0-based) is sent at ``arrival + ttft + i * gap`` (``time.monotonic``; deadlines, so
jitter does not accumulate). Output length is ``max_tokens`` with ``ignore_eos``, otherwise
``min(max_tokens, --natural-tokens)``. HTTP/1.1 keep-alive: streams use chunked encoding.

Faults (environment, flags, or ``POST /_control``)
------------------------------------------------
Startup, ``SPARKDEPLOY_STANDIN_STARTUP_FAULT`` / ``--startup-fault``:
``hang`` (log lines forever, port never opened), ``oom`` (CUDA-OOM-like traceback, exit 1),
``port_in_use`` (binds the port twice: the real ``[Errno 98] Address already in use``, exit 1;
a port that really is taken gives the same).

Per request, ``SPARKDEPLOY_STANDIN_FAULTS`` / ``--faults`` / ``POST /_control {"faults": ...}``:
a comma-separated list of rules ``KIND[:every=N|:fraction=F][:after=K][:seconds=S]``, KIND one
of ``http500``, ``close`` (stream closed midway, after K tokens), ``stall`` (no bytes for S
seconds after K tokens, then carry on). Generation requests are numbered 1, 2, ... (reset by
``POST /_control {"reset": true}``); the first rule that selects request n applies.
``every=N`` selects n % N == 0; ``fraction=F`` selects n when floor(n*F) > floor((n-1)*F)
(deterministic, exactly F of the requests). ``GET /_control`` shows the state and counters.

Timing, ``--ttft-ms`` / ``SPARKDEPLOY_STANDIN_TTFT_MS`` (default 120) and ``--tok-s`` /
``SPARKDEPLOY_STANDIN_TOK_S`` (default 27) or ``--gap-ms`` / ``SPARKDEPLOY_STANDIN_GAP_MS``;
``POST /_control {"ttft_ms": .., "gap_ms": ..}`` changes them while running.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ENV = "SPARKDEPLOY_STANDIN_"
FAULT_KINDS = ("http500", "close", "stall")
STARTUP_FAULTS = ("none", "hang", "oom", "port_in_use")
_WORDS = (
    "the model answers with steady tokens from the stand in engine while the benchmark "
    "watches every chunk arrive on time across the link"
).split()


class StandinError(Exception):
    """A refusal to start; ``str()`` is the message printed before exiting 1."""


# --- configuration ----------------------------------------------------------------------


@dataclass
class FaultRule:
    kind: str
    every: int | None = None
    fraction: float | None = None
    after: int = 4
    seconds: float = 30.0

    def selects(self, n: int) -> bool:
        if self.every:
            return n % self.every == 0
        if self.fraction is not None:
            return math.floor(n * self.fraction) > math.floor((n - 1) * self.fraction)
        return True

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "every": self.every,
            "fraction": self.fraction,
            "after": self.after,
            "seconds": self.seconds,
        }


def parse_faults(spec: str | list | None) -> list[FaultRule]:
    """``"http500:every=10,close:fraction=0.1:after=3"`` (or a list of dicts) -> rules."""
    if not spec:
        return []
    rules: list[FaultRule] = []
    items = spec if isinstance(spec, list) else [s for s in spec.split(",") if s.strip()]
    for item in items:
        if isinstance(item, dict):
            kind, opts = item.get("kind", ""), {k: v for k, v in item.items() if k != "kind"}
        else:
            kind, *parts = item.strip().split(":")
            opts = {}
            for p in parts:
                key, sep, val = p.partition("=")
                if not sep:
                    raise ValueError(f"fault option {p!r} is not KEY=VALUE")
                opts[key] = val
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r} (one of {', '.join(FAULT_KINDS)})")
        rule = FaultRule(kind)
        for key, val in opts.items():
            if val is None:
                continue
            if key == "every":
                rule.every = int(val)
            elif key == "fraction":
                rule.fraction = float(val)
            elif key == "after":
                rule.after = int(val)
            elif key == "seconds":
                rule.seconds = float(val)
            else:
                raise ValueError(f"unknown fault option {key!r}")
        rules.append(rule)
    return rules


@dataclass
class Config:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "standin"
    ttft_ms: float = 120.0
    gap_ms: float = 1000.0 / 27
    natural_tokens: int = 256
    default_max_tokens: int = 256
    reasoning_tokens: int = 8
    """Reasoning chunks before the content (chat, thinking on); capped at half the output."""
    startup_s: float = 0.0
    startup_fault: str = "none"
    faults: list[FaultRule] = field(default_factory=list)
    engine: str = "standin"
    log_requests: bool = False


def _env(name: str, default=None):
    return os.environ.get(ENV + name, default)


def _arg_parser(prog: str = "engine_server") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible engine stand-in")
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(_env("PORT", "8000")))
    p.add_argument("--model", default=_env("MODEL", "standin"))
    add_timing_flags(p)
    return p


def add_timing_flags(p: argparse.ArgumentParser) -> None:
    """Stand-in flags shared by every entry point (defaults from SPARKDEPLOY_STANDIN_*)."""
    g = p.add_argument_group("stand-in")
    g.add_argument("--ttft-ms", type=float, default=float(_env("TTFT_MS", "120")))
    g.add_argument("--tok-s", type=float, default=float(_env("TOK_S", "27")))
    g.add_argument("--gap-ms", type=float, default=_env("GAP_MS"), help="inter-token gap; overrides --tok-s")
    g.add_argument("--natural-tokens", type=int, default=int(_env("NATURAL_TOKENS", "256")))
    g.add_argument("--reasoning-tokens", type=int, default=int(_env("REASONING_TOKENS", "8")))
    g.add_argument("--startup-s", type=float, default=float(_env("STARTUP_S", "0")))
    g.add_argument("--startup-fault", choices=STARTUP_FAULTS, default=_env("STARTUP_FAULT", "none") or "none")
    g.add_argument("--faults", default=_env("FAULTS", ""))
    g.add_argument("--log-requests", action="store_true", default=_env("LOG_REQUESTS", "") not in ("", "0"))


def config_from_args(ns: argparse.Namespace, **over) -> Config:
    gap = float(ns.gap_ms) if ns.gap_ms not in (None, "") else 1000.0 / ns.tok_s
    cfg = Config(
        host=ns.host,
        port=ns.port,
        model=getattr(ns, "model", "standin"),
        ttft_ms=ns.ttft_ms,
        gap_ms=gap,
        natural_tokens=ns.natural_tokens,
        reasoning_tokens=ns.reasoning_tokens,
        startup_s=ns.startup_s,
        startup_fault=ns.startup_fault,
        faults=parse_faults(ns.faults),
        log_requests=ns.log_requests,
    )
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


# --- logging ----------------------------------------------------------------------------


def log(msg: str, *, engine: str = "standin") -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    if engine == "vllm":
        line = f"INFO {stamp} [api_server.py] {msg}"
    elif engine == "sglang":
        line = f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}"
    else:
        line = f"{stamp} standin: {msg}"
    print(line, flush=True)


# --- the HTTP server --------------------------------------------------------------------


class State:
    """Mutable, shared, lock-protected: timings, faults, counters."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.lock = threading.Lock()
        self.counter = 0
        self.served = 0
        self.faulted: dict[str, int] = {k: 0 for k in FAULT_KINDS}
        self.active = 0

    def next_request(self) -> tuple[int, FaultRule | None]:
        with self.lock:
            self.counter += 1
            self.active += 1
            n = self.counter
            rule = next((r for r in self.cfg.faults if r.selects(n)), None)
            if rule:
                self.faulted[rule.kind] += 1
            return n, rule

    def done(self) -> None:
        with self.lock:
            self.active -= 1
            self.served += 1

    def snapshot(self) -> dict:
        with self.lock:
            c = self.cfg
            return {
                "engine": c.engine,
                "model": c.model,
                "ttft_ms": c.ttft_ms,
                "gap_ms": c.gap_ms,
                "natural_tokens": c.natural_tokens,
                "reasoning_tokens": c.reasoning_tokens,
                "faults": [r.as_dict() for r in c.faults],
                "requests": self.counter,
                "served": self.served,
                "active": self.active,
                "faulted": dict(self.faulted),
            }

    def control(self, body: dict) -> None:
        with self.lock:
            c = self.cfg
            if "faults" in body:
                c.faults = parse_faults(body["faults"])
            if "ttft_ms" in body:
                c.ttft_ms = float(body["ttft_ms"])
            if "gap_ms" in body:
                c.gap_ms = float(body["gap_ms"])
            if "tok_s" in body:
                c.gap_ms = 1000.0 / float(body["tok_s"])
            for key in ("natural_tokens", "reasoning_tokens"):
                if key in body:
                    setattr(c, key, int(body[key]))
            if body.get("reset"):
                self.counter = 0
                self.served = 0
                self.faulted = {k: 0 for k in FAULT_KINDS}


class StandinServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    def __init__(self, cfg: Config):
        self.state = State(cfg)
        super().__init__((cfg.host, cfg.port), Handler)

    @property
    def port(self) -> int:
        return self.server_address[1]


class _Closed(Exception):
    pass


def _token(i: int) -> str:
    return _WORDS[i % len(_WORDS)] + " "


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server_version = "sparkdeploy-standin"
    sys_version = ""
    server: StandinServer

    def log_message(self, format, *args):  # noqa: A002  (BaseHTTPRequestHandler's name)
        if self.server.state.cfg.log_requests:
            super().log_message(format, *args)

    # -- plumbing --

    def parse_request(self) -> bool:
        # the request's arrival: its request line is in, before header parsing costs anything
        self.arrival = time.monotonic()
        return super().parse_request()

    def _json(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str, kind: str = "BadRequestError") -> None:
        self._json(
            code,
            {
                "object": "error",
                "message": message,
                "type": kind,
                "code": code,
                "error": {"message": message, "type": kind, "code": code},
            },
        )

    def _body(self) -> dict | None:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except ValueError:
            self._error(400, "request body is not JSON")
            return None
        if not isinstance(body, dict):
            self._error(400, "request body must be a JSON object")
            return None
        return body

    def _chunk(self, data: bytes) -> None:
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        except OSError as e:
            raise _Closed() from e

    # -- routes --

    def do_GET(self):  # noqa: N802
        path = self.path.split("?", 1)[0]
        st = self.server.state
        if path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/v1/models":
            self._json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": st.cfg.model,
                            "object": "model",
                            "created": 0,
                            "owned_by": st.cfg.engine,
                            "root": st.cfg.model,
                        }
                    ],
                },
            )
        elif path == "/_control":
            self._json(200, st.snapshot())
        else:
            self._error(404, f"no route {path}", "NotFoundError")

    def do_POST(self):  # noqa: N802
        path = self.path.split("?", 1)[0]
        arrival = self.arrival
        body = self._body()
        if body is None:
            return
        if path == "/_control":
            try:
                self.server.state.control(body)
            except (ValueError, TypeError) as e:
                self._error(400, str(e))
                return
            self._json(200, self.server.state.snapshot())
        elif path in ("/v1/chat/completions", "/v1/completions"):
            self._generate(path.endswith("chat/completions"), body, arrival)
        else:
            self._error(404, f"no route {path}", "NotFoundError")

    def _generate(self, chat: bool, body: dict, arrival: float) -> None:
        st = self.server.state
        if chat and not isinstance(body.get("messages"), list):
            self._error(400, "'messages' is required")
            return
        if not chat and "prompt" not in body:
            self._error(400, "'prompt' is required")
            return
        _n, rule = st.next_request()
        try:
            self._answer(chat, body, arrival, rule)
        except _Closed:
            self.close_connection = True
        finally:
            st.done()

    def _answer(self, chat: bool, body: dict, arrival: float, rule: FaultRule | None) -> None:
        cfg = self.server.state.cfg
        ttft, gap = cfg.ttft_ms / 1000.0, cfg.gap_ms / 1000.0
        if rule and rule.kind == "http500":
            self._error(500, "stand-in fault: internal server error", "InternalServerError")
            return
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        max_tokens = int(max_tokens) if max_tokens else cfg.default_max_tokens
        n = max_tokens if body.get("ignore_eos") else min(max_tokens, cfg.natural_tokens)
        n = max(n, 1)
        thinking = chat and (body.get("chat_template_kwargs") or {}).get("enable_thinking", True)
        n_reason = min(cfg.reasoning_tokens, n // 2) if thinking else 0
        prompt_tokens = _count_prompt(body, chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        model = body.get("model") or cfg.model
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        finish = "length" if n >= max_tokens else "stop"
        obj = "chat.completion" if chat else "text_completion"

        if not body.get("stream"):
            _sleep_until(arrival + ttft + (n - 1) * gap)
            if rule and rule.kind == "stall":
                time.sleep(rule.seconds)
            if rule and rule.kind == "close":
                self.close_connection = True
                _abort(self.connection)
                return
            reasoning = "".join(_token(i) for i in range(n_reason))
            text = "".join(_token(i) for i in range(n_reason, n))
            if chat:
                msg = {"role": "assistant", "content": text}
                if thinking:
                    msg["reasoning_content"] = reasoning
                choice = {"index": 0, "message": msg, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": reasoning + text, "finish_reason": finish}
            self._json(
                200,
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": usage,
                },
            )
            return

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        # CLOCK_MONOTONIC is shared by processes on one machine: a client on the same host can
        # tell how late the request reached this handler (time.perf_counter uses it on Linux)
        self.send_header("X-Standin-Arrival", f"{arrival:.6f}")
        self.end_headers()
        head = {"id": rid, "object": obj + ".chunk", "created": created, "model": model}

        def event(choice: dict | None, extra: dict | None = None) -> bytes:
            d = dict(head)
            d["choices"] = [choice] if choice is not None else []
            if extra:
                d.update(extra)
            return b"data: " + json.dumps(d, separators=(",", ":")).encode() + b"\n\n"

        if chat:
            self._chunk(
                event(
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
            )
        start = arrival + ttft
        stalled = False
        for i in range(n):
            if rule and i == min(rule.after, n - 1):
                if rule.kind == "close":
                    _abort(self.connection)
                    raise _Closed()
                if rule.kind == "stall" and not stalled:
                    stalled = True
                    time.sleep(rule.seconds)
                    start += rule.seconds
            last = i == n - 1
            fin = finish if last else None
            if chat:
                key = "reasoning_content" if i < n_reason else "content"
                choice = {"index": 0, "delta": {key: _token(i)}, "logprobs": None, "finish_reason": fin}
            else:
                choice = {"index": 0, "text": _token(i), "logprobs": None, "finish_reason": fin}
            data = event(choice)
            _sleep_until(start + i * gap)
            self._chunk(data)
        tail = b""
        if include_usage:
            tail += event(None, {"usage": usage})
        tail += b"data: [DONE]\n\n"
        self._chunk(tail)
        self._chunk(b"")  # the chunked-encoding terminator: the connection stays open


def _count_prompt(body: dict, chat: bool) -> int:
    if chat:
        text = " ".join(str(m.get("content", "")) for m in body.get("messages", []) if isinstance(m, dict))
    else:
        p = body.get("prompt", "")
        text = " ".join(map(str, p)) if isinstance(p, list) else str(p)
    return max(1, len(text.split()))


def _sleep_until(deadline: float) -> None:
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(left)


def _abort(conn: socket.socket) -> None:
    """Close the connection abruptly, mid-response (what a crashing worker does)."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


# --- running ----------------------------------------------------------------------------


def _startup(cfg: Config) -> None:
    """Model loading and the startup faults; raises StandinError or never returns (hang)."""
    eng = cfg.engine
    if cfg.startup_fault == "hang":
        log(f"Loading model {cfg.model} ...", engine=eng)
        i = 0
        while True:  # never opens the port
            i += 1
            log(f"Init: waiting for distributed workers ({i * 10}s elapsed)", engine=eng)
            time.sleep(10)
    if cfg.startup_fault == "oom":
        log(f"Loading model {cfg.model} ...", engine=eng)
        time.sleep(min(cfg.startup_s, 5))
        print(
            "Traceback (most recent call last):\n"
            '  File "model_runner.py", line 412, in load_model\n'
            "    self.model = get_model(model_config=self.model_config)\n"
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has "
            "a total capacity of 119.70 GiB of which 1.12 GiB is free. Including non-PyTorch "
            "memory, this process has 117.31 GiB memory in use. Of the allocated memory 116.02 "
            "GiB is allocated by PyTorch, and 812.44 MiB is reserved by PyTorch but unallocated.",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(1)
    if cfg.startup_s > 0:
        log(f"Loading model {cfg.model} ({cfg.startup_s:.0f}s) ...", engine=eng)
        time.sleep(cfg.startup_s)


def make_server(cfg: Config) -> StandinServer:
    """Bind the port (real errors surface as StandinError)."""
    holder = None
    if cfg.startup_fault == "port_in_use":
        holder = socket.socket()
        holder.bind((cfg.host, cfg.port))
        holder.listen(1)
    try:
        return StandinServer(cfg)
    except OSError as e:
        raise StandinError(
            f"ERROR: [Errno {e.errno}] error while attempting to bind on address "
            f"({cfg.host!r}, {cfg.port}): {e.strerror.lower()}"
        ) from None
    finally:
        if holder:
            holder.close()


def run_server(cfg: Config) -> int:
    """Startup (faults, load time), bind, log readiness, serve until interrupted."""
    # many handler threads wake at the same instant (64 streams in lockstep): a short GIL
    # switch interval keeps each one's wait for the interpreter, hence its lateness, small
    sys.setswitchinterval(float(os.environ.get(ENV + "SWITCH_INTERVAL_S", "0.0002")))
    try:
        _startup(cfg)
        srv = make_server(cfg)
    except StandinError as e:
        print(str(e), file=sys.stderr, flush=True)
        return 1
    ready = {
        "vllm": f"Starting vLLM API server on http://{cfg.host}:{srv.port}",
        "sglang": "The server is fired up and ready to roll!",
    }.get(cfg.engine, f"listening on http://{cfg.host}:{srv.port}")
    log(
        f"Uvicorn running on http://{cfg.host}:{srv.port} (Press CTRL+C to quit)"
        if cfg.engine == "vllm"
        else f"serving {cfg.model} on {cfg.host}:{srv.port}",
        engine=cfg.engine,
    )
    log(ready, engine=cfg.engine)
    try:
        srv.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0


def start_in_thread(cfg: Config) -> StandinServer:
    """Bind now (``cfg.port`` 0 picks a free port) and serve from a daemon thread."""
    srv = make_server(cfg)
    threading.Thread(
        target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True, name="standin"
    ).start()
    return srv


def main(argv: list[str] | None = None) -> int:
    ns = _arg_parser().parse_args(argv)
    try:
        cfg = config_from_args(ns)
    except ValueError as e:
        print(f"engine_server: {e}", file=sys.stderr)
        return 2
    return run_server(cfg)


# --- SGLang ------------------------------------------------------------------------------


def sglang_main(argv: list[str] | None = None) -> int:
    """``python3 -m sglang.launch_server`` with SGLang's flags."""
    p = argparse.ArgumentParser(prog="sglang.launch_server", allow_abbrev=False)
    p.add_argument("--model-path", "--model", required=True)
    p.add_argument("--served-model-name")
    p.add_argument("--tp", "--tp-size", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--trust-remote-code", action="store_true")
    add_timing_flags(p)
    ns, unknown = p.parse_known_args(argv)
    model = ns.served_model_name or ns.model_path
    ns.model = model
    cfg = config_from_args(ns, engine="sglang")
    log(
        f"server_args=ServerArgs(model_path={ns.model_path!r}, tp_size={ns.tp}, "
        f"nnodes={ns.nnodes}, node_rank={ns.node_rank}, dist_init_addr={ns.dist_init_addr!r}, "
        f"host={ns.host!r}, port={ns.port}, trust_remote_code={ns.trust_remote_code})"
        + (f" (ignored flags: {' '.join(unknown)})" if unknown else ""),
        engine="sglang",
    )
    if ns.nnodes > 1:
        if ns.dist_init_addr is None:
            print("ValueError: --dist-init-addr is required when --nnodes > 1", file=sys.stderr)
            return 1
        if os.environ.get(ENV + "SGLANG_MULTINODE", "") != "ok":
            _nccl_hang(ns)  # never returns
        log(
            f"Init torch distributed begin. rank={ns.node_rank} dist_init_addr={ns.dist_init_addr}",
            engine="sglang",
        )
        log("Init torch distributed ends.", engine="sglang")
        if ns.node_rank != 0:
            log(f"node rank {ns.node_rank}: scheduler ready; the HTTP server runs on rank 0", engine="sglang")
            while True:
                time.sleep(3600)
    return run_server(cfg)


def _nccl_hang(ns) -> None:
    host = socket.gethostname()
    pid = os.getpid()
    iface = os.environ.get("NCCL_SOCKET_IFNAME", "eth0")
    log(
        f"Init torch distributed begin. rank={ns.node_rank} dist_init_addr={ns.dist_init_addr}",
        engine="sglang",
    )
    lines = [
        f"{host}:{pid}:{pid} [0] NCCL INFO Bootstrap : Using {iface}:"
        f"{(ns.dist_init_addr or '').rsplit(':', 1)[0]}<0>",
        f"{host}:{pid}:{pid} [0] NCCL INFO NET/Plugin: No plugin found (libnccl-net.so)",
        f"{host}:{pid}:{pid} [0] NCCL INFO NET/IB : No device found.",
        f"{host}:{pid}:{pid} [0] NCCL INFO NET/Socket : Using [0]{iface}",
        f"{host}:{pid}:{pid} [0] NCCL INFO cudaDriverVersion 13000",
        "NCCL version 2.27.7+cuda13.0",
        f"{host}:{pid}:{pid} [0] NCCL INFO Channel 00/02 : 0 1",
        f"{host}:{pid}:{pid} [0] NCCL INFO Connecting to rank 1 via NET/Socket/0 ...",
    ]
    for line in lines:
        print(line, flush=True)
        time.sleep(0.05)
    waited = 0
    while True:  # the seed's failure: NCCL init never finishes, the port never opens
        time.sleep(30)
        waited += 30
        print(f"{host}:{pid}:{pid} [0] NCCL INFO bootstrap: waiting for peer rank 1 ({waited}s)", flush=True)


# --- vLLM --------------------------------------------------------------------------------


def check_ray_cluster(world_size: int) -> str:
    """Join the running Ray cluster; StandinError unless it has ``world_size`` GPUs and nodes."""
    try:
        import ray  # noqa: PLC0415  (only inside the lab's vLLM image)
    except ImportError:
        raise StandinError(
            "ValueError: Ray is required for --distributed-executor-backend ray, "
            "but it is not installed (pip install ray)"
        ) from None
    try:
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
    except Exception as e:  # ConnectionError and friends, whatever Ray version
        raise StandinError(
            f"ConnectionError: could not connect to a running Ray cluster (ray.init(address='auto')): {e}"
        ) from None
    try:
        gpus = float(ray.cluster_resources().get("GPU", 0))
        alive = [n for n in ray.nodes() if n.get("Alive")]
    finally:
        ray.shutdown()
    if gpus < world_size or len(alive) < world_size:
        raise StandinError(
            f"ValueError: The number of required GPUs exceeds the total number of available GPUs "
            f"in the placement group: tensor_parallel_size x pipeline_parallel_size = "
            f"{world_size}, Ray cluster has {gpus:g} GPUs on {len(alive)} alive node(s)"
        )
    return f"Ray cluster: {gpus:g} GPUs on {len(alive)} alive nodes"


def vllm_main(argv: list[str] | None = None) -> int:
    """The ``vllm`` console script: ``vllm serve MODEL ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: vllm serve MODEL [options]", file=sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print("0.17.0+standin")
        return 0
    if argv[0] != "serve":
        print(f"vllm: stand-in supports only 'serve', not {argv[0]!r}", file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(prog="vllm serve", allow_abbrev=False)
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--model")
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--distributed-executor-backend", choices=["ray", "mp", "uni", "external_launcher"])
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--trust-remote-code", action="store_true")
    add_timing_flags(p)
    ns, unknown = p.parse_known_args(argv[1:])
    model_path = ns.model_tag or ns.model
    if not model_path:
        print("vllm serve: error: the model is required", file=sys.stderr)
        return 2
    ns.model = ns.served_model_name[0] if ns.served_model_name else model_path
    cfg = config_from_args(ns, engine="vllm")
    world = ns.tensor_parallel_size * ns.pipeline_parallel_size
    log(
        f"vLLM API server version 0.17.0+standin; model={model_path!r} "
        f"tensor_parallel_size={ns.tensor_parallel_size} "
        f"pipeline_parallel_size={ns.pipeline_parallel_size} "
        f"distributed_executor_backend={ns.distributed_executor_backend}"
        + (f" (ignored flags: {' '.join(unknown)})" if unknown else ""),
        engine="vllm",
    )
    try:
        if ns.distributed_executor_backend == "ray":
            log(check_ray_cluster(world), engine="vllm")
        elif world > int(os.environ.get(ENV + "GPUS", "1")):
            raise StandinError(
                f"ValueError: tensor_parallel_size x pipeline_parallel_size = {world} exceeds the "
                f"GPUs on this node; use --distributed-executor-backend ray across nodes"
            )
    except StandinError as e:
        print(str(e), file=sys.stderr, flush=True)
        return 1
    return run_server(cfg)


if __name__ == "__main__":
    raise SystemExit(main())
