"""``serve.swap``: change the model with only a bring-up's downtime.

Two phases. **Prepare**, while the old deployment keeps serving (its watchdog keeps watching,
and the board shows the old model's health): ``swap.fit`` (the new model against each node's
memory as it will be once the old engine is gone: the node's usable memory plus what the old
engine's containers hold, ``ops.swap.held``), ``swap.disk`` (the new weights against each
node's free disk, the old weights kept: refused with free and needed bytes and what
``model.prune`` would free), then the new deployment's own steps as a plan over the registry
(``model.download`` ~> ``model.sync`` -> ``model.verify``, ``image.probe`` -> ``image.build``
-> ``image.ship``), then ``swap.flags`` (every engine command line against the parser of the
engine version ``image.probe`` found). A failure here stops the swap: nothing was stopped.

**Cut-over**, with the head's swap record saying so (``ops.swap``: the controller's watchdog
pauses on it): the old engine stopped (``serve.down``: its weights and image stay), the new one
up (``serve.up``, the ``--engine`` given alone), a coherence check (``ops.swap.coherent``).
Passed: a persisted old deployment's units are replaced by the new one's (``serve.unpersist``
of the old, ``serve.persist`` of the new). Failed (readiness deadline, a hang the diagnosis
names, an incoherent answer): the new one removed, the old one brought back from what is still
on the nodes (``serve.up`` of the old profile, or its units started again by ``serve.persist``),
its image decision put back, and the swap fails naming why.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from sparkdeploy import endpoint as ep
from sparkdeploy import fit
from sparkdeploy.deployment import Deployment
from sparkdeploy.engines import EngineError, launch
from sparkdeploy.events import Progress, StepState
from sparkdeploy.nodeops import free_space
from sparkdeploy.ops import serve_preflight
from sparkdeploy.ops import swap as ops
from sparkdeploy.ops.model import GB, ModelError, short_of
from sparkdeploy.ops.model_select import selected
from sparkdeploy.ops.serve_containers import active, installed, ours
from sparkdeploy.records import ImageDecision, Record
from sparkdeploy.results import Result
from sparkdeploy.steps.model_fit import checks, gpu_nodes, node_memory, report
from sparkdeploy.steps.registry import StepContext, step

STEP = "serve.swap"
FIT, DISK, FLAGS = "swap.fit", "swap.disk", "swap.flags"
PREPARE, CUT_OVER = "swap.prepare", "swap.cut-over"
PREPARE_STEPS = ("model.download", "image.probe", "image.build", "image.ship", "model.sync",
                 "model.verify")
"""The new deployment's steps the prepare phase runs (as ``deploy.all``'s plan has them)."""
HEALTH_EVERY_S = 5.0


class SwapRecord(Record):
    """What one swap did: both models, the downtime and why it ended as it did."""

    WHAT = "swap record"
    STEP = STEP
    from_model: str
    to_model: str
    from_recipe: str | None
    to_recipe: str | None
    outcome: str
    """``swapped``, ``rolled-back``, ``refused`` (prepare failed: nothing stopped), ``failed``."""
    why: str
    engine: str | None = None
    bringup_s: float | None = None
    downtime_s: float | None = None
    endpoint: str | None = None
    steps: dict[str, str] = {}


# --- the prepare phase's checks ----------------------------------------------------------------

def old_containers(old: Deployment, node: str) -> list[str]:
    """The running containers of the old deployment on ``node`` (by their labels)."""
    return [c.name for c in ours(old.host(node), old.profile.name) if c.running]


@step(FIT)
def swap_fit(ctx: StepContext, old: Deployment | None = None) -> None:
    """The new model (``ctx.dep``) against each node's memory once ``old``'s engine is gone."""
    dep = ctx.dep
    try:
        meta, note = selected(dep)
    except ModelError as e:
        ctx.failed(str(e))
        return
    weights = fit.weight_bytes(meta["files"])
    mem = node_memory(ctx)
    if len(mem) < len(gpu_nodes(ctx)):
        return
    freed = {n: ops.held(dep.host(n), old_containers(old, n)) if old else 0 for n in mem}
    after = {n: m.model_copy(update={"gpu_usable": (m.gpu_usable or 0)
                                     + freed[n] // max(dep.profile.node(n).gpus, 1)})
             for n, m in mem.items()}
    by_engine = checks(ctx, weights, after)
    held = ", ".join(f"{n} {fit.gib(b)}" for n, b in freed.items())
    if by_engine:
        report(ctx, weights, by_engine, after,
               (f"; {note}" if note else "") + f"; usable counts what the old engine holds "
               f"(docker stats): {held}")


def present_bytes(ctx: StepContext, node: str, path: str) -> int:
    """Bytes already under the new model's directory on ``node`` (a re-run resumes)."""
    parent = str(PurePosixPath(path).parent)
    return ops.model_dirs(ctx.dep.host(node), parent).get(path.rstrip("/"), 0)


