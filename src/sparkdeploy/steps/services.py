"""Free the GPUs: stop what holds them (systemd units), wait until no process is on the GPU,
and put the stopped units back later.

Before stopping, the controller records which units were active (``services/<profile>.json``
in the state dir); ``stop`` only ever adds to that record, ``restore`` starts exactly the
recorded units in reverse order and then forgets them.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparkdeploy.deployment import Deployment
from sparkdeploy.hosts import Host
from sparkdeploy.results import Result, changed, failed, ok, skipped

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


def _record_name(dep: Deployment) -> str:
    return f"services/{dep.profile.name}.json"


def read_record(dep: Deployment) -> dict[str, list[str]]:
    return dep.state.read_json(_record_name(dep), {}) or {}


def _write_record(dep: Deployment, record: dict[str, list[str]]) -> None:
    record = {k: v for k, v in record.items() if v}
    if record:
        dep.state.write_json(_record_name(dep), record)
    else:
        dep.state.remove(_record_name(dep))


def _merge(previous: list[str], new: list[str], order: list[str]) -> list[str]:
    """Union of two unit lists in the profile's stop order (unknown units keep their place)."""
    units = list(dict.fromkeys([*previous, *new]))
    rank = {u: i for i, u in enumerate(order)}
    return sorted(units, key=lambda u: (rank.get(u, len(order)), units.index(u)))


def probe_units(host: Host, units: list[str]) -> tuple[dict[str, str] | None, str]:
    """{unit: active state} for the units the node knows, or (None, error)."""
    r = host.run(list_units_argv(units), change=False)
    if r.unreachable:
        return None, f"unreachable: {r.one_line_error()}"
    if r.exit_code != 0:
        return None, f"systemctl list-units failed: {r.one_line_error()}"
    return parse_list_units(r.stdout), ""


def gpu_processes(host: Host) -> tuple[list[GpuProcess] | None, str]:
    r = host.run(COMPUTE_APPS, change=False)
    if r.unreachable:
        return None, f"unreachable: {r.one_line_error()}"
    if r.exit_code != 0:
        return None, f"nvidia-smi failed: {r.one_line_error()}"
    return parse_compute_apps(r.stdout), ""


def wait_gpu_free(dep: Deployment, host: Host) -> Result:
    timeout = dep.profile.services.gpu_free_timeout_s
    poll = dep.profile.services.gpu_poll_s
    deadline = dep.clock() + timeout
    while True:
        procs, err = gpu_processes(host)
        if procs is None:
            if dep.dry:
                return skipped(STEP_GPU, f"would wait up to {timeout:g}s for a free GPU ({err})",
                               host.name)
            return failed(STEP_GPU, err, host.name)
        if not procs:
            return ok(STEP_GPU, "no process on the GPU", host.name)
        if dep.dry:
            return skipped(STEP_GPU, f"would wait up to {timeout:g}s for a free GPU; now on it: "
                           + ", ".join(map(str, procs)), host.name,
                           processes=[p.__dict__ for p in procs])
        if dep.clock() >= deadline:
            return failed(STEP_GPU, f"GPU still busy after {timeout:g}s: "
                          + ", ".join(map(str, procs)), host.name,
                          processes=[p.__dict__ for p in procs])
        dep.sleep(poll)


def _stop_node(dep: Deployment, host: Host, units: list[str]) -> list[Result]:
    states, err = probe_units(host, units)
    if states is None:
        if not dep.dry:
            return [failed(STEP_STOP, err, host.name)]
        for u in units:
            host.run(["systemctl", "stop", u], sudo=True)
        return [skipped(STEP_STOP, f"{err}; listed what would run", host.name),
                wait_gpu_free(dep, host)]
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
            return [failed(STEP_STOP, f"systemctl stop {u}: {r.one_line_error()}", host.name,
                           stopped=stopped, recorded=merged)]
        stopped.append(u)
    note = f" ({len(absent)} absent: {', '.join(absent)})" if absent else ""
    if active and dep.dry:
        res = skipped(STEP_STOP, f"would stop {', '.join(active)}{note}", host.name,
                      would_stop=active, absent=absent)
    elif active:
        res = changed(STEP_STOP, f"stopped {', '.join(active)}{note}", host.name,
                      stopped=active, absent=absent, recorded=merged)
    else:
        res = ok(STEP_STOP, f"{len(units)} unit(s) already inactive or absent{note}", host.name,
                 absent=absent, recorded=merged)
    return [res, wait_gpu_free(dep, host)]


