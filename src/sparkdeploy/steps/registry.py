"""The step registry and the step protocol: every step under its name, with the steps it needs,
and the one context through which a running step reports.

A step is a body ``fn(ctx: StepContext, **options) -> None`` registered with ``@step(name,
needs=...)``. The body reports only through ``ctx``: a result per node (``ctx.ok``,
``ctx.changed``, ``ctx.skipped``, ``ctx.failed``, ``ctx.would`` under a dry run, or
``ctx.report`` of a result another context reported), ``ctx.progress`` and ``ctx.log`` during long work,
``ctx.each(hosts, fn)`` to fan out over nodes, ``ctx.call(name, ...)`` to run another registered
step. A step that cannot go on raises ``StepFailed`` (``sparkdeploy.core.errors``): its one failed
result, for the node it names; ``PartFailed`` in a fan-out fails that node's (that item's)
part, the other parts go on. A node that cannot be reached is one failed result for that node, whether it stops
one node's part of a fan-out or the whole step. Each result is
on the event stream once, as it happens. ``@step`` gives back ``fn(dep, **options) ->
list[Result]``: the step run on a deployment, its results in order. Records a step makes go
through ``ctx.dep.records``.

A step declares its whole contract where it is written, in ``@step``: the edges of every plan
(``needs``, ``after_start``), and how a plan runs it (``fingerprint``: a
``fingerprint.Fingerprint`` of what its outcome depends on, saying which part asks the nodes;
``reuse``, ``redo``, ``when``). ``deploy.all`` runs the registry as a graph; a plan
(``sparkdeploy.run.plan``) names steps and their options only.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from sparkdeploy.core import threads
from sparkdeploy.core.errors import PartFailed, StepFailed
from sparkdeploy.core.events import Event, EventSink, Log, Progress
from sparkdeploy.core.fingerprint import Fingerprint
from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.node.hosts import NodeUnreachable

if TYPE_CHECKING:
    from sparkdeploy.node.deployment import Deployment

Body = Callable[..., None]
StepFn = Callable[..., list[Result]]
T = TypeVar("T")
Item = TypeVar("Item")


@dataclass
class Caught:
    """What a ``StepContext.failing`` block caught: the error and the failed result it made."""

    error: Exception | None = None
    result: Result | None = None


class StepContext:
    """What a running step reports through, and the only way it does: each result goes on the
    event stream once, as it happens, and into ``results`` (and its caller's, for a step run
    by another with ``call``)."""

    def __init__(self, name: str, events: EventSink, dep: Deployment | None = None,
                 parent: StepContext | None = None):
        self.name = name
        self.events = events
        self._dep = dep
        self.parent = parent
        self.results: list[Result] = []

    @property
    def dep(self) -> Deployment:
        if self._dep is None:
            raise RuntimeError(f"{self.name} runs without a deployment")
        return self._dep

    @property
    def dry(self) -> bool:
        return bool(self._dep and self._dep.dry)

    # -- results ----------------------------------------------------------------------------
    def report(self, result: Result) -> Result:
        """Put ``result`` on the stream and in the results; hand it back."""
        self.events.emit(result)
        ctx: StepContext | None = self
        while ctx is not None:
            ctx.results.append(result)
            ctx = ctx.parent
        return result

    def _say(self, status: Status, why: str, node: str | None, details: dict[str, Any]) -> Result:
        return self.report(Result(self.name, status, why, node, details))

    def ok(self, why: str, node: str | None = None, **details: Any) -> Result:
        return self._say(Status.OK, why, node, details)

    def changed(self, why: str, node: str | None = None, **details: Any) -> Result:
        return self._say(Status.CHANGED, why, node, details)

    def skipped(self, why: str, node: str | None = None, **details: Any) -> Result:
        return self._say(Status.SKIPPED, why, node, details)

    def failed(self, why: str, node: str | None = None, **details: Any) -> Result:
        return self._say(Status.FAILED, why, node, details)

    def would(self, what: str, node: str | None = None, **details: Any) -> Result:
        """What the step would do, under a dry run: skipped, ``would <what>``."""
        return self._say(Status.SKIPPED, f"would {what}", node, details)

    def supersede(self, results: Iterable[Result]) -> None:
        """Failures this step recovered from (already on the stream, as they happened): they
        no longer count against its outcome."""
        for r in results:
            r.superseded = True

    def unreachable(self, e: NodeUnreachable, **details: Any) -> Result:
        """The one failed result for a node that cannot be reached."""
        return self.failed(f"unreachable: {e.why}", e.node, **details)

    @contextmanager
    def failing(self, *kinds: type[Exception], node: str | None = None, lead: str = "",
                **details: Any) -> Iterator[Caught]:
        """A block whose error of ``kinds`` (``StepFailed`` when none given) is one failed
        result of this step (``lead`` before the error's line; for ``node``, else the node the
        error names) and ends the block, not the step: what follows goes on (the next engine, a
        clean-up) and reads ``caught.result``. A node that cannot be reached is never caught
        here: it stays the context's one failed result for that node."""
        caught = Caught()
        wanted: tuple[type[Exception], ...] = kinds or (StepFailed,)
        try:
            yield caught
        except NodeUnreachable:
            raise
        except wanted as e:
            caught.error = e
            caught.result = self.failed(f"{lead}{e}", node or getattr(e, "node", None), **details)

    # -- long work --------------------------------------------------------------------------
    def progress(self, node: str | None, done: float, total: float | None = None,
                 unit: str = "B", note: str = "") -> None:
        self.events.emit(Progress(self.name, node, done, total, unit, note))

    def log(self, node: str | None, text: str) -> None:
        self.events.emit(Log(self.name, node, text))

    # -- nodes and other steps --------------------------------------------------------------
    def each(self, items: Iterable[Item], fn: Callable[[Item], T], *,
             parallel: bool = False) -> list[T | None]:
        """``fn(item)`` for each node (or each pair of nodes, for a tree fan-out), in order
        (``parallel``: all at once, results in order); a node that cannot be reached, or whose
        part raised ``PartFailed``, is one failed result for that node and None in the list."""
        def one(item: Item) -> T | None:
            try:
                return fn(item)
            except NodeUnreachable as e:
                self.unreachable(e)
            except PartFailed as e:
                self.failed(str(e), e.node)
            return None

        items = list(items)
        if not parallel or len(items) <= 1:
            return [one(x) for x in items]
        with threads.pool(len(items)) as p:
            return list(p.map(one, items))

    def aside(self) -> StepContext:
        """A context for work whose result this step judges before it reports its own (the
        repair ``model.verify`` runs with the downloader's code): its progress and logs go on the
        stream as they happen, its results only into its own ``results``."""
        outer = self.events

        def forward(ev: Event) -> None:
            if not isinstance(ev, Result):
                outer.emit(ev)

        return StepContext(self.name, EventSink([forward]), self._dep)

    def call(self, name: str, *, on: Deployment | None = None, **options: Any) -> list[Result]:
        """Run the registered step ``name`` as part of this one (``on``: on that deployment, the
        old one of a swap, a placed model, instead of this step's); its results (under its own
        name) are this step's too."""
        child = StepContext(name, self.events, on if on is not None else self._dep, parent=self)
        child.run(**options)
        return child.results

    def run(self, *args: Any, body: Body | None = None, **options: Any) -> list[Result]:
        """Run this context's registered step (or ``body`` reporting under its name); a node
        that cannot be reached, and so stops the step, is one failed result for that node; a
        ``StepFailed`` the step raised is its one failed result (for the node it names)."""
        try:
            (body or get(self.name).body)(self, *args, **options)
        except NodeUnreachable as e:
            self.unreachable(e)
        except StepFailed as e:
            self.failed(str(e), e.node)
        return self.results