def prunable(ctx: StepContext, node: str, keep: list[str]) -> dict[str, int]:
    """{directory: bytes} ``model.prune`` would remove on ``node``: every model directory
    beside the new model's but those in ``keep`` (the serving one, the new one)."""
    parent = str(PurePosixPath(ctx.dep.profile.model.path).parent)
    kept = {k.rstrip("/") for k in keep}
    return {d: b for d, b in ops.model_dirs(ctx.dep.host(node), parent).items() if d not in kept}


@step(DISK)
def swap_disk(ctx: StepContext, keep: list[str] | None = None) -> None:
    """The new weights against each node's free disk, the old weights staying (``keep``: the
    directories that stay); one failed line per node short of room, with both numbers and
    what ``model.prune`` would free there."""
    dep = ctx.dep
    try:
        meta, _ = selected(dep)
    except ModelError as e:
        ctx.failed(str(e))
        return
    need = sum(int(f["size"]) for f in meta["files"])
    path = dep.profile.model.path

    def one(node: str) -> None:
        host = dep.host(node)
        got = free_space(host, path)
        if got is None:
            ctx.failed(f"{node}: cannot read the free space for {path}", node)
            return
        missing = max(0, need - present_bytes(ctx, node, path))
        short = short_of(dep, host, missing, *got)
        if short is None:
            ctx.ok(f"{node}: {got[0] / GB:.2f} GB free on {got[1]}, the new weights need "
                   f"{missing / GB:.2f} GB more (the old weights stay)", node,
                   free=got[0], need=missing)
            return
        extra = prunable(ctx, node, [*(keep or []), path])
        freed = sum(extra.values())
        what = (f"; model.prune would free {freed / GB:.2f} GB ("
                + ", ".join(f"{d} {b / GB:.2f} GB" for d, b in extra.items()) + ")"
                if extra else "; model.prune would free nothing (no other model's weights)")
        ctx.failed(short.why + what, node, **short.details, prunable=freed)

    ctx.each([n.name for n in dep.profile.nodes], one)


@step(FLAGS)
def swap_flags(ctx: StepContext) -> None:
    """Every engine command line of the new deployment against the parser of the engine
    version ``image.probe`` found (``serve_preflight``'s check, before anything stops)."""
    dep = ctx.dep
    for eng in dep.profile.engines:
        try:
            lau = launch(dep.profile, eng, {})
        except EngineError as e:
            ctx.failed(f"{eng.name}: {e}")
            continue
        pf = serve_preflight.Preflight(ctx)
        said = serve_preflight._check_flags(dep, eng, lau, pf)
        if not pf.problems:
            ctx.ok(f"{eng.name}: {said}", engine=eng.name)


# --- the swap ----------------------------------------------------------------------------------

@dataclass
class Outcome:
    state: str
    why: str
    bringup_s: float | None = None
    downtime_s: float | None = None
    endpoint: str | None = None
    engine: str | None = None


def call_on(ctx: StepContext, dep: Deployment, name: str, **options: Any) -> list[Result]:
    """Run step ``name`` on ``dep`` (the old or the new deployment) as part of ``ctx``'s."""
    child = StepContext(name, ctx.events, dep, parent=ctx)
    child.run(**options)
    return child.results


def failed(results: list[Result]) -> list[Result]:
    return [r for r in results if r.failed and not r.superseded]


def persisted(dep: Deployment) -> bool:
    """Whether ``dep``'s units are installed and active on any node."""
    return any(active(dep.host(n.name), installed(dep, dep.host(n.name)))
               for n in dep.profile.nodes)


class Health:
    """The old model's health during the prepare phase, on the board every few seconds."""

    def __init__(self, ctx: StepContext, url: str | None, model: str):
        self.ctx, self.url, self.model = ctx, url, model
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        while self.url and not self.stop.is_set():
            n += 1
            ok = ep.health(self.url) and self.model in ep.models(self.url)
            note = f"old model {self.model}: {'serving' if ok else 'NOT answering'} at {self.url}"
            self.ctx.events.emit(Progress(PREPARE, None, n, None, "checks", note))
            self.stop.wait(HEALTH_EVERY_S)

    def __enter__(self) -> Health:
        if self.url and not self.ctx.dry:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=HEALTH_EVERY_S + 10)


