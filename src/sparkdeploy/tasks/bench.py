"""bench.run (default) and bench.compare: thin wrappers over sparkdeploy.bench and the
``bench.run`` step."""

from __future__ import annotations

from invoke.exceptions import Exit

from sparkdeploy.bench.client import DAY_S, BenchError
from sparkdeploy.bench.compare import compare as cmp
from sparkdeploy.bench.compare import parse_pct
from sparkdeploy.bench.depth import parse_depths
from sparkdeploy.bench.html import compare_report
from sparkdeploy.bench.metrics import parse_slo
from sparkdeploy.bench.report import comparison_table, depth_table, engine_table, run_table
from sparkdeploy.bench.sweep import MAX_RUNS, load_json, parse_levels
from sparkdeploy.core import checks
from sparkdeploy.core.events import EventSink
from sparkdeploy.core.files import write_output
from sparkdeploy.core.outcomes import Result
from sparkdeploy.node.deployment import Deployment, state_dir
from sparkdeploy.node.endpoint import url as endpoint_url
from sparkdeploy.profile.config import Bench
from sparkdeploy.steps.bench import (
    STEP,
    STEP_FIGURES,
    benchmark,
    depth_benchmark,
    report_context,
    request_settings,
)
from sparkdeploy.steps.registry import run_one
from sparkdeploy.tasks import _flags as flags
from sparkdeploy.tasks._common import drive, exits
from sparkdeploy.tasks._flags import task

DEPTH_STEP = "bench.depth"
DEFAULT_DEPTHS = "0,4096,16384,32768"

_HELP = {
    "url": "OpenAI-compatible endpoint (default: the one serve.up recorded, else the profile's)",
    "model": "model name (default: the first one /v1/models lists)",
    "concurrency": "comma-separated sweep, e.g. 1,8,64 (default: the profile's bench.concurrency)",
    "rate": "Poisson arrivals at R req/s instead (comma-separated sweep allowed)",
    "max_concurrency": "with --rate: cap on requests in flight (default min(requests, 256))",
    "requests": "measured requests per level (default: the profile's bench.requests)",
    "input_tokens": "prompt length in tokens (synthetic words)",
    "output_tokens": "max_tokens, with ignore_eos",
    "warmup": "warm-up requests before each level, not measured",
    "thinking": "on|off: chat_template_kwargs.enable_thinking (default: the server's)",
    "api": "chat|completions",
    "json": "write the results JSON here, and the HTML report beside it (F.json -> F.html)",
    "plot": "write the four-panel PNG here",
    "timeout": "seconds without data before a request fails (default: the profile's bench.timeout_s, "
               "at most a day)",
    "deadline": "seconds one whole request may take (default: the profile's bench.deadline_s, at "
                "most a day)",
    "save": "also save JSON and PNG under <state_dir>/bench/",
    "check_baseline": "fail unless the concurrency-1 median decode rate is within "
                      "--baseline-tolerance of the profile's bench.baseline_decode_tok_s",
    "baseline_tolerance": "allowed shortfall against the baseline (default: the profile's "
                          "bench.baseline_tolerance_pct)",
    "profile": "profile file (default: sparkdeploy.profile from invoke config)",
    "slo": "goodput against SLOs, any of ttft=2s,tpot=80ms,e2e=30s (a bare number is ms)",
    "runs": "measure each level K times: pooled figures and a 95% interval for each headline one",
    "depths": "a depth sweep instead (as bench.depth): context depths in tokens, e.g. 0,4096,16384",
    "tokenizer": "with --depths: the served model's directory (its tokenizer.json; default: the "
                 "head's model directory)",
    "gate": "--no-gate: skip the coherence gate for this run (a base model, one that cannot add); "
            "the results, the JSON and the HTML report say it was off",
    "recipe": "the deployment of this recipe (as deploy.all --recipe): its endpoint, its context "
              "and, with --depths, its model's tokenizer on the head",
    "recipes": "an owner's recipe directory (DIR[,DIR...]), looked up first",
}
_DEPTH_HELP = {
    "url": _HELP["url"], "model": _HELP["model"], "thinking": _HELP["thinking"],
    "timeout": _HELP["timeout"], "deadline": _HELP["deadline"], "profile": _HELP["profile"],
    "depths": f"context depths in tokens, comma-separated (default {DEFAULT_DEPTHS})",
    "tokenizer": "the served model's directory, or its tokenizer.json (default: the head's model "
                 "directory); no tokenizer, no sweep",
    "runs": "requests per depth, each with a prompt of its own; the figures are their medians "
            "(default 3)",
    "output_tokens": "tokens each measured request asks for, exactly (ignore_eos; default 128)",
    "json": "write the results JSON here",
    "gate": _HELP["gate"], "recipe": _HELP["recipe"], "recipes": _HELP["recipes"],
}


