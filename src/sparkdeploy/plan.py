"""``deploy.all``: the whole chain as one plan over the step registry, and its rollback; what a
plan step is and what it did in a run (``PlanStep``, ``StepRun``, ``PlanRun``), the fingerprints
of the profile slices and node facts the steps depend on, and the run record.

The plan (data, run by ``sparkdeploy.runner``)::

    link.check (the link doctor) -> model.download, serve.up
    hosts.check -> services.stop (head) -> model.fit (every node's memory against its share)
    hosts.check -> image.probe -> image.build (when the chosen image needs the layer) ->
    image.ship (workers)
    model.fit -> model.download (head, long: starts first) ~> model.sync (workers; starts once the download
    has started and follows it file by file) -> model.verify (every node, from the records)
    all of the above -> serve.up (with fallback) -> bench.run (a smoke: a few requests at
    concurrency 1, when something changed or with --bench) -> serve.persist (with --persist)

Each step carries a fingerprint of the profile slice it depends on, so a re-run after a profile
change redoes what the change touches and says which keys changed. The run ends with one
decision record (Markdown + JSON): the image by tag and ID and why, the engine and why, every
step's timing, the endpoint, the bench summary.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sparkdeploy.deployment import Deployment
from sparkdeploy.endpoint import url as endpoint_url
from sparkdeploy.fingerprint import flat
from sparkdeploy.hosts import Host
from sparkdeploy.nodeops import NodeUnreachable, docker, inspect_image, tagged
from sparkdeploy.ops.image import chosen, decision
from sparkdeploy.ops.serve import startup_line
from sparkdeploy.records import (
    DeployRun,
    RunEngine,
    RunImage,
    ServeDecision,
    StepTiming,
    Tried,
    Written,
    markdown_table,
)
from sparkdeploy.results import Result, Status, final
from sparkdeploy.steps import registry
from sparkdeploy.steps.deploy import PURGE

# --- a plan and its run --------------------------------------------------------------------

PENDING, RUNNING, DONE, FAILED, SKIPPED = "pending", "running", "done", "failed", "skipped"


@dataclass(frozen=True)
class PlanStep:
    name: str
    """The registered step (``model.download``)."""
    options: dict[str, Any] = field(default_factory=dict)
    fingerprint: Callable[[Deployment], dict[str, Any]] | None = None
    """The profile slice (and facts) the step's outcome depends on, as flat ``{key: value}``."""
    reuse: bool = False
    """A decision with no effect on the nodes: an unchanged fingerprint reuses the last outcome."""
    redo: str | None = None
    """A step to run first when the fingerprint changed since the step last finished."""
    when: Callable[[Deployment, dict[str, StepRun]], str | None] | None = None
    """Returns why to skip the step this time (None: run it); sees the run so far. An option
    value that is callable is called the same way when the step starts (a URL known only then)."""


@dataclass
class StepRun:
    """What one plan step did in this run."""

    name: str
    state: str = PENDING
    why: str = ""
    results: list[Result] = field(default_factory=list)
    started: float | None = None
    elapsed: float | None = None
    fingerprint: dict[str, Any] | None = None
    reused: bool = False
    blocked: bool = False
    """Skipped because a step it needs failed (its own dependents are skipped too)."""

    @property
    def changed(self) -> bool:
        return any(r.status is Status.CHANGED for r in self.results)

    def final(self) -> list[Result]:
        """The last result per (step, node) (``results.final``)."""
        return final(self.results)

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "why": self.why, "elapsed": self.elapsed,
                "changed": self.changed, "fingerprint": self.fingerprint,
                "results": [r.to_dict() for r in self.results]}


@dataclass
class PlanRun:
    """What one run of a plan did: each step's ``StepRun``, the wall time, serial or not (not
    ``fanout.Outcome``, one transfer's end)."""

    plan: str
    runs: dict[str, StepRun]
    wall: float
    serial: bool

    @property
    def failed(self) -> bool:
        return any(r.state == FAILED for r in self.runs.values())

    @property
    def changed(self) -> bool:
        return any(r.changed for r in self.runs.values())

    def results(self) -> list[Result]:
        return [res for r in self.runs.values() for res in r.results]


def graph(plan: list[PlanStep]) -> dict[str, set[str]]:
    """{step: the plan steps it needs}, from the registry."""
    names = {s.name for s in plan}
    return {s.name: registry.needs_in(s.name, names) for s in plan}



SMOKE: dict[str, Any] = {"concurrency": [1], "requests": 3, "warmup": 0}
SMOKE_OUTPUT_TOKENS = 64  # a smoke, not a measurement: a few short answers at concurrency 1


