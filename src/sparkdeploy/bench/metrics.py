"""Benchmark metrics, defined as ``vllm bench serve`` defines them (vllm/benchmarks/serve.py,
``calculate_metrics``; docs/bench.md compares the two).

A request is a timeline: its start (``time.perf_counter()`` just before the request is sent)
and the SSE ``data:`` payloads, each with its arrival time. From that timeline:

- TTFT: start -> the first chunk that carries text (``content`` or ``reasoning_content`` for
  chat, ``text`` for completions). The bare role chunk does not count.
- ITL: the gaps between consecutive text-carrying chunks (pooled over all requests for stats).
- E2EL: start -> the last chunk before ``[DONE]`` (usually the usage chunk).
- output tokens: ``usage.completion_tokens``; when the server sends no usage, the number of
  text-carrying chunks (``tokens_source`` says which).
- A broken peer is a failed request, named, never a figure: an answer of more than one token whose
  text all came in one read (the server or a proxy buffers the stream: no time per token), a
  ``completion_tokens`` of 0 for a streamed text (no count to measure by).
- TPOT: (E2EL - TTFT) / (output tokens - 1); per-request decode rate = 1000 / TPOT(ms).

Run level: aggregate output tok/s = output tokens of successful requests / duration, where
duration runs from the first request's start to the last request's end; requests/s =
successful requests / duration. Stats are mean, median, p90, p99 with linear interpolation
between order statistics (numpy's default, which vLLM uses). Failed requests are counted,
kept with their error, and left out of the latency stats.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, Field

from sparkdeploy.core.outside import OutsideError, parsed, validated

DONE = b"[DONE]"


@dataclass
class Timeline:
    """What the client recorded for one request (times in seconds, ``perf_counter``)."""

    start: float
    events: list[tuple[float, bytes]] = field(default_factory=list)
    end: float | None = None
    error: str | None = None
    scheduled: float | None = None


@dataclass
class RequestMetrics:
    ttft_ms: float | None
    e2el_ms: float | None
    output_tokens: int | None
    input_tokens: int | None
    itl_ms: list[float]
    tpot_ms: float | None
    decode_tok_s: float | None
    tokens_source: str | None
    error: str | None
    start: float
    end: float | None

    @property
    def ok(self) -> bool:
        return self.error is None

    def as_json(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "e2el_ms": self.e2el_ms,
                "output_tokens": self.output_tokens, "input_tokens": self.input_tokens,
                "tpot_ms": self.tpot_ms, "decode_tok_s": self.decode_tok_s,
                "tokens_source": self.tokens_source, "error": self.error}


Count = Annotated[int, Field(strict=True, ge=0, le=10**9)]
"""A token count as a server sends it: a JSON integer (not "5", 5.5, true or a word)."""


class _Delta(BaseModel):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _Choice(BaseModel):
    delta: _Delta | None = None
    text: str | None = None


class _Usage(BaseModel):
    prompt_tokens: Count | None = None
    completion_tokens: Count | None = None


class Chunk(BaseModel):
    """What the metrics read of one SSE event (the rest of it is ignored); an event that does not
    fit fails its request with one line naming the field."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None

    def answer(self) -> str:
        """The answer's text in this chunk (``content``, or a completion's ``text``), without
        the reasoning."""
        if not self.choices:
            return ""
        c = self.choices[0]
        return (c.delta.content or "") if c.delta is not None else (c.text or "")

    def text(self) -> str:
        if not self.choices:
            return ""
        c = self.choices[0]
        if c.delta is not None:
            d = c.delta
            return (d.content or "") + (d.reasoning_content or "") + (d.reasoning or "")
        return c.text or ""


def _error_text(err: Any) -> str:
    msg = err.get("message") if isinstance(err, dict) else err
    return str(msg)[:200]


def _broken_peer(usage_out: int | None, chunks: int, reads: set[float]) -> str | None:
    """What a peer did wrong that would make a figure a lie, or None."""
    if usage_out == 0 and chunks:
        return (f"the server streamed {chunks} text chunk(s) and reports completion_tokens 0: "
                "no token count to measure by")
    out = usage_out if usage_out is not None else chunks
    if out > 1 and len(reads) == 1:
        return (f"the whole answer ({out} tokens) came in one piece: the server or a proxy "
                "buffers the stream, so no time per token can be measured")
    return None


