"""``bench.run``: benchmark an OpenAI-compatible endpoint, a concurrency (or rate) sweep with
vLLM bench-serve metrics, each level's requests reported as ``Progress`` while they run.

``benchmark`` is the work itself and needs no deployment (``inv bench.run --url`` works
without a profile); the registered step fills every option the task did not give from the
profile (the endpoint serve.up recorded or the profile's, and its ``bench`` section)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sparkdeploy.bench.client import BenchError, Settings
from sparkdeploy.bench.depth import run_depths
from sparkdeploy.bench.engine import DISAGREE_PCT, disagreements
from sparkdeploy.bench.gate import OFF
from sparkdeploy.bench.html import run_report
from sparkdeploy.bench.plot import plot as draw
from sparkdeploy.bench.report import level_name
from sparkdeploy.bench.sweep import STEP, check_baseline, run_sweep, sweep_json
from sparkdeploy.core.errors import PartFailed, StepFailed
from sparkdeploy.core.files import write_atomic, write_text_atomic
from sparkdeploy.core.fingerprint import Fingerprint
from sparkdeploy.core.outcomes import Result
from sparkdeploy.core.records import (
    BenchFigures,
    DeployRun,
    ImageDecision,
    MetricsRecord,
    RecordError,
    ServeDecision,
)
from sparkdeploy.core.redaction import redact
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.endpoint import url as endpoint_url
from sparkdeploy.node.hosts import HostError
from sparkdeploy.node.nodeops import read_node_file
from sparkdeploy.ops import metrics
from sparkdeploy.profile import recipes
from sparkdeploy.profile.config import Bench, Profile
from sparkdeploy.steps.registry import Ran, StepContext, step


def level_line(run: dict[str, Any]) -> str:
    """One line per level: how many requests succeeded, throughput, decode rate, TTFT."""
    s = run["summary"]

    def num(v: float | None, digits: int = 1) -> str:
        return "-" if v is None else f"{v:,.{digits}f}"

    bad = f", {s['failed']} failed" if s["failed"] else ""
    good = s.get("goodput")
    slo = (f", goodput {good['req_s']:,.3f} req/s ({good['fraction'] * 100:.1f}% met the SLO)"
           if good else "")
    return (f"{level_name(run)}: {s['completed']}/{s['requests']} ok{bad}, "
            f"{num(s['output_tok_s'])} output tok/s, decode median "
            f"{num(s['per_request_output_tok_s']['median'])} tok/s, TTFT median "
            f"{num(s['ttft_ms']['median'])} ms{slo}")


def html_beside(json_path: str | Path) -> Path:
    """Where the HTML report of ``--json F`` goes: ``F`` with ``.html`` for ``.json``."""
    p = Path(json_path)
    return p.with_suffix(".html") if p.suffix == ".json" else p.with_name(p.name + ".html")


def report_context(dep: Any) -> dict[str, Any]:
    """What the HTML report shows of the deployment: its profile (secrets redacted), the image
    chosen per engine and the one the last ``deploy.all`` served (tag, image ID, base and its
    ID), that run's step timings, and the startup timings when a record has them. A record that
    cannot be read is left out."""
    out: dict[str, Any] = {"profile": dep.profile.model_dump(mode="json")}  # redacted when written
    try:
        image = dep.records.read(ImageDecision)
        if image is not None:
            out["image"] = {"chosen": {k: v.model_dump(mode="json")
                                       for k, v in image.engines.items()}}
        runs = sorted(dep.records.path(ImageDecision).parent.glob("deploy-*.json"))
        run = dep.records.read(DeployRun, runs[-1].stem) if runs else None
        if run is not None:
            out.setdefault("image", {})["deployed"] = run.image.model_dump(mode="json")
            out["deploy_steps_s"] = {k: v.elapsed for k, v in run.steps.items()}
        serve = dep.records.read(ServeDecision)
        for rec in (serve, run):
            startup = getattr(rec, "startup", None)  # startup timings, where a record keeps them
            if startup:
                out["startup"] = (startup if isinstance(startup, dict)
                                  else startup.model_dump(mode="json"))
    except (RecordError, OSError):
        pass  # the report goes without them
    return out


def engine_lines(ctx: StepContext, run: dict[str, Any]) -> None:
    """The level's engine figures in one line, and one naming where client and engine disagree
    by more than 10 % (a reading that failed after the run: one skipped line)."""
    eng = run["summary"].get("engine")
    if not eng:
        return
    if "skipped" in eng:
        ctx.skipped(f"{level_name(run)}: {eng['skipped']}")
        return

    def ms(key: str) -> str:
        return "-" if eng.get(key) is None else f"{eng[key]:,.1f} ms"

    kv, pre = eng.get("kv_cache_peak_pct"), eng.get("preemptions")
    ctx.ok(f"{level_name(run)}: engine ({eng.get('engine') or '?'}) /metrics: TTFT mean "
           f"{ms('ttft_ms')}, ITL mean {ms('itl_ms')}, end-to-end mean {ms('e2el_ms')}, queue "
           f"mean {ms('queue_ms')}, KV cache peak {'-' if kv is None else f'{kv:.1f}%'}, "
           f"preemptions {'-' if pre is None else f'{pre:g}'}")
    differ = disagreements(eng.get("vs_client") or [])
    if differ:
        ctx.ok(f"{level_name(run)}: client and engine disagree by more than "
               f"{DISAGREE_PCT:g}%: {differ}")


def request_settings(b: Bench, profile: Profile | None = None, **given: Any) -> Settings:
    """A request's settings: what was given (None: not given), else the profile's ``bench``;
    with a profile, its recipes' coherence gates (``recipes.gates``)."""
    chosen = {k: v for k, v in given.items() if v is not None}
    gates = recipes.gates(recipes.directories(profile.recipes)) if profile is not None else ()
    return Settings(**{"input_tokens": b.input_tokens, "output_tokens": b.output_tokens,
                       "timeout": b.timeout_s, "deadline": b.deadline_s, "gates": gates, **chosen})