class Ran(Protocol):
    """A plan step as a ``when`` sees it so far in the run (``plan.StepRun``)."""

    state: str

    @property
    def changed(self) -> bool: ...


When = Callable[["Deployment", Mapping[str, Ran], bool], "str | None"]
"""``when(dep, runs, forced)``: why a plan skips the step this time (None: run it); ``runs``:
the plan's steps so far; ``forced``: the plan asks for the step whatever changed
(``deploy.all --bench``)."""


@dataclass(frozen=True)
class StepSpec:
    name: str
    body: Body
    needs: tuple[str, ...] = ()
    """Steps that must have finished (and not failed) first, when a plan holds them: the one
    place the edges of every plan are declared."""
    after_start: tuple[str, ...] = ()
    """Steps that must have *started* first, when a plan holds them (they may still run)."""
    long: bool = False
    """Long work (a download): a graph runner starts it as early as its needs allow."""
    fingerprint: Fingerprint | None = None
    """What the step's outcome depends on (the profile slice, what the records and the nodes
    say), as flat ``{key: value}``: a plan names the keys that changed since the step last
    finished."""
    reuse: bool = False
    """A decision with no effect on the nodes: an unchanged fingerprint reuses the last outcome."""
    redo: str | None = None
    """A step to run first when the fingerprint changed since the step last finished."""
    when: When | None = None
    """Why a plan skips the step this time (None: run it)."""


