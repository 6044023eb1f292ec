"""``serve.persist`` / ``serve.unpersist``: the deployment as systemd units on every node.

Each node gets ``sparkdeploy-<engine>.service`` running ``helpers/serve_unit.py`` (put under
``/var/lib/sparkdeploy-node/serve/`` with one JSON spec per engine), written from the same
container specs ``serve.up`` starts: the same ``docker run`` arguments, stage by stage. The
supervisors form a group over the fast link (see ``helpers/serve_unit.py``): workers before the
head, and when one node's engine container dies every node's is restarted together
(``Restart=on-failure``), and a wedged rank or a canary that brings no token is found and
restarted the same way, recorded on the head (``serve_watchdog``). Stopping a unit removes its
node's containers.

``serve.persist`` hands the running deployment over to the units. When it serves exactly as
the profile says (``serving``: every container running with the profile's fingerprint and the
head's image, the endpoint answering with the model), the units adopt it: each node gets a
one-shot ``<engine>.adopt`` naming its containers by ID, the units start (workers first) and
form their group around the running containers, nothing restarts and the endpoint never stops
serving. Otherwise it removes ``serve.up``'s containers (or stops the previous units), starts
the units and waits until the endpoint serves again. The hand-over is a transaction: the
files a node had are kept beside the new ones until the end, and when a unit does not start
or the endpoint does not serve, the units that started are stopped (their containers go, the
adopted ones too), the files and the enablement are put back, and what ran before runs again
(the previous units, or ``serve.up``'s containers).
``serve.unpersist`` stops, disables and removes the units and their files; it touches no
other unit (``services.restore`` still brings back the head's original units).

An API key is not persisted: a unit that comes back at boot would need the key stored on the
node, and secrets are never written on a node. Persist without ``SPARKDEPLOY_API_KEY``, and
without secrets in the engine's ``env`` (they are refused the same way). The
one secret on the nodes is the supervisors' own group key (``<engine>.key``, mode 0600, made
here and sent over stdin), with which they authenticate each other on the fast link.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from sparkdeploy.core import labels
from sparkdeploy.core.errors import StepFailed
from sparkdeploy.core.fingerprint import Fingerprint
from sparkdeploy.core.packaged import helper
from sparkdeploy.core.wait import WaitTimeout, wait_for
from sparkdeploy.engines import Launch
from sparkdeploy.engines.base import API_KEY_ENV, profile_secrets, run_args
from sparkdeploy.node import endpoint as ep
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host, HostError
from sparkdeploy.node.nodeops import PROTOCOL, docker
from sparkdeploy.ops.serve import (
    Run,
    bring_up,
    drop_previous,
    engine_of,
    file_sum,
    put_file,
    restore_files,
    running_launch,
)
from sparkdeploy.ops.serve_containers import (
    RAY_PROBE,
    SERVE_DIR,
    UNIT_DIR,
    active,
    installed,
    listed,
    ours,
    remove,
    serving,
    unit_name,
)
from sparkdeploy.ops.serve_watch import EngineFailed, Watch, describe, policy, read_restarts
from sparkdeploy.ops.units import unit_file
from sparkdeploy.profile.config import Engine
from sparkdeploy.steps.registry import StepContext, step

STEP_PERSIST = "serve.persist"
STEP_UNPERSIST = "serve.unpersist"
NODE_DIR = SERVE_DIR
SUPERVISOR = "serve_unit.py"
WATCHDOG = "serve_watchdog.py"
"""The watchdog's decisions, beside the supervisor (it imports them)."""
PYTHON = "/usr/bin/python3"


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
        "stages": [{"wait": s.wait, "joined": s.joined,
                    "containers": [{"node": c.node, "name": c.name, "run": run_args(c)}
                                   for c in s.containers]} for s in lau.stages],
        "wait_addr": [head.link.address, lau.wait_port] if lau.wait_port else None,
        "ray_nodes": {n.link.address: n.gpus for n in prof.nodes},
        "ray_probe": RAY_PROBE,
        "ready_timeout_s": prof.serve.ready_timeout_s,
        "key": key_path(lau.engine),
        "watch": policy(prof.serve).as_dict(),
        "canary": {"port": lau.port, "model": lau.served_model},
        "engine": lau.engine.name,
        "unit": unit_name(lau.engine.name),
        "node_dir": NODE_DIR,
        "nodes": sorted({c.node for c in lau.containers}),
        "started_labels": {"at": labels.STARTED, "by": labels.STARTED_BY,
                           "by_value": unit_name(lau.engine.name)},
    }