def smoke_settings(dep: Deployment, runs: dict[str, StepRun]) -> Any:
    from sparkdeploy.steps.bench import request_settings

    b = dep.profile.bench
    return request_settings(b, output_tokens=min(SMOKE_OUTPUT_TOKENS, b.output_tokens))


# --- what each step depends on ---------------------------------------------------------------

def _section(dep: Deployment, *keys: str) -> dict[str, Any]:
    data = dep.profile.model_dump(mode="json")
    return flat({k: data.get(k) for k in keys})



# --- the node facts they read (``dep.facts``: once per node per run) ----------------------------

IMAGE_LIST = ("image", "ls", "--no-trunc", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}")


def _image_list(host: Host) -> dict[str, str] | None:
    """{repo:tag: image ID} of every tagged image on the node, in one command (None when the
    node cannot be reached)."""
    try:
        r = host.run(docker(host, *IMAGE_LIST), change=False)
    except NodeUnreachable:
        return None
    if not r.ok:
        return {}
    return dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)


def _inspected_id(host: Host, ref: str) -> str | None:
    try:
        info = inspect_image(host, ref)
    except NodeUnreachable:
        return None
    return info.get("Id") if info else None


def image_id(dep: Deployment, ref: str | None, node: str | None = None) -> str | None:
    """The ID of image ``ref`` on the head (or ``node``): by its tag in the node's image list,
    else (a digest, an ID, a name the list spells otherwise) by inspecting it; None if absent."""
    if not ref:
        return None
    node = node or dep.profile.head.name
    listed = dep.facts.get(node, "images", _image_list)
    if listed is None:
        return None
    return listed.get(tagged(ref)) or dep.facts.get(node, f"image {ref}",
                                                     lambda h: _inspected_id(h, ref))


def unit_states(dep: Deployment, node: str) -> dict[str, str] | None:
    """{unit: active state} of the units the profile stops on ``node`` (None: unreachable or
    systemctl failed)."""
    from sparkdeploy.ops.units import probe_units

    units = dep.profile.services.stop.get(node) or []

    def gather(host: Host) -> dict[str, str] | None:
        try:
            return probe_units(host, units)[0] if units else {}
        except NodeUnreachable:
            return None
    return dep.facts.get(node, "units", gather)


def fp_hosts(dep: Deployment) -> dict[str, Any]:
    return _section(dep, "nodes", "ssh")


def fp_services(dep: Deployment) -> dict[str, Any]:
    """The units to stop and their state now: unchanged since a finished stop means they are
    still stopped (the GPU is then busy with this deployment's own engine, not theirs)."""
    head = dep.profile.head.name
    return {**_section(dep, "services"), "head": head, **flat({"units_now": unit_states(dep, head)})}


def fp_probe(dep: Deployment) -> dict[str, Any]:
    """The candidates by ID too (a tag that moved is a new candidate), and the decision it left
    (one gone or replaced since is no reason to reuse it)."""
    ids = {f"id[{c.ref}]": image_id(dep, c.ref) for c in dep.profile.images.candidates}
    rec = decision(dep)
    return {**_section(dep, "images"), "model.repo": dep.profile.model.repo,
            "model.revision": dep.profile.model.revision, **ids,
            "decided": rec.made.time if rec and rec.made else None}


def fp_build(dep: Deployment) -> dict[str, Any]:
    return {**flat({"layer": dep.profile.model_dump(mode="json")["images"].get("layer")}),
            **flat({"chosen": chosen(dep)})}


def fp_ship(dep: Deployment) -> dict[str, Any]:
    """The image by ID on the head and on every worker: unchanged since a finished ship means
    every worker still holds what the head serves."""
    ref = chosen(dep).get("serve_image")
    fp: dict[str, Any] = {"image": ref, "image_id": image_id(dep, ref)}
    for n in dep.profile.workers:
        fp[f"on[{n.name}]"] = image_id(dep, ref, n.name)
    return fp


def fp_model(dep: Deployment) -> dict[str, Any]:
    return {**_section(dep, "model"), "head": dep.profile.head.name}


def fp_fit(dep: Deployment) -> dict[str, Any]:
    """The model, the engines, the nodes and the reserve: unchanged since a fit that passed, the
    fit is not measured again (this deployment's own engine, serving by then, holds the memory
    a second measurement would miss)."""
    return _section(dep, "model", "engines", "nodes", "fit")


def fp_sync(dep: Deployment) -> dict[str, Any]:
    return {**_section(dep, "model"), "workers": [n.name for n in dep.profile.workers]}


def fp_serve(dep: Deployment) -> dict[str, Any]:
    """Engines (args, env, images, ports), the nodes, the model path and the image chosen (by
    ID): a change to any of these redeploys the engine."""
    ref = chosen(dep).get("serve_image")
    return {**_section(dep, "engines", "nodes"), "model.path": dep.profile.model.path,
            "model.repo": dep.profile.model.repo, "image": ref, "image_id": image_id(dep, ref)}


