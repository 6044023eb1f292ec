"""The run record of ``deploy.all``: one ``DeployRun`` record per run
(``decisions/<profile>/deploy-<time>.{json,md}``): the image served by tag and ID and why (the
probe's table), the engine and why (each engine tried, its diagnosis and evidence), each step's
state and timing, the endpoint, the bench smoke's summary; and its Markdown."""

from __future__ import annotations

import time
from typing import Any

from sparkdeploy.core.records import (
    DeployRun,
    FabricRecord,
    RunEngine,
    RunImage,
    ServeDecision,
    StepTiming,
    Tried,
    Written,
    markdown_table,
)
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.endpoint import url as endpoint_url
from sparkdeploy.ops.image import decision, image_id
from sparkdeploy.ops.serve import startup_line
from sparkdeploy.run.plan import PlanRun, PlanStep, StepRun, describe_plan


def _bench_summary(runs: dict[str, StepRun]) -> dict[str, Any] | None:
    r = runs.get("bench.run")
    if r is None:
        return None
    levels = [x.details["run"] for x in r.results if isinstance(x.details.get("run"), dict)]
    if not levels:
        return {"state": r.state, "why": r.why}
    return {"state": r.state, "levels": [_level(lv) for lv in levels]}


def _level(run: dict[str, Any]) -> dict[str, Any]:
    """One bench level for the record: its load, the counts, the rates and the medians."""
    s = run.get("summary") or {}

    def med(key: str) -> float | None:
        v = (s.get(key) or {}).get("median")
        return round(v, 1) if isinstance(v, (int, float)) else None

    tok_s = s.get("output_tok_s")
    return {"concurrency": run.get("concurrency"), "rate": run.get("rate"),
            "requests": s.get("requests"), "completed": s.get("completed"),
            "failed": s.get("failed"),
            "output_tok_s": round(tok_s, 1) if isinstance(tok_s, (int, float)) else None,
            "decode_tok_s_median": med("per_request_output_tok_s"),
            "ttft_ms_median": med("ttft_ms"), "tpot_ms_median": med("tpot_ms")}


def _fabric(runs: dict[str, StepRun], dep: Deployment) -> dict[str, Any] | None:
    """The fabric test this run ran or reused (its record), None when the plan left it out."""
    if "link.fabric" not in runs:
        return None
    rec = dep.records.read(FabricRecord)
    if rec is None:
        return {"state": runs["link.fabric"].state, "why": runs["link.fabric"].why}
    made = rec.made.time_iso if rec.made else None
    return {**rec.model_dump(mode="json"), "time": made, "reused": runs["link.fabric"].reused}


def _fabric_markdown(fabric: dict[str, Any] | None) -> list[str]:
    if not fabric or "verdict" not in fabric:
        return [f"- {fabric['why'] if fabric else 'not run'}"]
    md = [f"- **{fabric['verdict']}**: {fabric['why']}"
          + (f" (reused, from {fabric['time']})" if fabric.get("reused") else ""), ""]
    if fabric["sizes"]:
        md.append(markdown_table(["bytes", "algbw GB/s", "busbw GB/s"],
                                 [[s["bytes"], s["algbw_gbs"], s["busbw_gbs"]] for s in fabric["sizes"]]))
    return md


def _engine(runs: dict[str, StepRun], dep: Deployment) -> RunEngine:
    """The engine serving and why: serve.up's record (each engine tried, its diagnosis class
    and evidence lines), and what serve.up said in this run."""
    rec = dep.records.read(ServeDecision)
    r = runs.get("serve.up")
    said = [x.why for x in r.results] if r else []
    chosen = (rec.chosen if rec else None) or next(
        (x.details.get("engine") for x in reversed(r.results if r else []) if x.details.get("engine")), None)
    tried = [Tried.model_validate(a.model_dump(by_alias=True, include={"engine", "outcome", "diagnosis",
                                                                      "phase", "why", "fallback_after_s"})
                                  | {"evidence": [list(e) for e in a.evidence[:6]]})
             for a in (rec.tried if rec else [])]
    return RunEngine(chosen=chosen, tried=tried, decided=rec.made.time_iso if rec and rec.made else None,
                     run_dir=rec.run_dir if rec else None, serve_up=said,
                     startup=rec.startup if rec else None)


