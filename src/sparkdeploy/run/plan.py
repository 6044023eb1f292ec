"""``deploy.all``: the whole chain as one plan over the step registry, and its rollback; what a
plan step is and what it did in a run (``PlanStep``, ``StepRun``, ``PlanRun``).

The plan (data, run by ``sparkdeploy.run.runner``)::

    link.check (the link doctor) -> model.download, serve.up
    hosts.check -> model.precheck (could it fit with every unit stopped?) -> services.stop
    (head) -> model.fit (every node's memory against its share)
    model.precheck -> image.probe -> image.build (when the chosen image needs the layer) ->
    image.ship (workers)
    model.fit -> model.download (head, long: starts first) ~> model.sync (workers; starts once the download
    has started and follows it file by file) -> model.verify (every node, from the records)
    link.check, image.ship -> link.fabric (an all-reduce in the serving image) -> model.sync, serve.up
    all of the above -> serve.up (with fallback) -> bench.run (a smoke: a few requests at
    concurrency 1, when something changed or with --bench) -> serve.persist (with --persist)
    serve.up -> metrics.up (Prometheus on the head, an exporter on every node)

A plan names steps and their options, nothing else: each step declares where it is written
(``@step``, ``steps/registry.py``) what it needs, its fingerprint (the profile slice and the
facts its outcome depends on, so that a re-run after a profile change redoes what the change
touches and says which keys changed), whether an unchanged decision is reused, what to redo
first and when it is skipped. The run ends with one decision record (``run_record``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparkdeploy.core.outcomes import Result, Status, final
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.endpoint import url as endpoint_url
from sparkdeploy.node.nodeops import NodeUnreachable
from sparkdeploy.ops.image import moved
from sparkdeploy.steps import registry
from sparkdeploy.steps.bench import SMOKE, smoke_settings
from sparkdeploy.steps.deploy import PURGE

# --- a plan and its run --------------------------------------------------------------------

PENDING, RUNNING, DONE, FAILED, SKIPPED = "pending", "running", "done", "failed", "skipped"


@dataclass(frozen=True)
class PlanStep:
    """A step in a plan: the registered step and its options. How the plan runs it (its
    fingerprint, reuse, redo, when) is the step's own declaration (``registry.StepSpec``)."""

    name: str
    """The registered step (``model.download``)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Its options; a value that is callable is called ``v(dep, runs)`` when the step starts (a
    URL known only then), ``runs`` being the run so far."""
    forced: bool = False
    """Run it even when its ``when`` would skip it for nothing changed (``--bench``)."""


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


# --- the plan --------------------------------------------------------------------------------

def plan(dep: Deployment, *, bench: bool = False, persist: bool = False) -> list[PlanStep]:
    head = dep.profile.head.name
    workers = ",".join(n.name for n in dep.profile.workers) or "all"
    steps = [
        # the link first: a bad link fails before the download (model.download needs it)
        PlanStep("link.check"),
        PlanStep("model.download", {"node": head}),
        PlanStep("hosts.check"),
        # what cannot fit even with every unit stopped is refused before anything stops or pulls
        PlanStep("model.precheck"),
        PlanStep("services.stop", {"node": head}),
        PlanStep("model.fit"),
        # the probe runs CPU-only containers (no GPU, no network): it need not wait for the GPU
        PlanStep("image.probe"),
        PlanStep("image.build"),
        PlanStep("image.ship", {"to": workers}),
        # an all-reduce in the image that will serve, on a quiet link before the weights cross it
        # (reused while the link, the nodes and the image are unchanged)
        PlanStep("link.fabric"),
        PlanStep("model.sync", {"to": workers}),
        PlanStep("model.verify"),
        PlanStep("serve.up"),
        # Prometheus and the exporters, beside the bench (which it then sees)
        PlanStep("metrics.up"),
        PlanStep("bench.run", {**SMOKE, "url": lambda d, runs: endpoint_url(d),
                               "settings": smoke_settings}, forced=bench),
    ]
    if persist:
        steps.append(PlanStep("serve.persist"))
    return steps


def refusal(dep: Deployment) -> str | None:
    """Why ``deploy.all`` must not start (None: it may): a candidate's tag names another image
    than the one image.probe decided on, one line each (checked before anything stops, in a dry
    run too: the decision, the build and the ship all rest on that image)."""
    try:
        lines = moved(dep)
    except NodeUnreachable:
        return None  # the plan's hosts.check says so, one line per node
    return "\n".join(lines) or None


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
        if spec is not None and spec.when is not None:
            bits.append("conditional")
        out.append(f"{i:>2}. {s.name}" + (f" ({opts})" if opts else "") + ": " + "; ".join(bits))
    for n, why in (left_out or {}).items():
        out.append(f" -. {n}: left out ({why})")
    return out
