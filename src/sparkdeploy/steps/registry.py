"""The step registry: every step under its name, with the steps it needs.

A step is ``fn(dep, **options) -> list[Result]``. It emits each ``Result`` through
``dep.events`` as it happens (``dep.report(r)``) and ``Progress`` during long work, and returns
all of them. Records it makes go through ``dep.records``. ``deploy.all`` runs the registry as a
graph (``graphlib.TopologicalSorter`` over ``needs``); single tasks call ``run_one``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparkdeploy.results import Result

if TYPE_CHECKING:
    from sparkdeploy.deployment import Deployment

StepFn = Callable[..., list[Result]]


@dataclass(frozen=True)
class StepSpec:
    name: str
    fn: StepFn
    needs: tuple[str, ...] = ()
    """Steps that must have finished (and not failed) first, when a plan holds them: the one
    place the edges of every plan are declared."""
    after_start: tuple[str, ...] = ()
    """Steps that must have *started* first, when a plan holds them (they may still run)."""
    long: bool = False
    """Long work (a download): a graph runner starts it as early as its needs allow."""


REGISTRY: dict[str, StepSpec] = {}


def step(name: str, *, needs: tuple[str, ...] = (), after_start: tuple[str, ...] = (),
         long: bool = False) -> Callable[[StepFn], StepFn]:
    """Register ``fn`` as step ``name`` (``image.ship``), needing the steps in ``needs`` (and
    starting once those in ``after_start`` started) wherever a plan holds them."""

    def deco(fn: StepFn) -> StepFn:
        if name in REGISTRY and REGISTRY[name].fn is not fn:
            raise ValueError(f"step {name!r} registered twice")
        REGISTRY[name] = StepSpec(name, fn, tuple(needs), tuple(after_start), long)
        fn.step_name = name  # type: ignore[attr-defined]
        return fn

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


def run_one(dep: Deployment, name: str, **options: Any) -> list[Result]:
    """Run one registered step; results it returned without emitting are emitted here, so the
    stream always carries every result exactly once."""
    results = get(name).fn(dep, **options)
    for r in results:
        if not dep.events.seen(r):
            dep.events.emit(r)
    return results


def load_all() -> dict[str, StepSpec]:
    """Import every step module so that each registers itself."""
    import importlib
    import pkgutil

    import sparkdeploy.steps as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name != "registry":
            importlib.import_module(f"sparkdeploy.steps.{mod.name}")
    return REGISTRY