def _engine_markdown(engine: RunEngine) -> list[str]:
    md = [f"- serving with **{engine.chosen or 'none'}**"
          + (f" (decided {engine.decided})" if engine.decided else "")]
    if engine.startup:
        md.append(f"- {startup_line(engine.startup)}, from the engine's start")
    if not engine.tried:
        md.append("- why: the profile's first engine, and it came up")
    for a in engine.tried:
        md.append(f"- {a.engine} was tried first: {a.outcome} in {a.phase or '?'}, "
                  f"diagnosis `{a.diagnosis}`: {a.why}"
                  + (f"; {a.fallback_after_s:.1f}s from the hang's start to the fallback"
                     if a.fallback_after_s is not None else ""))
        md += [f"  - evidence: `{e[0]}:{e[1]}`: `{e[2]}`" if len(e) >= 3 else f"  - evidence: {e}"
               for e in a.evidence]
    if engine.run_dir:
        md.append(f"- engine logs: {engine.run_dir}")
    md += [f"- serve.up said: {w}" for w in engine.serve_up]
    return md


def _image(dep: Deployment) -> RunImage:
    rec = decision(dep)
    c = rec.chosen if rec else None
    serve_image, base = (c.serve_image, c.image) if c else (None, None)
    return RunImage(tag=serve_image, id=image_id(dep, serve_image), base=base,
                    base_id=image_id(dep, base), engine=c.engine if c else None,
                    needs_layer=c.needs_layer if c else None, summary=rec.summary if rec else None,
                    candidates=rec.candidates if rec else [])


def _image_markdown(image: RunImage) -> list[str]:
    md = [f"- serving `{image.tag}` = `{image.id or '?'}`"
          + (f", built from `{image.base}` = `{image.base_id or '?'}` + the transformers layer"
             if image.needs_layer else ""),
          f"- why: {image.summary or 'no image decision recorded'}", ""]
    if image.candidates:
        rows = [c.model_dump() for c in image.candidates]
        md.append(markdown_table(
            ["image", "engine", "engine version", "transformers", "verdict", "why"],
            [[f"`{r['image']}`", r["engine"], r.get("engine_version"), r.get("transformers"),
              r["verdict"], r["why"]] for r in rows]))
    return md


def _run_markdown(run: DeployRun) -> str:
    md = [f"**{'failed' if run.failed else 'deployed'}** in {run.wall_s:.1f} s"
          f"{' (serial)' if run.serial else ''}; endpoint: {run.endpoint or '-'}", "",
          "## Image", "", *_image_markdown(run.image)]
    md += ["", "## Engine", "", *_engine_markdown(run.engine)]
    md += ["", "## Steps", "", markdown_table(
        ["step", "state", "seconds", "why"],
        [[n, t.state, f"{t.elapsed:.1f}" if t.elapsed is not None else "-", t.why]
         for n, t in run.steps.items()])]
    md += ["", "## Fabric (link.fabric)", "", *_fabric_markdown(run.fabric)]
    md += ["", "## Bench (smoke)", ""]
    bench = run.bench
    if bench and bench.get("levels"):
        md.append(markdown_table(list(bench["levels"][0]), [list(lv.values()) for lv in bench["levels"]]))
    else:
        md.append(f"- {bench['why'] if bench else 'not run'}")
    return "\n".join(md)


def write_record(dep: Deployment, out: PlanRun, steps: list[PlanStep]) -> Written | None:
    """The run's ``DeployRun`` record (``decisions/<profile>/deploy-<time>.{json,md}``)."""
    if dep.dry:
        return None
    run = DeployRun(plan=describe_plan(steps), serial=out.serial, wall_s=out.wall,
                    failed=out.failed, changed=out.changed, image=_image(dep),
                    engine=_engine(out.runs, dep), endpoint=endpoint_url(dep),
                    steps={n: StepTiming(state=r.state, elapsed=r.elapsed, why=r.why)
                           for n, r in out.runs.items()},
                    bench=_bench_summary(out.runs), fabric=_fabric(out.runs, dep))
    name = time.strftime("deploy-%Y%m%d-%H%M%S")
    return dep.records.write(run, name, markdown=_run_markdown(run),
                             title=f"Deployment of {dep.profile.name}")