@task(default=True, help=_HELP)
def run(c, url=None, model=None, concurrency=None, rate=None, max_concurrency=None,
        requests=None, input_tokens=None, output_tokens=None, warmup=None, thinking=None,
        api="chat", json=None, plot=None, timeout=None, deadline=None, save=False,
        check_baseline=False, baseline_tolerance=None, profile=None, slo=None, runs=None,
        depths=None, tokenizer=None, gate=True, recipe=None, recipes=None):
    """Benchmark an endpoint: a concurrency (or rate) sweep, vLLM bench-serve metrics (or, with
    --depths, the depth sweep of bench.depth)."""
    if depths is not None:
        for flag, given in (("--concurrency", concurrency), ("--rate", rate), ("--slo", slo),
                            ("--plot", plot), ("--requests", requests), ("--warmup", warmup),
                            ("--input-tokens", input_tokens), ("--max-concurrency", max_concurrency),
                            ("--check-baseline", check_baseline or None), ("--save", save or None),
                            ("--api", None if api == "chat" else api)):
            if given is not None:
                raise flags.usage(flag, "does not apply to a depth sweep (--depths)")
        return depth(c, url=url, model=model, tokenizer=tokenizer, depths=depths, runs=runs,
                     output_tokens=output_tokens, thinking=thinking, json=json, timeout=timeout,
                     deadline=deadline, profile=profile, gate=gate, recipe=recipe, recipes=recipes)
    if tokenizer is not None:
        raise flags.usage("--tokenizer", "only applies with --depths")

    # every flag first: a bad one exits 2 before the profile is read or a request is sent
    url = flags.url("--url", url)
    model = None if model is None else flags.parsed("--model", model, checks.no_control)
    flags.choice("--api", api, ("chat", "completions"))
    flags.choice("--thinking", thinking, ("on", "off"))
    levels = flags.parsed("--concurrency", concurrency, parse_levels, (BenchError,))
    rates = flags.parsed("--rate", rate, lambda v: parse_levels(v, float), (BenchError,))
    cap = flags.integer("--max-concurrency", max_concurrency, min=1, max=checks.MAX_CONCURRENCY)
    n = flags.integer("--requests", requests, min=1, max=checks.MAX_REQUESTS)
    k = flags.integer("--warmup", warmup, min=0, max=checks.MAX_WARMUP)
    n_in = flags.integer("--input-tokens", input_tokens, min=1, max=checks.MAX_TOKENS)
    n_out = flags.integer("--output-tokens", output_tokens, min=2, max=checks.MAX_TOKENS)
    secs = flags.number("--timeout", timeout, gt=0, max=DAY_S)
    whole = flags.number("--deadline", deadline, gt=0, max=DAY_S)
    tolerance = None if baseline_tolerance is None else flags.parsed(
        "--baseline-tolerance", baseline_tolerance, parse_pct)
    json_path = flags.output_file("--json", json)
    plot_path = flags.output_file("--plot", plot)
    slos = None if slo is None else flags.parsed("--slo", slo, parse_slo)
    k_runs = flags.integer("--runs", runs, default=1, min=1, max=MAX_RUNS)
    if cap is not None and not rates:
        raise flags.usage("--max-concurrency", "only applies with --rate")

    def work(dep: Deployment | None, events: EventSink) -> list[Result]:
        # the profile is needed only for the URL: without --url a bad one is fatal
        bench = dep.profile.bench if dep is not None else Bench()
        target = url or (endpoint_url(dep) if dep is not None else None)
        if not target:
            raise Exit("the profile has no endpoint (sparkdeploy.endpoint): pass --url URL", code=2)
        settings = request_settings(bench, dep.profile if dep is not None else None, api=api,
                                    model=model, input_tokens=n_in,
                                    output_tokens=n_out,
                                    thinking=None if thinking is None else thinking == "on",
                                    timeout=secs, deadline=whole)
        floor = (bench.baseline_decode_tok_s,
                 bench.baseline_tolerance_pct if tolerance is None else tolerance)
        out = run_one(None, STEP, target, settings, events=events, body=benchmark,
                      concurrency=levels or list(bench.concurrency), rates=rates,
                      requests=n or bench.requests, warmup=bench.warmup if k is None else k,
                      max_concurrency=cap, json_path=json_path, plot_path=plot_path,
                      save_dir=state_dir(c) / "bench" if save else None,
                      baseline=floor if check_baseline else None, slo=slos, runs=k_runs,
                      context=report_context(dep) if dep is not None else None, gate=gate)
        if dep is not None and target == endpoint_url(dep):  # the deployment's own figures
            out += run_one(dep, STEP_FIGURES, results=out)
        return out

    drive(c, STEP, work, profile=profile, deployment="optional" if url else "needed", lock=False,
          show=lambda dep, results: _tables(results), recipe=recipe,
          recipe_dirs=tuple(flags.name_list("--recipes", recipes)))


