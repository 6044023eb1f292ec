"""Free the GPUs: stop what holds them (systemd units), wait until no process is on the GPU,
and put the stopped units back later.

Before stopping, the controller records which units were active (``services/<profile>.json``
in the state dir); ``stop`` only ever adds to that record, ``restore`` starts exactly the
recorded units in reverse order and then forgets them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from sparkdeploy.deployment import Deployment
from sparkdeploy.events import Progress
from sparkdeploy.hosts import Host, NodeUnreachable
from sparkdeploy.records import StoppedServices
from sparkdeploy.results import Result, changed, failed, ok, skipped
from sparkdeploy.steps.registry import step
from sparkdeploy.wait import Stop, WaitTimeout, wait_for

STEP_STOP = "services.stop"
STEP_GPU = "services.gpu-free"
STEP_RESTORE = "services.restore"
STEP_STATUS = "services.status"

COMPUTE_APPS = [
    "nvidia-smi",
    "--query-compute-apps=pid,process_name,used_memory",
    "--format=csv,noheader",
]


def list_units_argv(units: list[str]) -> list[str]:
    return ["systemctl", "list-units", "--all", "--plain", "--no-legend", "--no-pager",
            "--type=service", "--", *units]


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    memory: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.name})"


def parse_list_units(text: str) -> dict[str, str]:
    """``UNIT LOAD ACTIVE SUB DESCRIPTION`` lines -> {unit: active state}.

    A unit that systemd reports as ``not-found`` counts as absent (left out)."""
    states: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        unit, load, active = parts[0].lstrip("●*"), parts[1], parts[2]
        if load == "not-found" or not unit:
            continue
        states[unit] = active
    return states


def parse_compute_apps(text: str) -> list[GpuProcess]:
    procs = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.lower().startswith("pid") or line.startswith("No running"):
            continue
        fields = [f.strip() for f in line.split(",")]
        try:
            pid = int(fields[0])
        except ValueError:
            continue
        name = fields[1] if len(fields) > 1 else "?"
        mem = fields[2] if len(fields) > 2 else "[N/A]"
        procs.append(GpuProcess(pid, name, mem))
    return procs


def read_record(dep: Deployment) -> dict[str, list[str]]:
    """{node: units stopped by services.stop, in stop order} (``StoppedServices``)."""
    rec = dep.records.read(StoppedServices, dep.profile.name)
    return dict(rec.units) if rec else {}


def _write_record(dep: Deployment, record: dict[str, list[str]]) -> None:
    record = {k: v for k, v in record.items() if v}
    if record:
        dep.records.write(StoppedServices(units=record), dep.profile.name)
    else:
        dep.records.remove(StoppedServices, dep.profile.name)


def _merge(previous: list[str], new: list[str], order: list[str]) -> list[str]:
    """Union of two unit lists in the profile's stop order (unknown units keep their place)."""
    units = list(dict.fromkeys([*previous, *new]))
    rank = {u: i for i, u in enumerate(order)}
    return sorted(units, key=lambda u: (rank.get(u, len(order)), units.index(u)))


def probe_units(host: Host, units: list[str]) -> tuple[dict[str, str] | None, str]:
    """{unit: active state} for the units the node knows, or (None, error).

    Raises ``NodeUnreachable`` when the node cannot be reached."""
    r = host.run(list_units_argv(units), change=False)
    if r.exit_code != 0:
        return None, f"systemctl list-units failed: {r.one_line_error()}"
    return parse_list_units(r.stdout), ""


def gpu_processes(host: Host) -> tuple[list[GpuProcess] | None, str]:
    r = host.run(COMPUTE_APPS, change=False)
    if r.exit_code != 0:
        return None, f"nvidia-smi failed: {r.one_line_error()}"
    return parse_compute_apps(r.stdout), ""


def wait_gpu_free(dep: Deployment, host: Host) -> Result:
    """Wait until no process is on the node's GPU (a dry run only looks once)."""
    timeout = dep.profile.services.gpu_free_timeout_s
    would = f"would wait up to {timeout:g}s for a free GPU"
    on_gpu: list[GpuProcess] = []

    def free() -> bool:
        procs, err = gpu_processes(host)
        if procs is None:
            raise Stop(err)
        on_gpu[:] = procs
        return not procs

    def tick(elapsed: float) -> None:
        dep.events.emit(Progress(STEP_GPU, host.name, elapsed, timeout, "s",
                                 "on the GPU: " + ", ".join(map(str, on_gpu))))

    try:
        wait_for(free, deadline=0 if dep.dry else timeout, interval=dep.profile.services.gpu_poll_s,
                 what=f"a free GPU on {host.name}", clock=dep.clock, sleep=dep.sleep, tick=tick)
    except NodeUnreachable as e:
        return skipped(STEP_GPU, f"{would} (unreachable: {e.why})", host.name) if dep.dry \
            else e.as_result(STEP_GPU)
    except Stop as e:
        return skipped(STEP_GPU, f"{would} ({e})", host.name) if dep.dry \
            else failed(STEP_GPU, str(e), host.name)
    except WaitTimeout:
        busy = ", ".join(map(str, on_gpu))
        details = {"processes": [p.__dict__ for p in on_gpu]}
        if dep.dry:
            return skipped(STEP_GPU, f"{would}; now on it: {busy}", host.name, **details)
        return failed(STEP_GPU, f"GPU still busy after {timeout:g}s: {busy}", host.name, **details)
    return ok(STEP_GPU, "no process on the GPU", host.name)


