"""The engine's own figures beside the client's: its Prometheus ``/metrics``, read before and
after each measured run and sampled while it runs.

What is read (the first name present wins; vLLM: vllm/v1/metrics/loggers.py, SGLang:
python/sglang/srt/metrics/collector.py; docs/bench.md lists them):

- TTFT, ITL, end-to-end and queue time: histograms; the run's mean is the difference of their
  ``_sum`` over the difference of their ``_count`` (after minus before), so requests served
  before the run do not count. vLLM measures from the request's arrival at its API server,
  SGLang from its arrival at the tokenizer manager; both to the token leaving the engine.
- KV-cache usage (a gauge, 0..1): its peak over the samples taken during the run.
- Preemptions (vLLM) or retracted requests (SGLang): a counter's difference.
- Running and waiting requests: their peaks.

The series of the model benchmarked are used (label ``model_name``) when there are any, else
all of them. The text format is the Prometheus exposition format 0.0.4 (what
``prometheus_client`` writes); a small parser here, as the client needs only samples, not
the library's registry.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from sparkdeploy.core.errors import RunError
from sparkdeploy.core.outside import OutsideError, request
from sparkdeploy.node.endpoint import headers as auth_headers

MAX_TEXT = 16 * 1024 * 1024
"""The most a /metrics answer may hold (vLLM's is ~100 kB; a bigger one is not metrics)."""

HISTOGRAMS = {
    "ttft_ms": ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds"),
    # vLLM 0.11 renamed time_per_output_token_seconds (the same figure) to inter_token_latency
    "itl_ms": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
               "sglang:inter_token_latency_seconds"),
    "e2el_ms": ("vllm:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds"),
    "queue_ms": ("vllm:request_queue_time_seconds", "sglang:queue_time_seconds"),
}
# vLLM 0.9 renamed gpu_cache_usage_perc to kv_cache_usage_perc; SGLang's token_usage is used
# KV tokens over the pool's
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
PREEMPTIONS = ("vllm:num_preemptions_total", "sglang:num_retracted_requests_total")
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")

COMPARED = (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2el_ms", "end-to-end"))
"""The client's means set beside the engine's (the client's ``itl_ms`` pools every gap as
vLLM's histogram does)."""
DISAGREE_PCT = 10.0
"""Client and engine disagree when their means differ by more than this, relative to the
engine's."""


SAMPLE_S = 0.5
"""How often the engine's metrics are sampled during a run (for the peaks)."""


class MetricsError(RunError):
    """No engine metrics to read: ``str()`` is the one line to show."""


Samples = dict[str, list[tuple[dict[str, str], float]]]

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _value(text: str) -> float:
    special = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}
    if text in special:
        return special[text]
    if not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text):
        raise ValueError(text)
    return float(text)


def _labels(text: str, where: str) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if not m:
            raise MetricsError(f"{where}: labels {text[:80]!r} are not name=\"value\" pairs")
        out[m.group(1)] = re.sub(r"\\[\\\"n]", lambda e: _UNESCAPE[e.group(0)], m.group(2))
        pos = m.end()
    return out


def parse(text: str, what: str = "/metrics") -> Samples:
    """Prometheus text exposition (format 0.0.4) -> ``{sample name: [(labels, value)]}``;
    ``MetricsError`` naming the first line that is not one (comments and blank lines skipped)."""
    out: Samples = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if not m:
            raise MetricsError(f"{what}: line {n} is not a Prometheus sample: {line[:80]!r}")
        name, labels, value = m.groups()
        try:
            v = _value(value)
        except ValueError:
            raise MetricsError(f"{what}: line {n}: {value[:40]!r} is not a number") from None
        out.setdefault(name, []).append((_labels(labels or "", f"{what}: line {n}"), v))
    return out


def _series(samples: Samples, name: str, model: str | None) -> list[float] | None:
    rows = samples.get(name)
    if rows is None:
        return None
    mine = [v for labels, v in rows if model is not None and labels.get("model_name") == model]
    return mine or [v for _labels, v in rows]


def _first(samples: Samples, names: tuple[str, ...], model: str | None,
           suffix: str = "") -> tuple[str, list[float]] | None:
    for name in names:
        vals = _series(samples, name + suffix, model)
        if vals is not None:
            return name, vals
    return None


@dataclass
class Snapshot:
    """One reading of /metrics, reduced to what the bench compares."""

    engine: str | None  # "vllm" | "sglang", from the families' prefix
    sums: dict[str, tuple[float, float]] = field(default_factory=dict)  # key -> (sum, count)
    names: dict[str, str] = field(default_factory=dict)  # key -> the family read
    preemptions: float | None = None
    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None


def reduce(samples: Samples, model: str | None = None) -> Snapshot:
    snap = Snapshot(engine=None)
    for key, names in HISTOGRAMS.items():
        got = _first(samples, names, model, "_sum")
        count = got and _series(samples, got[0] + "_count", model)
        if got and count:
            snap.sums[key] = (sum(got[1]), sum(count))
            snap.names[key] = got[0]
    for attr, names, pick in (("kv_usage", KV_USAGE, max), ("running", RUNNING, sum),
                              ("waiting", WAITING, sum), ("preemptions", PREEMPTIONS, sum)):
        got = _first(samples, names, model)
        if got:
            setattr(snap, attr, pick(got[1]))
            snap.names[attr] = got[0]
    prefixes = {n.split(":", 1)[0] for n in snap.names.values()}
    snap.engine = prefixes.pop() if len(prefixes) == 1 else None
    return snap


