"""`inv recipe.list`: the recipes, what each needs and whether it fits; `inv recipe.show NAME`."""

import json as _json

from invoke import Collection

from sparkdeploy.core.outcomes import Result
from sparkdeploy.model import estimate as est
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.profile import catalog
from sparkdeploy.profile import recipes as rcp
from sparkdeploy.tasks import _flags as flags
from sparkdeploy.tasks._common import drive, table
from sparkdeploy.tasks._flags import task


def _dirs(dep: Deployment | None, recipes: str | None) -> list:
    own = flags.name_list("--recipes", recipes) if recipes else []
    rcp.check_dirs(own, "--recipes")
    return rcp.directories([*own, *(dep.profile.recipes if dep is not None else [])])


@task(name="list", default=True, help={
    "json": "print a JSON list (name, repo, weights_bytes, min_nodes, engines, fits, why)",
    "nodes": "judge the fit on this many nodes (default: the profile's GPUs)",
    "memory_gib": "GiB an engine may use on each node (default: a GB10's, about 101)",
    "recipes": "an owner's recipe directory (DIR[,DIR...]), looked up first",
    "profile": "profile file (its nodes and recipes:)"})
def list_(c, json=False, nodes=None, memory_gib=None, recipes=None, profile=None):
    """Each recipe's model, weights (the files the engine loads), engines, the fewest Sparks it
    needs, and whether it fits this cluster (with the reason when not)."""
    n = flags.integer("--nodes", nodes, min=1, max=64)
    mem = flags.number("--memory-gib", memory_gib, gt=0)

    def show(dep: Deployment | None, results: list[Result]) -> None:
        count = n if n is not None else (sum(x.gpus for x in dep.profile.nodes) if dep else None)
        got = catalog.rows(_dirs(dep, recipes), count, mem or est.GB10_USABLE_GIB,
                           "--memory-gib" if mem else est.GB10_SOURCE)
        if json:
            print(_json.dumps([r.as_json() for r in got], indent=2), flush=True)
        else:
            table("recipes", catalog.HEADER, [r.cells() for r in got])

    drive(c, "recipe.list", lambda dep, events: [], profile=profile, deployment="optional",
          lock=False, show=show)


@task(help={"name": "the recipe", "recipes": "an owner's recipe directory (DIR[,DIR...])",
            "nodes": "show the layout and fit for these node counts: N[,N...] (default 1,2,3,4)",
            "profile": "profile file (its recipes:)"})
def show(c, name, recipes=None, nodes=None, profile=None):
    """The recipe with defaults filled in, where each part came from, its layout and fit on
    1 to 4 Sparks."""
    counts = [flags.integer("--nodes", x, min=1, max=64) for x in flags.name_list("--nodes", nodes)]

    def shown(dep: Deployment | None, results: list[Result]) -> None:
        print(catalog.show(name, _dirs(dep, recipes), [x for x in counts if x] or [1, 2, 3, 4]),
              end="", flush=True)

    drive(c, "recipe.show", lambda dep, events: [], profile=profile, deployment="optional",
          lock=False, show=shown)


ns = Collection("recipe", list_, show)
