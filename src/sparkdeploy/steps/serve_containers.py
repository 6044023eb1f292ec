"""This deployment's containers on the nodes (found by label, removed), its persisted units
(found, stopped), and the Ray probe: shared by ``serve`` and ``serve_persist``."""

from __future__ import annotations

from sparkdeploy.deployment import Deployment
from sparkdeploy.engines.base import LABEL_DEPLOYMENT, LABEL_ENGINE
from sparkdeploy.hosts import Host
from sparkdeploy.nodeops import docker

UNIT_DIR = "/etc/systemd/system"

RAY_PROBE = (
    "import json, ray\n"
    "ray.init(address='auto', logging_level='ERROR', log_to_driver=False)\n"
    "print(json.dumps([{'ip': n['NodeManagerAddress'], 'gpus': n['Resources'].get('GPU', 0)}\n"
    "                  for n in ray.nodes() if n['Alive']]))\n"
)



def ours(host: Host, deployment: str, engine: str | None = None) -> list[dict[str, str]]:
    """This deployment's containers on a node: [{name, state, engine, role}]."""
    args = ["ps", "-a", "--filter", f"label={LABEL_DEPLOYMENT}={deployment}"]
    if engine:
        args += ["--filter", f"label={LABEL_ENGINE}={engine}"]
    fmt = '{{.Names}}|{{.State}}|{{.Label "sparkdeploy.engine"}}|{{.Label "sparkdeploy.role"}}'
    r = host.run(docker(host, *args, "--format", fmt), change=False)
    out = []
    for line in r.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4:
            out.append(dict(zip(("name", "state", "engine", "role"), parts, strict=True)))
    return out


def remove(dep: Deployment, hosts: list[Host], engine: str | None = None) -> dict[str, list[str]]:
    """Remove this deployment's containers (of one engine, or all) on the nodes; {node: names}."""
    gone: dict[str, list[str]] = {}
    for h in hosts:
        names = [c["name"] for c in ours(h, dep.profile.name, engine)]
        if names:
            h.run(docker(h, "rm", "--force", "--volumes", *names), timeout=120)
            gone[h.name] = names
    return gone


def unit_name(engine: str) -> str:
    return f"sparkdeploy-{engine}.service"


def installed(dep: Deployment, host: Host) -> list[str]:
    """This deployment's unit files on the node (one per engine of the profile)."""
    paths = [f"{UNIT_DIR}/{unit_name(e.name)}" for e in dep.profile.engines]
    r = host.run(["sh", "-c", 'for f; do [ -e "$f" ] && echo "$f"; done; true', "sh", *paths],
                 change=False)
    return [p.rsplit("/", 1)[1] for p in r.stdout.split()]


def active(host: Host, units: list[str]) -> list[str]:
    if not units:
        return []
    r = host.run(["systemctl", "is-active", "--", *units], change=False)
    states = r.stdout.split()
    return [u for u, s in zip(units, states, strict=False) if s in ("active", "activating")]


def stop_units(dep: Deployment, host: Host) -> list[str]:
    """Stop this deployment's active units on the node (their ExecStop removes the
    containers); the names stopped."""
    units = active(host, installed(dep, host))
    for u in units:
        host.run(["systemctl", "stop", "--", u], sudo=True, timeout=180)
    return units
