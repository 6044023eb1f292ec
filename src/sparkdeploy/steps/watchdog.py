"""``serve.watch``: the watchdog of a deployment ``serve.up`` started and nobody persisted, run
from the controller for as long as it runs (the persisted supervisors have their own, in
``helpers/serve_unit.py``; the decisions and the record's shape are shared, in
``helpers/serve_watchdog.py``)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

from pydantic import BaseModel

from sparkdeploy.engines import Launch
from sparkdeploy.engines.diagnose import classify
from sparkdeploy.helpers import serve_watchdog as wd
from sparkdeploy.node import endpoint as ep
from sparkdeploy.node.hosts import Host
from sparkdeploy.node.nodeops import docker, run_helper
from sparkdeploy.ops import swap as swap_ops
from sparkdeploy.ops.serve import Run, bring_up, drop_previous, engine_of, put_file, running_launch
from sparkdeploy.ops.serve_containers import active, installed, remove, unit_name
from sparkdeploy.ops.serve_watch import EngineFailed, Watch, full_log, policy, read_restarts
from sparkdeploy.steps.registry import StepContext, step

STEP_WATCH = "serve.watch"
HELPER = "serve_watchdog.py"
WALL: Callable[[], float] = time.time
"""Wall-clock time for the records (the deployment's clock is monotonic)."""


class _Ranks(BaseModel):
    ranks: dict[str, str | None]


class _Saved(BaseModel):
    dir: str
    files: list[str] = []


def _docker_flags(host: Host, names: list[str]) -> list[str]:
    return [*(f"--docker={a}" for a in docker(host)), *(f"--name={n}" for n in names)]


def look(ctx: StepContext, lau: Launch, url: str, pol: wd.Policy) -> wd.Wedge | None:
    """One look: every rank's engine on its node, then (all of them running) the canary."""
    dep = ctx.dep
    ranks: dict[str, str | None] = {}
    for node in sorted({c.node for c in lau.containers}):
        h = dep.host(node)
        got = run_helper(h, HELPER, ["ranks", *_docker_flags(h, [c.name for c in lau.on(node)])],
                         result=_Ranks, where=f"{node}: the ranks", timeout=60)
        ranks.update({f"{node}: {n}": p for n, p in got.ranks.items()})
    err = None
    if not any(ranks.values()):
        text = ep.stream_chat(url, lau.served_model, max_tokens=2, deadline=pol.canary_s)
        err = None if text else f"no token within {pol.canary_s:g}s"
    return wd.wedge(err, ranks)


def write_restarts(head: Host, engine: str, recs: list[dict]) -> None:
    path = wd.record_path(engine)
    if put_file(head, path, wd.records_text(recs), "0644"):
        drop_previous(head, [path])


def restart(ctx: StepContext, lau: Launch, w: wd.Wedge, pol: wd.Policy) -> str:
    """Save every node's logs (on the node), classify them, record the restart on the head, then
    (within the budget, after the backoff) every rank removed and started again together.
    ``serving``, ``failed`` (the ranks did not come up again: removed) or ``gave-up`` (the
    budget is spent: recorded, said, nothing restarted)."""
    dep = ctx.dep
    head = dep.host(lau.head)
    recs = read_restarts(head, lau.engine.name)
    now = WALL()
    go, wait, n = wd.next_restart(recs, now, pol)
    rid = wd.restart_id(now, secrets.token_hex(2))
    nodes = sorted({c.node for c in lau.containers})
    saved, logs = {}, {}
    for node in nodes:
        h = dep.host(node)
        names = [c.name for c in lau.on(node)]
        saved[node] = run_helper(h, HELPER, ["save-logs", *_docker_flags(h, names), "--id", rid],
                                 result=_Saved, where=f"{node}: saving the logs", sudo=True,
                                 timeout=300).dir
        logs.update({f"{node}-{c}.log": full_log(h, c) for c in names})
    diag = classify(logs)
    recs.append(wd.entry(w, rid=rid, t=now, by=STEP_WATCH, engine=lau.engine.name, n=n,
                         backoff_s=wait, gave_up=not go, logs=saved, cls=diag.cls))
    write_restarts(head, lau.engine.name, recs)
    if not go:
        ctx.failed(f"wedge: {w.why}; class {diag.cls}; the restart budget is spent "
                   f"({pol.max_restarts} within {pol.window_s:g}s): not restarted", restart=recs[-1])
        return "gave-up"
    ctx.progress(None, 0, None, "s", f"restart {n}: backoff {wait:.0f}s")
    dep.sleep(wait)
    hosts = [dep.host(x) for x in nodes]
    remove(dep, hosts, lau.engine.name)
    with ctx.failing(EngineFailed, lead=f"restart {n} after {w.why}: ", restart=recs[-1]) as caught:
        bring_up(dep, lau, Run(dep), Watch(ctx, dep.profile.serve.stall_s, dep.profile.serve.poll_s))
    if caught.error is not None:
        remove(dep, hosts, lau.engine.name)
        return "failed"
    wd.served_again(recs, WALL())
    write_restarts(head, lau.engine.name, recs)
    ctx.changed(f"restart {n}: {w.why}; class {diag.cls}; every rank restarted, serving again "
                f"after {recs[-1]['served_again_after_s']:g}s", restart=recs[-1])
    return "serving"


def swap_pause(ctx: StepContext) -> str | None:
    """What a ``serve.swap`` on the head says of this watch: ``paused`` during its cut-over
    (the old engine stops on purpose: nothing to restart), ``swapped`` once a swap put another
    model than the profile's in its place (said so: the watch ends), else None."""
    dep = ctx.dep
    rec = swap_ops.read_phase(dep.host(dep.profile.head.name), dep.profile.name)
    if rec is None:
        return None
    if rec.phase == swap_ops.CUT_OVER:
        ctx.progress(None, 0, None, "checks", f"paused: serve.swap's cut-over to {rec.to_model}")
        return "paused"
    if (rec.phase == swap_ops.DONE and rec.to_model != dep.profile.model.repo
            and swap_ops.serving_url(dep) is None):  # not deployed again since
        ctx.ok(f"serve.swap replaced {dep.profile.model.repo} with {rec.to_model}: this watch "
               "ends (serve.watch with the new deployment's profile watches it)")
        return "swapped"
    return None


@step(STEP_WATCH)
def watch(ctx: StepContext, checks: int | None = None) -> None:
    """Watch a deployment serve.up started (not persisted): every ``serve.watch_s`` every rank's
    engine and a canary; a wedge restarts every rank together (budget, backoff), recorded on
    the head. ``checks``: that many looks, then end (default: until interrupted)."""
    dep = ctx.dep
    eng = engine_of(dep, None)
    if eng is None:
        ctx.failed("no engine recorded: serve.up first")
        return
    units = {n.name: active(dep.host(n.name), installed(dep, dep.host(n.name)))
             for n in dep.profile.nodes}
    if any(units.values()):
        ctx.ok(f"the persisted supervisors watch it ({unit_name(eng.name)}): nothing to do")
        return
    lau = running_launch(dep, eng)  # EngineError: the step's failure
    pol = policy(dep.profile.serve)
    url = ep.engine_url(dep.host(lau.head), lau.port)
    if dep.dry:
        ctx.would(f"watch {url}: a canary every {pol.watch_s:g}s, every rank's engine read")
        return
    done, now = 0, "serving"
    while checks is None or done < checks:
        done += 1
        swapping = swap_pause(ctx)
        if swapping == "swapped":
            return
        w = None if swapping else look(ctx, lau, url, pol)
        now = "serving" if w is None else restart(ctx, lau, w, pol)
        if now == "gave-up":
            return
        ctx.progress(None, done, checks, "checks", now)
        if checks is None or done < checks:
            dep.sleep(pol.watch_s)
    if now == "serving":  # else the failed restart said why
        ctx.ok(f"{done} check(s) of {url}: serving")
