"""Free the GPUs: stop what holds them (systemd units), wait until no process is on the GPU
(``services.gpu-free``, a step of its own that ``services.stop`` runs for each node it
stopped), and put the stopped units back later.

A GPU whose every process runs in a sparkdeploy engine container (found by the containers'
labels and ``docker top``) is not waited on: the step says at once whose it is. This
deployment's own engine is ``ok`` (``serve.up`` keeps it or replaces it); another deployment's
fails, naming the container and its deployment.

Before stopping, the node records which units were active (its own record,
``/var/lib/sparkdeploy-node/services/<profile>.json``: any controller with the profile restores
them); ``stop`` only ever adds to that record, ``restore`` starts exactly the recorded units in
reverse order and then forgets them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from sparkdeploy.core import labels
from sparkdeploy.core.fingerprint import Fingerprint, flat, head
from sparkdeploy.core.outcomes import Result
from sparkdeploy.core.outside import OutsideError, last_line
from sparkdeploy.core.wait import Stop, WaitTimeout, wait_for
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host, HostError, NodeUnreachable
from sparkdeploy.node.nodeops import NODE_STATE, docker, read_node_file, write_node_file
from sparkdeploy.ops.units import GpuProcess, gpu_processes, probe_units, unit_states
from sparkdeploy.steps.registry import StepContext, step

STEP_STOP = "services.stop"
STEP_GPU = "services.gpu-free"
STEP_RESTORE = "services.restore"
STEP_STATUS = "services.status"


class NodeStopped(BaseModel):
    """What ``services.stop`` stopped on a node for a deployment (the node's own record)."""

    deployment: str
    units: list[str]
    time: str


def record_path(dep: Deployment) -> str:
    return f"{NODE_STATE}/services/{dep.profile.name}.json"


def recorded(dep: Deployment, host: Host) -> list[str]:
    """The units ``services.stop`` stopped on the node for this deployment, in stop order
    (from the node: any controller restores them)."""
    text = read_node_file(host, record_path(dep))
    if text is None:
        return []
    try:
        return last_line(NodeStopped, text, f"{host.name}: {record_path(dep)}").units
    except OutsideError as e:
        raise HostError(str(e)) from None


def _record(dep: Deployment, host: Host, units: list[str]) -> None:
    rec = NodeStopped(deployment=dep.profile.name, units=units, time=labels.stamp(dep.wall()))
    write_node_file(host, record_path(dep), rec.model_dump_json() + "\n" if units else None)


def _merge(previous: list[str], new: list[str], order: list[str]) -> list[str]:
    """Union of two unit lists in the profile's stop order (unknown units keep their place)."""
    units = list(dict.fromkeys([*previous, *new]))
    rank = {u: i for i, u in enumerate(order)}
    return sorted(units, key=lambda u: (rank.get(u, len(order)), units.index(u)))


def gpu_holders(host: Host, procs: list[GpuProcess]) -> dict[int, labels.Container]:
    """{pid: the sparkdeploy engine container (of any deployment) it runs in} for the GPU's
    processes, from the containers' labels and ``docker top`` (host PIDs, as nvidia-smi's)."""
    r = host.run(docker(host, *labels.ps_args()), change=False)
    want = {p.pid for p in procs}
    held: dict[int, labels.Container] = {}
    for c in labels.parse_ps(r.stdout) if r.ok else []:
        if not c.running or set(held) == want:
            continue
        top = host.run(docker(host, "top", c.id, "-eo", "pid"), change=False)
        pids = {int(x) for x in top.stdout.split() if x.isdigit()} if top.ok else set()
        held.update({pid: c for pid in pids & want})
    return held


class Held(Stop):
    """Every process on the GPU is in a sparkdeploy engine container: waiting frees nothing."""

    def __init__(self, containers: list[labels.Container]):
        super().__init__("held by sparkdeploy's engine")
        self.containers = containers


def _say_held(ctx: StepContext, host: Host, e: Held) -> None:
    dep = ctx.dep
    cs = e.containers
    def one(c: labels.Container) -> str:
        since = f", since {c.started}" if c.started else ""
        return f"{c.name} (deployment {c.deployment}, engine {c.engine}{since})"

    details = {"containers": [c.name for c in cs], "deployments": sorted({c.deployment for c in cs})}
    if all(c.deployment == dep.profile.name for c in cs):
        ctx.ok("the GPU is held by this deployment's own engine: " + ", ".join(map(one, cs))
               + "; serve.up keeps it if it serves what the profile says, else replaces it "
               "(serve.down frees the GPU)", host.name, **details)
        return
    why = ("the GPU is held by sparkdeploy's engine of another deployment: "
           + ", ".join(map(one, cs)) + "; serve.down with that deployment's profile frees it")
    if dep.dry:
        ctx.would(f"fail: {why}", host.name, **details)
    else:
        ctx.failed(why, host.name, **details)


@step(STEP_GPU)
def gpu_free(ctx: StepContext, node: str | None = None) -> None:
    """Wait until no process is on each node's GPU (a dry run only looks once)."""
    for host in ctx.dep.select(node):
        _wait_gpu_free(ctx, host)


def _wait_gpu_free(ctx: StepContext, host: Host) -> None:
    dep = ctx.dep
    timeout = dep.profile.services.gpu_free_timeout_s
    would = f"wait up to {timeout:g}s for a free GPU"
    on_gpu: list[GpuProcess] = []

    looked: set[frozenset[int]] = set()

    def free() -> bool:
        procs, err = gpu_processes(host)
        if procs is None:
            raise Stop(err)
        on_gpu[:] = procs
        pids = frozenset(p.pid for p in procs)
        if pids and pids not in looked:  # who holds it: once for each set of processes
            looked.add(pids)
            held = gpu_holders(host, procs)
            if set(held) == pids:
                raise Held(list({c.name: c for c in held.values()}.values()))
        return not procs

    def tick(elapsed: float) -> None:
        ctx.progress(host.name, elapsed, timeout, "s", "on the GPU: " + ", ".join(map(str, on_gpu)))

    try:
        wait_for(free, deadline=0 if dep.dry else timeout, interval=dep.profile.services.gpu_poll_s,
                 what=f"a free GPU on {host.name}", clock=dep.clock, sleep=dep.sleep, tick=tick)
    except NodeUnreachable as e:
        if not dep.dry:
            raise
        ctx.would(f"{would} (unreachable: {e.why})", host.name)
    except Held as e:
        _say_held(ctx, host, e)
    except Stop as e:
        _not_free(ctx, host, f"{would} ({e})", str(e))
    except WaitTimeout:
        busy = ", ".join(map(str, on_gpu))
        _not_free(ctx, host, f"{would}; now on it: {busy}", f"GPU still busy after {timeout:g}s: {busy}",
                  processes=[p.__dict__ for p in on_gpu])
    else:
        ctx.ok("no process on the GPU", host.name)


def _not_free(ctx: StepContext, host: Host, would: str, why: str, **details: Any) -> None:
    """A wait that ended with the GPU not free: what it would do under ``--dry``, else the
    node's failure."""
    if ctx.dry:
        ctx.would(would, host.name, **details)
    else:
        ctx.failed(why, host.name, **details)


def _stop_node(ctx: StepContext, host: Host, units: list[str]) -> bool:
    """Stop the node's active units (recorded first); whether to go on to the GPU wait."""
    dep = ctx.dep
    try:
        states, err = probe_units(host, units)
    except NodeUnreachable as e:
        if not dep.dry:
            raise
        states, err = None, f"unreachable: {e.why}"  # a dry run still lists what would run
    if states is None:
        if not dep.dry:
            ctx.failed(err, host.name)
            return False
        for u in units:
            host.run(["systemctl", "stop", u], sudo=True)
        ctx.skipped(f"{err}; listed what would run", host.name)
        return True
    active = [u for u in units if states.get(u) == "active"]
    absent = [u for u in units if u not in states]
    before = recorded(dep, host)
    merged = _merge(before, active, units)
    if merged != before and not dep.dry:
        _record(dep, host, merged)
    stopped: list[str] = []
    for u in active:
        r = host.run(["systemctl", "stop", u], sudo=True)
        if not r.ok:
            ctx.failed(f"systemctl stop {u}: {r.one_line_error()}", host.name,
                       stopped=stopped, recorded=merged)
            return False
        stopped.append(u)
    note = f" ({len(absent)} absent: {', '.join(absent)})" if absent else ""
    if active and dep.dry:
        ctx.would(f"stop {', '.join(active)}{note}", host.name, would_stop=active, absent=absent)
    elif active:
        ctx.changed(f"stopped {', '.join(active)}{note}", host.name,
                    stopped=active, absent=absent, recorded=merged)
    else:
        ctx.ok(f"{len(units)} unit(s) already inactive or absent{note}", host.name,
               absent=absent, recorded=merged)
    return True


def units_now(dep: Deployment) -> dict[str, object]:
    """The head's units to stop and their state now (asks the head): unchanged since a finished
    stop means they are still stopped (the GPU is then busy with this deployment's own engine,
    not theirs)."""
    return flat({"units_now": unit_states(dep, dep.profile.head.name)})


@step(STEP_STOP, needs=("hosts.check", "model.precheck"), reuse=True,
      fingerprint=Fingerprint("services", also=head, asks=units_now))
def stop(ctx: StepContext, node: str | None = None) -> None:
    """Stop each node's configured units in order, then wait until its GPU is free."""
    dep = ctx.dep
    plan = dep.profile.services.stop
    hosts = dep.select(node) if node else [dep.host(n) for n in plan]
    if not hosts:
        ctx.ok("the profile names no services to stop")
        return

    def one(host: Host) -> None:
        units = plan.get(host.name, [])
        if not units:
            ctx.ok("no services configured for this node", host.name)
        elif not _stop_node(ctx, host, units):
            return
        ctx.call(STEP_GPU, node=host.name)

    ctx.each(hosts, one)


@step(STEP_RESTORE, needs=("serve.down",))
def restore(ctx: StepContext, node: str | None = None) -> None:
    """Start exactly the recorded units, in reverse stop order, then forget them."""
    dep = ctx.dep

    def one(host: Host) -> None:
        units = recorded(dep, host)
        if units:
            _restore_node(ctx, host, units)
        else:
            ctx.ok("nothing recorded to restore", host.name)

    ctx.each(dep.select(node), one)


def _restore_node(ctx: StepContext, host: Host, units: list[str]) -> Result:
    dep, name = ctx.dep, host.name
    states, err = probe_units(host, units)
    if states is None and not dep.dry:
        return ctx.failed(err, name, recorded=units)
    states = states or {}
    to_start = [u for u in reversed(units) if states.get(u) != "active"]
    started, problems = [], []
    for u in to_start:
        r = host.run(["systemctl", "start", u], sudo=True)
        if r.ok:
            started.append(u)
        else:
            problems.append(f"{u}: {r.one_line_error()}")
    if dep.dry:
        return ctx.skipped("would start " + (", ".join(to_start) or
                       "nothing (all active)"), name, would_start=to_start)
    after, err = probe_units(host, units)
    not_active = [u for u in units if (after or {}).get(u) != "active"]
    if problems or not_active:
        _record(dep, host, not_active or units)
        why = "; ".join(problems) or f"not active after start: {', '.join(not_active)}"
        return ctx.failed(why, name, started=started)
    _record(dep, host, [])
    if started:
        return ctx.changed(f"started {', '.join(started)}", name, started=started)
    return ctx.ok("recorded units already active", name)


@step(STEP_STATUS)
def status(ctx: StepContext, node: str | None = None) -> None:
    """Each node's configured and recorded units, and what is on its GPU."""
    dep = ctx.dep

    def one(host: Host) -> None:
        mine = recorded(dep, host)
        units = list(dict.fromkeys([*dep.profile.services.stop.get(host.name, []), *mine]))
        _status_node(ctx, host, units, mine)

    ctx.each(dep.select(node), one)


def _status_node(ctx: StepContext, host: Host, units: list[str], recorded: list[str]) -> Result:
    parts: list[str] = []
    details: dict[str, object] = {"recorded": recorded}
    if units:
        states, err = probe_units(host, units)
        if states is None:
            return ctx.failed(err, host.name)
        details["units"] = {u: states.get(u, "absent") for u in units}
        parts.append(", ".join(f"{u} {states.get(u, 'absent')}" for u in units))
    procs, err = gpu_processes(host)
    if procs is None:
        return ctx.failed(err, host.name, **details)
    details["gpu_processes"] = [p.__dict__ for p in procs]
    parts.append("GPU free" if not procs else "GPU: " + ", ".join(map(str, procs)))
    return ctx.ok("; ".join(parts), host.name, **details)