def stop(dep: Deployment, node: str | None = None) -> list[Result]:
    """Stop each node's configured units in order, then wait until its GPU is free."""
    plan = dep.profile.services.stop
    if node:
        hosts = dep.select(node)
    else:
        hosts = [dep.host(n) for n in plan]
    if not hosts:
        return [ok(STEP_STOP, "the profile names no services to stop")]
    results: list[Result] = []
    for host in hosts:
        units = plan.get(host.name, [])
        if not units:
            results.append(ok(STEP_STOP, "no services configured for this node", host.name))
            results.append(wait_gpu_free(dep, host))
            continue
        results.extend(_stop_node(dep, host, units))
    return results


def restore(dep: Deployment, node: str | None = None) -> list[Result]:
    """Start exactly the recorded units, in reverse stop order, then forget them."""
    record = read_record(dep)
    names = [h.name for h in dep.select(node)] if node else list(record)
    if not any(record.get(n) for n in names):
        return [ok(STEP_RESTORE, "nothing recorded to restore")]
    results: list[Result] = []
    for name in names:
        units = record.get(name, [])
        if not units:
            results.append(ok(STEP_RESTORE, "nothing recorded for this node", name))
            continue
        host = dep.host(name)
        states, err = probe_units(host, units)
        if states is None and not dep.dry:
            results.append(failed(STEP_RESTORE, err, name, recorded=units))
            continue
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
            results.append(skipped(STEP_RESTORE, "would start " + (", ".join(to_start) or
                                   "nothing (all active)"), name, would_start=to_start))
            continue
        after, err = probe_units(host, units)
        not_active = [u for u in units if (after or {}).get(u) != "active"]
        if problems or not_active:
            record[name] = not_active or units
            _write_record(dep, record)
            why = "; ".join(problems) or f"not active after start: {', '.join(not_active)}"
            results.append(failed(STEP_RESTORE, why, name, started=started))
            continue
        record.pop(name, None)
        _write_record(dep, record)
        if started:
            results.append(changed(STEP_RESTORE, f"started {', '.join(started)}", name,
                                   started=started))
        else:
            results.append(ok(STEP_RESTORE, "recorded units already active", name))
    return results


def status(dep: Deployment, node: str | None = None) -> list[Result]:
    """Each node's configured and recorded units, and what is on its GPU."""
    record = read_record(dep)
    results: list[Result] = []
    for host in dep.select(node):
        units = list(dict.fromkeys([*dep.profile.services.stop.get(host.name, []),
                                    *record.get(host.name, [])]))
        parts: list[str] = []
        details: dict[str, object] = {"recorded": record.get(host.name, [])}
        if units:
            states, err = probe_units(host, units)
            if states is None:
                results.append(failed(STEP_STATUS, err, host.name))
                continue
            details["units"] = {u: states.get(u, "absent") for u in units}
            parts.append(", ".join(f"{u} {states.get(u, 'absent')}" for u in units))
        procs, err = gpu_processes(host)
        if procs is None:
            results.append(failed(STEP_STATUS, err, host.name, **details))
            continue
        details["gpu_processes"] = [p.__dict__ for p in procs]
        parts.append("GPU free" if not procs else "GPU: " + ", ".join(map(str, procs)))
        results.append(ok(STEP_STATUS, "; ".join(parts), host.name, **details))
    return results
