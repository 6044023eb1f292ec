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
    --pp-size --nnodes --node-rank --dist-init-addr --host --port --trust-remote-code ...``; unknown flags
    tolerated). With ``--nnodes`` > 1 the ranks really meet: rank 0 listens on
    ``--dist-init-addr`` (the port the head's "init port" probe sees open), the others connect
    (c10d-style retries and timeouts) and they exchange, per rank, the address it advertises
    (``SGLANG_HOST_IP``, ``HOST_IP``, the NIC in ``SGLANG_LOCAL_IP_NIC``, else the default
    route's source address: in the lab, the management address) and its address on the fast
    link (the local end of its connection to ``--dist-init-addr``). NCCL's choices follow the
    node and the environment (``nccl_plan``: ``NCCL_SOCKET_IFNAME``, ``NCCL_IB_HCA``,
    ``NCCL_IB_DISABLE``, ``NCCL_IB_GID_INDEX`` against ``/sys/class/infiniband``). Then:

    - all right: ``Init torch distributed ends``, the model directory's files are read, rank 0
      serves the API and every token it streams needs every other rank (``DecodeSteps``: one
      message to each rank and its answer per decode step, over the ``--dist-init-addr``
      connections), as tensor parallel does; a rank that is stopped or wedged (SIGSTOP,
      ``docker pause``) stalls every stream while ``/health`` still answers 200; a rank that
      dies leaves a half-cluster: rank 0 answers ``/health`` 503 and never answers a request;
    - a rank advertising an address other than its fast-link one, or the lab fault
      ``sglang-hang`` (``faults.json`` in the node's lab view): every rank's last line is
      ``CustomAllreduce is disabled because this process group spans across nodes.``, then
      silence until killed (SGLang's cross-node message queue never connects);
    - a misconfigured link: no matching socket interface or a GID index that is not the fast
      link's RoCE v2 IPv4 entry (NCCL WARN, the rank exits 1, its peers wait silently); no
      usable RoCE device with sockets on another network (``NET/IB : No device found.``,
      ``NET/Socket : Using ...``, a connect retry line every 30 s).

    A shim ``sglang/launch_server.py``::

        import sys; sys.path.insert(0, "/opt/standin")
        from engine_server import sglang_main
        if __name__ == "__main__":
            raise SystemExit(sglang_main())

``vllm_main(argv=None)``
    The ``vllm`` console script: ``vllm serve MODEL --tensor-parallel-size N
    --pipeline-parallel-size P --distributed-executor-backend ray --host H --port P ...``
    (parsed first as vLLM's own parser does, from the image's flag manifest: an unknown flag or
    a value outside a flag's choices is argparse's error, exit 2). With
    ``--distributed-executor-backend ray`` it joins the real Ray cluster
    (``ray.init(address="auto")``, ``ray`` imported lazily: it exists only in the lab's vLLM
    image) and asks Ray for vLLM's placement group: N*P bundles of one GPU, the first on the
    Ray node whose address is the driver's (``VLLM_HOST_IP``, else the default route's
    source address). Until Ray can place it (a worker that never joined, a GPU missing, a
    ``VLLM_HOST_IP`` that is no Ray node's address) it prints vLLM's ``Waiting for creating a
    placement group of specs for N seconds ...`` lines (10, 30, 70, 150, 310 s ...) and gives up
    after 1800 s like vLLM; once placed, one GPU actor per bundle holds each node's GPU.
Both refuse a model whose config.json ``architectures`` the image's engine does not register,
with the engine's own error and exit 1 (``unsupported_arch``): what it registers is read from
the engine's model files in the image (SGLang's ``srt/models/*.py`` ``EntryClass``, vLLM's
``model_executor/models/registry.py`` tables), never from a list here.
``run_server(config)`` / ``start_in_thread(config)``
    In-process use (tests): build a ``Config``, serve forever, or start in a daemon thread and get
    the ``StandinServer`` back (``.port``, ``.shutdown()``).

Behaviour
---------
``/health`` (200), ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``; non-streaming
and SSE streaming. ``/metrics``: the engine's Prometheus families (``EngineMetrics``: vLLM's
always, SGLang's with ``--enable-metrics``, the generic server's with ``--metrics vllm|sglang``),
from the timings the server really measured of the requests it served. A streamed chat answer
is: a role chunk (``delta: {"role": "assistant", "content": ""}``), then ``reasoning_content`` chunks (unless
``chat_template_kwargs.enable_thinking`` is false), then ``content`` chunks, one token per
chunk, then a usage chunk when ``stream_options.include_usage``, then ``data: [DONE]``.
Token i (0-based) is sent at ``arrival + ttft + i * gap`` (``time.monotonic``; deadlines, so
jitter does not accumulate). Output length is ``max_tokens`` with ``ignore_eos``, otherwise
``min(max_tokens, --natural-tokens)``. HTTP/1.1 keep-alive: streams use chunked encoding.

Faults (environment, flags, or ``POST /_control``)
------------------------------------------------
Startup, ``SPARKDEPLOY_STANDIN_STARTUP_FAULT`` / ``--startup-fault``:
``hang`` (log lines forever, port never opened), ``oom`` (CUDA-OOM-like traceback, exit 1;
also the lab fault ``oom-at-load``: SGLang's ranks and vLLM while loading the weights),
``port_in_use`` (binds the port twice: the real ``[Errno 98] Address already in use``, exit 1;
a port that really is taken gives the same).

Per request, ``SPARKDEPLOY_STANDIN_FAULTS`` / ``--faults`` / ``POST /_control {"faults": ...}``:
a comma-separated list of rules ``KIND[:every=N|:fraction=F][:after=K][:seconds=S][:first=M]``,
KIND one of ``http500``, ``close`` (stream closed midway, after K tokens), ``stall`` (no bytes
for S seconds after K tokens, then carry on), ``garbage`` (the answer is the same token again
and again; also the lab fault ``garbage``, read from the lab view on every request); ``first=M``
leaves requests before the M-th alone. Generation requests are numbered 1, 2, ... (reset by
``POST /_control {"reset": true}``); the first rule that selects request n applies.
``every=N`` selects n % N == 0; ``fraction=F`` selects n when floor(n*F) > floor((n-1)*F)
(deterministic, exactly F of the requests). ``GET /_control`` shows the state and counters.

Timing, ``--ttft-ms`` / ``SPARKDEPLOY_STANDIN_TTFT_MS`` (default 120) and ``--tok-s`` /
``SPARKDEPLOY_STANDIN_TOK_S`` (default 27) or ``--gap-ms`` / ``SPARKDEPLOY_STANDIN_GAP_MS``;
``POST /_control {"ttft_ms": .., "gap_ms": ..}`` changes them while running. The prompt shapes
both, so a depth sweep measures something: the first token waits ttft + prompt tokens /
``--prefill-tok-s`` (default 8000; 0: not at all), and every decode step takes gap x (1 + prompt
tokens / ``--decode-half-depth``) (default 131072: half the rate at that depth; 0: no slowdown);
``Config()`` in a test has both off. ``usage.prompt_tokens`` is counted with the served model's
``tokenizer.json`` (SGLang's ``--model-path``, vLLM's model, ``--model`` or ``--tokenizer`` here,
when it is a directory holding one) over the chat as the lab model's template renders it
(``PromptCounter``: the same count as the ``tokenizers`` library, standard library only);
otherwise it is the prompt's words.

Answers: a prompt with one right answer (``What is A + B?``, ``Repeat this word ...: W``, the
bench's coherence gate) is answered right and the answer ends there (EOS), unless
``ignore_eos``; every other prompt gets the stand-in's words.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import unicodedata
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NoReturn

ENV = "SPARKDEPLOY_STANDIN_"
FAULT_KINDS = ("http500", "close", "stall", "garbage")
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
    first: int = 1
    """The first request the rule may select (``first=3``: the first two are left alone)."""

    def selects(self, n: int) -> bool:
        if n < self.first:
            return False
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
            "first": self.first,
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
            elif key == "first":
                rule.first = int(val)
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
    workers: list = field(default_factory=list)
    steps: DecodeSteps | None = None
    """Tensor parallel's lockstep with the other ranks (multi-node): every token waits for one."""
    api_key: str | None = None
    """``--api-key`` (SGLang, vLLM) or ``VLLM_API_KEY``: /v1/* then need ``Authorization: Bearer``."""
    prefill_tok_s: float = 0.0
    """Prefill rate: the first token waits ``ttft_ms`` plus prompt tokens / this (0: no wait)."""
    decode_half_depth: int = 0
    """Decode slows with the prompt: the gap is ``gap_ms * (1 + prompt tokens / this)``, half
    the rate at this depth (0: decode does not slow)."""
    tokenizer: str | None = None
    """The served model's directory (or its tokenizer.json): prompt tokens counted with it."""
    metrics: str | None = None
    """The ``/metrics`` the server exports: ``"vllm"`` (vLLM always does), ``"sglang"`` (SGLang
    with ``--enable-metrics``), None (404)."""
    kv_tokens: int = 65536
    """The KV cache's size in tokens (what ``/metrics`` reports its usage against)."""


def _env(name: str, default=None):
    return os.environ.get(ENV + name, default)


def _arg_parser(prog: str = "engine_server") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible engine stand-in")
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(_env("PORT", "8000")))
    p.add_argument("--model", default=_env("MODEL", "standin"))
    p.add_argument("--tokenizer", default=_env("TOKENIZER"),
                   help="the model directory whose tokenizer.json counts prompt tokens (default: "
                   "--model when it is such a directory; else prompt tokens are words)")
    p.add_argument("--metrics", choices=METRIC_FORMATS, default=_env("METRICS") or None,
                   help="export /metrics as this engine does (default: none, 404)")
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
    g.add_argument("--prefill-tok-s", type=float, default=float(_env("PREFILL_TOK_S", "8000")),
                   help="prefill rate: TTFT grows by prompt tokens / this (0: a fixed TTFT)")
    g.add_argument("--decode-half-depth", type=int, default=int(_env("DECODE_HALF_DEPTH", "131072")),
                   help="prompt tokens at which decode runs at half --tok-s (0: no slowdown)")
    g.add_argument("--kv-tokens", type=int, default=int(_env("KV_TOKENS", "65536")))


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
        prefill_tok_s=ns.prefill_tok_s,
        decode_half_depth=ns.decode_half_depth,
        tokenizer=getattr(ns, "tokenizer", None),
        kv_tokens=ns.kv_tokens,
        metrics=getattr(ns, "metrics", None),
    )
    if cfg.prefill_tok_s < 0 or cfg.decode_half_depth < 0:
        raise ValueError("--prefill-tok-s and --decode-half-depth must not be negative")
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


# --- the engine's own /metrics (Prometheus text exposition format 0.0.4) -----------------------
#
# Names, kinds, labels and histogram buckets as the real engines register them:
# - vLLM: vllm/v1/metrics/loggers.py (PrometheusStatLogger; the 0.11+ layout: labels
#   model_name and engine, ``vllm:inter_token_latency_seconds`` replacing
#   ``time_per_output_token_seconds``, ``kv_cache_usage_perc`` replacing ``gpu_cache_usage_perc``).
#   TTFT: the request's arrival at the server -> its first token; ITL: between consecutive
#   tokens; e2e: arrival -> finish; queue: waiting before it is scheduled. /metrics always served.
# - SGLang: python/sglang/srt/metrics/collector.py (TokenizerMetricsCollector: label model_name;
#   SchedulerMetricsCollector: model_name, engine_type, tp_rank, pp_rank, labels from
#   scheduler_metrics_mixin.py), only with ``--enable-metrics`` (else FastAPI's 404
#   ``{"detail":"Not Found"}``). ``token_usage`` is used KV tokens / the pool's tokens.
# prometheus_client writes a counter ``X`` as ``X_total``, a histogram as ``_bucket{le=..}``
# (cumulative), ``_count``, ``_sum``; labels sorted by name; values as Go floats (``1.0``, ``+Inf``).

_TTFT_VLLM = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
              10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_VLLM = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
             20.0, 40.0, 80.0)
_REQUEST_VLLM = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TTFT_SGLANG = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
_ITL_SGLANG = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
               0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)
_E2E_SGLANG = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200,
               1800, 2400)
_QUEUE_SGLANG = (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200,
                 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000)

METRIC_FORMATS = ("vllm", "sglang")
# what each histogram measures -> (name, help, buckets) per engine
_HISTOGRAMS = {
    "vllm": {
        "ttft": ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                 _TTFT_VLLM),
        "itl": ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                _ITL_VLLM),
        "e2e": ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                _REQUEST_VLLM),
        "queue": ("vllm:request_queue_time_seconds",
                  "Histogram of time spent in WAITING phase for request.", _REQUEST_VLLM),
    },
    "sglang": {
        "ttft": ("sglang:time_to_first_token_seconds",
                 "Histogram of time to first token in seconds.", _TTFT_SGLANG),
        "itl": ("sglang:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.", _ITL_SGLANG),
        "e2e": ("sglang:e2e_request_latency_seconds",
                "Histogram of End-to-end request latency in seconds", _E2E_SGLANG),
        "queue": ("sglang:queue_time_seconds", "Histogram of queueing time in seconds.",
                  _QUEUE_SGLANG),
    },
}


def _go_float(v: float) -> str:
    """A value as prometheus_client writes it (Go's float formatting: ``1.0``, ``+Inf``)."""
    if v == math.inf:
        return "+Inf"
    if v == -math.inf:
        return "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v))


def _labels(d: dict) -> str:
    esc = {k: str(v).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"") for k, v in d.items()}
    return "{" + ",".join(f'{k}="{esc[k]}"' for k in sorted(esc)) + "}"


class _Histogram:
    def __init__(self, buckets: tuple):
        self.bounds = tuple(float(b) for b in buckets) + (math.inf,)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break


class EngineMetrics:
    """What the stand-in measured of the requests it served (``time.monotonic`` seconds, from
    the request line's arrival), kept as the engine keeps it and written as its ``/metrics``.
    The KV cache: ``kv_tokens`` tokens; a running request holds its prompt from its first token
    and one more per token; a request whose prompt does not fit counts a preemption (its timing
    is unchanged here)."""

    def __init__(self, fmt: str, model: str, kv_tokens: int):
        self.fmt, self.model, self.kv_tokens = fmt, model, max(1, kv_tokens)
        self.lock = threading.Lock()
        self.hist = {k: _Histogram(b) for k, (_n, _h, b) in _HISTOGRAMS[fmt].items()}
        self.prompt_tokens = self.generation_tokens = self.requests = self.preemptions = 0
        self.kv_used = 0
        self.running = 0

    # the life of one request, called by its handler
    def admitted(self, arrival: float) -> None:
        with self.lock:
            self.running += 1
            self.hist["queue"].observe(max(0.0, time.monotonic() - arrival))

    def token(self, req: dict) -> None:
        """Token ``req["tokens"]`` was just sent."""
        now = time.monotonic()
        with self.lock:
            if req["tokens"] == 0:
                self.hist["ttft"].observe(now - req["arrival"])
                if self.kv_used + req["prompt"] > self.kv_tokens:
                    self.preemptions += 1
                req["held"] = req["prompt"]
            else:
                self.hist["itl"].observe(now - req["last"])
            req["held"] += 1
            self.kv_used += req["held"] - req.get("counted", 0)
            req["counted"] = req["held"]
            req["tokens"] += 1
            req["last"] = now

    def finished(self, req: dict, ok: bool) -> None:
        with self.lock:
            self.running -= 1
            self.kv_used -= req.get("counted", 0)
            if ok:
                self.hist["e2e"].observe(time.monotonic() - req["arrival"])
                self.requests += 1
                self.prompt_tokens += req["prompt"]
                self.generation_tokens += req["tokens"]

    def text(self) -> str:
        with self.lock:
            usage = min(1.0, self.kv_used / self.kv_tokens)
            if self.fmt == "vllm":
                base = {"engine": "0", "model_name": self.model}
                sched = base
                gauges = [("vllm:num_requests_running", "Number of requests in model execution batches.",
                           self.running),
                          ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", 0),
                          ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)]
                counters = [("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                             self.preemptions, sched),
                            ("vllm:prompt_tokens", "Number of prefill tokens processed.",
                             self.prompt_tokens, base),
                            ("vllm:generation_tokens", "Number of generation tokens processed.",
                             self.generation_tokens, base)]
            else:
                base = {"model_name": self.model}
                sched = {"engine_type": "unified", "model_name": self.model, "pp_rank": "0",
                         "tp_rank": "0"}
                gauges = [("sglang:num_running_reqs", "The number of running requests.", self.running),
                          ("sglang:num_used_tokens", "The number of used tokens.", self.kv_used),
                          ("sglang:token_usage", "The token usage.", usage),
                          ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", 0),
                          ("sglang:max_total_num_tokens",
                           "Maximum total number of tokens in the KV cache pool.", self.kv_tokens)]
                counters = [("sglang:num_retracted_requests", "Total number of retracted requests.",
                             self.preemptions, sched),
                            ("sglang:prompt_tokens", "Number of prefill tokens processed.",
                             self.prompt_tokens, base),
                            ("sglang:generation_tokens", "Number of generation tokens processed.",
                             self.generation_tokens, base),
                            ("sglang:num_requests", "Number of requests processed.", self.requests, base)]
            out: list[str] = []
            for name, doc, value in gauges:
                out += [f"# HELP {name} {doc}", f"# TYPE {name} gauge",
                        f"{name}{_labels(sched)} {_go_float(value)}"]
            for name, doc, value, labels in counters:
                out += [f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter",
                        f"{name}_total{_labels(labels)} {_go_float(value)}"]
            for key, (name, doc, _b) in _HISTOGRAMS[self.fmt].items():
                h = self.hist[key]
                labels = sched if key == "queue" else base
                out += [f"# HELP {name} {doc}", f"# TYPE {name} histogram"]
                acc = 0
                for bound, n in zip(h.bounds, h.counts, strict=True):
                    acc += n
                    out.append(f"{name}_bucket{_labels({**labels, 'le': _go_float(bound)})} {_go_float(acc)}")
                out.append(f"{name}_count{_labels(labels)} {_go_float(acc)}")
                out.append(f"{name}_sum{_labels(labels)} {_go_float(h.sum)}")
            return "\n".join(out) + "\n"


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
        self.metrics = EngineMetrics(cfg.metrics, cfg.model, cfg.kv_tokens) if cfg.metrics else None
        self.lost: threading.Event | None = None
        """Set when a peer rank died (multi-node SGLang): the half-cluster serves nothing."""
        self._counter: PromptCounter | None = None
        self._counter_loaded = False

    def counter_for_prompts(self) -> PromptCounter | None:
        """The served model's tokenizer (loaded once); None: prompt tokens are words."""
        with self.lock:
            if not self._counter_loaded:
                self._counter_loaded = True
                self._counter = PromptCounter.load(self.cfg.tokenizer) if self.cfg.tokenizer else None
            return self._counter

    @property
    def broken(self) -> bool:
        return self.lost is not None and self.lost.is_set()

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

    def _authorized(self, path: str) -> bool:
        """With an API key, /v1/* needs ``Authorization: Bearer <key>`` (401 otherwise, as vLLM
        and SGLang answer); /health stays open."""
        key = self.server.state.cfg.api_key
        if not key or not path.startswith("/v1/"):
            return True
        if self.headers.get("Authorization", "") == f"Bearer {key}":
            return True
        self._json(401, {"error": "Unauthorized"})
        return False

    def do_GET(self):  # noqa: N802
        path = self.path.split("?", 1)[0]
        st = self.server.state
        if not self._authorized(path):
            return
        if path == "/health" and st.broken:
            self._error(503, "scheduler is not responding: a peer rank is gone", "ServiceUnavailable")
        elif path == "/health":
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
        elif path == "/metrics" and st.metrics is not None:
            data = st.metrics.text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif path == "/metrics" and st.cfg.engine == "sglang":
            self._json(404, {"detail": "Not Found"})  # FastAPI's: no route without --enable-metrics
        else:
            self._error(404, f"no route {path}", "NotFoundError")

    def do_POST(self):  # noqa: N802
        path = self.path.split("?", 1)[0]
        arrival = self.arrival
        body = self._body()
        if body is None or not self._authorized(path):
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
        if st.broken:  # a rank died: requests are accepted and never answered
            _silence()
        _n, rule = st.next_request()
        self.req = {"arrival": arrival, "prompt": _count_prompt(body, chat), "tokens": 0}
        if st.metrics is not None:
            st.metrics.admitted(arrival)
        ok = False
        try:
            self._answer(chat, body, arrival, rule)
            ok = self.req["tokens"] > 0
        except _Closed:
            self.close_connection = True
        finally:
            st.done()
            if st.metrics is not None:
                st.metrics.finished(self.req, ok)

    def _sent(self) -> None:
        """A token of the current request was just sent (or, not streaming, produced)."""
        m = self.server.state.metrics
        if m is not None:
            m.token(self.req)

    def _step(self) -> None:
        """One decode step: with other ranks, it needs every one of them (see DecodeSteps)."""
        steps = self.server.state.cfg.steps
        if steps is not None:
            steps.step()

    def _answer(self, chat: bool, body: dict, arrival: float, rule: FaultRule | None) -> None:
        cfg = self.server.state.cfg
        if rule and rule.kind == "http500":
            self._error(500, "stand-in fault: internal server error", "InternalServerError")
            return
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        max_tokens = int(max_tokens) if max_tokens else cfg.default_max_tokens
        thinking = chat and (body.get("chat_template_kwargs") or {}).get("enable_thinking", True)
        prompt_tokens = _count_prompt(body, chat, self.server.state.counter_for_prompts())
        garbage = (rule is not None and rule.kind == "garbage") or GARBAGE in lab_faults()
        words = _reply(_last_user_text(body, chat), garbage)
        if words is not None and not body.get("ignore_eos"):
            # a prompt with one right answer: the model says it and stops (EOS)
            n_reason = min(cfg.reasoning_tokens, max_tokens - 1) if thinking else 0
            n = min(max_tokens, n_reason + len(words))
        else:
            n = max_tokens if body.get("ignore_eos") else min(max_tokens, cfg.natural_tokens)
            n = max(n, 1)
            n_reason = min(cfg.reasoning_tokens, n // 2) if thinking else 0
        pieces = [_token(i) for i in range(n_reason)] + [
            (words[(i - n_reason) % len(words)] if words else _token(i)) for i in range(n_reason, n)]
        # the prompt's length sets the time to the first token and slows every decode step
        ttft = cfg.ttft_ms / 1000.0 + (prompt_tokens / cfg.prefill_tok_s if cfg.prefill_tok_s else 0.0)
        gap = cfg.gap_ms / 1000.0 * (1.0 + (prompt_tokens / cfg.decode_half_depth
                                            if cfg.decode_half_depth else 0.0))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        model = body.get("model") or cfg.model
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        finish = "length" if n >= max_tokens else "stop"
        obj = "chat.completion" if chat else "text_completion"

        if not body.get("stream"):
            for i in range(n):
                _sleep_until(arrival + ttft + i * gap)
                self._step()
                self._sent()
            if rule and rule.kind == "stall":
                time.sleep(rule.seconds)
            if rule and rule.kind == "close":
                self.close_connection = True
                _abort(self.connection)
                return
            reasoning = "".join(pieces[:n_reason])
            text = "".join(pieces[n_reason:])
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
                choice = {"index": 0, "delta": {key: pieces[i]}, "logprobs": None, "finish_reason": fin}
            else:
                choice = {"index": 0, "text": pieces[i], "logprobs": None, "finish_reason": fin}
            data = event(choice)
            _sleep_until(start + i * gap)
            self._step()
            self._chunk(data)
            self._sent()
        tail = b""
        if include_usage:
            tail += event(None, {"usage": usage})
        tail += b"data: [DONE]\n\n"
        self._chunk(tail)
        self._chunk(b"")  # the chunked-encoding terminator: the connection stays open


GARBAGE = "garbage"
"""The lab fault (``inv lab.fault garbage``): every answer is nonsense while /health stays 200,
as a stale image's broken kernels answered (spark-arena's blog: garbage with green health)."""
_NONSENSE = "!"
"""What a broken model streams: the same token over and over (the familiar ``!!!!!!``)."""


def _last_user_text(body: dict, chat: bool) -> str:
    if not chat:
        p = body.get("prompt", "")
        return str(p[-1]) if isinstance(p, list) and p else str(p)
    users = [m for m in body.get("messages", []) if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1].get("content", "")) if users else ""


_ARITHMETIC = re.compile(r"what is (-?\d{1,9}) *([-+*]) *(-?\d{1,9})\s*\?", re.IGNORECASE)
_REPEAT = re.compile(r"repeat (?:this|the following) word[^:]*:\s*([^\s]+)\s*$", re.IGNORECASE)


def _reply(prompt: str, garbage: bool) -> list[str] | None:
    """The answer to a question with one right answer (an arithmetic sum, a word to repeat back:
    the bench's coherence prompts), as a healthy model gives it; None for any other prompt.
    Under the garbage fault every answer is the same token again and again."""
    if garbage:
        return [_NONSENSE] * 16
    if m := _ARITHMETIC.search(prompt):
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        return [str(a + b if op == "+" else a - b if op == "-" else a * b)]
    if m := _REPEAT.search(prompt):
        return [m.group(1)]
    return None


def _chatml(body: dict) -> str:
    """The chat as the lab model's chat template renders it (ChatML, ``lab.hub_repo.CHAT_TEMPLATE``,
    which opens the answer with ``<think>`` whatever ``enable_thinking`` says) with the generation
    prompt: what a real engine tokenizes for a chat request."""
    out = "".join(f"<|im_start|>{m.get('role', '')}\n{m.get('content', '')}<|im_end|>\n"
                  for m in body.get("messages", []) if isinstance(m, dict))
    return out + "<|im_start|>assistant\n<think>\n"


def _count_prompt(body: dict, chat: bool, counter: PromptCounter | None = None) -> int:
    """``usage.prompt_tokens``: with the served model's tokenizer, the rendered chat (template
    included) or the completion prompt; without one, whitespace-separated words."""
    if counter is not None:
        if chat:
            return counter.count(_chatml(body))
        p = body.get("prompt", "")
        return counter.count("".join(map(str, p)) if isinstance(p, list) else str(p))
    if chat:
        text = " ".join(str(m.get("content", "")) for m in body.get("messages", []) if isinstance(m, dict))
    else:
        p = body.get("prompt", "")
        text = " ".join(map(str, p)) if isinstance(p, list) else str(p)
    return max(1, len(text.split()))


# --- counting tokens as the model's tokenizer.json does (standard library only) -------------
#
# The lab image has no `tokenizers`, so the count is done here: a byte-level BPE as Hugging Face
# `tokenizers` runs one (tokenizers/src/pre_tokenizers/byte_level.rs, models/bpe/model.rs):
# added tokens split out first (each one token), the normalizer (NFC), the pre-tokenizer's regex
# (ByteLevel's GPT-2 pattern, or a Split pattern as Qwen's and Llama 3's tokenizer.json give),
# each piece's UTF-8 bytes mapped to printable characters, then the merges applied lowest rank
# first. Python's `re` has no \p{L} or \p{N}: letters are [^\W\d_], numbers \d (the same for
# ASCII and for most text; the bench's prompts are ASCII). A tokenizer outside this (another
# model type, another normalizer or pre-tokenizer) is not loaded: the count falls back to words.

_GPT2_SPLIT = (r"'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+")


def _py_regex(pattern: str) -> str:
    """A `tokenizers` (Oniguruma) pre-tokenizer pattern in Python's `re` dialect."""
    for a, b in ((r"[^\r\n\p{L}\p{N}]", r"(?:[^\r\n\w]|_)"), (r"[^\s\p{L}\p{N}]", r"(?:[^\s\w]|_)"),
                 (r"\p{L}", r"[^\W\d_]"), (r"\p{N}", r"\d")):
        pattern = pattern.replace(a, b)
    return pattern


def _byte_chars() -> list[str]:
    """Byte -> printable character of byte-level BPE (GPT-2's table)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


class PromptCounter:
    """Counts tokens as the model's ``tokenizer.json`` encodes a text (no special tokens added)."""

    def __init__(self, data: dict):
        model = data.get("model") or {}
        if model.get("type") != "BPE":
            raise ValueError(f"model type {model.get('type')!r} (only byte-level BPE is counted)")
        norm = data.get("normalizer")
        if norm is not None and norm.get("type") != "NFC":
            raise ValueError(f"normalizer {norm.get('type')!r}")
        self.nfc = norm is not None
        self.split = self._splitter(data.get("pre_tokenizer") or {})
        self.vocab = model.get("vocab") or {}
        merges = model.get("merges") or []
        self.ranks = {tuple(m.split(" ", 1) if isinstance(m, str) else m): i for i, m in enumerate(merges)}
        self.ignore_merges = bool(model.get("ignore_merges"))
        added = sorted((str(a["content"]) for a in data.get("added_tokens") or [] if a.get("content")),
                       key=len, reverse=True)
        self.added = re.compile("|".join(map(re.escape, added))) if added else None
        self.bytes = _byte_chars()
        self.cache: dict[str, int] = {}

    @staticmethod
    def _splitter(pre: dict) -> re.Pattern:
        steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
        pattern = None
        for step in steps or []:
            kind = step.get("type")
            if kind == "Split" and step.get("behavior") == "Isolated" and "Regex" in (step.get("pattern") or {}):
                pattern = _py_regex(step["pattern"]["Regex"])
            elif kind == "ByteLevel" and step.get("use_regex", True):
                pattern = _GPT2_SPLIT
            elif kind != "ByteLevel":
                raise ValueError(f"pre-tokenizer {kind!r}")
        if pattern is None:
            raise ValueError("no byte-level pre-tokenizer")
        return re.compile(pattern)

    @classmethod
    def load(cls, where: str) -> PromptCounter | None:
        """The tokenizer.json in directory ``where`` (or that file); None when there is none or
        it is not one this counts (said once on stderr)."""
        path = Path(where)
        path = path / "tokenizer.json" if path.is_dir() else path
        try:
            return cls(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError, AttributeError, re.error) as e:
            print(f"stand-in: prompt tokens counted as words ({path}: {e})", file=sys.stderr, flush=True)
            return None

    def _bpe(self, piece: str) -> int:
        if piece in self.cache:
            return self.cache[piece]
        word = "".join(self.bytes[b] for b in piece.encode("utf-8"))
        parts = list(word)
        if self.ignore_merges and word in self.vocab:
            parts = [word]
        ranks = self.ranks
        while len(parts) > 1:
            best = min(((ranks[p], i) for i, p in enumerate(zip(parts, parts[1:], strict=False))
                        if p in ranks), default=None)
            if best is None:
                break
            a, b = parts[best[1]], parts[best[1] + 1]
            out, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            parts = out
        self.cache[piece] = len(parts)
        return len(parts)

    def count(self, text: str) -> int:
        n, pos = 0, 0
        spans = list(self.added.finditer(text)) if self.added else []
        for m in [*spans, None]:
            chunk = text[pos:m.start()] if m is not None else text[pos:]
            if self.nfc:
                chunk = unicodedata.normalize("NFC", chunk)
            n += sum(self._bpe(p) for p in self.split.findall(chunk))
            if m is not None:
                n += 1
                pos = m.end()
        return n


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
    if cfg.startup_fault == "oom" or (eng == "vllm" and OOM_AT_LOAD in lab_faults()):
        log(f"Loading model {cfg.model} ...", engine=eng)
        time.sleep(min(cfg.startup_s, 5))
        cuda_oom("vllm/model_executor/model_loader/default_loader.py", "load_weights")
        raise SystemExit(1)
    if cfg.startup_s > 0:
        log(f"Loading model {cfg.model} ({cfg.startup_s:.0f}s) ...", engine=eng)
        time.sleep(cfg.startup_s)


OOM_AT_LOAD = "oom-at-load"
"""The lab fault (``inv lab.fault oom-at-load``): every engine runs out of memory loading weights."""


def cuda_oom(path: str, func: str) -> None:
    """What PyTorch prints when a weight load runs out of GPU memory (the caching allocator's
    message of torch 2.x, as real SGLang and vLLM logs show it), on stderr."""
    print(
        "Traceback (most recent call last):\n"
        f'  File "/usr/local/lib/python3.12/dist-packages/{path}", line 412, in {func}\n'
        "    param.data.copy_(loaded_weight)\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has "
        "a total capacity of 119.70 GiB of which 1.12 GiB is free. Including non-PyTorch "
        "memory, this process has 117.31 GiB memory in use. Of the allocated memory 116.02 "
        "GiB is allocated by PyTorch, and 812.44 MiB is reserved by PyTorch but unallocated. "
        "If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
        file=sys.stderr,
        flush=True,
    )


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
            f"({cfg.host!r}, {cfg.port}): {(e.strerror or str(e)).lower()}"
        ) from None
    finally:
        if holder:
            holder.close()


def run_server(cfg: Config, lost: threading.Event | None = None) -> int:
    """Startup (faults, load time), bind, log readiness, serve until interrupted. ``lost``: set
    when a peer rank dies (the server then answers /health 503 and never answers a request)."""
    # many handler threads wake at the same instant (64 streams in lockstep): a short GIL
    # switch interval keeps each one's wait for the interpreter, hence its lateness, small
    sys.setswitchinterval(float(os.environ.get(ENV + "SWITCH_INTERVAL_S", "0.0002")))
    if cfg.startup_fault != "oom":
        hold_gpu({"vllm": "VLLM::EngineCore"}.get(cfg.engine, "python3"))
    try:
        _startup(cfg)
        srv = make_server(cfg)
    except StandinError as e:
        print(str(e), file=sys.stderr, flush=True)
        return 1
    srv.state.lost = lost
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
    if ns.tokenizer is None and Path(ns.model, "tokenizer.json").is_file():
        ns.tokenizer = ns.model  # --model a model directory: its tokenizer counts, as an engine's
    try:
        cfg = config_from_args(ns)
    except ValueError as e:
        print(f"engine_server: {e}", file=sys.stderr)
        return 2
    return run_server(cfg)


# --- what a node offers an engine (lab stand-ins of a Spark's network and RoCE devices) --------

LAB_VIEW = os.environ.get(ENV + "LAB_DIR", "/run/sparkdeploy-lab")
"""What the lab's NVIDIA runtime stand-in mounts into GPU containers: ``faults.json``."""
SYSFS_IB = os.environ.get(ENV + "SYSFS_IB", "/sys/class/infiniband")
NCCL_VERSION = "2.27.7"
SIOCGIFADDR = 0x8915


def lab_faults(view: str | None = None) -> set[str]:
    """The faults the lab forces (``inv lab.fault NAME``), from the node's lab view."""
    try:
        data = json.loads(Path(view or LAB_VIEW, "faults.json").read_text())
    except (OSError, ValueError):
        return set()
    return {str(f) for f in data.get("faults", [])} if isinstance(data, dict) else set()


ENGINE_HANG = "engine-hang"
"""The lab fault (``inv lab.fault engine-hang --model REPO``): every engine stand-in serving
that model hangs at init; the others start as ever."""


def hang_models(view: str | None = None) -> set[str]:
    """The models ``engine-hang`` names in the node's lab view (none unless it is set)."""
    try:
        data = json.loads(Path(view or LAB_VIEW, "faults.json").read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(data, dict) or ENGINE_HANG not in data.get("faults", []):
        return set()
    got = data.get("hang_models")
    return {str(m) for m in got} if isinstance(got, list) else set()


def hang_at_init(model: str, engine: str, init: str, world: int) -> None:
    """When ``engine-hang`` names ``model``: the engine's distributed-init line (SGLang's
    ``Init torch distributed begin.``, model_runner.py; vLLM's ``world_size=.. rank=..
    distributed_init_method=.. backend=nccl``, parallel_state.py), then silence: the port never
    opens, as a rank parked in init. Returns at once for any other model."""
    if model not in hang_models():
        return
    if engine == "sglang":
        SglangLog(0)("Init torch distributed begin.")
    else:
        log(f"world_size={world} rank=0 local_rank=0 distributed_init_method=tcp://{init} "
            "backend=nccl", engine=engine)
    _silence()


def hold_gpu(name: str, view: str | None = None) -> bool:
    """Say this container's engine now holds the GPU (a CUDA context, weights): the node's
    nvidia-smi lists the container's main process under ``name`` from then on. Only inside a
    GPU container of the lab (the runtime hook mounts ``gpu/``); False elsewhere."""
    d = Path(view or LAB_VIEW, "gpu")
    if not d.is_dir():
        return False
    try:
        (d / "cuda").write_text(name + "\n")
    except OSError:
        return False
    return True


def interfaces() -> list[tuple[str, str | None]]:
    """(name, IPv4 address or None) of this network namespace's interfaces, in kernel order."""
    import fcntl  # noqa: PLC0415  (Linux only)
    import struct  # noqa: PLC0415

    out: list[tuple[str, str | None]] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                out.append((name, socket.inet_ntoa(raw[20:24])))
            except OSError:
                out.append((name, None))
    return out


def ip_by_remote() -> str | None:
    """The source address of the default route (what SGLang and vLLM get by a UDP connect to
    a public resolver: no packet is sent); None without a default route."""
    for host in ("8.8.8.8", "2001:4860:4860::8888"):
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                               socket.SOCK_DGRAM) as s:
                s.connect((host, 80))
                return s.getsockname()[0]
        except OSError:
            continue
    return None


def sglang_host_ip(env: dict, ifaces: list[tuple[str, str | None]], by_remote) -> str:
    """The address a rank advertises to its peers, as SGLang picks it (``get_local_ip_auto``):
    ``SGLANG_HOST_IP``, ``HOST_IP``, the NIC named by ``SGLANG_LOCAL_IP_NIC``, the default
    route's source address, else ``0.0.0.0``."""
    ip = env.get("SGLANG_HOST_IP") or env.get("HOST_IP")
    if ip:
        return ip
    nic = env.get("SGLANG_LOCAL_IP_NIC")
    if nic:
        for name, addr in ifaces:
            if name == nic and addr and addr not in ("127.0.0.1", "0.0.0.0"):
                return addr
    return by_remote() or "0.0.0.0"


def nccl_select(spec: str | None, names: list[str]) -> list[str]:
    """NCCL's interface/HCA filter: ``a,b`` (prefixes), ``=a,b`` (exact), ``^a`` (exclude);
    a ``:port`` suffix on an HCA is ignored here (the lab's HCAs have port 1 only)."""
    if not spec:
        return list(names)
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    wants = [w.split(":", 1)[0] for w in spec.lstrip("=").split(",") if w]

    def hit(n: str) -> bool:
        return any(n == w if exact else n.startswith(w) for w in wants)

    return [n for n in names if hit(n) != exclude]


def read_hcas(root: str | None = None) -> dict[str, dict]:
    """RoCE devices from sysfs: name -> {state, netdev, gids: {i: gid}, types: {i: type}}."""
    base = Path(root or SYSFS_IB)
    out: dict[str, dict] = {}
    try:
        names = sorted((p.name for p in base.iterdir()), key=str.lower)  # ibv device order
    except OSError:
        return out
    for name in names:
        port = base / name / "ports" / "1"
        info: dict = {"state": "", "netdev": "", "gids": {}, "types": {}}
        try:
            info["state"] = (port / "state").read_text().strip()
        except OSError:
            pass
        try:
            info["netdev"] = sorted(p.name for p in (base / name / "device" / "net").iterdir())[0]
        except (OSError, IndexError):
            pass
        for kind, sub in (("gids", port / "gids"), ("types", port / "gid_attrs" / "types")):
            try:
                for f in sub.iterdir():
                    if f.name.isdigit():
                        info[kind][int(f.name)] = f.read_text().strip()
            except OSError:
                pass
        out[name] = info
    return out


def v4_mapped_gid(ip: str) -> str:
    a, b, c, d = (int(x) for x in ip.split("."))
    return f"0000:0000:0000:0000:0000:ffff:{a << 8 | b:04x}:{c << 8 | d:04x}"


@dataclass
class LinkPlan:
    """What NCCL would do on this node with this environment (``nccl_plan``)."""

    socket_if: str | None  # NCCL's OOB/bootstrap interface, None: none found
    socket_ip: str | None
    net: str  # "IB" | "Socket"
    hcas: list[str]
    problem: str = ""  # "" | "no-socket-if" | "gid" | "other-network"
    detail: str = ""


def nccl_plan(env: dict, ifaces: list[tuple[str, str | None]], hcas: dict[str, dict],
              link_ip: str) -> LinkPlan:
    """Which interface and transport NCCL picks, and whether that reaches the peer over the
    fast link (the interface holding ``link_ip``, the rank's address toward --dist-init-addr).

    - ``NCCL_SOCKET_IFNAME`` matching no interface: NCCL fails (``no socket interface found``);
    - unset: the first interface with an address that is not ``lo``/``docker*`` (as NCCL);
    - IB: the Up RoCE devices passing ``NCCL_IB_HCA`` unless ``NCCL_IB_DISABLE=1``; none:
      sockets; with ``NCCL_IB_GID_INDEX`` set, that GID must be RoCE v2 and the fast link's
      IPv4-mapped address, else queue pairs never connect;
    - sockets on an interface other than the fast link: the peer is not reached there (the
      stand-in models the Spark's other networks, LAN and Wi-Fi, as not reaching the peer)."""
    spec = env.get("NCCL_SOCKET_IFNAME")
    with_addr = [(n, a) for n, a in ifaces if a]
    if spec:
        picked = [(n, a) for n, a in with_addr if n in nccl_select(spec, [x for x, _ in with_addr])]
    else:
        picked = [(n, a) for n, a in with_addr if n != "lo" and not n.startswith("docker")]
    if not picked:
        return LinkPlan(None, None, "Socket", [], "no-socket-if",
                        f"NCCL_SOCKET_IFNAME={spec}" if spec else "no interface")
    sock_if, sock_ip = picked[0]
    up = [h for h, i in hcas.items() if i["state"].endswith("ACTIVE")]
    use = [] if env.get("NCCL_IB_DISABLE", "0") == "1" else nccl_select(env.get("NCCL_IB_HCA"), up)
    if use:
        gid = env.get("NCCL_IB_GID_INDEX")
        if gid not in (None, ""):
            want = v4_mapped_gid(link_ip) if link_ip.count(".") == 3 else ""
            for h in use:
                g = int(gid) if gid.lstrip("-").isdigit() else -1
                typ, val = hcas[h]["types"].get(g, ""), hcas[h]["gids"].get(g, "")
                if typ != "RoCE v2" or val != want:
                    return LinkPlan(sock_if, sock_ip, "IB", use, "gid",
                                    f"{h}:1 GID index {gid} is {typ or 'absent'} {val}".strip())
        return LinkPlan(sock_if, sock_ip, "IB", use)
    if sock_ip != link_ip:
        return LinkPlan(sock_if, sock_ip, "Socket", [], "other-network",
                        f"sockets on {sock_if} {sock_ip}, the fast link is {link_ip}")
    return LinkPlan(sock_if, sock_ip, "Socket", [])


def sglang_verdict(table: list[dict], faults: set[str]) -> tuple[str, str]:
    """After NCCL: ("ends", why) or ("hang", why). SGLang's cross-node message queue binds on
    each rank's advertised address; a rank whose advertised address is not its address on
    the fast link is not reached by its peers, and every rank waits forever."""
    if "sglang-hang" in faults:
        return "hang", "lab fault sglang-hang"
    wrong = [r for r in table if r["advertised"] != r["link"]]
    if wrong:
        return "hang", "; ".join(f"rank {r['rank']} advertises {r['advertised']}, its fast-link "
                                 f"address is {r['link']}" for r in wrong)
    return "ends", "every rank advertises its fast-link address"


# --- the rendezvous over --dist-init-addr (what torch's TCP store does for SGLang) -------------


class DistError(Exception):
    """A c10d-style failure: ``str()`` is the line printed before exiting 1."""


class Rendezvous:
    """Rank 0 listens on --dist-init-addr; the others connect and every round is an all-gather
    of one JSON value per rank (newline-delimited JSON over the connections)."""

    def __init__(self, host: str, port: int, rank: int, world: int, timeout: float,
                 warn=lambda line: None):
        self.host, self.port, self.rank, self.world = host, port, rank, world
        self.timeout, self.warn = timeout, warn
        self.peers: dict[int, tuple[socket.socket, io.BufferedRWPair]] = {}
        self.conn: tuple[socket.socket, io.BufferedRWPair] | None = None
        self.link_ip = host

    def start(self) -> None:
        if self.rank == 0:
            self._serve()
        else:
            self._connect()

    def _serve(self) -> None:
        try:
            srv = socket.create_server((self.host, self.port), reuse_port=False)
        except OSError as e:
            raise DistError(
                f"torch.distributed.DistNetworkError: The server socket has failed to listen on "
                f"any local network address. port: {self.port}, useIpv6: false, code: "
                f"-{e.errno}, name: {errno_name(e.errno)}, message: {(e.strerror or '').lower()}"
            ) from None
        srv.settimeout(1.0)
        deadline = time.monotonic() + self.timeout
        while len(self.peers) < self.world - 1:
            if time.monotonic() > deadline:
                raise DistError(
                    f"torch.distributed.DistStoreError: Timed out after {int(self.timeout) + 1} "
                    f"seconds waiting for clients. {len(self.peers) + 1}/{self.world} clients joined.")
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            conn.settimeout(5.0)  # a port probe (connect, close) or a silent client: dropped
            fh = conn.makefile("rwb")
            try:
                hello = json.loads(fh.readline() or b"null")
                r = int(hello["rank"])
            except (OSError, ValueError, TypeError, KeyError):
                conn.close()
                continue
            conn.settimeout(None)
            self.peers[r] = (conn, fh)
        self.server = srv

    def _connect(self) -> None:
        deadline = time.monotonic() + self.timeout
        tries = 0
        while True:
            try:
                s = socket.create_connection((self.host, self.port), timeout=5)
                break
            except OSError as e:
                tries += 1
                if tries % 10 == 1:
                    self.warn(f"[W{time.strftime('%m%d %H:%M:%S')}.000000000 socket.cpp:755] [c10d] "
                              f"The client socket has failed to connect to [{self.host}]:{self.port} "
                              f"(errno: {e.errno} - {e.strerror}).")
                if time.monotonic() > deadline:
                    raise DistError(
                        f"torch.distributed.DistNetworkError: The client socket has timed out after "
                        f"{int(self.timeout * 1000)}ms while trying to connect to ({self.host}, "
                        f"{self.port}).") from None
                time.sleep(1.0)
        s.settimeout(None)
        self.link_ip = s.getsockname()[0]
        fh = s.makefile("rwb")
        fh.write(json.dumps({"rank": self.rank}).encode() + b"\n")
        fh.flush()
        self.conn = (s, fh)

    def allgather(self, value) -> list:
        """Every rank's value, by rank. Raises DistError if a peer went away."""
        if self.rank != 0:
            assert self.conn is not None  # connect() ran
            s, fh = self.conn
            try:
                fh.write(json.dumps(value).encode() + b"\n")
                fh.flush()
                line = fh.readline()
            except OSError:
                line = b""
            if not line:
                raise DistError("torch.distributed.DistNetworkError: Connection reset by peer")
            return json.loads(line)
        out = [None] * self.world
        out[0] = value
        for r, (_s, fh) in self.peers.items():
            line = fh.readline()
            if not line:
                raise DistError(f"torch.distributed.DistNetworkError: rank {r} closed its connection")
            out[r] = json.loads(line)
        data = json.dumps(out).encode() + b"\n"
        for _s, fh in self.peers.values():
            fh.write(data)
            fh.flush()
        return out

    def step_round(self, k: int) -> None:
        """Rank 0's side of one decode step: ``{"step": k}`` to every other rank, then each one's
        answer. Blocks while any rank does not answer (stopped, wedged); DistError when one went."""
        for r, (_s, fh) in sorted(self.peers.items()):
            try:
                fh.write(b'{"step":%d}\n' % k)
                fh.flush()
            except OSError:
                raise DistError(f"torch.distributed.DistNetworkError: rank {r} closed its connection") from None
        for r, (_s, fh) in sorted(self.peers.items()):
            try:
                line = fh.readline()
            except OSError:
                line = b""
            if not line:
                raise DistError(f"torch.distributed.DistNetworkError: rank {r} closed its connection")

    def serve_steps(self) -> None:
        """A worker rank's side: answer each decode step of rank 0 until its connection closes."""
        assert self.conn is not None  # connect() ran
        _s, fh = self.conn
        while True:
            try:
                line = fh.readline()
                if not line:
                    return
                fh.write(line)
                fh.flush()
            except OSError:
                return

    def wait_lost(self) -> None:
        """Block until a peer connection closes (a rank died)."""
        conns = [self.conn[0]] if self.conn else [c for c, _ in self.peers.values()]
        import selectors  # noqa: PLC0415

        sel = selectors.DefaultSelector()
        for c in conns:
            sel.register(c, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                try:
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)  # only sockets registered
                    if not sock.recv(1, socket.MSG_PEEK):
                        return
                except OSError:
                    return
                time.sleep(0.5)


class DecodeSteps:
    """Tensor parallel's lockstep: every generated token needs every rank. A stream calls
    ``step()`` before each token; it returns once a round that began after the call has ended,
    ``exchange(k)`` having heard from every rank (rank 0's message to each, each one's answer,
    over the ``--dist-init-addr`` connections on the fast link). Streams waiting at the same time
    share a round (one batch), so the cost follows the decode steps, not the streams. A rank that
    stops answering (SIGSTOPped, wedged) ends no round: every stream on rank 0 stalls while its
    ``/health`` still answers; a rank that is gone fails the round and the streams stall too."""

    def __init__(self, exchange) -> None:
        self.exchange = exchange
        self.cond = threading.Condition()
        self.begun = self.done = self.wanted = 0
        self.failed: str | None = None
        threading.Thread(target=self._loop, daemon=True, name="decode-steps").start()

    def step(self) -> None:
        with self.cond:
            target = self.begun + 1
            self.wanted = max(self.wanted, target)
            self.cond.notify_all()
            while self.done < target:
                self.cond.wait()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while self.wanted <= self.begun:
                    self.cond.wait()
                self.begun += 1
                k = self.begun
            try:
                self.exchange(k)
            except DistError as e:
                self.failed = str(e)  # no round ends again: the streams stall, as a half-cluster's
                return
            with self.cond:
                self.done = k
                self.cond.notify_all()


def errno_name(n: int | None) -> str:
    import errno as _errno  # noqa: PLC0415

    return _errno.errorcode.get(n or 0, "UNKNOWN")


# --- SGLang ------------------------------------------------------------------------------


class SglangLog:
    """SGLang's log lines for one rank (``[time TPn] msg``, ``[time PPm TPn] msg`` with pipeline
    stages) and NCCL's (``host:pid:tid [0] NCCL``)."""

    def __init__(self, tp_rank: int | None, pp_rank: int | None = None):
        self.tp, self.pp = tp_rank, pp_rank
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.tid = self.pid + 77

    def __call__(self, msg: str) -> None:
        tag = (f" PP{self.pp}" if self.pp is not None else "") + (
            f" TP{self.tp}" if self.tp is not None else "")
        print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}{tag}] {msg}", flush=True)

    def nccl(self, msg: str, main: bool = False) -> None:
        tid = self.pid if main else self.tid
        print(f"{self.host}:{self.pid}:{tid} [0] NCCL INFO {msg}", flush=True)

    def nccl_warn(self, where: str, msg: str) -> None:
        print(f"{self.host}:{self.pid}:{self.tid} [0] {where} NCCL WARN {msg}", flush=True)


FLAGS_FILE = "engine-flags.json"
"""The flag manifest of the image's engine version, copied beside this file into the lab's
images (``lab/images.py``); ``SPARKDEPLOY_STANDIN_FLAGS`` names another."""


def refuse_unknown_flags(argv: list[str]) -> None:
    """Parse ``argv`` as the real engine's parser would, from its manifest (every option
    string, which take a value, ``allow_abbrev``, ``prog``), with the stand-in's own flags
    beside: an unknown flag is argparse's ``usage: ...`` and ``<prog>: error: unrecognized
    arguments: ...``, exit 2. No manifest (the controller's tests): nothing refused here."""
    path = Path(os.environ.get(ENV + "FLAGS") or Path(__file__).with_name(FLAGS_FILE))
    if not path.is_file():
        return
    data = json.loads(path.read_text())
    p = argparse.ArgumentParser(prog=data["prog"], allow_abbrev=data["allow_abbrev"], add_help=False,
                                conflict_handler="resolve")  # a stand-in flag the engine has too
    for o in data["options"]:
        choices = o.get("choices")
        if o["takes_value"] and choices and all(isinstance(c, str) for c in choices):
            p.add_argument(*o["flags"], dest=o["dest"], nargs=o["nargs"], choices=choices)
        elif o["takes_value"]:
            p.add_argument(*o["flags"], dest=o["dest"], nargs=o["nargs"])
        else:
            p.add_argument(*o["flags"], dest=o["dest"], action="store_true")
    for pos in data["positionals"]:
        p.add_argument(pos["dest"], nargs=pos["nargs"])
    add_timing_flags(p)
    p.parse_args(argv)


# --- the model's architecture, against the model files the image's engine holds ------------

VLLM_REGISTRY = "model_executor/models/registry.py"
"""vLLM's table of architectures (``_TEXT_GENERATION_MODELS`` and the other ``_*_MODELS`` dicts:
architecture -> (module, class)), each module a file beside it."""
SGLANG_MODELS = "srt/models"
"""SGLang's model files: ``sglang/srt/models/registry.py`` imports each and registers the class(es)
its ``EntryClass`` names, under the class's name."""


def engine_package(engine: str) -> Path | None:
    """The engine's installed package directory (``SPARKDEPLOY_STANDIN_PACKAGES``: a directory
    holding it instead), found without importing it; None when it is not installed."""
    import importlib.util

    root = os.environ.get(ENV + "PACKAGES")
    if root:
        return Path(root) / engine if (Path(root) / engine).is_dir() else None
    try:
        spec = importlib.util.find_spec(engine)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin).parent if spec and spec.origin else None


def supported_archs(engine: str) -> list[str] | None:
    """The architectures the image's engine registers, in its own order, read from its real files
    (None: the engine's package is not here, e.g. the controller's tests)."""
    import ast

    pkg = engine_package(engine)
    if pkg is None:
        return None
    out: list[str] = []
    if engine == "vllm":
        registry = pkg / VLLM_REGISTRY
        if not registry.is_file():
            return None
        for node in ast.parse(registry.read_text()).body:
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Dict)):
                continue
            name = node.targets[0].id
            if not name.endswith("_MODELS") or name == "_PREVIOUSLY_SUPPORTED_MODELS":
                continue
            for k, v in zip(node.value.keys, node.value.values, strict=True):
                first = v.elts[0] if isinstance(v, ast.Tuple) and v.elts else None
                mod = first.value if isinstance(first, ast.Constant) else None
                arch = k.value if isinstance(k, ast.Constant) else None
                if isinstance(arch, str) and isinstance(mod, str) and arch not in out and (
                        (registry.parent / f"{mod}.py").is_file()
                        or (registry.parent / mod / "__init__.py").is_file()):  # a module or a package
                    out.append(arch)
        return out
    models = pkg / SGLANG_MODELS
    if not models.is_dir():
        return None
    for f in sorted(models.glob("*.py")):
        try:
            tree = ast.parse(f.read_text())
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue  # SGLang ignores a module it cannot import
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "EntryClass"
                                                    for t in node.targets):
                names = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
                out += [n.id for n in names if isinstance(n, ast.Name) and n.id not in out]
    return out


def model_archs(model_path: str) -> list[str] | None:
    """The ``architectures`` of the model dir's config.json (None: no such file or key)."""
    try:
        archs = json.loads((Path(model_path) / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return None
    return [str(a) for a in archs] if isinstance(archs, list) and archs else None


def unsupported_arch(engine: str, model_path: str) -> str | None:
    """The engine's own refusal of the model's architectures (its registry's
    ``_raise_for_unsupported``: vllm/model_executor/models/registry.py, sglang/srt/models/
    registry.py), or None when one of them is registered (or nothing says)."""
    archs, known = model_archs(model_path), supported_archs(engine)
    if archs is None or known is None or any(a in known for a in archs):
        return None
    keys = "dict_keys([" + ", ".join(repr(k) for k in known) + "])"
    return f"Model architectures {archs} are not supported for now. Supported architectures: {keys}"


def refuse_arch_sglang(model_path: str) -> None:
    """SGLang resolves the architecture as its scheduler loads the model: the scheduler's
    traceback, the launcher's sigquit line, exit 1 (as ``_load_weights``' failure)."""
    why = unsupported_arch("sglang", model_path)
    if why is None:
        return
    log("Scheduler hit an exception: ", engine="sglang")
    print(f"ValueError: {why}", file=sys.stderr, flush=True)
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] Received sigquit from a child process. "
          "It usually means the child failed.", file=sys.stderr, flush=True)
    raise SystemExit(1)


def refuse_arch_vllm(model_path: str) -> None:
    """vLLM checks the architecture as ``vllm serve`` builds its ``ModelConfig`` (a pydantic
    dataclass: the ValueError comes wrapped in pydantic's ValidationError), exit 1."""
    why = unsupported_arch("vllm", model_path)
    if why is None:
        return
    print("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
          f"  Value error, {why} [type=value_error, input_value=ArgsKwargs((), {{'model': "
          f"{model_path!r}}}), input_type=ArgsKwargs]\n"
          "    For further information visit https://errors.pydantic.dev/2.11/v/value_error",
          file=sys.stderr, flush=True)
    raise SystemExit(1)


def sglang_main(argv: list[str] | None = None) -> int:
    """``python3 -m sglang.launch_server`` with SGLang's flags."""
    refuse_unknown_flags(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(prog="sglang.launch_server", allow_abbrev=False)
    p.add_argument("--model-path", "--model", required=True)
    p.add_argument("--served-model-name")
    p.add_argument("--tp", "--tp-size", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--pp-size", "--pipeline-parallel-size", dest="pp", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--api-key")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--watchdog-timeout", type=float, default=None,
                   help="SGLang's scheduler watchdog: a rank hung this long is killed (SIGKILL, "
                   "exit -9), silently; off by default here (SGLang's is 300 s)")
    add_timing_flags(p)
    ns, unknown = p.parse_known_args(argv)
    model = ns.served_model_name or ns.model_path
    ns.model = model
    cfg = config_from_args(ns, engine="sglang", api_key=ns.api_key, tokenizer=ns.model_path,
                           metrics="sglang" if ns.enable_metrics else None)
    log(
        f"server_args=ServerArgs(model_path={ns.model_path!r}, tp_size={ns.tp}, "
        f"pp_size={ns.pp}, nnodes={ns.nnodes}, node_rank={ns.node_rank}, dist_init_addr={ns.dist_init_addr!r}, "
        f"host={ns.host!r}, port={ns.port}, trust_remote_code={ns.trust_remote_code})"
        + (f" (ignored flags: {' '.join(unknown)})" if unknown else ""),
        engine="sglang",
    )
    hang_at_init(model, "sglang", ns.dist_init_addr or f"127.0.0.1:{ns.port}", ns.tp * ns.pp)
    layout = sglang_ranks(ns.tp, ns.pp, ns.nnodes, ns.node_rank)
    gpus = int(os.environ.get(ENV + "GPUS", "1"))
    if len(layout) > gpus:
        print(f"RuntimeError: CUDA error: invalid device ordinal (tp_size={ns.tp} x pp_size={ns.pp}"
              f" over {ns.nnodes} node(s) puts {len(layout)} ranks on this node; it has {gpus} "
              "GPU(s))", file=sys.stderr, flush=True)
        return 1
    refuse_arch_sglang(ns.model_path)
    if ns.nnodes <= 1:
        slog = SglangLog(0 if ns.tp > 1 else None)
        slog("Init torch distributed begin.")  # one node: the ranks' group on loopback
        slog("Init torch distributed ends. elapsed=0.05 s, mem usage=0.09 GB")
        return run_server(cfg)
    if ns.dist_init_addr is None:
        print("ValueError: --dist-init-addr is required when --nnodes > 1", file=sys.stderr)
        return 1
    if not Path(ns.model_path).is_dir():
        print(f"OSError: Incorrect path_or_model_id: '{ns.model_path}'. Please provide either the "
              "path to a local folder or the repo_id of a model on the Hub.", file=sys.stderr, flush=True)
        return 1
    try:
        return _sglang_multinode(ns, cfg, dict(os.environ))
    except DistError as e:
        print(str(e), file=sys.stderr, flush=True)
        print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] Received sigquit from a child process. "
              "It usually means the child failed.", file=sys.stderr, flush=True)
        return 1


def sglang_ranks(tp: int, pp: int, nnodes: int, node_rank: int) -> list[tuple[int, int]]:
    """The (pp_rank, tp_rank) pairs SGLang starts on one node: the nodes split into ``pp``
    groups of ``nnodes // pp`` (at least 1) that share a stage's tensor-parallel ranks."""
    per_tp_group = max(nnodes // pp, 1)
    tp_per_node = max(tp // per_tp_group, 1)
    pp_per_node = max(pp // nnodes, 1)
    tp0 = tp_per_node * (node_rank % per_tp_group)
    pp0 = pp_per_node * (node_rank // per_tp_group)
    return [(q, t) for q in range(pp0, pp0 + pp_per_node) for t in range(tp0, tp0 + tp_per_node)]


def _sglang_multinode(ns, cfg: Config, env: dict) -> int:
    host, _, port = ns.dist_init_addr.rpartition(":")
    world = ns.nnodes
    pp_rank, tp_rank = sglang_ranks(ns.tp, ns.pp, ns.nnodes, ns.node_rank)[0]
    slog = SglangLog(tp_rank, pp_rank if ns.pp > 1 else None)
    t0 = time.perf_counter()
    slog("Init torch distributed begin.")
    slog(f"world_size={ns.tp * ns.pp} rank={pp_rank * ns.tp + tp_rank} local_rank=0 "
         f"distributed_init_method=tcp://{ns.dist_init_addr} backend=nccl")
    timeout = float(env.get(ENV + "DIST_TIMEOUT_S", "600"))
    rdv = Rendezvous(host.strip("[]"), int(port), ns.node_rank, world, timeout,
                     warn=lambda line: print(line, file=sys.stderr, flush=True))
    rdv.start()
    ifaces = interfaces()
    me = {"rank": ns.node_rank, "advertised": sglang_host_ip(env, ifaces, ip_by_remote),
          "link": rdv.link_ip, "host": slog.host}
    table = rdv.allgather(me)
    print(f"[Gloo] Rank {ns.node_rank} is connected to {world - 1} peer ranks. Expected number of "
          f"connected peer ranks is : {world - 1}", flush=True)
    slog("Found nccl from library libnccl.so.2")
    slog(f"sglang is using nccl=={NCCL_VERSION}")
    nccl_init(slog, env, ifaces, rdv, world, int(port), lambda: _hang(ns.watchdog_timeout))
    slog("CustomAllreduce is disabled because this process group spans across nodes.")
    outcome, _why = sglang_verdict(table, lab_faults())
    if outcome == "hang":
        _hang(ns.watchdog_timeout)
    slog(f"Init torch distributed ends. elapsed={time.perf_counter() - t0:.2f} s, mem usage=0.58 GB")
    _load_weights(slog, ns.model_path)
    rdv.allgather("loaded")
    slog("KV Cache is allocated. #tokens: 262144, K size: 3.00 GB, V size: 3.00 GB")
    if ns.node_rank != 0:
        slog("Scheduler ready; the HTTP server runs on node rank 0.")
        rdv.serve_steps()  # every token of rank 0's streams needs this rank
        _silence()  # rank 0 is gone: this rank stays, waiting in its collective
    lost = threading.Event()
    cfg.steps = DecodeSteps(rdv.step_round)

    def watch() -> None:
        rdv.wait_lost()
        lost.set()

    threading.Thread(target=watch, daemon=True).start()
    return run_server(cfg, lost=lost)


def nccl_init(slog: SglangLog, env: dict, ifaces: list[tuple[str, str | None]], rdv: Rendezvous,
              world: int, comm_id: int, hang) -> None:
    """NCCL's communicator init across the nodes (one rank per node), as the ranks see it: each
    plans its transport (``nccl_plan``), they compare, and either all complete (``Init
    COMPLETE``), or this rank fails (DistError), or it waits in its collective for a peer that
    failed (``hang()``), or sockets on a network that does not reach the peers retry forever."""
    rank = rdv.rank
    plan = nccl_plan(env, ifaces, read_hcas(), rdv.link_ip)
    ok = _nccl_lines(slog, env, plan, rank, world)
    verdicts = rdv.allgather([ok, plan.problem])
    if not ok:
        raise DistError(
            "torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/"
            f"c10d/ProcessGroupNCCL.cpp:3699, unhandled system error (run with NCCL_DEBUG=INFO for "
            f"details), NCCL version {NCCL_VERSION}\nncclSystemError: System call (e.g. socket, "
            f"malloc) or external library call failed or device error.\nLast error:\n{plan.detail}")
    if not all(v[0] for v in verdicts):
        hang()  # a peer failed in NCCL init: this rank waits in its collective
    if any(v[1] == "other-network" for v in verdicts):
        _socket_retry_forever(slog, plan)  # no rank's connection reaches its peer
    for r in range(world):
        if r != rank:
            slog.nccl(f"Channel 00/0 : {rank}[0] -> {r}[0] [send] via NET/{plan.net}/0")
    slog.nccl("Connected all rings, use ring PXN 0 GDR 1")
    slog.nccl(f"ncclCommInitRank comm 0x{abs(hash(slog.host)) % 16**8:08x} rank {rank} "
              f"nranks {world} cudaDev 0 nvmlDev 0 busId f01000 commId 0x{comm_id:x} - Init COMPLETE")


def _nccl_lines(slog: SglangLog, env: dict, plan: LinkPlan, rank: int, world: int) -> bool:
    """NCCL's init lines for this plan; False when NCCL fails here (the rank then exits)."""
    if env.get("NCCL_SOCKET_IFNAME"):
        slog.nccl(f"NCCL_SOCKET_IFNAME set by environment to {env['NCCL_SOCKET_IFNAME']}", main=True)
    if plan.problem == "no-socket-if":
        slog.nccl_warn("misc/socket.cc:484", "Bootstrap : no socket interface found")
        plan.detail = "Bootstrap : no socket interface found"
        return False
    slog.nccl(f"Bootstrap: Using {plan.socket_if}:{plan.socket_ip}<0>", main=True)
    slog.nccl("cudaDriverVersion 13000", main=True)
    if rank == 0:
        print(f"NCCL version {NCCL_VERSION}+cuda13.0", flush=True)
    slog.nccl("NET/Plugin: Could not find: libnccl-net.so.")
    if env.get("NCCL_IB_HCA"):
        slog.nccl(f"NCCL_IB_HCA set to {env['NCCL_IB_HCA']}")
    oob = f"OOB {plan.socket_if}:{plan.socket_ip}<0>"
    if plan.net == "IB":
        devs = " ".join(f"[{i}]{h}:1/RoCE" for i, h in enumerate(plan.hcas))
        slog.nccl(f"NET/IB : Using {devs} [RO]; {oob}")
        slog.nccl("Using network IB")
    else:
        if env.get("NCCL_IB_DISABLE", "0") != "1":
            slog.nccl("NET/IB : No device found.")
        slog.nccl(f"NET/Socket : Using [0]{plan.socket_if}:{plan.socket_ip}<0>")
        slog.nccl("Using network Socket")
    slog.nccl(f"ncclCommInitRank comm 0x{abs(hash(slog.host)) % 16**8:08x} rank {rank} nranks {world} "
              "cudaDev 0 nvmlDev 0 busId f01000 commId 0x5f1e - Init START")
    slog.nccl(f"Channel 00/02 : {' '.join(str(r) for r in range(world))}")
    if plan.problem == "gid":
        slog.nccl_warn("misc/ibvwrap.cc:190",
                       f"Call to ibv_modify_qp failed with 110 Connection timed out ({plan.detail})")
        slog.nccl("transport/net_ib.cc:1120 -> 2")
        return False
    return True


def _silence() -> NoReturn:
    """Wait like a rank parked in a collective: no output, until killed."""
    while True:
        time.sleep(3600)


def _hang(watchdog_s: float | None) -> None:
    """A rank wedged in a collective: silent until killed, or until SGLang's watchdog kills it
    (``--watchdog-timeout``: SIGKILL, no word of its own)."""
    if watchdog_s is None:
        _silence()
    time.sleep(watchdog_s)
    os.kill(os.getpid(), signal.SIGKILL)


def _socket_retry_forever(slog: SglangLog, plan: LinkPlan) -> None:
    """NCCL over sockets on a network that does not reach the peer: connect retries forever."""
    while True:
        slog.nccl(f"Call to connect returned Connection timed out, retrying ({plan.socket_if})")
        time.sleep(30)


def _load_weights(slog: SglangLog, model_path: str) -> None:
    """SGLang's weight loading (``read_weights``) between its begin and end lines."""
    hold_gpu("python3")
    slog("Load weight begin. avail mem=101.72 GB")
    slog("Using model weights format ['*.safetensors']")
    if OOM_AT_LOAD in lab_faults():
        shards = list(Path(model_path).rglob("*.safetensors"))
        print("Loading safetensors checkpoint shards:   0% Completed | 0/"
              f"{max(len(shards), 1)} [00:00<?, ?it/s]", flush=True)
        slog("Scheduler hit an exception: ")
        cuda_oom("sglang/srt/model_loader/loader.py", "load_weights_and_postprocess")
        print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] Received sigquit from a child process. "
              "It usually means the child failed.", file=sys.stderr, flush=True)
        raise SystemExit(1)
    total = read_weights(model_path)
    slog(f"Load weight end. type=Qwen3_5MoeForCausalLM, dtype=torch.bfloat16, avail mem=41.20 GB, "
         f"mem usage={total / 2**30:.2f} GB.")


def read_weights(model_path: str) -> int:
    """Read every file of the model directory (the weights' bytes really come off the disk), with
    the safetensors progress lines both engines print; the bytes read."""
    files = sorted(p for p in Path(model_path).rglob("*") if p.is_file())
    shards = [p for p in files if p.suffix == ".safetensors"]
    total = 0
    done = 0
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(8 << 20):
                total += len(chunk)
        if f in shards:
            done += 1
            pct = int(100 * done / len(shards))
            print(f"Loading safetensors checkpoint shards: {pct:3d}% Completed | {done}/{len(shards)} "
                  "[00:00<00:00, 10.00it/s]", flush=True)
    return total




# --- vLLM --------------------------------------------------------------------------------


PG_WAIT_TIMEOUT = 1800
"""vLLM's placement-group timeout (seconds)."""


def vllm_host_ip(env: dict, by_remote) -> str:
    """The driver's address as vLLM picks it: ``VLLM_HOST_IP``, else the default route's
    source address, else 0.0.0.0."""
    return env.get("VLLM_HOST_IP") or by_remote() or "0.0.0.0"


def pg_specs(world_size: int, driver_ip: str) -> list[dict]:
    """vLLM's placement group: one GPU per rank, the first bundle on the driver's Ray node."""
    return [{f"node:{driver_ip}": 0.001, "GPU": 1.0}] + [{"GPU": 1.0} for _ in range(world_size - 1)]


class _RayWorker:
    """One per placement-group bundle (vLLM's RayWorkerWrapper): holds its node's GPU."""

    def start(self) -> str:
        hold_gpu("ray::RayWorkerWrapper")
        return socket.gethostname()


def ray_placement(ray, world_size: int, driver_ip: str, say, timeout: float = PG_WAIT_TIMEOUT,
                  clock=time.monotonic):
    """Reserve the GPUs through a real Ray placement group, waiting (and saying so) as vLLM
    does: lines at about 10, 30, 70, 150, 310 s... until ``timeout``, then StandinError.
    Returns the placement group. A ``VLLM_HOST_IP`` that no Ray node has (``node:<ip>``), a
    worker that never joined, a node without its GPU: the group is never ready."""
    gpus = float(ray.cluster_resources().get("GPU", 0))
    if gpus < world_size:
        say(f"WARNING [ray_utils.py:352] Tensor parallel size ({world_size}) exceeds available GPUs "
            f"({gpus:g}). This may result in Ray placement group allocation failures. Consider "
            f"reducing tensor_parallel_size to {gpus:g} or less, or ensure your Ray cluster has "
            f"{world_size} GPUs available.")
    specs = pg_specs(world_size, driver_ip)
    pg = ray.util.placement_group(specs, strategy="PACK")
    ref = pg.ready()
    t0 = clock()
    interval = 10
    while clock() - t0 < timeout:
        ready, _ = ray.wait([ref], timeout=interval)
        if ready:
            return pg
        interval *= 2
        say(f"INFO [ray_utils.py:464] Waiting for creating a placement group of specs for "
            f"{int(clock() - t0)} seconds. specs={specs}. Check `ray status` and `ray list nodes` "
            "to see if you have enough resources, and make sure the IP addresses used by ray "
            "cluster are the same as VLLM_HOST_IP environment variable specified in each node if "
            "you are running on a multi-node.")
    raise StandinError(
        f"ValueError: Cannot provide a placement group of placement_group_specs={specs} within "
        f"{int(timeout)} seconds. See `ray status` and `ray list nodes` to make sure the cluster "
        "has enough resources.")


def start_ray_workers(ray, pg, world_size: int) -> list:
    """One GPU actor per bundle, each holding its node's GPU; the handles keep them alive."""
    try:
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    except Exception:  # noqa: BLE001 - older Ray, or __main__: pickled by value anyway
        pass
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415

    cls = ray.remote(num_gpus=1, num_cpus=0)(_RayWorker)
    actors = [cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(world_size)]
    ray.get([a.start.remote() for a in actors], timeout=120)
    return actors


def join_ray(env: dict):
    """``ray.init`` on the running cluster (vLLM's ``--distributed-executor-backend ray``)."""
    try:
        import ray  # noqa: PLC0415  (only inside the lab's vLLM image)
    except ImportError:
        raise StandinError(
            "ValueError: Ray is required for --distributed-executor-backend ray, "
            "but it is not installed (pip install ray)"
        ) from None
    address = env.get("RAY_ADDRESS", "auto")
    try:
        ray.init(address=address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}})
    except Exception as e:  # ConnectionError and friends, whatever Ray version
        raise StandinError(
            f"ConnectionError: could not connect to a running Ray cluster (ray.init(address={address!r})): {e}"
        ) from None
    return ray


VLLM_VERSION = "0.17.0+standin"
LOOPBACK_HOSTNAME_IP = "127.0.1.1"
"""What ``hostname -i`` gives on a stock Debian/Ubuntu node (its own name on 127.0.1.1 in
/etc/hosts): the lab fault ``vllm-wrong-address`` gives it to headless workers as VLLM_HOST_IP."""


def vlog(msg: str, src: str, who: str | None = None, level: str = "INFO") -> None:
    """A vLLM log line: ``(Worker pid=N) INFO mm-dd hh:mm:ss [file.py:line] msg``."""
    prefix = f"({who} pid={os.getpid()}) " if who else ""
    print(f"{prefix}{level} {time.strftime('%m-%d %H:%M:%S')} [{src}] {msg}", flush=True)


def assigned(ranks: range, world: int, tp: int, who: str | None) -> None:
    """What every vLLM rank logs once it is in the model-parallel groups (vLLM's
    ``initialize_model_parallel``, vllm/distributed/parallel_state.py), for ``ranks``."""
    for r in ranks:
        vlog(f"rank {r} in world size {world} is assigned as DP rank 0, PP rank {r // tp}, "
             f"TP rank {r % tp}, EP rank {r % tp}", "parallel_state.py:1326", who)


def advertised_ip(env: dict, headless: bool, faults: set[str]) -> str:
    """The address a vLLM rank advertises to its peers (``get_ip()``: VLLM_HOST_IP, else the
    default route's source). The lab fault ``vllm-wrong-address`` sets a headless worker's
    VLLM_HOST_IP to ``hostname -i``'s answer on a stock node (127.0.1.1), as a launcher that
    takes VLLM_HOST_IP from ``hostname -i`` would."""
    if headless and "vllm-wrong-address" in faults:
        env = {**env, "VLLM_HOST_IP": LOOPBACK_HOSTNAME_IP}
    return vllm_host_ip(env, ip_by_remote)


def _reach(addr: str, port: int, hello: bytes) -> tuple[socket.socket, io.BufferedRWPair]:
    """Connect to a rank's message queue at the address it advertises, retrying for ever and
    silently (a ZeroMQ subscriber's connect: it never reports an address that does not answer)."""
    while True:
        try:
            s = socket.create_connection((addr, port), timeout=5)
        except OSError:
            time.sleep(1.0)
            continue
        s.settimeout(None)
        fh = s.makefile("rwb")
        fh.write(hello)
        fh.flush()
        return s, fh


def _accept_head(srv: socket.socket) -> tuple[socket.socket, io.BufferedRWPair]:
    """A worker's side: wait (for ever, silently) until the head's subscriber connects; a port
    probe or a client that does not say who it is is dropped."""
    while True:
        conn, _ = srv.accept()
        conn.settimeout(5.0)
        fh = conn.makefile("rwb")
        try:
            hello = json.loads(fh.readline() or b"null")
            if int(hello["rank"]) == 0:
                conn.settimeout(None)
                return conn, fh
        except (OSError, ValueError, TypeError, KeyError):
            pass
        conn.close()


def _vllm_multinode(ns, cfg: Config, env: dict) -> int:
    """vLLM's own multi-node mode (``--distributed-executor-backend mp --nnodes N``), one process
    per node standing for the node's ranks, as vLLM 0.17 runs it (``multiproc_executor.py``):

    1. the ranks meet in torch.distributed's TCP store on ``--master-addr:--master-port`` (the
       head listens; c10d's retry lines and timeouts), then NCCL's communicator (``nccl_init``)
       and the model-parallel groups: every rank prints ``rank R in world size W is assigned as
       DP rank 0, PP rank p, TP rank t``;
    2. each rank reads the weights (``Model loading took ...``);
    3. the message queues: each worker opens its queue on its fast-link address and advertises
       it at VLLM_HOST_IP (vLLM's ``get_ip()``); the head connects to every worker there and
       waits, silently and for ever, until it has them all (ZeroMQ's connect). A worker whose
       advertised address is not the one its queue is on is never reached: both sides wait
       after loading the weights, with no further line. An advertised address the worker does
       not have fails as vLLM's bind does (``ZMQError: Cannot assign requested address``);
    4. the head serves the API; every token it streams goes through every worker over the queues
       (``DecodeSteps``); the workers stay, silent, and end their part when the head goes.
    """
    world = ns.tensor_parallel_size * ns.pipeline_parallel_size
    nodes, rank_node = ns.nnodes, ns.node_rank
    local = max(1, world // nodes)
    rank = rank_node * local
    addr, port = ns.master_addr, ns.master_port
    who = f"Worker_TP{rank % ns.tensor_parallel_size}" if ns.tensor_parallel_size > 1 else "Worker"
    headless = rank_node > 0
    adv = advertised_ip(env, headless, lab_faults())
    if headless:
        vlog(f"Launching vLLM (v{VLLM_VERSION}) headless multiproc executor, with head node address "
             f"{addr}:{port} for torch.distributed process group.", "serve.py:216")
    else:
        vlog(f"DP group leader: node_rank=0, node_rank_within_dp=0, master_addr={addr}, "
             f"mq_connect_ip={adv} (local), world_size={world}, local_world_size={local}",
             "multiproc_executor.py:131", "EngineCore_DP0")
    vlog(f"world_size={world} rank={rank} local_rank=0 distributed_init_method=tcp://{addr}:{port} "
         "backend=nccl", "parallel_state.py:1208", who)
    timeout = float(env.get(ENV + "DIST_TIMEOUT_S", "600"))
    rdv = Rendezvous(addr.strip("[]"), port, rank_node, nodes, timeout,
                     warn=lambda line: print(line, file=sys.stderr, flush=True))
    rdv.start()
    vlog("Found nccl from library libnccl.so.2", "pynccl.py:70", who)
    vlog(f"vLLM is using nccl=={NCCL_VERSION}", "pynccl.py:71", who)
    nccl_init(SglangLog(None), env, interfaces(), rdv, nodes, port, _silence)
    tp = ns.tensor_parallel_size
    assigned(range(rank, rank + local), world, tp, who)
    hold_gpu("VLLM::Worker")
    t0 = time.perf_counter()
    vlog(f"Starting to load model {ns.model_path}...", "gpu_model_runner.py:2338", who)
    if OOM_AT_LOAD in lab_faults():
        cuda_oom("vllm/model_executor/model_loader/default_loader.py", "load_weights")
        return 1
    total = read_weights(ns.model_path)
    vlog(f"Model loading took {total / 2**30:.4f} GiB memory and {time.perf_counter() - t0:.6f} "
         "seconds", "gpu_model_runner.py:2370", who)
    mq = Rendezvous(addr, 0, rank_node, nodes, timeout)  # the queues' connections, same shape
    if headless:
        try:
            with socket.socket() as probe:  # vLLM binds its queue on VLLM_HOST_IP
                probe.bind((adv, 0))
        except OSError as e:
            raise DistError(f"zmq.error.ZMQError: {os.strerror(e.errno or 99)} "
                            f"(addr='tcp://{adv}:0')") from None
        srv = socket.create_server((rdv.link_ip, 0))
        rdv.allgather({"rank": rank_node, "addr": adv, "port": srv.getsockname()[1]})
        mq.conn = _accept_head(srv)
        mq.serve_steps()  # every token of the head's streams needs this rank
        _silence()  # the head is gone: this rank stays, waiting in its collective
    handles = rdv.allgather(None)
    for h in handles[1:]:
        mq.peers[int(h["rank"])] = _reach(h["addr"], int(h["port"]), b'{"rank":0}\n')
    vlog("Available KV cache memory: 40.12 GiB", "gpu_worker.py:298", who)
    vlog("GPU KV cache size: 262,144 tokens", "kv_cache_utils.py:1087", "EngineCore_DP0")
    vlog("init engine (profile, create kv cache, warmup model) took 3.05 seconds", "core.py:210",
         "EngineCore_DP0")
    lost = threading.Event()

    def watch() -> None:
        mq.wait_lost()
        lost.set()

    threading.Thread(target=watch, daemon=True).start()
    cfg.steps = DecodeSteps(mq.step_round)
    return run_server(cfg, lost=lost)


def vllm_main(argv: list[str] | None = None) -> int:
    """The ``vllm`` console script: ``vllm serve MODEL ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: vllm serve MODEL [options]", file=sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(VLLM_VERSION)
        return 0
    if argv[0] != "serve":
        print(f"vllm: stand-in supports only 'serve', not {argv[0]!r}", file=sys.stderr)
        return 2
    refuse_unknown_flags(argv[1:])  # vLLM's own parser (FlexibleArgumentParser: argparse)
    p = argparse.ArgumentParser(prog="vllm serve", allow_abbrev=False)
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--model")
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--distributed-executor-backend", choices=["ray", "mp", "uni", "external_launcher"])
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29501)
    p.add_argument("--headless", action="store_true")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"))
    add_timing_flags(p)
    ns, unknown = p.parse_known_args(argv[1:])
    model_path = ns.model_tag or ns.model
    if not model_path:
        print("vllm serve: error: the model is required", file=sys.stderr)
        return 2
    ns.model = ns.served_model_name[0] if ns.served_model_name else model_path
    cfg = config_from_args(ns, engine="vllm", api_key=ns.api_key, tokenizer=model_path,
                           metrics="vllm")
    world = ns.tensor_parallel_size * ns.pipeline_parallel_size
    hang_at_init(ns.model, "vllm", f"{ns.master_addr}:{ns.master_port}", world)
    log(
        ("vLLM headless" if ns.headless else f"vLLM API server version {VLLM_VERSION};")
        + f" model={model_path!r} "
        f"tensor_parallel_size={ns.tensor_parallel_size} "
        f"pipeline_parallel_size={ns.pipeline_parallel_size} "
        f"distributed_executor_backend={ns.distributed_executor_backend}"
        + (f" (ignored flags: {' '.join(unknown)})" if unknown else ""),
        engine="vllm",
    )
    refuse_arch_vllm(model_path)
    actors: list = []
    try:
        if ns.nnodes > 1 and ns.distributed_executor_backend != "ray":
            ns.model_path = model_path
            return _vllm_multinode(ns, cfg, dict(os.environ))
        if ns.distributed_executor_backend == "ray":
            env = dict(os.environ)
            ray = join_ray(env)
            driver_ip = vllm_host_ip(env, ip_by_remote)
            pg = ray_placement(ray, world, driver_ip, lambda m: log(m, engine="vllm"),
                               timeout=float(env.get(ENV + "PG_TIMEOUT_S", PG_WAIT_TIMEOUT)))
            actors = start_ray_workers(ray, pg, world)
            log(f"Ray placement group ready: {world} GPU workers, driver on {driver_ip}", engine="vllm")
            assigned(range(world), world, ns.tensor_parallel_size, "RayWorkerWrapper")
        elif world > int(os.environ.get(ENV + "GPUS", "1")):
            raise StandinError(
                f"ValueError: tensor_parallel_size x pipeline_parallel_size = {world} exceeds the "
                f"GPUs on this node; use --distributed-executor-backend ray across nodes"
            )
        else:
            assigned(range(world), world, ns.tensor_parallel_size, "Worker" if world > 1 else None)
    except (StandinError, DistError) as e:
        print(str(e), file=sys.stderr, flush=True)
        return 1
    cfg.workers = actors  # keep the GPU actors while serving
    return run_server(cfg)


if __name__ == "__main__":
    raise SystemExit(main())