def group_key(eng: Engine, hosts: list[Host]) -> str | None:
    """None when every node holds one and the same group key already; else a new key, for all
    (the supervisors authenticate each other with it)."""
    sums = {file_sum(h, key_path(eng)) for h in hosts}
    return None if len(sums) == 1 and None not in sums else secrets.token_hex(32)


def key_path(eng: Engine) -> str:
    return f"{NODE_DIR}/{eng.name}.key"


@dataclass(eq=False)
class Handover:
    """One node's side of a hand-over: what it had before, what was done to it."""

    host: Host
    enabled: bool
    active: bool
    written: list[str] = field(default_factory=list)
    started: bool = False
    adopting: bool = False
    """This node's one-shot adoption file was written (a rollback removes what is left of it)."""


def _enabled(host: Host, unit: str) -> bool:
    return host.run(["systemctl", "is-enabled", "--", unit], change=False).stdout.strip() == "enabled"


class GaveUp(StepFailed):
    """The head's unit recorded that it gave up on the group (its restart budget spent)."""


def _wait_endpoint(ctx: StepContext, lau: Launch, engine: str, seen: int) -> str:
    """The endpoint once it serves under systemd; WaitTimeout past the readiness deadline,
    GaveUp as soon as the head's unit records that it gave up (a restart record after the
    ``seen`` ones there before the hand-over): it would not try again."""
    dep = ctx.dep
    head = dep.host(lau.head)
    url = ep.engine_url(head, lau.port)

    def serving() -> bool:
        if (ep.health(url) and lau.served_model in ep.models(url)
                and bool(ep.stream_chat(url, lau.served_model))):
            return True
        gave_up = [r for r in read_restarts(head, engine)[seen:] if r.get("outcome") == "gave-up"]
        if gave_up:
            raise GaveUp(describe(gave_up[-1]))
        return False

    wait_for(serving, deadline=dep.profile.serve.ready_timeout_s, interval=dep.profile.serve.poll_s,
             what=f"{url} to serve under systemd", clock=dep.clock, sleep=dep.sleep,
             tick=lambda el: ctx.progress(None, el, None, "s", "waiting"))
    return url


def _install(dep: Deployment, eng: Engine, lau: Launch, h: Host, text: str,
             key: str | None, enable: bool = True) -> Handover:
    """The unit's files on one node (the versions they replace kept), enabled (``enable``);
    raises HandoverFailed when enabling fails (the node's files then are as before)."""
    unit = unit_name(eng.name)
    ho = Handover(h, _enabled(h, unit), bool(active(h, [unit])))
    files = {f"{NODE_DIR}/{SUPERVISOR}": (helper(SUPERVISOR).read_text(), "0755"),
             f"{NODE_DIR}/{WATCHDOG}": (helper(WATCHDOG).read_text(), "0644"),
             f"{NODE_DIR}/{PROTOCOL}": (helper(PROTOCOL).read_text(), "0644"),  # the watchdog's toolkit
             f"{NODE_DIR}/{eng.name}.json":
                 (json.dumps(group_spec(dep, lau, h), indent=2, sort_keys=True) + "\n", "0600"),
             f"{UNIT_DIR}/{unit}": (text, "0644")}
    if key is not None:
        files[key_path(eng)] = (key + "\n", "0600")
    for path, (content, mode) in files.items():
        if put_file(h, path, content, mode):
            ho.written.append(path)
    h.run(["systemctl", "daemon-reload"], sudo=True)
    if not enable:
        return ho
    r = h.run(["systemctl", "enable", "--", unit], sudo=True)
    if not r.ok:
        raise HandoverFailed(f"{h.name}: systemctl enable {unit}: {r.one_line_error()}", [ho])
    return ho