def _stop_node(dep: Deployment, host: Host, units: list[str]) -> Iterator[Result]:
    try:
        states, err = probe_units(host, units)
    except NodeUnreachable as e:
        states, err = None, f"unreachable: {e.why}"
        if not dep.dry:
            yield e.as_result(STEP_STOP)
            return
    if states is None:
        if not dep.dry:
            yield failed(STEP_STOP, err, host.name)
            return
        for u in units:
            host.run(["systemctl", "stop", u], sudo=True)
        yield skipped(STEP_STOP, f"{err}; listed what would run", host.name)
        yield wait_gpu_free(dep, host)
        return
    active = [u for u in units if states.get(u) == "active"]
    absent = [u for u in units if u not in states]
    record = read_record(dep)
    merged = _merge(record.get(host.name, []), active, units)
    if merged != record.get(host.name, []) and not dep.dry:
        record[host.name] = merged
        _write_record(dep, record)
    stopped: list[str] = []
    for u in active:
        r = host.run(["systemctl", "stop", u], sudo=True)
        if not r.ok:
            yield failed(STEP_STOP, f"systemctl stop {u}: {r.one_line_error()}", host.name,
                         stopped=stopped, recorded=merged)
            return
        stopped.append(u)
    note = f" ({len(absent)} absent: {', '.join(absent)})" if absent else ""
    if active and dep.dry:
        yield skipped(STEP_STOP, f"would stop {', '.join(active)}{note}", host.name,
                      would_stop=active, absent=absent)
    elif active:
        yield changed(STEP_STOP, f"stopped {', '.join(active)}{note}", host.name,
                      stopped=active, absent=absent, recorded=merged)
    else:
        yield ok(STEP_STOP, f"{len(units)} unit(s) already inactive or absent{note}", host.name,
                 absent=absent, recorded=merged)
    yield wait_gpu_free(dep, host)


@step(STEP_STOP, needs=("hosts.check",))
def stop(dep: Deployment, node: str | None = None) -> list[Result]:
    """Stop each node's configured units in order, then wait until its GPU is free."""
    return dep.report_all(_stop(dep, node))


def _stop(dep: Deployment, node: str | None) -> Iterator[Result]:
    plan = dep.profile.services.stop
    hosts = dep.select(node) if node else [dep.host(n) for n in plan]
    if not hosts:
        yield ok(STEP_STOP, "the profile names no services to stop")
        return
    for host in hosts:
        units = plan.get(host.name, [])
        if not units:
            yield ok(STEP_STOP, "no services configured for this node", host.name)
            yield wait_gpu_free(dep, host)
            continue
        yield from _stop_node(dep, host, units)


@step(STEP_RESTORE, needs=("serve.down",))
def restore(dep: Deployment, node: str | None = None) -> list[Result]:
    """Start exactly the recorded units, in reverse stop order, then forget them."""
    record = read_record(dep)
    names = [h.name for h in dep.select(node)] if node else list(record)
    if not any(record.get(n) for n in names):
        return [dep.report(ok(STEP_RESTORE, "nothing recorded to restore"))]
    results: list[Result] = []
    for name in names:
        units = record.get(name, [])
        if not units:
            results.append(dep.report(ok(STEP_RESTORE, "nothing recorded for this node", name)))
            continue
        try:
            res = _restore_node(dep, dep.host(name), units, record)
        except NodeUnreachable as e:
            res = e.as_result(STEP_RESTORE, recorded=units)
        results.append(dep.report(res))
    return results


def _restore_node(dep: Deployment, host: Host, units: list[str],
                  record: dict[str, list[str]]) -> Result:
    name = host.name
    states, err = probe_units(host, units)
    if states is None and not dep.dry:
        return failed(STEP_RESTORE, err, name, recorded=units)
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
        return skipped(STEP_RESTORE, "would start " + (", ".join(to_start) or
                       "nothing (all active)"), name, would_start=to_start)
    after, err = probe_units(host, units)
    not_active = [u for u in units if (after or {}).get(u) != "active"]
    if problems or not_active:
        record[name] = not_active or units
        _write_record(dep, record)
        why = "; ".join(problems) or f"not active after start: {', '.join(not_active)}"
        return failed(STEP_RESTORE, why, name, started=started)
    record.pop(name, None)
    _write_record(dep, record)
    if started:
        return changed(STEP_RESTORE, f"started {', '.join(started)}", name, started=started)
    return ok(STEP_RESTORE, "recorded units already active", name)


@step(STEP_STATUS)
def status(dep: Deployment, node: str | None = None) -> list[Result]:
    """Each node's configured and recorded units, and what is on its GPU."""
    record = read_record(dep)
    results: list[Result] = []
    for host in dep.select(node):
        units = list(dict.fromkeys([*dep.profile.services.stop.get(host.name, []),
                                    *record.get(host.name, [])]))
        try:
            res = _status_node(host, units, record.get(host.name, []))
        except NodeUnreachable as e:
            res = e.as_result(STEP_STATUS)
        results.append(dep.report(res))
    return results


def _status_node(host: Host, units: list[str], recorded: list[str]) -> Result:
    parts: list[str] = []
    details: dict[str, object] = {"recorded": recorded}
    if units:
        states, err = probe_units(host, units)
        if states is None:
            return failed(STEP_STATUS, err, host.name)
        details["units"] = {u: states.get(u, "absent") for u in units}
        parts.append(", ".join(f"{u} {states.get(u, 'absent')}" for u in units))
    procs, err = gpu_processes(host)
    if procs is None:
        return failed(STEP_STATUS, err, host.name, **details)
    details["gpu_processes"] = [p.__dict__ for p in procs]
    parts.append("GPU free" if not procs else "GPU: " + ", ".join(map(str, procs)))
    return ok(STEP_STATUS, "; ".join(parts), host.name, **details)