REGISTRY: dict[str, StepSpec] = {}


def step(name: str, *, needs: tuple[str, ...] = (), after_start: tuple[str, ...] = (),
         long: bool = False, fingerprint: Fingerprint | None = None, reuse: bool = False,
         redo: str | None = None, when: When | None = None) -> Callable[[Body], StepFn]:
    """Register the body ``fn(ctx, **options)`` as step ``name`` (``image.ship``), needing the
    steps in ``needs`` (and starting once those in ``after_start`` started) wherever a plan
    holds them, with how a plan runs it (``StepSpec``); returns the step as ``fn(dep,
    **options) -> list[Result]``."""
    if (reuse or redo) and fingerprint is None:
        raise TypeError(f"step {name!r}: reuse and redo follow a fingerprint, and it declares none")

    def deco(body: Body) -> StepFn:
        body = getattr(body, "body", body)  # a module imported again registers the same body
        if inspect.isgeneratorfunction(body):
            raise TypeError(f"step {name!r}: a body reports through its context, it yields nothing")
        if name in REGISTRY and REGISTRY[name].body is not body:
            raise ValueError(f"step {name!r} registered twice")
        REGISTRY[name] = StepSpec(name, body, tuple(needs), tuple(after_start), long,
                                  fingerprint, reuse, redo, when)

        @functools.wraps(body)
        def run(dep: Deployment, *args: Any, **options: Any) -> list[Result]:
            return StepContext(name, dep.events, dep).run(*args, **options)

        run.step_name = name  # type: ignore[attr-defined]
        run.body = body  # type: ignore[attr-defined]
        return run

    return deco


def needs_in(name: str, plan: set[str]) -> set[str]:
    """The steps of ``plan`` that ``name`` needs: its registered needs, followed through steps
    the plan leaves out (with ``image.build`` skipped, ``image.ship`` still follows
    ``image.probe``)."""
    found: set[str] = set()
    seen: set[str] = set()
    todo = list(REGISTRY[name].needs) if name in REGISTRY else []
    while todo:
        n = todo.pop()
        if n in seen or n == name:
            continue
        seen.add(n)
        if n in plan:
            found.add(n)
        elif n in REGISTRY:
            todo.extend(REGISTRY[n].needs)
    return found


def after_start_in(name: str, plan: set[str]) -> tuple[str, ...]:
    """The steps of ``plan`` that must have started before ``name`` starts."""
    spec = REGISTRY.get(name)
    return tuple(n for n in spec.after_start if n in plan) if spec else ()


def get(name: str) -> StepSpec:
    load_all()
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"no step named {name!r} (steps: {', '.join(sorted(REGISTRY))})") from None


def run_one(dep: Deployment | None, name: str, *args: Any, events: EventSink | None = None,
            body: Body | None = None, **options: Any) -> list[Result]:
    """Run one registered step on ``dep``; its results, each already on the stream. The one
    way to run a step from outside a step (inside one: ``ctx.call``). ``body``: work that is no
    registered step (the lab, a discovery before any profile exists) reporting as ``name``;
    without a deployment it reports on ``events`` (a stream of its own when None)."""
    sink = dep.events if dep is not None else events if events is not None else EventSink()
    return StepContext(name, sink, dep).run(*args, body=body, **options)


def load_all() -> dict[str, StepSpec]:
    """Import every step module so that each registers itself."""
    import importlib
    import pkgutil

    import sparkdeploy.steps as pkg  # here, not at the top: each step module imports this registry

    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name != "registry":
            importlib.import_module(f"sparkdeploy.steps.{mod.name}")
    return REGISTRY