def metrics_url(base: str) -> str:
    """The engine's /metrics beside its OpenAI API (``http://h:p/v1`` -> ``http://h:p/metrics``)."""
    return base.rstrip("/").removesuffix("/v1") + "/metrics"


def scrape(url: str, model: str | None = None, deadline: float = 5.0) -> Snapshot:
    """Read and reduce ``url``; ``MetricsError`` (one line) when there is nothing to read: not
    reachable, not 200 (SGLang without ``--enable-metrics`` answers 404), not metrics text, or
    no family the bench knows."""
    try:
        r = request("GET", url, headers=auth_headers(), deadline=deadline, max_body=MAX_TEXT)
    except OutsideError as e:
        raise MetricsError(str(e)) from None
    if r.status != 200:
        raise MetricsError(f"{url}: HTTP {r.status}")
    try:
        text = r.body.decode("utf-8")
    except UnicodeDecodeError:
        raise MetricsError(f"{url}: not UTF-8 text") from None
    snap = reduce(parse(text, url), model)
    if not snap.names:
        raise MetricsError(f"{url}: no vLLM or SGLang metric in it")
    return snap


def _mean_ms(before: Snapshot, after: Snapshot, key: str) -> tuple[float | None, int]:
    if key not in after.sums:
        return None, 0
    s1, c1 = after.sums[key]
    s0, c0 = before.sums.get(key, (0.0, 0.0))
    n = c1 - c0
    return ((s1 - s0) / n * 1000.0 if n > 0 else None), int(max(n, 0))


def _peak(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None and not math.isnan(v)]
    return max(got) if got else None


def summarize(before: Snapshot, after: Snapshot, samples: list[Snapshot]) -> dict[str, Any]:
    """The run's engine figures: means from the histograms' deltas, peaks over the samples
    (before and after included), the preemptions counted during the run."""
    seen = [before, *samples, after]
    out: dict[str, Any] = {"engine": after.engine, "families": dict(after.names)}
    for key in HISTOGRAMS:
        out[key], n = _mean_ms(before, after, key)
        out[key.removesuffix("_ms") + "_count"] = n
    kv = _peak([s.kv_usage for s in seen])
    out["kv_cache_peak_pct"] = None if kv is None else kv * 100.0
    out["running_peak"] = _peak([s.running for s in seen])
    out["waiting_peak"] = _peak([s.waiting for s in seen])
    out["preemptions"] = (None if after.preemptions is None or before.preemptions is None
                          else after.preemptions - before.preemptions)
    out["samples"] = len(seen)
    return out


def versus(client: dict, engine: dict) -> list[dict[str, Any]]:
    """Client mean beside engine mean for TTFT, ITL and end-to-end; ``disagree`` when they
    differ by more than ``DISAGREE_PCT`` of the engine's."""
    rows = []
    for key, label in COMPARED:
        c = (client.get(key) or {}).get("mean")
        e = engine.get(key)
        diff = (c - e) / e * 100.0 if c is not None and e else None
        rows.append({"metric": key, "label": label, "client": c, "engine": e, "diff_pct": diff,
                     "disagree": diff is not None and abs(diff) > DISAGREE_PCT})
    return rows


def disagreements(rows: list[dict[str, Any]]) -> str | None:
    """One line naming where client and engine disagree, or None."""
    bad = [r for r in rows if r["disagree"]]
    if not bad:
        return None
    return "; ".join(f"{r['label']} client {r['client']:,.1f} ms vs engine {r['engine']:,.1f} ms "
                     f"({r['diff_pct']:+.1f}%)" for r in bad)


class Watch:
    """The engine's metrics over one run: ``start()`` reads them (raises ``MetricsError``),
    a thread samples them every ``interval`` seconds, ``stop()`` reads them again and returns
    the run's figures (``{"skipped": why}`` when the last reading failed)."""

    def __init__(self, url: str, model: str | None, interval: float | None = None,
                 deadline: float = 5.0):
        self.url, self.model, self.deadline = url, model, deadline
        self.interval = SAMPLE_S if interval is None else interval
        self.samples: list[Snapshot] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.before: Snapshot | None = None

    def start(self) -> Watch:
        self.before = scrape(self.url, self.model, self.deadline)
        self._thread = threading.Thread(target=self._sample, daemon=True, name="bench-metrics")
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.samples.append(scrape(self.url, self.model, self.deadline))
            except MetricsError:
                pass  # a sample missed; the readings before and after decide

    def cancel(self) -> None:
        """End the sampling (the run did not finish)."""
        self._stop.set()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.deadline + 1)
        assert self.before is not None  # start() read it
        try:
            after = scrape(self.url, self.model, self.deadline)
        except MetricsError as e:
            return {"skipped": f"engine metrics: {e}"}
        return {"url": self.url, **summarize(self.before, after, self.samples)}