class HandoverFailed(StepFailed):
    def __init__(self, why: str, nodes: list[Handover]):
        super().__init__(why)
        self.why, self.nodes = why, nodes


def adopt_file(eng: Engine) -> str:
    return f"{NODE_DIR}/{eng.name}.adopt"


def adoptable(dep: Deployment, eng: Engine, lau: Launch,
              have: dict[str, list[labels.Container]]) -> dict[str, dict[str, str]]:
    """{node: {container: ID}} of what the units can adopt: every container of ``lau`` running
    on its node and the engine serving as the profile says (``serving``); {} otherwise."""
    if serving(dep, eng, have).url is None:
        return {}
    out: dict[str, dict[str, str]] = {}
    for c in lau.containers:
        got = [x for x in have.get(c.node, []) if x.name == c.name and x.running]
        if not got:
            return {}
        out.setdefault(c.node, {})[c.name] = got[0].id
    return out


def hand_over(ctx: StepContext, eng: Engine, lau: Launch, nodes: list[Handover],
              adopt: dict[str, dict[str, str]]) -> tuple[dict[str, str], str]:
    """The units start (workers first, then the head) and the endpoint serves: around the
    running containers when ``adopt`` names them (each node's adoption file written first),
    else once serve.up's containers (or the units' previous version) are gone. What started on
    each node, in order, and the endpoint (for the step to report); HandoverFailed at the first
    that does not."""
    dep = ctx.dep
    unit = unit_name(eng.name)
    hosts = [n.host for n in nodes]
    seen = len(read_restarts(dep.host(lau.head), eng.name))
    for n in nodes:
        if n.active:
            n.host.run(["systemctl", "stop", "--", unit], sudo=True, timeout=180)
    if adopt:
        for n in nodes:
            n.adopting = True
            n.host.put_file(adopt_file(eng), "".join(
                f"{name} {cid}\n" for name, cid in adopt.get(n.host.name, {}).items()), mode="0600")
    else:
        remove(dep, hosts, eng.name)
    started: dict[str, str] = {}
    for n in sorted(nodes, key=lambda n: n.host.name == lau.head):
        n.started = True  # a unit whose start failed may still be activating: it is stopped too
        r = n.host.run(["systemctl", "start", "--", unit], sudo=True, timeout=120)
        if not r.ok:
            raise HandoverFailed(f"{n.host.name}: systemctl start {unit}: {r.one_line_error()}",
                                 nodes)
        names = ", ".join(c.name for c in lau.on(n.host.name))
        how = f"; it adopted {names}, kept running" if adopt else f" ({names})"
        started[n.host.name] = f"{unit} written, enabled and started{how}"
    try:
        url = _wait_endpoint(ctx, lau, eng.name, seen)
    except GaveUp as e:
        raise HandoverFailed(f"the head's unit {e}", nodes) from None
    except WaitTimeout as e:
        left = {h.name: [c.name for c in ours(h, dep.profile.name, eng.name)] for h in hosts}
        raise HandoverFailed(f"{e}; containers: {left}", nodes) from None
    return started, url


