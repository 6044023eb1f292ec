"""``serve.persist`` / ``serve.unpersist``: the deployment as systemd units on every node.

Each node gets ``sparkdeploy-<engine>.service`` running ``helpers/serve_unit.py`` (put under
``/var/lib/sparkdeploy-node/serve/`` with one JSON spec per engine), written from the same
container specs ``serve.up`` starts: the same ``docker run`` arguments, stage by stage. The
supervisors form a group over the fast link (see ``helpers/serve_unit.py``): workers before the
head, and when one node's engine container dies every node's is restarted together
(``Restart=on-failure``). Stopping a unit removes its node's containers.

``serve.persist`` hands the running deployment over to the units: it removes ``serve.up``'s
containers, starts the units (workers first) and waits until the endpoint serves again.
``serve.unpersist`` stops, disables and removes the units and their files; it touches no
other unit (``services.restore`` still brings back the head's original units).

An API key is not persisted: a unit that comes back at boot would need the key stored on the
node, and secrets are never written on a node. Persist without ``SPARKDEPLOY_API_KEY``.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from sparkdeploy import checks
from sparkdeploy import endpoint as ep
from sparkdeploy.config import Engine
from sparkdeploy.deployment import Deployment
from sparkdeploy.engines import EngineError, Launch, NodeFacts, launch
from sparkdeploy.engines.base import API_KEY_ENV, run_args
from sparkdeploy.hosts import Host
from sparkdeploy.nodeops import NodeUnreachable, docker
from sparkdeploy.packaged import helper
from sparkdeploy.results import Result, changed, failed, ok, skipped
from sparkdeploy.steps.registry import step
from sparkdeploy.steps.serve_containers import RAY_PROBE, ours, remove
from sparkdeploy.wait import WaitTimeout, wait_for

STEP_PERSIST = "serve.persist"
STEP_UNPERSIST = "serve.unpersist"
UNIT_DIR = "/etc/systemd/system"
NODE_DIR = "/var/lib/sparkdeploy-node/serve"
SUPERVISOR = "serve_unit.py"
PYTHON = "/usr/bin/python3"


def unit_name(engine: str) -> str:
    return f"sparkdeploy-{engine}.service"


class UnitValueError(ValueError):
    """A value that cannot go into a unit file (it would end its line or continue it)."""


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


def unit_text(dep: Deployment, engine: Engine, host: Host, roles: list[str]) -> str:
    spec = f"{NODE_DIR}/{engine.name}.json"
    sup = f"{NODE_DIR}/{SUPERVISOR}"
    return unit_file({
        "Unit": [
            ("Description", f"sparkdeploy {engine.name} ({', '.join(roles)}) of "
                            f"{dep.profile.name} on {host.name}"),
            ("Wants", "docker.service network-online.target"),
            ("After", "docker.service network-online.target"),
        ],
        "Service": [
            ("Type", "simple"),
            ("ExecStart", f"{PYTHON} {sup} run --spec {spec}"),
            ("ExecStop", f"{PYTHON} {sup} stop --spec {spec}"),
            ("Restart", "on-failure"),
            ("RestartSec", "10"),
            ("TimeoutStopSec", "120"),
        ],
        "Install": [("WantedBy", "multi-user.target")],
    })


def group_spec(dep: Deployment, lau: Launch, host: Host) -> dict[str, Any]:

    prof = dep.profile
    port = prof.serve.group_port
    head = prof.head
    node = prof.node(host.name)
    return {
        "docker": docker(host),
        "node": host.name,
        "role": "head" if node.role == "head" else "worker",
        "listen": [node.link.address, port],
        "head": [head.link.address, port],
        "workers": {n.name: [n.link.address, port] for n in prof.workers
                    if any(c.node == n.name for c in lau.containers)},
        "stages": [{"wait": s.wait,
                    "containers": [{"node": c.node, "name": c.name, "run": run_args(c)}
                                   for c in s.containers]} for s in lau.stages],
        "wait_addr": [head.link.address, lau.wait_port] if lau.wait_port else None,
        "ray_nodes": {n.link.address: n.gpus for n in prof.nodes},
        "ray_probe": RAY_PROBE,
        "ready_timeout_s": prof.serve.ready_timeout_s,
    }


def put_file(host: Host, path: str, content: str, mode: str = "0644") -> bool:
    """Write ``content`` at ``path`` on the node (atomically) unless it is already there;
    True when written."""
    want = hashlib.sha256(content.encode()).hexdigest()
    r = host.run(["sha256sum", "--", path], change=False)
    if r.ok and r.stdout.split()[:1] == [want]:
        return False
    script = ('mkdir -p -- "$(dirname -- "$1")" && printf %s "$2" | base64 -d > "$1.part" '
              '&& chmod "$3" "$1.part" && mv -f -- "$1.part" "$1"')
    encoded = base64.b64encode(content.encode()).decode()
    w = host.run(["sh", "-c", script, "sh", path, encoded, mode], sudo=True)
    if not w.ok:
        raise NodeUnreachable(host.name, f"cannot write {path}: {w.one_line_error()}")
    return True


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


def _engine(dep: Deployment, name: str | None) -> Engine | None:
    if name is None:
        rec = ep.recorded(dep.records)
        name = rec.engine if rec else None
    return next((e for e in dep.profile.engines if e.name == name), None)


def _wait_endpoint(dep: Deployment, lau: Launch) -> str:
    addr = ep.controller_address(dep.profile.node(lau.head), dep.profile.ssh.config)
    url = f"http://{addr}:{lau.port}"

    def serving() -> bool:
        return (ep.health(url) and lau.served_model in ep.models(url)
                and bool(ep.stream_chat(url, lau.served_model)))

    wait_for(serving, deadline=dep.profile.serve.ready_timeout_s, interval=dep.profile.serve.poll_s,
             what=f"{url} to serve under systemd", clock=dep.clock, sleep=dep.sleep,
             tick=lambda el: dep.events.progress(STEP_PERSIST, None, el, None, "s", "waiting"))
    return url


@step(STEP_PERSIST, needs=("serve.up", "bench.run"))
def persist(dep: Deployment, engine: str | None = None) -> list[Result]:
    """Install the deployment as systemd units on every node and hand it over to them."""
    if ep.api_key():
        return [dep.report(failed(STEP_PERSIST, f"{API_KEY_ENV} is set: a unit that comes back at "
                                  "boot would need the key stored on the node; not persisted"))]
    eng = _engine(dep, engine)
    if eng is None:
        return [dep.report(failed(STEP_PERSIST, "no engine to persist: serve.up first, or "
                                  "--engine NAME"))]
    from sparkdeploy.steps.serve_preflight import node_facts

    hosts = [dep.host(n.name) for n in dep.profile.nodes]
    facts = {}
    for h in hosts:
        got = node_facts(dep, h, [], [])
        facts[h.name] = NodeFacts(got["gid"]["index"], bool(got["rdma_devices"]))
    try:
        lau = launch(dep.profile, eng, facts)
    except EngineError as e:
        return [dep.report(failed(STEP_PERSIST, str(e)))]
    unit = unit_name(eng.name)
    results: list[Result] = []
    wrote: dict[str, bool] = {}
    supervisor = helper(SUPERVISOR).read_text()
    try:  # every unit file first: a value that cannot go into one writes none
        units = {h.name: unit_text(dep, eng, h, [c.role for c in lau.on(h.name)])
                 for h in hosts if lau.on(h.name)}
    except UnitValueError as e:
        return [dep.report(failed(STEP_PERSIST, str(e)))]
    for h in hosts:
        if not lau.on(h.name):
            continue
        roles = [c.role for c in lau.on(h.name)]
        if dep.dry:
            h.run(["systemctl", "enable", "--", unit], sudo=True)
            results.append(dep.report(skipped(STEP_PERSIST, f"would write {UNIT_DIR}/{unit} "
                                              f"({', '.join(roles)}) and enable it", h.name)))
            continue
        w1 = put_file(h, f"{NODE_DIR}/{SUPERVISOR}", supervisor, "0755")
        w2 = put_file(h, f"{NODE_DIR}/{eng.name}.json",
                      json.dumps(group_spec(dep, lau, h), indent=2, sort_keys=True) + "\n", "0600")
        w3 = put_file(h, f"{UNIT_DIR}/{unit}", units[h.name])
        wrote[h.name] = w1 or w2 or w3
        h.run(["systemctl", "daemon-reload"], sudo=True)
        r = h.run(["systemctl", "enable", "--", unit], sudo=True)
        if not r.ok:
            results.append(dep.report(failed(STEP_PERSIST, f"systemctl enable {unit}: "
                                             f"{r.one_line_error()}", h.name)))
    if dep.dry or any(r.failed for r in results):
        return results
    running = {h.name: active(h, [unit]) for h in hosts if lau.on(h.name)}
    if all(running.values()) and not any(wrote.values()):
        results.append(dep.report(ok(STEP_PERSIST, f"{unit} installed and active on every node")))
        return results
    # hand over: serve.up's containers go, the units start (workers first, then the head)
    for h in hosts:
        if running.get(h.name):
            h.run(["systemctl", "stop", "--", unit], sudo=True, timeout=180)
    remove(dep, hosts, eng.name)
    order = [h for h in hosts if h.name != lau.head] + [dep.host(lau.head)]
    for h in order:
        if not lau.on(h.name):
            continue
        r = h.run(["systemctl", "start", "--", unit], sudo=True, timeout=120)
        if not r.ok:
            results.append(dep.report(failed(STEP_PERSIST, f"systemctl start {unit}: "
                                             f"{r.one_line_error()}", h.name)))
            return results
        results.append(dep.report(changed(STEP_PERSIST, f"{unit} written, enabled and started "
                                          f"({', '.join(c.name for c in lau.on(h.name))})", h.name)))
    try:
        url = _wait_endpoint(dep, lau)
    except WaitTimeout as e:
        left = {h.name: [c["name"] for c in ours(h, dep.profile.name, eng.name)] for h in hosts}
        results.append(dep.report(failed(STEP_PERSIST, f"{e}; containers: {left}")))
        return results
    results.append(dep.report(ok(STEP_PERSIST, f"endpoint: {url} (under systemd)", endpoint=url,
                                 engine=eng.name)))
    return results


@step(STEP_UNPERSIST)
def unpersist(dep: Deployment) -> list[Result]:
    """Stop, disable and remove the deployment's units and their files on every node."""
    results: list[Result] = []
    for h in (dep.host(n.name) for n in dep.profile.nodes):
        try:
            units = installed(dep, h)
        except NodeUnreachable as e:
            results.append(dep.report(failed(STEP_UNPERSIST, f"unreachable: {e.why}", h.name)))
            continue
        if not units:
            results.append(dep.report(ok(STEP_UNPERSIST, "no sparkdeploy unit", h.name)))
            continue
        for u in units:
            h.run(["systemctl", "stop", "--", u], sudo=True, timeout=180)
            h.run(["systemctl", "disable", "--", u], sudo=True)
        files = [f"{UNIT_DIR}/{u}" for u in units]
        files += [f"{NODE_DIR}/{u.removeprefix('sparkdeploy-').removesuffix('.service')}.json"
                  for u in units]
        h.run(["rm", "-f", "--", *files], sudo=True)
        h.run(["systemctl", "daemon-reload"], sudo=True)
        if dep.dry:
            results.append(dep.report(skipped(STEP_UNPERSIST, f"would remove {', '.join(units)}",
                                              h.name)))
            continue
        left = installed(dep, h)
        if left:
            results.append(dep.report(failed(STEP_UNPERSIST, f"still there: {', '.join(left)}",
                                             h.name)))
        else:
            results.append(dep.report(changed(STEP_UNPERSIST, f"stopped, disabled and removed "
                                              f"{', '.join(units)}", h.name)))
    return results