def benchmark(ctx: StepContext, url: str, settings: Settings, *, concurrency: Sequence[int],
              rates: Sequence[float] = (), requests: int, warmup: int,
              max_concurrency: int | None = None, json_path: str | Path | None = None,
              plot_path: str | Path | None = None, save_dir: str | Path | None = None,
              baseline: tuple[float, float] | None = None,
              slo: dict[str, float] | None = None, runs: int = 1,
              context: dict[str, Any] | None = None, gate: bool = True) -> None:
    """Run the sweep (no deployment needed: ``ctx`` may have none); one result per level
    (``details["run"]`` holds it), one per file written, and the baseline gate's when
    ``baseline`` (decode tok/s, tolerance %) is given. Failed requests are counted in a level's
    summary; a level where none succeeded is a failed result, and when no level has a success
    nothing is written. An endpoint that cannot be benchmarked (unreachable, no model) is a
    failure too. ``gate`` False: the coherence gate is off for this run, said first and in every
    level's line, the JSON and the HTML report."""
    if not gate:
        ctx.skipped(OFF)
    try:
        doc = run_sweep(url, settings, concurrency=list(concurrency), rates=list(rates),
                        requests=requests, warmup=warmup, max_concurrency=max_concurrency,
                        events=ctx.events, slo=slo, runs=runs, gate=gate)
    except BenchError as e:  # the endpoint cannot be benchmarked: this step's failure
        raise StepFailed(str(e)) from None
    off = "" if gate else " (gate off)"
    if context:
        doc["context"] = context  # the profile, image, startup timings: the HTML report shows them
    doc = redact(doc)  # every file written from it: the JSON, the HTML report, the --save copies
    skipped = doc["engine_metrics"]["skipped"]
    if skipped:
        ctx.skipped(f"{skipped}: the client's figures only")
    for run in doc["runs"]:
        s = run["summary"]
        if s["completed"]:
            ctx.ok(level_line(run) + off, run=run)
            engine_lines(ctx, run)
            continue
        errors = s.get("errors") or {}
        first = max(errors, key=lambda e: errors[e]) if errors else "no request ran"
        ctx.failed(f"{level_line(run)}: no request succeeded (most often: {first})", run=run)
    if not any(run["summary"]["completed"] for run in doc["runs"]):
        # nothing measured: no JSON or PNG that could pass for a result
        ctx.failed("every request failed: nothing written")
        return
    targets: list[tuple[str, Path]] = []
    if json_path:  # the HTML report always beside the JSON
        targets += [("json", Path(json_path)), ("html", html_beside(json_path))]
    if plot_path:
        targets.append(("plot", Path(plot_path)))
    if save_dir:
        stem = Path(save_dir) / time.strftime("bench-%Y%m%d-%H%M%S")
        try:
            stem.parent.mkdir(parents=True, exist_ok=True)  # our own state dir: made, not refused
        except OSError as e:
            raise StepFailed(f"--save: cannot make {stem.parent}: {e.strerror or e}") from None
        targets += [("json", stem.with_suffix(".json")), ("html", stem.with_suffix(".html")),
                    ("plot", stem.with_suffix(".png"))]
    title = f"{doc['config']['model']} @ {doc['config']['url']}"

    def write(target: tuple[str, Path]) -> None:
        # whole or not at all: a failure leaves no half-written file; the other files still go
        kind, path = target
        try:
            if kind == "json":
                write_text_atomic(path, sweep_json(doc))
            elif kind == "html":

                write_text_atomic(path, run_report(doc))
            else:

                write_atomic(path, lambda tmp: draw(doc["runs"], tmp, title=title))
        except OSError as e:
            raise PartFailed(f"cannot write {path}: {e.strerror or e}") from None
        ctx.changed(f"wrote {path}", path=str(path))

    ctx.each(targets, write)
    if baseline is not None:
        good, line = check_baseline(doc, *baseline)
        (ctx.ok if good else ctx.failed)(line)


