"""`inv deploy` (= `inv deploy.all`): the whole chain as one pipelined, resumable run; and
`inv deploy.rollback`."""

from __future__ import annotations

import sys
from collections.abc import Callable

from invoke import Collection
from invoke.exceptions import Exit

from sparkdeploy.core.events import EventSink
from sparkdeploy.core.outcomes import Result
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.endpoint import url as endpoint_url
from sparkdeploy.ops.engine_check import check_flags
from sparkdeploy.run import plan as plans
from sparkdeploy.run.plan import PlanRun, PlanStep
from sparkdeploy.run.run_record import write_record
from sparkdeploy.run.runner import Runner, select
from sparkdeploy.steps.deploy import purge_targets
from sparkdeploy.tasks import _flags as flags
from sparkdeploy.tasks._common import drive
from sparkdeploy.tasks._flags import task


class _Plan:
    """One plan run by ``drive``: the steps selected (``prepare``, with the dry run's listing),
    then the runner's outcome (``work``)."""

    def __init__(self, name: str, steps_for, *, serial=False, only=None, skip=None,
                 before: Callable[[Deployment], None] | None = None):
        self.name, self.steps_for, self.serial, self.before = name, steps_for, serial, before
        self.only, self.skip = flags.name_list("--only", only), flags.name_list("--skip", skip)
        self.steps: list[PlanStep] = []
        self.out: PlanRun | None = None

    def prepare(self, dep: Deployment) -> None:
        if self.before is not None:
            self.before(dep)
        self.steps, left = select(self.steps_for(dep), self.only, self.skip)
        self.runner = Runner(dep, self.steps, name=self.name, serial=self.serial or dep.dry,
                             left_out=left)
        if dep.dry:
            print(f"plan ({self.name}, dry run: every command per node, nothing changed):",
                  flush=True)
            for line in plans.describe_plan(self.steps, left):
                print("  " + line, flush=True)

    def work(self, dep: Deployment | None, events: EventSink) -> list[Result]:
        self.out = self.runner.run()
        return self.out.results()

    def verdict(self, results: list[Result]) -> str | None:
        bad = [n for n, r in self.out.runs.items() if r.state == "failed"] if self.out else []
        return f"{len(bad)} step(s) failed: {', '.join(bad)}; run it again to resume" if bad else None

    def drive(self, c, profile, show=None, recipe=None, recipes=None) -> None:
        drive(c, self.name, self.work, profile=profile, prepare=self.prepare, show=show,
              verdict=self.verdict, recipe=recipe,
              recipe_dirs=tuple(flags.name_list("--recipes", recipes)))


@task(name="all", default=True, help={
    "serial": "run the steps one by one (for comparison)",
    "only": "run only these steps: NAME[,NAME...]",
    "skip": "leave these steps out: NAME[,NAME...]",
    "bench": "run the bench smoke even when nothing changed",
    "persist": "make the deployment come back at boot (serve.persist)",
    "profile": "profile file",
    "recipe": "deploy this recipe (its model, images, engines) on the profile's cluster",
    "recipes": "an owner's recipe directory (DIR[,DIR...]), looked up first",
})
def all_(c, serial=False, only=None, skip=None, bench=False, persist=False, profile=None,
         recipe=None, recipes=None):
    """Deploy: free the head, choose/build/ship the image, download and sync the weights, serve
    (with fallback), bench smoke, optionally persist; resumable, records every decision."""
    def checked(dep: Deployment) -> None:
        """Every engine's flags against the real engine's (exit 2), then the decided images'
        tags against what they name now (exit 1), before anything runs."""
        for line in check_flags(dep):
            if dep.dry:
                print(line, flush=True)
        why = plans.refusal(dep)
        if why:
            raise Exit(why, code=1)

    run = _Plan("deploy", lambda d: plans.plan(d, bench=bench, persist=persist), serial=serial,
                only=only, skip=skip, before=checked)

    def show(dep: Deployment | None, results: list[Result]) -> None:
        assert dep is not None and run.out is not None
        written = write_record(dep, run.out, run.steps)
        endpoint = endpoint_url(dep)
        print(f"took: {run.out.wall:.1f}s{' (serial)' if run.out.serial else ''}", flush=True)
        metrics = next((r.details["metrics"] for r in results
                        if r.step == "metrics.up" and not r.failed and r.details.get("metrics")), None)
        status = next((r.details["status"] for r in results
                       if r.step == "metrics.up" and not r.failed and r.details.get("status")), None)
        print(f"status: {status or '-'}", flush=True)
        print(f"metrics: {metrics or '-'}", flush=True)  # beside the endpoint, which stays last but one
        print(f"endpoint: {endpoint or '-'}", flush=True)
        print(f"record: {written.markdown if written else 'none (dry run)'}", flush=True)

    run.drive(c, profile, show, recipe=recipe, recipes=recipes)


@task(help={"purge": "also remove the weights and sparkdeploy's images from the nodes",
            "yes": "do not ask before --purge removes anything", "profile": "profile file",
            "recipe": "the recipe deploy.all --recipe deployed", "recipes": "as deploy.all's"})
def rollback(c, purge=False, yes=False, profile=None, recipe=None, recipes=None):
    """Undo the deployment: serve.unpersist, serve.down, services.restore (the head's units are
    back); --purge also removes the weights and sparkdeploy's images, after asking."""
    def confirm(dep: Deployment) -> None:
        if purge and not yes and not dep.dry:
            if not sys.stdin.isatty():
                raise Exit("--purge removes weights and images: confirm with --yes when not on a "
                           "terminal", code=2)
            print("--purge will remove:")
            for line in purge_targets(dep):
                print(f"  {line}")
            if input("remove these? [y/N] ").strip().lower() not in ("y", "yes"):
                raise Exit("nothing removed", code=1)

    _Plan("rollback", lambda d: plans.rollback_plan(d, purge=purge), serial=True,
          before=confirm).drive(c, profile, recipe=recipe, recipes=recipes)


ns = Collection("deploy", all_, rollback)
