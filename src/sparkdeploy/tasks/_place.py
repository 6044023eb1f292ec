"""``inv serve.add``'s and ``inv serve.remove``'s drivers: the flags, the run, the last line
(``endpoint: URL``, the gateway's address)."""

from __future__ import annotations

from invoke import Context

from sparkdeploy.core.events import EventSink
from sparkdeploy.core.outcomes import Result
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.profile import recipes as rcp
from sparkdeploy.run import placement
from sparkdeploy.steps.registry import run_one
from sparkdeploy.tasks._common import drive
from sparkdeploy.tasks._flags import NODES, node_names, usage


def _endpoint(dep: Deployment | None, results: list[Result]) -> None:
    url = next((r.details["endpoint"] for r in reversed(results)
                if r.step == "serve.gateway" and r.details.get("endpoint") and not r.failed), None)
    print(f"endpoint: {url or '-'}", flush=True)


def _then_metrics(dep: Deployment, results: list[Result]) -> list[Result]:
    """``metrics.up`` once the change succeeded: Prometheus scrapes the gateway while models are
    placed (its per-model figures), and no longer once none is."""
    if any(r.failed and not r.superseded for r in results):
        return results
    return results + run_one(dep, "metrics.up")


def add(c: Context, *, recipe: str | None, nodes: str | None, profile: str | None,
        recipes: tuple[str, ...] = (), on_demand: bool = False) -> list[Result]:
    if not recipe:
        raise usage("--recipe", "name the recipe whose model to place (recipe.list shows them)")

    def prepare(dep: Deployment) -> None:
        rcp.read(recipe, rcp.directories(dep.profile.recipes), "--recipe")  # a usage error
        node_names(NODES, nodes, dep.hosts, allow_all=False)

    def work(dep: Deployment | None, events: EventSink) -> list[Result]:
        assert dep is not None  # drive loads it ("needed")
        return _then_metrics(dep, placement.run(dep, recipe, nodes, on_demand))

    return drive(c, placement.STEP, work, profile=profile, prepare=prepare, show=_endpoint,
                 recipe_dirs=recipes)


def remove(c: Context, *, recipe: str | None, profile: str | None,
           recipes: tuple[str, ...] = ()) -> list[Result]:
    if not recipe:
        raise usage("--recipe", "name the placed recipe to remove (serve.list shows them)")

    def work(dep: Deployment | None, events: EventSink) -> list[Result]:
        assert dep is not None  # drive loads it ("needed")
        return _then_metrics(dep, run_one(dep, "serve.remove", recipe=recipe))

    return drive(c, "serve.remove", work, profile=profile, recipe_dirs=recipes)
