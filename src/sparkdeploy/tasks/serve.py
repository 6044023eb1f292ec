"""`inv serve.*`: bring the model up across the nodes, watch it (restarting it whole when it
wedges), persist it, take it down, and say why when it does not come up."""

import json as _json
import sys

from invoke import Collection
from invoke.exceptions import Exit

from sparkdeploy.engines import diagnose as dx
from sparkdeploy.steps.registry import run_one
from sparkdeploy.tasks import _flags as flags
from sparkdeploy.tasks import _place, _swap
from sparkdeploy.tasks._common import drive, run_step
from sparkdeploy.tasks._flags import integer, task

_P = {"profile": "profile file (default: sparkdeploy.profile)"}


@task(default=True, help={"engine": "start with this engine of the profile (default: the first)",
                          "skip_link_check": "do not run link.check first", **_P})
def up(c, engine=None, profile=None, skip_link_check=False):
    """link.check, then preflight, start and wait in phases; on a hang diagnose and fall back to the
    next engine; then metrics.up (Prometheus and the exporters, `metrics: URL`)."""
    # serve.up needs link.check: a bad link fails before anything starts
    run_step(c, "serve.up", profile=profile, engine=engine,
             first=() if skip_link_check else ("link.check",), after=("metrics.up",))


@task(help=_P)
def down(c, profile=None):
    """Remove the deployment's engine containers and metrics units on every node (stopping
    persisted units)."""
    run_step(c, "serve.down", profile=profile)


@task(help=_P)
def status(c, profile=None):
    """Engine containers per node, Ray's nodes, the endpoint's health."""
    run_step(c, "serve.status", profile=profile, lock=False)


@task(name="list", help={"json": "print only the list, as one JSON document (the stream goes to "
                                 "stderr)", **_P})
def list_(c, json=False, profile=None):
    """What serves where on the nodes, by their containers' labels: recipe, repo, nodes, URL, loaded."""
    def work(dep, events):
        return run_one(dep, "serve.list")

    def show(dep, results):
        if json:
            print(_json.dumps([r.details["placed"] for r in results if "placed" in r.details]),
                  flush=True)

    drive(c, "serve.list", work, profile=profile, lock=False, show=show,
          out=sys.stderr if json else None, live=not json)


@task(help={"nodes": "only these nodes: NAME[,NAME...] (default: every node)",
            "node": "deprecated: --nodes", "tail": "only the last N lines", **_P})
def logs(c, nodes=None, tail=None, profile=None, node=None):
    """Show the engine containers' logs."""
    n = integer("--tail", tail, min=1)
    flag, picked = flags.nodes(nodes, node=node)
    run_step(c, "serve.logs", profile=profile, lock=False, node=picked, flag=flag, tail=n)


@task(help={"engine": "the engine to persist (default: the one serve.up chose)",
            "recipe": "the deployment of this recipe (as deploy.all --recipe): the one serving",
            "recipes": "an owner's recipe directory (DIR[,DIR...]), looked up first", **_P})
def persist(c, engine=None, profile=None, recipe=None, recipes=None):
    """Install the deployment as systemd units on every node and hand it over to them."""
    run_step(c, "serve.persist", profile=profile, engine=engine, recipe=recipe,
             recipe_dirs=tuple(flags.name_list("--recipes", recipes)))


@task(help=_P)
def unpersist(c, profile=None):
    """Stop, disable and remove the deployment's systemd units on every node."""
    run_step(c, "serve.unpersist", profile=profile)


@task(help={"checks": "look this many times, then end (default: until interrupted)", **_P})
def watch(c, checks=None, profile=None):
    """Watch an unpersisted deployment: a canary every serve.watch_s; a wedge restarts every rank."""
    n = integer("--checks", checks, min=1)
    run_step(c, "serve.watch", profile=profile, checks=n)


@task(iterable=["log"], help={"log": "an engine log file, one per node (repeat --log for each)"})
def diagnose(c, log=None):
    """Classify engine logs: prints `class: NAME`, then the evidence lines as FILE:LINE: text."""
    if not log:
        raise Exit("--log: give at least one engine log file", code=2)
    code = dx.main(list(log))
    if code:
        raise Exit(code=code)


@task(help={"recipe": "the recipe to serve instead of the one serving now",
            "engine": "only this engine of the new recipe (no fallback)",
            "recipes": "an owner's recipe directory (DIR[,DIR...]), looked up first", **_P})
def swap(c, recipe=None, engine=None, profile=None, recipes=None):
    """Change the model with only a bring-up's downtime: prepare the new one while the old one
    serves, then stop the old one and bring up the new one; back to the old one on a failure."""
    _swap.swap(c, recipe=recipe, engine=engine, profile=profile,
               recipes=tuple(flags.name_list("--recipes", recipes)))


_RECIPES = {"recipes": "an owner's recipe directory (DIR[,DIR...]), looked up first"}


@task(help={"recipe": "the recipe whose model to place (recipe.list shows them)",
            "nodes": "on these nodes: NAME[,NAME...] (default: the fewest nodes it fits on)",
            "on-demand": "register it on the head, loaded by the first request for it (the least "
                         "recently used model on demand evicted when memory requires)",
            **_RECIPES, **_P})
def add(c, recipe=None, nodes=None, on_demand=False, profile=None, recipes=None):
    """Place a recipe's model beside what serves, where it fits (counting what the models there
    hold), bring it up and route it through the gateway on the head; prints `endpoint: URL`."""
    _place.add(c, recipe=recipe, nodes=nodes, on_demand=bool(on_demand), profile=profile,
               recipes=tuple(flags.name_list("--recipes", recipes)))


@task(help={"recipe": "the placed recipe to stop serving", **_RECIPES, **_P})
def remove(c, recipe=None, profile=None, recipes=None):
    """Take a model serve.add placed out of the gateway, then stop its engine."""
    _place.remove(c, recipe=recipe, profile=profile,
                  recipes=tuple(flags.name_list("--recipes", recipes)))


ns = Collection("serve", up, down, status, list_, logs, watch, persist, unpersist, diagnose, swap,
                add, remove)