def roll_back(ctx: StepContext, eng: Engine, lau: Launch, nodes: list[Handover],
              containers_before: bool) -> str:
    """The new units stopped (their containers go), their files back as they were, enabled as
    they were; then what ran before runs again: the previous units (workers first), or
    serve.up's containers. What is back, in words."""
    dep = ctx.dep
    unit = unit_name(eng.name)
    began = any(n.started for n in nodes)  # else what ran is still running, untouched
    for n in reversed(nodes):
        if n.started:
            n.host.run(["systemctl", "stop", "--", unit], sudo=True, timeout=180)
    if began:
        remove(dep, [n.host for n in nodes], eng.name)
    problems = []
    for n in nodes:
        if n.adopting:  # not read by a unit that never ran
            n.host.run(["rm", "-f", "--", adopt_file(eng)], sudo=True)
        if n.written and not restore_files(n.host, n.written):
            problems.append(f"{n.host.name}: the previous unit files could not be restored")
        n.host.run(["systemctl", "daemon-reload"], sudo=True)
        if not n.enabled:
            n.host.run(["systemctl", "disable", "--", unit], sudo=True)
    if not began:
        back = "the running deployment was not touched"
    elif any(n.active for n in nodes):
        for n in sorted(nodes, key=lambda n: n.host.name == lau.head):
            if n.active:
                r = n.host.run(["systemctl", "start", "--", unit], sudo=True, timeout=120)
                if not r.ok:
                    problems.append(f"{n.host.name}: systemctl start {unit}: {r.one_line_error()}")
        back = f"the previous {unit}"
    elif containers_before:
        back = f"serve.up's {eng.name} containers"
        try:
            bring_up(dep, lau, Run(dep), Watch(ctx, dep.profile.serve.stall_s,
                                               dep.profile.serve.poll_s))
        except EngineFailed as e:
            problems.append(f"{back}: {e}")
    else:
        back = "nothing ran before"
    return f"rollback failed: {'; '.join(problems)}" if problems else f"rolled back: {back}"


def serving_other(dep: Deployment, eng: Engine,
                  have: dict[str, list[labels.Container]]) -> str | None:
    """Why the units would not run what serves (None: they would): the engine's running
    containers (``have``, by node) run something else than the profile says (another recipe's
    model, another image), and persisting would hand the nodes over to what the profile says."""
    fp = labels.engine_fingerprint(dep.profile, eng)
    for n in dep.profile.nodes:
        for c in have.get(n.name, []):
            keys = c.differs(fp) if c.running else []
            if keys:
                said = f" (its containers say recipe {c.recipe})" if c.recipe else ""
                return (f"{eng.name} on {n.name} serves something else than the profile says "
                        f"({', '.join(keys[:3])}){said}: persisting would replace it; pass "
                        "--recipe R for the recipe serving, or serve.up first")
    return None


@step(STEP_PERSIST, needs=("serve.up", "bench.run"), fingerprint=Fingerprint("engines", "nodes"))
def persist(ctx: StepContext, engine: str | None = None, idle: bool = False) -> None:
    """Install the deployment as systemd units on every node and hand it over to them: all
    units start and the endpoint serves, or the previous deployment is back. ``idle`` (a model
    on demand): the units installed only, neither started nor enabled."""
    dep = ctx.dep
    if ep.api_key():
        ctx.failed(f"{API_KEY_ENV} is set: a unit that comes back at boot would need the key "
                   "stored on the node; not persisted")
        return
    eng = engine_of(dep, engine)
    if eng is None:
        ctx.failed("no engine to persist: serve.up first, or --engine NAME")
        return
    have = listed(dep, eng)
    other = serving_other(dep, eng, have)
    if other:
        ctx.failed(other)
        return
    lau = running_launch(dep, eng)  # EngineError: the step's failure
    kept = sorted({k for c in lau.containers for k in profile_secrets(c)})
    if kept:
        ctx.failed(f"engines[{eng.name}].env: {', '.join(kept)} would have to be stored on the "
                   "nodes for a unit that comes back at boot (secrets are not); not persisted")
        return
    unit = unit_name(eng.name)
    hosts = [dep.host(n.name) for n in dep.profile.nodes if lau.on(n.name)]
    if idle:
        _install_idle(ctx, eng, lau, hosts)
        return
    if dep.dry:
        for h in hosts:
            h.run(["systemctl", "enable", "--", unit], sudo=True)
            ctx.would(f"write {UNIT_DIR}/{unit} ({', '.join(c.role for c in lau.on(h.name))}) "
                      "and enable it", h.name)
        return
    # every unit file first: a value that cannot go into one (UnitValueError) writes none
    texts = {h.name: unit_text(dep, eng, h, [c.role for c in lau.on(h.name)]) for h in hosts}
    containers_before = any(c.running for h in hosts for c in have.get(h.name, []))
    nodes: list[Handover] = []
    try:
        key = group_key(eng, hosts)
        for h in hosts:
            nodes.append(_install(dep, eng, lau, h, texts[h.name], key))
        if all(n.active for n in nodes) and not any(n.written for n in nodes):
            ctx.ok(f"{unit} installed and active on every node")
            return
        adopt = {} if any(n.active for n in nodes) else adoptable(dep, eng, lau, have)
        started, url = hand_over(ctx, eng, lau, nodes, adopt)
    except (HandoverFailed, HostError) as e:  # a node lost or a write refused mid-way: the rest rolls back
        nodes += [n for n in getattr(e, "nodes", []) if n not in nodes]
        why = e.why if isinstance(e, HandoverFailed) else str(e)
        raise StepFailed(f"{why}; {roll_back(ctx, eng, lau, nodes, containers_before)}") from None
    for ho in nodes:
        if ho.written:
            drop_previous(ho.host, ho.written)
    for name, why in started.items():
        ctx.changed(why, name)
    ctx.ok(f"endpoint: {url} (under systemd)", endpoint=url, engine=eng.name)