def phase(ctx: StepContext, name: str, state: str, why: str = "", t0: float | None = None) -> None:
    """One of the two phases on the board."""
    took = round(ctx.dep.clock() - t0, 3) if t0 is not None else None
    ctx.events.emit(StepState(name, state, why, took))


def prepare(ctx: StepContext, old: Deployment, keep: list[str]) -> str | None:
    """The prepare phase on the new deployment (``ctx.dep``); why it failed, or None."""
    from sparkdeploy import plan as plans
    from sparkdeploy.runner import Runner

    new = ctx.dep
    for name, opts in ((FIT, {"old": old}), (DISK, {"keep": keep})):
        bad = failed(ctx.call(name, **opts))
        if bad:
            return f"{name}: {bad[0].why}"
    steps = [s for s in plans.plan(new) if s.name in PREPARE_STEPS]
    out = Runner(new, steps, name="swap", serial=new.dry).run()
    bad_steps = [n for n, r in out.runs.items() if r.state == "failed"]
    for r in out.results():
        ctx.results.append(r)  # already on the stream, as the runner's steps reported them
    if bad_steps:
        return f"{', '.join(bad_steps)} failed"
    bad = failed(ctx.call(FLAGS))
    return f"{FLAGS}: {bad[0].why}" if bad else None


def bring_back(ctx: StepContext, old: Deployment, engine: str | None, was_persisted: bool,
               decision: ImageDecision | None) -> str:
    """The old deployment serving again from what the nodes still hold; what happened."""
    new = ctx.dep
    call_on(ctx, new, "serve.down")
    if decision is not None and not old.dry:
        old.records.write(decision, markdown=None)
    if was_persisted:
        back = call_on(ctx, old, "serve.persist", engine=engine)
    else:
        back = call_on(ctx, old, "serve.up", engine=engine)
    bad = failed(back)
    return (f"the old model {old.profile.model.repo} could not be brought back: {bad[0].why}"
            if bad else f"the old model {old.profile.model.repo} serves again")


def cut_over(ctx: StepContext, old: Deployment, engine: str | None, old_engine: str | None,
             decision: ImageDecision | None, record: ops.Phase) -> Outcome:
    new = ctx.dep
    head = new.host(new.profile.head.name)
    was_persisted = persisted(old)
    record.phase = ops.CUT_OVER
    if not new.dry:
        ops.write_phase(head, record)
    last_good = time.time()
    down = call_on(ctx, old, "serve.down")
    if failed(down):
        return Outcome("failed", f"the old engine did not stop: {failed(down)[0].why}")
    t0 = new.clock()
    up = call_on(ctx, new, "serve.up", engine=engine)
    bringup = round(new.clock() - t0, 1)
    url = next((r.details["endpoint"] for r in up if r.details.get("endpoint")), None)
    served = next((r.details.get("engine") for r in up if r.details.get("endpoint")), None)
    if new.dry:
        return Outcome("dry", "dry run: nothing stopped", engine=served)
    why = failed(up)[0].why if failed(up) else None
    if why is None and url is None:
        why = "serve.up named no endpoint"
    if why is None and url is not None:
        bad = ops.coherent(url, new.profile.model.repo)
        why = f"coherence check: {bad}" if bad else None
    if why is not None:
        back = bring_back(ctx, old, old_engine, was_persisted, decision)
        record.phase, record.why = ops.ROLLED_BACK, f"{why}; {back}"
        ops.write_phase(head, record)
        return Outcome("rolled-back", f"{why}; {back}", bringup_s=bringup)
    downtime = round(time.time() - last_good, 1)
    if was_persisted:
        for name, opts in (("serve.unpersist", {}), ("serve.persist", {"engine": served})):
            bad_p = failed(call_on(ctx, old if name == "serve.unpersist" else new, name, **opts))
            if bad_p:
                record.phase, record.why = ops.DONE, f"{name}: {bad_p[0].why}"
                ops.write_phase(head, record)
                return Outcome("failed", f"the new model serves, but {name}: {bad_p[0].why}",
                               bringup, downtime, url, served)
    record.phase, record.why = ops.DONE, f"{new.profile.model.repo} serves"
    ops.write_phase(head, record)
    return Outcome("swapped", f"{served} serves {new.profile.model.repo}", bringup, downtime,
                   url, served)