def analyse(tl: Timeline) -> RequestMetrics:
    """One request's metrics from its timeline (errors stay errors; an event that is not JSON or
    does not fit ``Chunk`` becomes one)."""
    error = tl.error
    first: float | None = None
    last_text = last_any = 0.0
    itl: list[float] = []
    usage_out = usage_in = None
    chunks = 0
    reads: set[float] = set()  # the reads that brought text (one arrival time each)
    done = False
    for t, payload in tl.events:
        if payload.strip() == DONE:
            done = True
            continue
        try:
            d = parsed(payload, "bad SSE payload")
        except OutsideError:
            error = error or f"bad SSE payload: {payload[:80]!r}"
            break
        if not isinstance(d, dict):
            continue
        try:
            c = validated(Chunk, d, "bad SSE event")
        except OutsideError as e:
            error = error or str(e)
            break
        if c.error:
            error = error or f"error event: {_error_text(c.error)}"
        if c.usage is not None:
            if c.usage.completion_tokens is not None:
                usage_out = c.usage.completion_tokens
            if c.usage.prompt_tokens is not None:
                usage_in = c.usage.prompt_tokens
        if c.text():
            chunks += 1
            reads.add(t)
            if first is None:
                first = t
            else:
                itl.append((t - last_text) * 1000.0)
            last_text = t
        last_any = t
    if error is None and not done:
        error = "stream ended before [DONE]"
    if error is None and first is None:
        error = "no content in the stream"
    error = error or _broken_peer(usage_out, chunks, reads)
    if error is not None:
        return RequestMetrics(None, None, None, usage_in, [], None, None, None, error,
                              tl.start, tl.end)
    assert first is not None  # no text is an error, returned above
    ttft = (first - tl.start) * 1000.0
    e2el = (last_any - tl.start) * 1000.0
    if usage_out is not None:
        out, source = usage_out, "usage"
    else:
        out, source = chunks, "chunks"
    tpot = (e2el - ttft) / (out - 1) if out > 1 else None
    rate = 1000.0 / tpot if tpot else None
    return RequestMetrics(ttft, e2el, out, usage_in, itl, tpot, rate, source, None,
                          tl.start, tl.end)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default method)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


QUANTILES = (50, 90, 95, 99)
"""The percentiles every latency is reported at (``p50`` is also kept as ``median``)."""


def stats(values: list[float]) -> dict[str, float | None]:
    """Mean, median and p50/p90/p95/p99 (numpy's linear interpolation); None without values."""
    if not values:
        return {"mean": None, "median": None, **{f"p{q}": None for q in QUANTILES}}
    qs = {f"p{q}": percentile(values, q) for q in QUANTILES}
    return {"mean": sum(values) / len(values), "median": qs["p50"], **qs}


# --- goodput: the requests that met every SLO -------------------------------------------------
#
# As vLLM defines it (vllm/benchmarks/serve.py, calculate_metrics, ``--goodput ttft:MS tpot:MS
# e2el:MS``): a completed request is good when every metric given is at most its SLO
# (``s >= r``), a request of one output token counting TPOT 0; ``request_goodput`` = good
# requests / the run's duration. The fraction as AIPerf defines it (aiperf
# GoodRequestFractionMetric, docs/tutorials/goodput.md): good requests / (completed + failed),
# so a run that drops requests does not look good because its survivors were fast.

SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2el_ms", "e2el": "e2el_ms"}
_UNITS = {"ms": 1.0, "s": 1000.0}


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft=2s,tpot=80ms,e2e=30s"`` (any subset; ``ms`` or ``s``, a bare number is ms as in
    vLLM's ``--goodput``) -> ``{"ttft_ms": 2000.0, "tpot_ms": 80.0, "e2el_ms": 30000.0}``;
    ValueError naming what does not fit."""
    out: dict[str, float] = {}
    for part in str(text).split(","):
        key, sep, value = part.strip().partition("=")
        key, value = key.strip().lower(), value.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"{part.strip()!r} is not ttft=, tpot= or e2e= a duration "
                             "(e.g. ttft=2s,tpot=80ms,e2e=30s)")
        unit = "ms" if value.endswith("ms") else "s" if value.endswith("s") else ""
        try:
            ms = float(value[: len(value) - len(unit)]) * _UNITS.get(unit, 1.0)
        except ValueError:
            raise ValueError(f"{key}: {value!r} is not a duration (2s, 80ms)") from None
        if not 0 < ms <= 86_400_000:  # nan and inf fail this too
            raise ValueError(f"{key}: {value!r} is not within (0, 1 day]")
        if SLO_KEYS[key] in out:
            raise ValueError(f"{key} is given twice")
        out[SLO_KEYS[key]] = ms
    return out


def met_slo(r: RequestMetrics, slo: dict[str, float]) -> bool:
    """Whether request ``r`` met every SLO (a failed request meets none)."""
    if not r.ok:
        return False
    got: dict[str, float | None] = {"ttft_ms": r.ttft_ms, "tpot_ms": r.tpot_ms or 0.0,
                                    "e2el_ms": r.e2el_ms}
    return all((v := got[k]) is not None and v <= limit for k, limit in slo.items())


def goodput(reqs: list[RequestMetrics], slo: dict[str, float], duration_s: float) -> dict:
    good = sum(met_slo(r, slo) for r in reqs)
    return {"slo": dict(slo), "good": good,
            "req_s": good / duration_s if duration_s > 0 else 0.0,
            "fraction": good / len(reqs) if reqs else 0.0}


# --- a 95 % confidence interval over repeated runs (--runs K) ----------------------------------
#
# Student's t: mean +- t(0.975, K-1) * s / sqrt(K), s the sample standard deviation of the K
# runs' figures (AIPerf's multi-run confidence reporting, docs/tutorials/multi-run-confidence.md,
# reports the same per metric). The two-sided 97.5 % quantiles for 1..30 degrees of freedom,
# from the standard t table; beyond 30 the normal's 1.96 is within 1.5 % of them.

T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    return T975[df - 1] if df <= len(T975) else 1.96


def confidence(values: list[float]) -> dict[str, float | int | None]:
    """The mean of ``values`` (one per run) and its 95 % interval; no interval from one run."""
    n = len(values)
    if n == 0:
        return {"mean": None, "low": None, "high": None, "runs": 0}
    mean = sum(values) / n
    if n == 1:
        return {"mean": mean, "low": None, "high": None, "runs": 1}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "runs": n}


HEADLINES = (("output_tok_s",), ("requests_s",), ("goodput", "req_s"), ("goodput", "fraction"),
             ("per_request_output_tok_s", "median"), ("ttft_ms", "p50"), ("ttft_ms", "p90"),
             ("tpot_ms", "p50"), ("itl_ms", "p50"), ("e2el_ms", "p50"))
"""The figures ``--runs K`` gives an interval for (``summary["ci95"]["ttft_ms.p50"]``)."""


def intervals(summaries: list[dict]) -> dict[str, dict]:
    """``summary["ci95"]``: per headline figure, its interval over the runs that have it."""
    out: dict[str, dict] = {}
    for keys in HEADLINES:
        values = []
        for s in summaries:
            v: Any = s
            for k in keys:
                v = v.get(k) if isinstance(v, dict) else None
            if isinstance(v, (int, float)):
                values.append(float(v))
        if values:
            out[".".join(keys)] = confidence(values)
    return out


def summarize(reqs: list[RequestMetrics], duration_s: float | None = None,
              slo: dict[str, float] | None = None) -> dict:
    """The run summary (the issue's JSON shape, plus totals and the error tally; ``goodput``
    against ``slo`` when given)."""
    ok = [r for r in reqs if r.ok]
    if duration_s is None:
        ends = [r.end for r in reqs if r.end is not None]
        duration_s = (max(ends) - min(r.start for r in reqs)) if reqs and ends else 0.0
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    sources = sorted({r.tokens_source for r in ok if r.tokens_source})
    return {
        "requests": len(reqs),
        "completed": len(ok),
        "failed": len(reqs) - len(ok),
        "duration_s": duration_s,
        "ttft_ms": stats([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "itl_ms": stats([x for r in ok for x in r.itl_ms]),
        "tpot_ms": stats([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "e2el_ms": stats([r.e2el_ms for r in ok if r.e2el_ms is not None]),
        "output_tok_s": out_tokens / duration_s if duration_s > 0 else 0.0,
        "requests_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "per_request_output_tok_s": stats([r.decode_tok_s for r in ok
                                           if r.decode_tok_s is not None]),
        "total_output_tokens": out_tokens,
        "total_input_tokens": sum(r.input_tokens or 0 for r in ok),
        "output_tokens_source": "+".join(sources) if sources else None,
        "errors": dict(Counter(r.error for r in reqs if r.error)),
        **({"goodput": goodput(reqs, slo, duration_s)} if slo else {}),
    }