def depth_line(row: dict[str, Any]) -> str:
    """One line per depth: prefill and decode rates and TTFT (medians over the runs)."""
    return (f"depth {row['depth']}: pp {row['pp_tok_s']:,.1f} tok/s ({row['prompt_tokens']:,.0f} "
            f"prompt tokens), tg {row['tg_tok_s']:,.2f} tok/s, TTFT {row['ttft_ms']:,.1f} ms "
            f"(median of {len(row['runs'])})")


def head_tokenizer(ctx: StepContext, dep: Deployment, save_dir: Path) -> Path | None:
    """The model's tokenizer.json from the head's model directory, kept under ``save_dir``
    (None, with a failed result, when the head has none)."""

    head = dep.host(dep.profile.head.name)
    path = f"{dep.profile.model.path.rstrip('/')}/tokenizer.json"
    try:
        text = read_node_file(head, path)
    except HostError as e:
        raise StepFailed(f"no tokenizer: cannot read {head.name}:{path}: {e}; pass --tokenizer DIR") from None
    if text is None:
        ctx.failed(f"no tokenizer: {head.name}:{path} does not exist (is the model downloaded?); "
                   "pass --recipe R (the recipe serving) or --tokenizer DIR")
        return None
    local = save_dir / "tokenizer.json"
    try:
        local.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(local, text)
    except OSError as e:
        raise StepFailed(f"cannot keep the tokenizer at {local}: {e.strerror or e}") from None
    return local


def depth_benchmark(ctx: StepContext, url: str, settings: Settings, *, tokenizer: str | Path | None,
                    depths: Sequence[int], runs: int = 1, json_path: str | Path | None = None,
                    deployment: Deployment | None = None,
                    tokenizer_dir: Path | None = None, gate: bool = True) -> None:
    """The depth sweep (``bench.depth``): one result per depth (``details["depth"]``), one per
    file written. The model's tokenizer is ``tokenizer``, else the head's (``deployment``'s model
    directory, fetched into ``tokenizer_dir``); no tokenizer or a gate that fails is one failed
    result and nothing written; a depth whose request failed is a failed result (the others are
    written), and when no depth was measured nothing is written."""

    if tokenizer is None:
        if deployment is None or tokenizer_dir is None:
            ctx.failed("no tokenizer: pass --tokenizer DIR (the served model's directory with its "
                       "tokenizer.json); there is no fallback")
            return
        tokenizer = head_tokenizer(ctx, deployment, tokenizer_dir)
        if tokenizer is None:
            return
    if not gate:
        ctx.skipped(OFF)
    try:
        doc = run_depths(url, settings, tokenizer, list(depths), runs=runs, events=ctx.events,
                         step=ctx.name, judge=gate)
    except BenchError as e:
        raise StepFailed(str(e)) from None
    for row in doc["depths"]:
        if row.get("error"):
            ctx.failed(row["error"])
        else:
            ctx.ok(depth_line(row) + ("" if gate else " (gate off)"), depth=row,
                   model=doc["config"]["model"])
    if all(row.get("error") for row in doc["depths"]):
        ctx.failed("no depth was measured: nothing written")
        return
    if json_path:
        try:
            write_text_atomic(Path(json_path), sweep_json(redact(doc)))
        except OSError as e:
            raise StepFailed(f"cannot write {json_path}: {e.strerror or e}") from None
        ctx.changed(f"wrote {json_path}", path=str(json_path))


