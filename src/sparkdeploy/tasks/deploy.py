"""`inv deploy` (= `inv deploy.all`): the whole chain as one pipelined, resumable run; and
`inv deploy.rollback`."""

from __future__ import annotations

import sys

from invoke import Collection
from invoke.exceptions import Exit

from sparkdeploy import plan as plans
from sparkdeploy.config import ProfileError
from sparkdeploy.endpoint import url as endpoint_url
from sparkdeploy.events import rendering
from sparkdeploy.hosts import HostError
from sparkdeploy.plan import PlanRun
from sparkdeploy.records import RecordError
from sparkdeploy.runner import PlanError, Runner, select
from sparkdeploy.state import LockHeld
from sparkdeploy.steps.deploy import purge_targets
from sparkdeploy.tasks import _flags as flags
from sparkdeploy.tasks._common import load
from sparkdeploy.tasks._flags import task


def _run(c, profile, steps_for, name, *, serial=False, only=None, skip=None) -> tuple:
    dep = load(c, profile)
    try:
        steps, left = select(steps_for(dep), flags.name_list("--only", only),
                             flags.name_list("--skip", skip))
        runner = Runner(dep, steps, name=name, serial=serial or dep.dry, left_out=left)
    except PlanError as e:
        raise Exit(str(e), code=2) from None
    except RecordError as e:
        raise Exit(str(e), code=1) from None
    if dep.dry:
        print(f"plan ({name}, dry run: every command per node, nothing changed):", flush=True)
        for line in plans.describe_plan(steps, left):
            print("  " + line, flush=True)
    with rendering(dep.events):
        try:
            if dep.dry:
                out = runner.run()
            else:
                with dep.state.lock(name):
                    out = runner.run()
        except ProfileError as e:
            raise Exit(str(e), code=2) from None
        except (HostError, LockHeld, RecordError) as e:
            raise Exit(str(e), code=1) from None
    return dep, steps, out


def _finish(out: PlanRun) -> None:
    bad = [n for n, r in out.runs.items() if r.state == "failed"]
    if bad:
        raise Exit(f"{len(bad)} step(s) failed: {', '.join(bad)}; run it again to resume", code=1)


@task(name="all", default=True, help={
    "serial": "run the steps one by one (for comparison)",
    "only": "run only these steps: NAME[,NAME...]",
    "skip": "leave these steps out: NAME[,NAME...]",
    "bench": "run the bench smoke even when nothing changed",
    "persist": "make the deployment come back at boot (serve.persist)",
    "profile": "profile file",
})
def all_(c, serial=False, only=None, skip=None, bench=False, persist=False, profile=None):
    """Deploy: free the head, choose/build/ship the image, download and sync the weights, serve
    (with fallback), bench smoke, optionally persist; resumable, records every decision."""
    dep, steps, out = _run(c, profile, lambda d: plans.plan(d, bench=bench, persist=persist),
                           "deploy", serial=serial, only=only, skip=skip)
    try:
        written = plans.write_record(dep, out, steps)
        endpoint = endpoint_url(dep)
    except RecordError as e:
        raise Exit(str(e), code=1) from None
    print(f"took: {out.wall:.1f}s{' (serial)' if out.serial else ''}", flush=True)
    print(f"endpoint: {endpoint or '-'}", flush=True)
    print(f"record: {written.markdown if written else 'none (dry run)'}", flush=True)
    _finish(out)


@task(help={"purge": "also remove the weights and sparkdeploy's images from the nodes",
            "yes": "do not ask before --purge removes anything", "profile": "profile file"})
def rollback(c, purge=False, yes=False, profile=None):
    """Undo the deployment: serve.unpersist, serve.down, services.restore (the head's units are
    back); --purge also removes the weights and sparkdeploy's images, after asking."""
    if purge and not yes:
        dep = load(c, profile)
        if not dep.dry:
            if not sys.stdin.isatty():
                raise Exit("--purge removes weights and images: confirm with --yes when not on a "
                           "terminal", code=2)
            print("--purge will remove:")
            for line in purge_targets(dep):
                print(f"  {line}")
            if input("remove these? [y/N] ").strip().lower() not in ("y", "yes"):
                raise Exit("nothing removed", code=1)
    _, _, out = _run(c, profile, lambda d: plans.rollback_plan(d, purge=purge), "rollback",
                     serial=True)
    _finish(out)


ns = Collection("deploy", all_, rollback)
