"""`inv link.*`: the link doctor, and the fabric test in the serving image."""

import json as _json
import sys

from invoke import Collection

from sparkdeploy.steps.registry import run_one
from sparkdeploy.tasks import _flags as flags
from sparkdeploy.tasks._common import drive, run_step
from sparkdeploy.tasks._flags import task


@task(default=True, help={"profile": "profile file (default: sparkdeploy.profile)"})
def check(c, profile=None):
    """Check the fast link: interfaces, MTU, subnet, RoCE HCAs, engines' addresses, reach, bandwidth."""
    run_step(c, "link.check", profile=profile, lock=False)


@task(help={"json": "print only the verdict and the figures, as one JSON document (the stream goes to stderr)",
            "engine": "the engine whose image and container spec run the test (default: the one serving, "
                      "else the profile's first)",
            "recipe": "test with this recipe's engines (as deploy.all --recipe)",
            "recipes": "an owner's recipe directory (DIR[,DIR...]), looked up first",
            "profile": "profile file (default: sparkdeploy.profile)"})
def fabric(c, json=False, engine=None, recipe=None, recipes=None, profile=None):
    """An all-reduce across every node in the engine's image (1 MiB to 1 GiB): algbw, busbw, a verdict."""
    def prepare(dep):
        names = [e.name for e in dep.profile.engines]
        if engine is not None and engine not in names:
            raise flags.usage("--engine", f"no engine named {engine!r} (engines: {', '.join(names)})")

    def work(dep, events):
        return run_one(dep, "link.fabric", engine=engine)

    def show(dep, results):
        if json:
            # a node that could not be reached stops the step before any verdict: failed, its line
            found = next((r.details["fabric"] for r in results if "fabric" in r.details), None)
            print(_json.dumps(found or {"verdict": "failed", "expected_gbs": None, "sizes": [],
                                        "why": next((r.why for r in results if r.failed), "no answer")}),
                  flush=True)

    drive(c, "link.fabric", work, profile=profile, prepare=prepare, show=show, recipe=recipe,
          recipe_dirs=tuple(flags.name_list("--recipes", recipes)), out=sys.stderr if json else None,
          live=not json)


ns = Collection("link", check, fabric)