@step(STEP)
def swap(ctx: StepContext, old: Deployment, engine: str | None = None,
         from_recipe: str | None = None, to_recipe: str | None = None) -> None:
    """Swap ``old`` (serving) for the new deployment (``ctx.dep``): prepare while the old one
    serves, then the cut-over; back to the old one on any failure there."""
    new = ctx.dep
    now = ops.serving_url(new)
    if now is not None:
        ctx.ok(f"{now[0]} already serves {new.profile.model.repo}: nothing stopped",
               engine=now[0], endpoint=now[1])
        return
    head = new.host(new.profile.head.name)
    was = ops.read_phase(head)
    old_now = ops.serving_url(old)
    if old_now is None and not (was and was.phase == ops.CUT_OVER):
        ctx.failed(f"nothing of this deployment serves {old.profile.model.repo}: deploy.all "
                   f"--recipe {to_recipe or '...'} deploys the new model")
        return
    record = ops.Phase(phase=ops.PREPARE, from_model=old.profile.model.repo,
                       to_model=new.profile.model.repo, from_recipe=from_recipe,
                       to_recipe=to_recipe, engine=engine,
                       at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    old_engine = old_now[0] if old_now else (was.engine if was else None)
    decision = old.records.read(ImageDecision)
    if not new.dry and old_now is not None:
        ops.write_phase(head, record)
    t0 = new.clock()
    phase(ctx, PREPARE, "running", f"{new.profile.model.repo} while "
          f"{old.profile.model.repo} serves")
    with Health(ctx, old_now[1] if old_now else None, old.profile.model.repo):
        why = prepare(ctx, old, [old.profile.model.path])
    if why is not None:
        phase(ctx, PREPARE, "failed", why, t0)
        if decision is not None and not new.dry:
            old.records.write(decision)
        _finish(ctx, Outcome("refused", f"prepare: {why}; nothing was stopped"), record)
        return
    phase(ctx, PREPARE, "done", "the new weights and image are on every node", t0)
    t1 = new.clock()
    phase(ctx, CUT_OVER, "running", f"{old.profile.model.repo} -> {new.profile.model.repo}")
    out = cut_over(ctx, old, engine, old_engine, decision, record)
    phase(ctx, CUT_OVER, "done" if out.state in ("swapped", "dry") else "failed", out.why, t1)
    _finish(ctx, out, record)


def _finish(ctx: StepContext, out: Outcome, record: ops.Phase) -> None:
    new = ctx.dep
    details: dict[str, Any] = {"bringup_s": out.bringup_s, "downtime_s": out.downtime_s, "engine": out.engine,
               "outcome": out.state}
    if out.state == "dry":
        ctx.would(f"swap {record.from_model} for {record.to_model}")
        return
    rec = SwapRecord(from_model=record.from_model, to_model=record.to_model,
                     from_recipe=record.from_recipe, to_recipe=record.to_recipe,
                     outcome=out.state, why=out.why, engine=out.engine,
                     bringup_s=out.bringup_s, downtime_s=out.downtime_s, endpoint=out.endpoint)
    written = new.records.write(rec, time.strftime("swap-%Y%m%d-%H%M%S"), markdown=_markdown(rec),
                                title=f"Swap of {new.profile.name}")
    details["record"] = str(written.markdown)
    if out.state == "swapped":
        ctx.changed(f"{record.from_model} -> {record.to_model}: {out.why}; downtime "
                    f"{out.downtime_s} s, bring-up {out.bringup_s} s", **details)
        ctx.ok(f"endpoint: {out.endpoint}", endpoint=out.endpoint, engine=out.engine)
    else:
        ctx.failed(f"swap {out.state}: {out.why}", **details)


def _markdown(rec: SwapRecord) -> str:
    return "\n".join([
        f"- from: `{rec.from_model}`" + (f" (recipe {rec.from_recipe})" if rec.from_recipe else ""),
        f"- to: `{rec.to_model}`" + (f" (recipe {rec.to_recipe})" if rec.to_recipe else ""),
        f"- outcome: **{rec.outcome}**: {rec.why}",
        f"- engine: {rec.engine or '-'}; bring-up {rec.bringup_s if rec.bringup_s is not None else '-'} s; "
        f"downtime {rec.downtime_s if rec.downtime_s is not None else '-'} s",
        f"- endpoint: {rec.endpoint or '-'}"])
