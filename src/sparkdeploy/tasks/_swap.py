"""``inv serve.swap``'s driver: the new deployment (the profile with ``--recipe``'s model
part), the old one beside it (``ops.swap.old_deployment``), the ``serve.swap`` step, and its
last lines (``bring-up N s``, ``endpoint: URL``, the record)."""

from __future__ import annotations

from invoke import Context

from sparkdeploy import swap as swapping
from sparkdeploy.deployment import Deployment
from sparkdeploy.events import EventSink
from sparkdeploy.ops import swap as ops
from sparkdeploy.results import Result
from sparkdeploy.tasks._common import drive
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
        return swapping.run(dep, old["dep"], engine=engine, from_recipe=old_recipe["recipe"],
                            to_recipe=recipe)

    def show(dep: Deployment | None, results: list[Result]) -> None:
        took = next((r.details["bringup_s"] for r in results
                     if r.step == "serve.swap" and r.details.get("bringup_s") is not None), None)
        url = next((r.details["endpoint"] for r in reversed(results)
                    if r.step == "serve.swap" and r.details.get("endpoint")), None)
        record = next((r.details["record"] for r in results if r.details.get("record")), None)
        if took is not None:
            print(f"bring-up {took:g} s", flush=True)
        print(f"endpoint: {url or '-'}", flush=True)
        if record:
            print(f"record: {record}", flush=True)

    return drive(c, "serve.swap", work, profile=profile, prepare=prepare, show=show,
                 recipe=recipe, recipe_dirs=recipes)
