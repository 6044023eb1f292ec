"""A benchmark run: warm up, then one measured level per concurrency (or per rate)."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field, model_validator

from sparkdeploy.bench import gate as coherence
from sparkdeploy.bench.client import BenchError, Settings, Target, default_model, run_level
from sparkdeploy.bench.engine import MetricsError, Watch, metrics_url, versus
from sparkdeploy.bench.metrics import RequestMetrics, intervals, summarize
from sparkdeploy.core import checks
from sparkdeploy.core.events import EventSink
from sparkdeploy.core.files import MB, InputError, read_input
from sparkdeploy.core.outside import OutsideError, parsed, validated

STEP = "bench.run"
MAX_RUNS = 100
"""``--runs``: repeats of each level (the interval narrows as 1/sqrt(K); 100 is plenty)."""


def parse_levels(text: str | None, kind=int) -> list:
    """``"1,8,64"`` -> [1, 8, 64] (concurrencies), or rates with ``kind=float``; BenchError on
    anything else, or on a level beyond ``checks.MAX_CONCURRENCY`` / ``checks.RATE_RANGE``."""
    if text is None or str(text).strip() == "":
        return []
    lo, hi = (1, checks.MAX_CONCURRENCY) if kind is int else checks.RATE_RANGE
    out = []
    for part in str(text).split(","):
        try:
            v = kind(part.strip())
        except ValueError:
            raise BenchError(f"not a number: {part.strip()!r}") from None
        if v <= 0:
            raise BenchError(f"must be positive: {part.strip()!r}")
        if not lo <= v <= hi:  # nan fails this too
            raise BenchError(f"{part.strip()!r} is out of range ({lo:g}..{hi:g})")
        out.append(v)
    return out


def run_sweep(url: str, settings: Settings, *, concurrency: list[int] | None = None,
              rates: list[float] | None = None, requests: int, warmup: int,
              max_concurrency: int | None = None, events: EventSink | None = None,
              slo: dict[str, float] | None = None, runs: int = 1, gate: bool = True) -> dict:
    """The whole run as the JSON document (``config`` + ``runs``, one per level). With ``events``,
    each level's requests are reported as ``Progress("bench.run", None, done, total, "req",
    level)`` as they finish (warm-up included). With ``slo``, each level's summary has its
    ``goodput``; with ``runs`` > 1 each level is measured that many times (each request a prompt
    of its own): the summary pools every run's requests, ``repeats`` holds each run's summary and
    ``summary["ci95"]`` the 95 % interval of each headline figure over the runs. ``gate`` False:
    the coherence gate is off for this run (``config["gate"]`` says so, ``gate`` is empty)."""
    target = Target.parse(url)
    listed = default_model(target, deadline=min(10.0, settings.timeout))
    if settings.model is None:  # else: the call above fails early, in one line, when unreachable
        settings.model = listed

    # a model that answers nonsense gets no figures, unless the owner turned the gate off
    answers = coherence.check(target, settings) if gate else []
    levels: list[tuple[int | None, float | None]]
    if rates:
        levels = [(max_concurrency, r) for r in rates]
    else:
        levels = [(c, None) for c in (concurrency or [1])]
    doc: dict[str, Any] = {
        "config": {"url": target.url, **settings.as_json(), "requests": requests,
                   "warmup": warmup, "concurrency": concurrency if not rates else None,
                   "rates": rates or None, "max_concurrency": max_concurrency,
                   "slo": slo or None, "runs": runs, "gate": "on" if gate else "off",
                   "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")},
        "gate": [{"prompt": a.prompt, "answer": a.answer} for a in answers],
        "runs": [],
    }
    # the engine's own /metrics beside each level's figures (bench/engine.py); none: one line
    engine_metrics: dict[str, Any] = {"url": metrics_url(target.url), "skipped": None}
    doc["engine_metrics"] = engine_metrics
    index = 0
    for conc, rate in levels:
        name = f"concurrency {conc}" if rate is None else f"rate {rate:g} req/s"
        if warmup:
            run_level(target, settings, warmup, concurrency=min(warmup, conc or 1),
                      first_index=10_000_000 + index, events=events, step=STEP,
                      note=f"{name}: warm-up")
        watch = None
        if engine_metrics["skipped"] is None:
            try:
                watch = Watch(engine_metrics["url"], settings.model,
                              deadline=min(5.0, settings.timeout)).start()
            except MetricsError as e:
                engine_metrics["skipped"] = f"engine metrics: {e}"
        kept: list[RequestMetrics] = []
        repeats = []
        try:
            for k in range(runs):
                note = name if runs == 1 else f"{name}: run {k + 1}/{runs}"
                repeats.append(run_level(target, settings, requests, concurrency=conc, rate=rate,
                                         first_index=index, events=events, step=STEP, note=note,
                                         slo=slo, keep=kept))
                index += requests
        except BaseException:
            if watch is not None:
                watch.cancel()
            raise
        if runs == 1:
            doc["runs"].append({"concurrency": conc, "rate": rate, **repeats[0]})
            _engine_beside(repeats[0]["summary"], watch)
            continue
        each = [r["summary"] for r in repeats]
        summary = summarize(kept, sum(s["duration_s"] for s in each), slo=slo)
        summary["client"] = each[-1]["client"]
        summary["ci95"] = intervals(each)
        _engine_beside(summary, watch)
        doc["runs"].append({"concurrency": conc, "rate": rate, "summary": summary,
                            "requests": [row for r in repeats for row in r["requests"]],
                            "repeats": each})
    return doc


def _engine_beside(summary: dict, watch: Watch | None) -> None:
    """The level's engine figures (``summary["engine"]``), their means set beside the client's
    (``engine["vs_client"]``)."""
    if watch is None:
        return
    engine = watch.stop()
    if "skipped" not in engine:
        engine["vs_client"] = versus(summary, engine)
    summary["engine"] = engine


def sweep_json(doc: dict) -> str:
    """The sweep's document as the file ``bench.run --json`` writes (atomically, by the step)."""
    return json.dumps(doc, indent=1) + "\n"