@task(help=_DEPTH_HELP)
def depth(c, url=None, model=None, tokenizer=None, depths=DEFAULT_DEPTHS, runs=None,
          output_tokens=None, thinking=None, json=None, timeout=None, deadline=None, profile=None,
          gate=True, recipe=None, recipes=None):
    """Prefill (pp) and decode (tg) rates at increasing context depths, llama-bench style, with
    the model's own tokenizer, after the coherence gate."""

    url = flags.url("--url", url)
    model = None if model is None else flags.parsed("--model", model, checks.no_control)
    flags.choice("--thinking", thinking, ("on", "off"))
    levels = flags.parsed("--depths", depths, parse_depths)
    k_runs = flags.integer("--runs", runs, default=3, min=1, max=MAX_RUNS)
    n_out = flags.integer("--output-tokens", output_tokens, default=128, min=2,
                          max=checks.MAX_TOKENS)
    secs = flags.number("--timeout", timeout, gt=0, max=DAY_S)
    whole = flags.number("--deadline", deadline, gt=0, max=DAY_S)
    json_path = flags.output_file("--json", json)
    tok = None if tokenizer is None else flags.parsed("--tokenizer", tokenizer, checks.no_control)

    def work(dep: Deployment | None, events: EventSink) -> list[Result]:
        bench = dep.profile.bench if dep is not None else Bench()
        target = url or (endpoint_url(dep) if dep is not None else None)
        if not target:
            raise Exit("the profile has no endpoint (sparkdeploy.endpoint): pass --url URL", code=2)
        settings = request_settings(bench, dep.profile if dep is not None else None, model=model,
                                    output_tokens=n_out,
                                    thinking=None if thinking is None else thinking == "on",
                                    timeout=secs, deadline=whole)
        return run_one(None, DEPTH_STEP, target, settings, events=events, body=depth_benchmark,
                       tokenizer=tok, depths=levels, runs=k_runs, json_path=json_path, deployment=dep,
                       tokenizer_dir=state_dir(c) / "bench" / "tokenizer", gate=gate)

    # the profile is needed for the endpoint (no --url); without --tokenizer, the head's is read
    # when there is one (the step says what to pass when there is none)
    drive(c, DEPTH_STEP, work, profile=profile, deployment="optional" if url else "needed",
          lock=False, show=lambda dep, results: _depth_table(results, n_out), recipe=recipe,
          recipe_dirs=tuple(flags.name_list("--recipes", recipes)))


def _depth_table(results, output_tokens: int) -> None:
    from rich.console import Console


    rows = [r.details["depth"] for r in results if "depth" in r.details]
    if rows:
        model = next(r.details["model"] for r in results if "depth" in r.details)
        console = Console()
        console.width = max(console.width, 100)  # a row of a table is one line, as llama-bench's
        console.print(depth_table(model, rows, output_tokens))


def _tables(results) -> None:
    """Each level's table after the stream (rich renders plain text off a terminal)."""
    from rich.console import Console


    console = Console()
    runs = [r.details["run"] for r in results if "run" in r.details]
    for r in runs:
        console.print(run_table(r))
        engine = engine_table(r)
        if engine is not None:
            console.print(engine)
    sources = {r["summary"]["output_tokens_source"] for r in runs} - {None}
    if sources and sources != {"usage"}:
        console.print("note: some output token counts are chunk counts (no usage from the server)")


@task(help={"base": "the reference results JSON", "new": "the results JSON to judge",
            "max_regression": "allowed worsening per headline metric (default 5%)",
            "html": "write the HTML report of the comparison (both runs' tables and plots) here"})
def compare(c, base, new, max_regression="5%", html=None):
    """Side-by-side headline metrics; exit 1 when NEW is worse than BASE beyond the threshold."""
    from rich.console import Console


    threshold = flags.parsed("--max-regression", max_regression, parse_pct)
    html_path = flags.output_file("--html", html)
    with exits():
        base_doc = load_json(flags.input_file("BASE", base))
        new_doc = load_json(flags.input_file("NEW", new))
        result = cmp(base_doc, new_doc, threshold)  # a sweep against a depth sweep: exit 2
        if html_path:

            write_output(html_path, compare_report(base_doc, new_doc, result, base, new))
    console = Console()
    if html_path:
        console.print(f"wrote {html_path}")
    console.print(comparison_table(result, base, new))
    for level in result.only_base:
        console.print(f"{level}: only in {base}")
    for level in result.only_new:
        console.print(f"{level}: only in {new}")
    if not result.rows:
        raise Exit("no level in common between the two files", code=2)
    if not result.compared:
        raise Exit("no headline metric in both files at a common level: nothing to compare",
                   code=2)
    bad = result.regressions
    if bad:
        raise Exit(f"{len(bad)} regression(s) beyond {threshold:g}%", code=1)