def _install_idle(ctx: StepContext, eng: Engine, lau: Launch, hosts: list[Host]) -> None:
    """The units' files written, not started, not enabled (whatever starts them later runs what
    they say then); a node that refuses a write puts back what it had."""
    dep = ctx.dep
    unit = unit_name(eng.name)
    if dep.dry:
        for h in hosts:
            ctx.would(f"write {UNIT_DIR}/{unit}, not started (on demand)", h.name)
        return
    texts = {h.name: unit_text(dep, eng, h, [c.role for c in lau.on(h.name)]) for h in hosts}
    nodes: list[Handover] = []
    try:
        key = group_key(eng, hosts)
        for h in hosts:
            nodes.append(_install(dep, eng, lau, h, texts[h.name], key, enable=False))
    except HostError as e:
        for n in nodes:
            if n.written:
                restore_files(n.host, n.written)
        raise StepFailed(f"{e}; the unit files were put back") from None
    for n in nodes:
        if n.written:
            drop_previous(n.host, n.written)
            ctx.changed(f"{unit} written, not started: on demand" +
                        (" (it runs now: the new files at its next start)" if n.active else ""),
                        n.host.name)
        else:
            ctx.ok(f"{unit} installed, {'loaded' if n.active else 'not loaded'}: on demand",
                   n.host.name)


@step(STEP_UNPERSIST)
def unpersist(ctx: StepContext) -> None:
    """Stop, disable and remove the deployment's units and their files on every node."""
    dep = ctx.dep
    ctx.each([dep.host(n.name) for n in dep.profile.nodes], lambda h: _unpersist_node(ctx, h))


def _unpersist_node(ctx: StepContext, h: Host) -> None:
    dep = ctx.dep
    units = installed(dep, h)
    if not units:
        ctx.ok("no sparkdeploy unit", h.name)
        return
    for u in units:
        h.run(["systemctl", "stop", "--", u], sudo=True, timeout=180)
        h.run(["systemctl", "disable", "--", u], sudo=True)
    files = [f"{UNIT_DIR}/{u}" for u in units]
    files += [f"{NODE_DIR}/{u.removeprefix('sparkdeploy-').removesuffix('.service')}{ext}"
              for u in units for ext in (".json", ".key")]
    h.run(["rm", "-f", "--", *files], sudo=True)
    h.run(["systemctl", "daemon-reload"], sudo=True)
    if dep.dry:
        ctx.would(f"remove {', '.join(units)}", h.name)
        return
    left = installed(dep, h)
    if left:
        ctx.failed(f"still there: {', '.join(left)}", h.name)
    else:
        ctx.changed(f"stopped, disabled and removed {', '.join(units)}", h.name)
