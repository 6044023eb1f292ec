"""A node's systemd units and the processes on its GPU, as probes read them: shared by the
``services.*`` steps, ``serve.up``'s preflight and ``services.stop``'s fingerprint; and the one
way a unit file is written (``unit_file``: the persisted engines', the metrics')."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparkdeploy.core import checks
from sparkdeploy.core.errors import StepFailed
from sparkdeploy.node.hosts import Host, NodeUnreachable

if TYPE_CHECKING:
    from sparkdeploy.node.deployment import Deployment

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



def probe_units(host: Host, units: list[str]) -> tuple[dict[str, str] | None, str]:
    """{unit: active state} for the units the node knows, or (None, error).

    Raises ``NodeUnreachable`` when the node cannot be reached."""
    r = host.run(list_units_argv(units), change=False)
    if r.exit_code != 0:
        return None, f"systemctl list-units failed: {r.one_line_error()}"
    return parse_list_units(r.stdout), ""


def unit_states(dep: Deployment, node: str) -> dict[str, str] | None:
    """{unit: active state} of the units the profile stops on ``node`` (None: unreachable or
    systemctl failed), one look per node per run (``dep.facts``)."""
    units = dep.profile.services.stop.get(node) or []

    def gather(host: Host) -> dict[str, str] | None:
        try:
            return probe_units(host, units)[0] if units else {}
        except NodeUnreachable:
            return None
    return dep.facts.get(node, "units", gather)


def gpu_processes(host: Host) -> tuple[list[GpuProcess] | None, str]:
    r = host.run(COMPUTE_APPS, change=False)
    if r.exit_code != 0:
        return None, f"nvidia-smi failed: {r.one_line_error()}"
    return parse_compute_apps(r.stdout), ""


class UnitValueError(StepFailed, ValueError):
    """A value that cannot go into a unit file (it would end its line or continue it)."""


def service_unit(what: str, deployment: str, node: str, start: list[str],
                 stop: list[str] | None = None) -> str:
    """A helper's unit (the metrics', the gateway's): one long-running program, restarted on a
    failure, started with the node (``WantedBy=multi-user.target``) once enabled."""
    service = [("Type", "simple"), ("ExecStart", shlex.join(start))]
    if stop:
        service.append(("ExecStop", shlex.join(stop)))
    service += [("Restart", "on-failure"), ("RestartSec", "5"), ("TimeoutStopSec", "30")]
    return unit_file({
        "Unit": [("Description", f"sparkdeploy {what} of {deployment} on {node}"),
                 ("Wants", "docker.service network-online.target"),
                 ("After", "docker.service network-online.target")],
        "Service": service,
        "Install": [("WantedBy", "multi-user.target")],
    })


def unit_file(sections: dict[str, list[tuple[str, str]]]) -> str:
    """A systemd unit file from ``{section: [(key, value), ...]}``: every value is one line.

    A value holding a control character (a newline would start a directive of its own) or
    ending in a backslash (which continues the line) is refused whatever the schema allowed;
    ``%`` is doubled (systemd would expand it as a specifier)."""
    out = []
    for section, items in sections.items():
        out.append(f"[{section}]")
        for key, value in items:
            if checks.control_char(key + value) is not None or value.endswith("\\"):
                raise UnitValueError(f"{key}={value!r} cannot go into a unit file")
            out.append(f"{key}={value.replace('%', '%%')}")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def listening(host: Host) -> dict[int, str]:
    """{port: who} of the node's listening TCP sockets (``ss``; who: the process when told)."""
    r = host.run(["ss", "-Hltnp"], change=False)
    out: dict[int, str] = {}
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        port = parts[3].rsplit(":", 1)[-1]
        if port.isdigit():
            who = next((p for p in parts[5:] if p.startswith("users:")), "")
            out[int(port)] = who.split('"')[1] if who.count('"') >= 2 else "another program"
    return out
