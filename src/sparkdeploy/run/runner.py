"""Run a plan of registered steps as a graph: independent steps at once, long ones first.

A plan is data: ``PlanStep(name, options)`` over the step registry, where each step declares
its edges and how a plan runs it (fingerprint, reuse, redo, when: ``registry.StepSpec``). The
runner orders a plan with ``graphlib.TopologicalSorter`` (a step's registered needs as far as
they are in the plan, followed through steps the plan leaves out), starts every ready step in
a thread pool (long steps first, then plan order; ``serial`` runs one at a time), and emits a
``StepState`` for every change (pending, running, done, failed, skipped, with elapsed seconds)
through ``dep.events``.

A step may also be registered to start only once another step has *started* (``after_start``):
the weights' sync follows the download file by file, so it needs the download running, not done.

Resuming: the runner keeps, per plan step, what happened last time and the step's declared
fingerprint (the profile slice and facts the step depends on) (``<state_dir>/runs/<plan>-<profile>.json``). A step runs
again on every run (steps probe before they act and report ``ok``), except a ``reuse`` step (a
pure decision, e.g. the image probe) whose fingerprint is unchanged since it last finished. A
changed fingerprint is named (which keys) and, for a step with ``redo``, that step runs first
(the serving engine is taken down before it comes up with new arguments).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from graphlib import CycleError, TopologicalSorter
from typing import TYPE_CHECKING, Any

from sparkdeploy.core import threads
from sparkdeploy.core.errors import Error, UsageError
from sparkdeploy.core.events import StepState
from sparkdeploy.core.files import write_text_atomic
from sparkdeploy.core.fingerprint import diff_keys
from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.core.records import PlanMemory, StepMemory
from sparkdeploy.run.plan import DONE, FAILED, PENDING, RUNNING, SKIPPED, PlanRun, PlanStep, StepRun, graph
from sparkdeploy.steps import registry
from sparkdeploy.steps.registry import StepContext

if TYPE_CHECKING:
    from sparkdeploy.node.deployment import Deployment

class PlanError(UsageError, ValueError):
    """A plan or a selection that cannot run (bad step name, cycle): one line, exit 2."""


def select(plan: Iterable[PlanStep], only: Iterable[str] = (), skip: Iterable[str] = ()) -> tuple[
        list[PlanStep], dict[str, str]]:
    """The steps to run and {step: why} for those left out by ``only``/``skip``."""
    plan = list(plan)
    names = [s.name for s in plan]
    only, skip = [s for s in only if s], [s for s in skip if s]
    for flag, picked in (("--only", only), ("--skip", skip)):
        bad = [n for n in picked if n not in names]
        if bad:
            raise PlanError(f"{flag}: no step {', '.join(repr(b) for b in bad)} in the plan "
                            f"(steps: {', '.join(names)})")
    both = [n for n in only if n in skip]
    if both:
        raise PlanError(f"--only and --skip both name {', '.join(repr(b) for b in both)}")
    left: dict[str, str] = {}
    for n in names:
        if only and n not in only:
            left[n] = "not in --only"
        elif n in skip:
            left[n] = "--skip"
    return [s for s in plan if s.name not in left], left


def check(plan: list[PlanStep]) -> None:
    names = [s.name for s in plan]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise PlanError(f"plan names a step twice: {', '.join(sorted(dup))}")
    for s in plan:
        spec = registry.REGISTRY.get(s.name)
        for n in (*spec.needs, *spec.after_start) if spec else ():
            if n not in registry.REGISTRY:
                raise PlanError(f"plan: {s.name} needs {n!r}, which is no step")
    try:
        TopologicalSorter(graph(plan)).prepare()
    except CycleError as e:
        raise PlanError(f"plan has a cycle: {' -> '.join(e.args[1])}") from None


def _absent(ctx: StepContext, **options: Any) -> None:
    """The body of a planned step this version does not have (never run: ``Runner._call``)."""


class Runner:
    """Runs one plan on one deployment; ``run()`` returns the ``PlanRun``."""

    def __init__(self, dep: Deployment, plan: list[PlanStep], *, name: str = "deploy",
                 serial: bool = False, left_out: dict[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        registry.load_all()
        check(plan)
        self.dep, self.plan, self.name, self.serial = dep, plan, name, serial
        self.left_out = left_out or {}
        self.clock = clock
        self.by_name = {s.name: s for s in plan}
        self.runs = {s.name: StepRun(s.name) for s in plan}
        self.previous = self._load_state()

    # -- state ------------------------------------------------------------------------------
    @property
    def state_name(self) -> str:
        """The ``PlanMemory`` record's name: ``runs/<plan>-<profile>.json``."""
        return f"{self.name}-{self.dep.profile.name}"

    def _load_state(self) -> PlanMemory:
        return self.dep.records.read(PlanMemory, self.state_name) or PlanMemory(steps={})

    def _save_state(self) -> None:
        if self.dep.dry:
            return
        steps = dict(self.previous.steps)
        for n, r in self.runs.items():
            if r.state in (DONE, FAILED) and not r.reused:
                steps[n] = StepMemory(state=r.state, why=r.why, elapsed=r.elapsed,
                                      fingerprint=r.fingerprint, time=time.time())
        self.previous = PlanMemory(steps=steps)
        self.dep.records.write(self.previous, self.state_name, step=self.name)

    def last(self, name: str) -> dict[str, Any]:
        m = self.previous.steps.get(name)
        return m.model_dump() if m else {}

    # -- events -----------------------------------------------------------------------------
    def _state(self, r: StepRun, state: str, why: str = "") -> None:
        r.state, r.why = state, why
        if state in (DONE, FAILED, SKIPPED) and r.started is not None:
            r.elapsed = round(self.clock() - r.started, 3)
        self.dep.events.emit(StepState(r.name, state, why, r.elapsed))

    # -- one step ---------------------------------------------------------------------------
    def _call(self, ctx: StepContext, name: str, options: dict[str, Any]) -> list[Result]:
        """Run step ``name`` as part of the plan step ``ctx`` reports for; its results."""
        if name not in registry.REGISTRY:
            return [ctx.skipped("no such step in this version of sparkdeploy")]
        try:
            return ctx.call(name, **options)
        except Error as e:  # one line, as a task would say it
            return [ctx.failed(str(e), e.node)]
        except Exception as e:  # a step must not take the other threads down with it
            where = self._save_traceback(name)
            return [ctx.failed(f"{type(e).__name__}: {e}{where}")]

    def _save_traceback(self, name: str) -> str:
        if self.dep.dry:
            return ""
        p = self.dep.state.ensure() / "runs" / f"{name}.traceback"
        p.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(p, traceback.format_exc(), 0o644)
        return f" (traceback: {p})"

    def _execute(self, spec: PlanStep) -> None:
        ctx = StepContext(spec.name, self.dep.events, self.dep)
        try:
            self._execute_step(spec, ctx)
        except Error as e:
            ctx.failed(str(e))
        except Exception as e:  # a fingerprint or a redo that raised: the step failed, the run goes on
            where = self._save_traceback(spec.name)
            ctx.failed(f"{type(e).__name__}: {e}{where}")
        finally:
            self.runs[spec.name].results = ctx.results

    def _execute_step(self, planned: PlanStep, ctx: StepContext) -> None:
        r = self.runs[planned.name]
        # how the plan runs it is the step's own declaration (none for a step this version
        # lacks: ``_call`` says so)
        spec = registry.REGISTRY.get(planned.name) or registry.StepSpec(planned.name, _absent)
        fp = spec.fingerprint(self.dep) if spec.fingerprint else {}
        r.fingerprint = fp
        before = self.last(spec.name)
        changed_keys = diff_keys(before.get("fingerprint"), fp) if before else []
        if spec.reuse and before.get("state") == DONE and not changed_keys:
            r.reused = True
            ctx.ok(f"unchanged since the last run: {before.get('why')}")
            return
        if changed_keys and before.get("state") == DONE:
            shown = ", ".join(changed_keys[:4]) + (" ..." if len(changed_keys) > 4 else "")
            why = (f"{spec.redo} first, then {spec.name} again" if spec.redo
                   else "running it again")
            # a note on the stream, not an outcome: the step's own results decide its state
            ctx.results.remove(ctx.ok(f"changed since the last run ({shown}): {why}"))
            if spec.redo and any(x.failed for x in self._call(ctx, spec.redo, {})):
                return
        options = {k: (v(self.dep, self.runs) if callable(v) else v) for k, v in planned.options.items()}
        self._call(ctx, spec.name, options)
        if spec.reuse and spec.fingerprint and not self.dep.dry and not any(x.failed for x in ctx.results):
            # what a reuse step's fingerprint probes is what the step made so: keep it as it is now
            r.fingerprint = spec.fingerprint(self.dep)

    def _summary(self, r: StepRun) -> str:
        final = [x for x in r.final() if x.step == r.name] or r.final()
        every = r.results  # a decision a step reports under its own sub-name counts too
        worst = (next((x for x in final if x.failed), None)
                 or next((x for x in reversed(every) if x.status is Status.CHANGED), None)
                 or (final[-1] if final else None))
        return f"{worst.status.value}: {worst.why}" if worst else "no result"

    # -- the graph --------------------------------------------------------------------------
    def run(self) -> PlanRun:
        start = self.clock()
        for r in self.runs.values():
            self._state(r, PENDING)
        for n, reason in self.left_out.items():
            self.dep.events.emit(StepState(n, SKIPPED, reason))
        needs = graph(self.plan)
        ts = TopologicalSorter(needs)
        ts.prepare()
        order = {s.name: i for i, s in enumerate(self.plan)}
        ready: list[str] = []
        running: dict[Future, str] = {}
        pool = threads.pool(1 if self.serial else len(self.plan))
        try:
            while ts.is_active():
                ready.extend(ts.get_ready())
                ready.sort(key=lambda n: (not self._long(n), order[n]))
                settled = False
                for n in list(ready):
                    why = self._blocked(n, needs[n])
                    if why is not None:
                        ready.remove(n)
                        self._state(self.runs[n], SKIPPED, why)
                        ts.done(n)
                        settled = True
                        continue
                    if self.serial and running:
                        break
                    if not self._started_enough(n, running):
                        continue
                    ready.remove(n)
                    self._launch(n, pool, running)
                if settled:  # a skip may have made more steps ready
                    continue
                if not running:
                    if ready:  # waiting on a step that will never start: let them go
                        self._launch(ready.pop(0), pool, running)
                        continue
                    break
                finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in finished:
                    n = running.pop(fut)
                    fut.result()
                    r = self.runs[n]
                    self._state(r, self._end_state(r), self._summary(r))
                    ts.done(n)
                self._save_state()
        finally:
            pool.shutdown(wait=True)
        self._save_state()
        return PlanRun(self.name, self.runs, round(self.clock() - start, 3), self.serial)

    @staticmethod
    def _end_state(r: StepRun) -> str:
        final = r.final()
        if any(x.failed for x in final):
            return FAILED
        own = [x for x in final if x.step == r.name]
        if own and all(x.status is Status.SKIPPED for x in own):
            return SKIPPED
        return DONE

    def _long(self, name: str) -> bool:
        spec = registry.REGISTRY.get(name)
        return bool(spec and spec.long)

    def _blocked(self, name: str, needs: set[str]) -> str | None:
        bad = [n for n in needs if self.runs[n].state == FAILED or self.runs[n].blocked]
        if bad and not self.dep.dry:  # a dry run lists what every step would do regardless
            self.runs[name].blocked = True
            return f"needs {', '.join(sorted(bad))}, which " + (
                "failed" if len(bad) == 1 and self.runs[bad[0]].state == FAILED else "did not run")
        spec = registry.REGISTRY.get(name)
        if spec is not None and spec.when is not None:
            return spec.when(self.dep, self.runs, self.by_name[name].forced)
        return None

    def _started_enough(self, name: str, running: dict[Future, str]) -> bool:
        for n in registry.after_start_in(name, set(self.by_name)):
            if self.runs[n].state == PENDING:
                return False
        return True

    def _launch(self, name: str, pool: Executor, running: dict[Future, str]) -> None:
        r = self.runs[name]
        r.started = self.clock()
        self._state(r, RUNNING)
        running[pool.submit(self._execute, self.by_name[name])] = name


def longest_chain(out: PlanRun, plan: list[PlanStep]) -> tuple[float, list[str]]:
    """The longest chain of dependent steps, by the seconds each took in ``out``: a step ends a
    chain of its own time plus the longest chain of its needs; an ``after_start`` step adds to
    the chain up to the *start* of the step it follows. Returns (seconds, the chain's steps)."""
    names = {s.name for s in plan}
    took = {n: (r.elapsed or 0.0) for n, r in out.runs.items()}
    best: dict[str, tuple[float, list[str]]] = {}
    needs = graph(plan)
    started = {n: registry.after_start_in(n, names) for n in names}
    for name in TopologicalSorter({n: needs[n] | set(started[n]) for n in names}).static_order():
        before = [best[n] for n in needs[name]]
        before += [(best[a][0] - took.get(a, 0.0), best[a][1][:-1]) for a in started[name]]
        base = max(before, default=(0.0, []), key=lambda x: x[0])
        best[name] = (base[0] + took.get(name, 0.0), [*base[1], name])
    return max(best.values(), default=(0.0, []), key=lambda x: x[0])