def fp_bench(dep: Deployment) -> dict[str, Any]:
    return _section(dep, "bench")


def fp_persist(dep: Deployment) -> dict[str, Any]:
    return _section(dep, "engines", "nodes")


# --- when a step runs ------------------------------------------------------------------------

def why_skip_build(dep: Deployment, runs: dict[str, StepRun]) -> str | None:
    """Why ``image.build`` has nothing to build (None: build): no derivative image in the
    profile, or the chosen image serves as it is."""
    c = chosen(dep)
    if dep.profile.images.layer is None:
        return "the profile has no images.layer"
    if c and not c.get("needs_layer"):
        return f"the chosen image {c.get('image')} needs no layer"
    return None


def why_skip_bench(dep: Deployment, runs: dict[str, StepRun], forced: bool) -> str | None:
    """Why the smoke bench does not run (None: run it): a dry run, or nothing changed in this
    run and ``forced`` (``--bench``) is not given."""
    if dep.dry:
        return (f"would run {SMOKE['requests']} requests at concurrency {SMOKE['concurrency'][0]} "
                f"against {endpoint_url(dep) or 'the endpoint serve.up records'}")
    if forced:
        return None
    if any(r.changed for r in runs.values()):
        return None
    return "nothing changed in this run (--bench runs it anyway)"


# --- the plan --------------------------------------------------------------------------------

def plan(dep: Deployment, *, bench: bool = False, persist: bool = False) -> list[PlanStep]:
    head = dep.profile.head.name
    workers = ",".join(n.name for n in dep.profile.workers) or "all"
    steps = [
        # the link first: a bad link fails before the download (model.download needs it)
        PlanStep("link.check"),
        PlanStep("model.download", {"node": head}, fingerprint=fp_model),
        PlanStep("hosts.check", fingerprint=fp_hosts),
        PlanStep("services.stop", {"node": head}, fingerprint=fp_services, reuse=True),
        PlanStep("model.fit", fingerprint=fp_fit, reuse=True),
        # the probe runs CPU-only containers (no GPU, no network): it need not wait for the GPU
        PlanStep("image.probe", fingerprint=fp_probe, reuse=True),
        PlanStep("image.build", fingerprint=fp_build, when=why_skip_build),
        PlanStep("image.ship", {"to": workers}, fingerprint=fp_ship, reuse=True),
        PlanStep("model.sync", {"to": workers}, fingerprint=fp_sync),
        PlanStep("model.verify", fingerprint=fp_sync),
        PlanStep("serve.up", fingerprint=fp_serve, redo="serve.down"),
        PlanStep("bench.run", {**SMOKE, "url": lambda d, runs: endpoint_url(d),
                               "settings": smoke_settings},
                 fingerprint=fp_bench, when=lambda d, runs: why_skip_bench(d, runs, bench)),
    ]
    if persist:
        steps.append(PlanStep("serve.persist", fingerprint=fp_persist))
    return steps


def rollback_plan(dep: Deployment, *, purge: bool = False) -> list[PlanStep]:
    steps = [
        PlanStep("serve.unpersist"),
        PlanStep("serve.down"),
        PlanStep("services.restore"),
    ]
    if purge:
        steps.append(PlanStep(PURGE))
    return steps


def describe_plan(steps: list[PlanStep], left_out: dict[str, str] | None = None) -> list[str]:
    """The plan as lines: each step, what it needs, its options (for --dry and the record)."""
    registry.load_all()
    names = {s.name for s in steps}
    edges = graph(steps)
    out = []
    for i, s in enumerate(steps, 1):
        needs = sorted(edges[s.name])
        opts = ", ".join(f"{k}={'(at run time)' if callable(v) else v}" for k, v in s.options.items())
        bits = [f"needs {', '.join(needs)}" if needs else "needs nothing"]
        after = registry.after_start_in(s.name, names)
        if after:
            bits.append(f"starts once {', '.join(after)} started")
        spec = registry.REGISTRY.get(s.name)
        if spec is None:
            bits.append("not available in this version")
        elif spec.long:
            bits.append("long")
        if s.when is not None:
            bits.append("conditional")
        out.append(f"{i:>2}. {s.name}" + (f" ({opts})" if opts else "") + ": " + "; ".join(bits))
    for n, why in (left_out or {}).items():
        out.append(f" -. {n}: left out ({why})")
    return out


# --- the record ------------------------------------------------------------------------------

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
                    bench=_bench_summary(out.runs))
    name = time.strftime("deploy-%Y%m%d-%H%M%S")
    return dep.records.write(run, name, markdown=_run_markdown(run),
                             title=f"Deployment of {dep.profile.name}")