STEP_FIGURES = "bench.figures"

SMOKE: dict[str, Any] = {"concurrency": [1], "requests": 3, "warmup": 0}
"""``deploy.all``'s bench: a smoke, not a measurement."""
SMOKE_OUTPUT_TOKENS = 64  # a few short answers at concurrency 1


def smoke_settings(dep: Deployment, runs: Mapping[str, Ran]) -> Settings:
    """A few short answers, each prompt well within the recipe's context (a small model's
    ``--max-model-len`` refuses the profile's prompt size: HTTP 400). The prompt is counted in
    words (``bench.client.synthetic_prompt``), and a word is up to about four tokens of a
    tokenizer with few merges (lab-tiny's byte-level BPE): an eighth of the context."""
    b = dep.profile.bench
    out = min(SMOKE_OUTPUT_TOKENS, b.output_tokens)
    n_in = b.input_tokens
    if dep.profile.recipe:
        context = recipes.read(dep.profile.recipe, recipes.directories(dep.profile.recipes),
                               "--recipe").context
        n_in = max(1, min(n_in, context // 8))
    return request_settings(b, dep.profile, input_tokens=n_in, output_tokens=out)


def why_skip_smoke(dep: Deployment, runs: Mapping[str, Ran], forced: bool) -> str | None:
    """Why a plan's bench does not run (None: run it): a dry run, or nothing changed in this
    run and the plan does not force it (``deploy.all --bench``)."""
    if dep.dry:
        return (f"would run {SMOKE['requests']} requests at concurrency {SMOKE['concurrency'][0]} "
                f"against {endpoint_url(dep) or 'the endpoint serve.up records'}")
    if forced:
        return None
    if any(r.changed for r in runs.values()):
        return None
    return "nothing changed in this run (--bench runs it anyway)"


@step(STEP, needs=("serve.up",), fingerprint=Fingerprint("bench"), when=why_skip_smoke)
def run(ctx: StepContext, url: str | None = None, settings: Settings | None = None,
        concurrency: Sequence[int] | None = None, rates: Sequence[float] = (),
        requests: int | None = None, warmup: int | None = None,
        max_concurrency: int | None = None, json_path: str | None = None,
        plot_path: str | None = None, save: bool = False, check: bool = False,
        tolerance: float | None = None) -> None:
    """Benchmark the profile's endpoint (or ``url``) with the profile's bench settings."""
    dep = ctx.dep
    b = dep.profile.bench
    url = url or endpoint_url(dep)
    if not url:
        ctx.failed("no endpoint: none recorded by serve.up and the profile has none (endpoint)")
        return
    settings = settings or request_settings(b, dep.profile)
    gate = (b.baseline_decode_tok_s, b.baseline_tolerance_pct if tolerance is None else tolerance)
    benchmark(ctx, url, settings, concurrency=concurrency or list(b.concurrency),
              rates=rates, requests=requests or b.requests,
              warmup=b.warmup if warmup is None else warmup,
              max_concurrency=max_concurrency, json_path=json_path, plot_path=plot_path,
              save_dir=dep.state.path / "bench" if save else None,
              baseline=gate if check else None, context=report_context(dep))
    if url == endpoint_url(dep):
        ctx.call(STEP_FIGURES, results=list(ctx.results))


@step(STEP_FIGURES)
def figures(ctx: StepContext, results: Sequence[Result] = ()) -> None:
    """A bench run's figures at its lowest load (``results``: the run's): the deployment's
    record, and the head's metrics (``sparkdeploy_bench_*``) when this controller started them."""
    dep = ctx.dep
    levels = [r.details["run"] for r in results if isinstance(r.details.get("run"), dict)]
    if not levels or dep.dry:
        return
    s = levels[0].get("summary") or {}

    def number(v: Any) -> float | None:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    dep.records.write(BenchFigures(
        output_tok_s=number(s.get("output_tok_s")), time=time.time(),
        ttft_ms_median=number((s.get("ttft_ms") or {}).get("median")),
        itl_ms_median=number((s.get("itl_ms") or {}).get("median"))))
    if not dep.profile.metrics.enabled or dep.records.read(MetricsRecord) is None:
        return  # no metrics.up of this controller: they run nowhere it knows of
    try:
        if metrics.publish(dep, metrics.figures(dep)):
            ctx.ok("the figures are in the metrics (sparkdeploy_bench_*)")
    except HostError as e:
        ctx.skipped(f"the figures are not in the metrics: {e}")