Finite = Annotated[float, Field(allow_inf_nan=False)]


class _Quantiles(BaseModel):
    median: Finite | None = None
    p90: Finite | None = None


class _Summary(BaseModel):
    """What compare and the baseline gate read of a level's summary (the rest is kept as is)."""

    output_tok_s: Finite | None = None
    per_request_output_tok_s: _Quantiles = _Quantiles()
    ttft_ms: _Quantiles = _Quantiles()
    itl_ms: _Quantiles = _Quantiles()


class _Run(BaseModel):
    concurrency: int | None = Field(default=None, ge=1)
    rate: Finite | None = Field(default=None, gt=0)
    summary: _Summary

    @model_validator(mode="after")
    def _names_its_level(self) -> _Run:
        if self.concurrency is None and self.rate is None:
            raise ValueError("a run names its level: a concurrency or a rate")
        return self


class _Doc(BaseModel):
    runs: list[_Run]


class _Depth(BaseModel):
    """What compare reads of one depth of a depth sweep (a failed depth: its ``error`` only)."""

    depth: int = Field(ge=0)
    pp_tok_s: Finite | None = None
    tg_tok_s: Finite | None = None
    ttft_ms: Finite | None = None
    error: str | None = None


class _DepthDoc(BaseModel):
    depths: list[_Depth]


def load_json(path: str | Path) -> dict:
    """A benchmark JSON file, checked to be one (``BenchError`` naming the file and the first
    field that does not fit)."""
    path = Path(path)
    try:
        text = read_input(path, limit=64 * MB, what="benchmark JSON file")
    except InputError as e:
        raise BenchError(str(e)) from None
    where = f"{path}: not a benchmark JSON file"
    try:
        doc = parsed(text, where)
        # a depth sweep's (bench.depth: "depths") or a sweep's (bench.run: "runs")
        validated(_DepthDoc if isinstance(doc, dict) and "depths" in doc else _Doc, doc, where)
    except OutsideError as e:
        raise BenchError(str(e)) from None
    return doc


def check_baseline(doc: dict, baseline_tok_s: float, tolerance_pct: float) -> tuple[bool, str]:
    """The single-request gate: median per-request decode rate at concurrency 1 must be at
    least ``baseline * (1 - tolerance)``."""
    run = next((r for r in doc["runs"] if r.get("concurrency") == 1 and r.get("rate") is None),
               None)
    if run is None:
        return False, "no concurrency-1 run to check against the baseline (add 1 to the sweep)"
    got = run["summary"]["per_request_output_tok_s"]["median"]
    floor = baseline_tok_s * (1 - tolerance_pct / 100.0)
    if got is None:
        return False, "concurrency 1: no successful request, no decode rate to check"
    verdict = "ok" if got >= floor else "BELOW BASELINE"
    return got >= floor, (f"single-request median decode rate {got:.2f} tok/s vs baseline "
                          f"{baseline_tok_s:g} tok/s (floor {floor:.2f}, tolerance "
                          f"{tolerance_pct:g}%): {verdict}")
