"""``serve.swap``: change the model with only a bring-up's downtime.

Two phases. **Prepare**, while the old deployment keeps serving (its watchdog keeps watching,
and the board shows the old model's health): the checks of ``steps/swap.py`` (``swap.fit``,
``swap.disk``), then the new deployment's own steps as a plan over the registry, as
``deploy.all``'s plan has them (``model.download`` ~> ``model.sync`` -> ``model.verify``,
``image.probe`` -> ``image.build`` -> ``image.ship``), then ``swap.flags``. A failure here ends
the swap: nothing was stopped.

**Cut-over**, with the head's swap record saying so (``ops.swap``: the controller's watchdog
pauses on it): the old engine stopped (``serve.down``: its weights and image stay), the new one
up (``serve.up``, the ``--engine`` given alone), a coherence check (``ops.swap.coherent``).
Passed: a persisted old deployment's units are replaced by the new one's (``serve.unpersist``
of the old, ``serve.persist`` of the new). Failed (readiness deadline, a hang the diagnosis
names, an incoherent answer): the new one removed, the old one brought back from what is still
on the nodes (``serve.up`` of the old profile, or its units started again by ``serve.persist``),
its image decision put back, and the swap fails naming why. The record (``SwapRecord``) names
both models, the outcome and why, the bring-up and the downtime.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from sparkdeploy.core.events import Progress, StepState
from sparkdeploy.core.outcomes import Result
from sparkdeploy.core.records import ImageDecision, Record
from sparkdeploy.node import endpoint as ep
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.ops import swap as ops
from sparkdeploy.ops.serve_containers import active, installed
from sparkdeploy.profile import recipes
from sparkdeploy.run import plan as plans
from sparkdeploy.run.runner import Runner
from sparkdeploy.steps.registry import StepContext, run_one
from sparkdeploy.steps.swap import DISK, FIT, FLAGS

STEP = "serve.swap"
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


@dataclass
class Outcome:
    state: str
    why: str
    bringup_s: float | None = None
    downtime_s: float | None = None
    endpoint: str | None = None
    engine: str | None = None


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


def prepare(ctx: StepContext, old: Deployment, keep: list[str],
            old_engine: str | None = None) -> str | None:
    """The prepare phase on the new deployment (``ctx.dep``); why it failed, or None."""
    new = ctx.dep
    for name, opts in ((FIT, {"old": old, "engine": old_engine}), (DISK, {"keep": keep})):
        bad = failed(ctx.call(name, **opts))
        if bad:
            return f"{name}: {bad[0].why}"
    return staged(ctx, new)


def staged(ctx: StepContext, new: Deployment, name: str = "swap") -> str | None:
    """``new``'s weights and image on its nodes (``PREPARE_STEPS`` as ``deploy.all``'s plan has
    them), then its engines' flags checked (``swap.flags``), reporting as part of ``ctx``'s step:
    why it failed, or None. Nothing serving is touched (``serve.swap``'s prepare, ``serve.add``)."""
    steps = [s for s in plans.plan(new) if s.name in PREPARE_STEPS]
    out = Runner(new, steps, name=name, serial=new.dry).run()
    bad_steps = [n for n, r in out.runs.items() if r.state == "failed"]
    for r in out.results():
        ctx.results.append(r)  # already on the stream, as the runner's steps reported them
    if bad_steps:
        return f"{', '.join(bad_steps)} failed"
    bad = failed(ctx.call(FLAGS, on=new))
    return f"{FLAGS}: {bad[0].why}" if bad else None


def bring_back(ctx: StepContext, old: Deployment, engine: str | None, was_persisted: bool,
               decision: ImageDecision | None) -> str:
    """The old deployment serving again from what the nodes still hold; what happened."""
    new = ctx.dep
    ctx.call("serve.down", on=new, keep_metrics=True, keep_placed=True)
    if decision is not None and not old.dry:
        old.records.write(decision, markdown=None)
    if was_persisted:
        back = ctx.call("serve.persist", on=old, engine=engine)
    else:
        back = ctx.call("serve.up", on=old, engine=engine)
    bad = failed(back)
    return (f"the old model {old.profile.model.repo} could not be brought back: {bad[0].why}"
            if bad else f"the old model {old.profile.model.repo} serves again")


def bringup_s(up: list[Result], wall: float) -> float:
    """The new engine's bring-up: the last startup milestone ``serve.up`` timed from its start
    (its ``startup`` detail: containers running ... first token), else ``serve.up``'s wall time."""
    marks = next((r.details["startup"] for r in up if isinstance(r.details.get("startup"), dict)
                  and r.details["startup"]), None)
    return round(max(marks.values()) if marks else wall, 1)


def roll_back(ctx: StepContext, old: Deployment, why: str, was_persisted: bool,
              decision: ImageDecision | None, record: ops.Phase,
              bringup: float | None = None) -> Outcome:
    """The cut-over failed (``why``): the old one back, the head's record saying so."""
    back = bring_back(ctx, old, record.from_engine, was_persisted, decision)
    record.phase, record.why = ops.ROLLED_BACK, f"{why}; {back}"
    ops.write_phase(ctx.dep.host(ctx.dep.profile.head.name), record)
    return Outcome("rolled-back", f"{why}; {back}", bringup_s=bringup)


def cut_over(ctx: StepContext, old: Deployment, engine: str | None,
             decision: ImageDecision | None, record: ops.Phase) -> Outcome:
    new = ctx.dep
    head = new.host(new.profile.head.name)
    was_persisted = record.persisted = persisted(old) or record.persisted
    record.phase = ops.CUT_OVER
    if not new.dry:
        ops.write_phase(head, record)
    last_good = time.time()
    down = ctx.call("serve.down", on=old, keep_metrics=True, keep_placed=True)  # the metrics follow
    if failed(down) and not new.dry:
        return roll_back(ctx, old, f"the old engine did not stop: {failed(down)[0].why}",
                         was_persisted, decision, record)
    t0 = new.clock()
    up = ctx.call("serve.up", on=new, engine=engine)
    bringup = bringup_s(up, new.clock() - t0)
    url = next((r.details["endpoint"] for r in up if r.details.get("endpoint")), None)
    served = next((r.details.get("engine") for r in up if r.details.get("endpoint")), None)
    if new.dry:
        return Outcome("dry", "dry run: nothing stopped", engine=served)
    why = failed(up)[0].why if failed(up) else None
    if why is None and url is None:
        why = "serve.up named no endpoint"
    if why is None and url is not None:
        bad = ops.coherent(url, new.profile.model.repo,
                           gates=recipes.gates(recipes.directories(new.profile.recipes)))
        why = f"coherence check: {bad}" if bad else None
    if why is not None:
        return roll_back(ctx, old, why, was_persisted, decision, record, bringup)
    if was_persisted:  # the hand-over to the new units is part of the downtime
        for name, opts in (("serve.unpersist", {}), ("serve.persist", {"engine": served})):
            bad_p = failed(ctx.call(name, on=old if name == "serve.unpersist" else new, **opts))
            if bad_p:
                record.phase, record.why = ops.DONE, f"{name}: {bad_p[0].why}"
                ops.write_phase(head, record)
                return Outcome("failed", f"the new model serves, but {name}: {bad_p[0].why}",
                               bringup, round(time.time() - last_good, 1), url, served)
    downtime = round(time.time() - last_good, 1)
    record.phase, record.why = ops.DONE, f"{new.profile.model.repo} serves"
    ops.write_phase(head, record)
    return Outcome("swapped", f"{served} serves {new.profile.model.repo}", bringup, downtime,
                   url, served)


def settled(ctx: StepContext, old: Deployment, was: ops.Phase | None) -> bool:
    """The new model serves already: ok, nothing stopped (True). A swap to it that a killed
    controller left in its cut-over is completed: a persisted old deployment's units replaced
    by the new one's, the head's record saying it is done."""
    new = ctx.dep
    now = ops.serving_url(new)
    if now is None:
        return False
    if (was is not None and was.phase in (ops.PREPARE, ops.CUT_OVER)
            and was.to_model == new.profile.model.repo and not new.dry):
        if was.persisted and not persisted(new):
            ctx.call("serve.unpersist", on=old)
            ctx.call("serve.persist", on=new, engine=now[0])
        was.phase, was.why = ops.DONE, f"{new.profile.model.repo} serves (completed by a re-run)"
        ops.write_phase(new.host(new.profile.head.name), was)
    ctx.ok(f"{now[0]} already serves {new.profile.model.repo}: nothing stopped",
           engine=now[0], endpoint=now[1])
    return True


def body(ctx: StepContext, old: Deployment, engine: str | None = None,
         from_recipe: str | None = None, to_recipe: str | None = None) -> None:
    """Swap ``old`` (serving) for the new deployment (``ctx.dep``): prepare while the old one
    serves, then the cut-over; back to the old one on any failure there."""
    new = ctx.dep
    head = new.host(new.profile.head.name)
    was = ops.read_phase(head, new.profile.name)
    if settled(ctx, old, was):
        return
    clash = ops.shared_dir(old.profile.model, new.profile.model)
    if clash:
        ctx.failed(clash)
        return
    old_now = ops.serving_url(old)
    if old_now is None and not (was and was.phase == ops.CUT_OVER):
        ctx.failed(f"nothing of this deployment serves {old.profile.model.repo}: deploy.all "
                   f"--recipe {to_recipe or '...'} deploys the new model")
        return
    record = ops.Phase(phase=ops.PREPARE, deployment=new.profile.name,
                       from_model=old.profile.model.repo,
                       to_model=new.profile.model.repo, from_recipe=from_recipe,
                       to_recipe=to_recipe, engine=engine, from_path=old.profile.model.path,
                       to_path=new.profile.model.path,
                       from_engine=old_now[0] if old_now else (was.from_engine if was else None),
                       persisted=bool(old_now is None and was and was.persisted),
                       at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    decision = old.records.read(ImageDecision)
    if not new.dry and old_now is not None:
        ops.write_phase(head, record)
    t0 = new.clock()
    phase(ctx, PREPARE, "running", f"{new.profile.model.repo} while "
          f"{old.profile.model.repo} serves")
    with Health(ctx, old_now[1] if old_now else None, old.profile.model.repo):
        why = prepare(ctx, old, [old.profile.model.path], record.from_engine)
    if why is not None:
        phase(ctx, PREPARE, "failed", why, t0)
        if decision is not None and not new.dry:
            old.records.write(decision)
        _finish(ctx, Outcome("refused", f"prepare: {why}; nothing was stopped"), record)
        return
    phase(ctx, PREPARE, "done", "the new weights and image are on every node", t0)
    t1 = new.clock()
    phase(ctx, CUT_OVER, "running", f"{old.profile.model.repo} -> {new.profile.model.repo}")
    out = cut_over(ctx, old, engine, decision, record)
    phase(ctx, CUT_OVER, "done" if out.state in ("swapped", "dry") else "failed", out.why, t1)
    _finish(ctx, out, record)


def _finish(ctx: StepContext, out: Outcome, record: ops.Phase) -> None:
    new = ctx.dep
    details: dict[str, Any] = {"bringup_s": out.bringup_s, "downtime_s": out.downtime_s,
                               "engine": out.engine, "outcome": out.state}
    if new.dry:
        ctx.would(f"swap {record.from_model} for {record.to_model}" + (
            "" if out.state == "dry" else f" ({out.why})"))
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


def run(new: Deployment, old: Deployment, *, engine: str | None = None,
        from_recipe: str | None = None, to_recipe: str | None = None) -> list[Result]:
    """The swap from ``old`` (serving) to ``new``, reporting as ``serve.swap``."""
    return run_one(new, STEP, body=body, old=old, engine=engine, from_recipe=from_recipe,
                   to_recipe=to_recipe)
