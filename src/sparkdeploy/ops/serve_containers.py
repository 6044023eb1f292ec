"""This deployment's containers on the nodes (found by their labels, checked against the
profile, removed), its persisted units (found, stopped), and the Ray probe: shared by
``serve`` and ``serve_persist``."""

from __future__ import annotations

from dataclasses import dataclass

from sparkdeploy.core import labels
from sparkdeploy.engines import launch
from sparkdeploy.node import endpoint as ep
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host
from sparkdeploy.node.nodeops import NODE_STATE, docker, inspect_image
from sparkdeploy.profile.config import Engine

UNIT_DIR = "/etc/systemd/system"
SERVE_DIR = f"{NODE_STATE}/serve"
"""The persisted units' files on a node: the supervisor, each engine's spec, key and records."""

RAY_PROBE = (
    "import json, ray\n"
    "ray.init(address='auto', logging_level='ERROR', log_to_driver=False)\n"
    "print(json.dumps([{'ip': n['NodeManagerAddress'], 'gpus': n['Resources'].get('GPU', 0)}\n"
    "                  for n in ray.nodes() if n['Alive']]))\n"
)



def ours(host: Host, deployment: str | None, engine: str | None = None) -> list[labels.Container]:
    """This deployment's engine containers on a node (of one engine, or all; of every deployment
    when ``deployment`` is None), by their labels."""
    r = host.run(docker(host, *labels.ps_args(deployment, engine)), change=False)
    return labels.parse_ps(r.stdout) if r.ok else []


@dataclass(frozen=True)
class Serving:
    """What the nodes run of one engine of this deployment, read from its containers' labels
    and checked against the profile."""

    engine: str
    url: str | None = None
    """The endpoint, when every container runs what the profile says and it serves."""
    why: str = ""
    """Why not (empty when nothing of the engine is on the nodes)."""
    containers: tuple[labels.Container, ...] = ()

    @property
    def since(self) -> str:
        return min((c.started for c in self.containers if c.started), default="")


def listed(dep: Deployment, engine: Engine) -> dict[str, list[labels.Container]]:
    """The engine's containers on every node of the profile, {node: containers}: one listing
    that ``serving`` and ``serve.persist``'s checks share. Raises NodeUnreachable."""
    prof = dep.profile
    return {n.name: ours(dep.host(n.name), prof.name, engine.name) for n in prof.nodes}


def serving(dep: Deployment, engine: Engine,
            on_nodes: dict[str, list[labels.Container]] | None = None) -> Serving:
    """Whether the nodes serve ``engine`` as the profile says: every container of its launch
    running on its node, with the profile's fingerprint and the image ID the head holds under
    the engine's tag now, and the endpoint (the head, the labelled port) answering with the
    model. ``on_nodes``: the containers as ``listed`` read them (else read here). Raises
    NodeUnreachable."""
    prof = dep.profile
    want = launch(prof, engine, {}).containers
    have: dict[tuple[str, str], labels.Container] = {}
    for node in dict.fromkeys(c.node for c in want):
        got = on_nodes[node] if on_nodes is not None else ours(dep.host(node), prof.name, engine.name)
        have.update({(node, c.name): c for c in got})
    found = tuple(have.values())
    if not have:
        return Serving(engine.name)
    down = [f"{c.node}: {c.name}" for c in want
            if not (have.get((c.node, c.name)) and have[(c.node, c.name)].running)]
    if down:
        return Serving(engine.name, why=f"{engine.name} is incomplete on the nodes (not running: "
                       f"{', '.join(down)})", containers=found)
    fp = labels.engine_fingerprint(prof, engine)
    keys = sorted({k for c in found for k in c.differs(fp)})
    if keys:
        more = f" and {len(keys) - 6} more" if len(keys) > 6 else ""
        return Serving(engine.name, why=f"{engine.name} on the nodes differs from the profile: "
                       f"{', '.join(keys[:6])}{more}", containers=found)
    head = dep.host(prof.head.name)
    info = inspect_image(head, engine.image)
    now, ran = (info or {}).get("Id"), {c.image_id for c in found}
    if now and ran != {now}:
        return Serving(engine.name, why=f"{engine.name} runs image {', '.join(sorted(ran))[:19]}, "
                       f"the head's {engine.image} is now {now[:19]}", containers=found)
    port = next((c.port for c in found if c.port), engine.port)
    url = ep.engine_url(head, port)
    if ep.health(url) and prof.model.repo in ep.models(url):
        return Serving(engine.name, url=url, containers=found)
    return Serving(engine.name, why=f"{engine.name} runs but {url} does not serve "
                   f"{prof.model.repo}", containers=found)


@dataclass(frozen=True)
class Placed:
    """One engine of some deployment on the profile's nodes, as its containers' labels say."""

    deployment: str
    engine: str
    recipe: str
    """The recipe its model came from ('' when its containers do not say)."""
    nodes: tuple[str, ...]
    """The nodes it has containers on, in the profile's order."""
    url: str | None
    """Its own API address: the node of the container that carries the port, and that port."""
    containers: tuple[labels.Container, ...]

    @property
    def running(self) -> bool:
        return all(c.running for c in self.containers)


def placed(dep: Deployment, on_nodes: dict[str, list[labels.Container]]) -> list[Placed]:
    """What ``on_nodes`` ({node: every sparkdeploy engine container on it}) places where: one
    entry per (deployment, engine), in the order first seen along the profile's nodes."""
    groups: dict[tuple[str, str], list[tuple[str, labels.Container]]] = {}
    for n in dep.profile.nodes:
        for c in on_nodes.get(n.name) or []:
            groups.setdefault((c.deployment, c.engine), []).append((n.name, c))
    out = []
    for (deployment, engine), found in groups.items():
        head = next(((node, c) for node, c in found if c.port), None)
        url = ep.engine_url(dep.host(head[0]), head[1].port) if head and head[1].port else None
        out.append(Placed(deployment, engine, next((c.recipe for _, c in found if c.recipe), ""),
                          tuple(dict.fromkeys(node for node, _ in found)), url,
                          tuple(c for _, c in found)))
    return out


def remove(dep: Deployment, hosts: list[Host], engine: str | None = None) -> dict[str, list[str]]:
    """Remove this deployment's containers (of one engine, or all) on the nodes; {node: names}."""
    gone: dict[str, list[str]] = {}
    for h in hosts:
        names = [c.name for c in ours(h, dep.profile.name, engine)]
        if names:
            h.run(docker(h, "rm", "--force", "--volumes", *names), timeout=120)
            gone[h.name] = names
    return gone


def unit_name(engine: str) -> str:
    return f"sparkdeploy-{engine}.service"


def unit_files(host: Host, units: list[str]) -> list[str]:
    """Those of ``units`` whose file is on the node (``UNIT_DIR``), in one remote call."""
    paths = [f"{UNIT_DIR}/{u}" for u in units]
    r = host.run(["sh", "-c", 'for f; do [ -e "$f" ] && echo "$f"; done; true', "sh", *paths],
                 change=False)
    return [p.rsplit("/", 1)[1] for p in r.stdout.split()]


def installed(dep: Deployment, host: Host) -> list[str]:
    """This deployment's unit files on the node (one per engine of the profile)."""
    return unit_files(host, [unit_name(e.name) for e in dep.profile.engines])


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
