"""``inv serve.swap``'s and ``inv model.prune``'s drivers: the new deployment (the profile with ``--recipe``'s model
part), the old one beside it (``ops.swap.old_deployment``), the ``serve.swap`` step (then
``serve.gateway`` and ``metrics.up``), and its last lines (``bring-up N s``, ``endpoint: URL``, the record)."""

from __future__ import annotations

import sys

from invoke import Context
from invoke.exceptions import Exit

from sparkdeploy.core.events import EventSink
from sparkdeploy.core.outcomes import Result
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.ops import swap as ops
from sparkdeploy.run import swap as swapping
from sparkdeploy.steps import model_prune
from sparkdeploy.steps.registry import run_one
from sparkdeploy.tasks._common import drive, failed_count
from sparkdeploy.tasks._flags import usage


def swap(c: Context, *, recipe: str | None, engine: str | None, profile: str | None,
         recipes: tuple[str, ...] = ()) -> list[Result]:
    if not recipe:
        raise usage("--recipe", "name the recipe to swap to (recipe.list shows them)")
    old: dict[str, Deployment] = {}
    old_recipe: dict[str, str | None] = {}

    def prepare(dep: Deployment) -> None:
        names = [e.name for e in dep.profile.engines]
        if engine is not None:
            if engine not in names:
                raise usage("--engine", f"no engine named {engine!r} in recipe {recipe} "
                            f"(engines: {', '.join(names)})")
            dep.profile = dep.profile.model_copy(
                update={"engines": [e for e in dep.profile.engines if e.name == engine]})
        old["dep"], old_recipe["recipe"] = ops.old_deployment(dep, recipes)

    def work(dep: Deployment | None, events: EventSink) -> list[Result]:
        assert dep is not None  # drive loads it ("needed")
        results = swapping.run(dep, old["dep"], engine=engine, from_recipe=old_recipe["recipe"],
                               to_recipe=recipe)
        if not any(r.failed and not r.superseded for r in results):
            results += run_one(dep, "serve.gateway")  # with models placed: it routes the new one
            results += run_one(dep, "metrics.up")  # the exporters say the new model
        return results

    def show(dep: Deployment | None, results: list[Result]) -> None:
        took = next((r.details["bringup_s"] for r in results
                     if r.step == "serve.swap" and r.details.get("bringup_s") is not None), None)
        # the new model's, or after a way back the old one's as serve.up brought it back
        url = next((r.details["endpoint"] for r in reversed(results)
                    if r.details.get("endpoint") and not r.failed), None)
        record = next((r.details["record"] for r in results if r.details.get("record")), None)
        if took is not None:
            print(f"bring-up {took:g} s", flush=True)
        print(f"endpoint: {url or '-'}", flush=True)
        if record:
            print(f"record: {record}", flush=True)

    def verdict(results: list[Result]) -> str | None:
        """The swap's own failure (why it was refused or rolled back), else any other."""
        said = next((r.why for r in reversed(results) if r.step == "serve.swap" and r.failed), None)
        return said or failed_count(results)

    return drive(c, "serve.swap", work, profile=profile, prepare=prepare, show=show,
                 verdict=verdict, recipe=recipe, recipe_dirs=recipes)


def prune(c: Context, *, yes: bool, profile: str | None) -> list[Result]:
    """``inv model.prune``: what it would remove on each node, asked about unless ``yes``, then
    the ``model.prune`` step with the serving model's directory (the deployment the nodes serve
    now: ``ops.swap.old_deployment``) left."""
    serving: dict[str, str] = {}

    def confirm(dep: Deployment) -> None:
        serving["path"] = ops.old_deployment(dep)[0].profile.model.path
        found = {h.name: model_prune.targets(dep, h, serving["path"]) for h in dep.hosts.values()}
        if not any(found.values()) or dep.dry:
            return
        print(f"model.prune will remove (serving: {serving['path']}; model.keep: "
              f"{dep.profile.model.keep}):", flush=True)
        for node, dirs in found.items():
            print(f"  {node}: {model_prune.listing(dirs) or 'nothing'}", flush=True)
        if yes:
            return
        if not sys.stdin.isatty():
            raise usage("--yes", "model.prune removes weights: confirm with --yes when not on a "
                        "terminal")
        if input("remove these? [y/N] ").strip().lower() not in ("y", "yes"):
            raise Exit("nothing removed", code=1)

    def work(dep: Deployment | None, events: EventSink) -> list[Result]:
        return run_one(dep, model_prune.PRUNE, serving=serving.get("path"))

    return drive(c, model_prune.PRUNE, work, profile=profile, prepare=confirm, live=False)
