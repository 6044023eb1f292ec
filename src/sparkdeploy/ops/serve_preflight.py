"""``serve.up``'s preflight, a part of that step: before it starts anything, every node
reachable, its fast link up with the profile's address, the RoCE GID index readable, the weights
there, the GPU free, the engine's ports free, the head reaching each worker on the fast link,
and one image ID everywhere.

Each problem is one failed result of ``serve.up`` with one line (``details["part"]`` is
``preflight``); any problem means nothing is started. The facts the engines need (GID index,
RDMA devices) come back for the container specs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from sparkdeploy.core.outcomes import Result
from sparkdeploy.engines import EngineError, Launch, NodeFacts, launch
from sparkdeploy.engines import flags as engine_flags
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host, HostError
from sparkdeploy.node.nodeops import NodeUnreachable, inspect_image, run_helper
from sparkdeploy.ops import Ctx, model, model_select
from sparkdeploy.ops import image as image_ops
from sparkdeploy.ops.units import gpu_processes
from sparkdeploy.profile.config import Engine

PART = "preflight"
HELPER = "serve_node.py"


@dataclass
class Preflight:
    ctx: Ctx
    """The step the preflight is part of: each problem is one of its failed results."""
    facts: dict[str, NodeFacts] = field(default_factory=dict)
    ship_to: list[str] = field(default_factory=list)
    """Nodes without the engine's image (``image.ship`` puts it there from the head)."""
    image_id: str | None = None
    image_digest: str | None = None
    """The digest image.probe decided on for the image the engine serves (the candidate's, or
    the base's of the layer built over it)."""
    start: int = 0
    """Where the preflight's results begin among the step's."""

    def __post_init__(self) -> None:
        self.start = len(self.ctx.results)

    @property
    def problems(self) -> list[Result]:
        return [r for r in self.ctx.results[self.start:] if r.failed]

    def fail(self, node: str | None, why: str) -> None:
        self.ctx.failed(why, node, part=PART)


def facts_args(dep: Deployment, node_name: str, ports: list[int], peers: list[str]) -> list[str]:
    node = dep.profile.node(node_name)
    argv = ["facts", "--iface", node.link.interface, "--addr", node.link.address]
    for h in node.link.hcas:
        argv += ["--hca", h]
    for p in ports:
        argv += ["--port", str(p)]
    argv += ["--model", dep.profile.model.path]
    for peer in peers:
        argv += ["--peer", peer]
    return argv


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Iface(_Loose):
    exists: bool
    up: bool = False
    addrs: list[str] = []


class _Gid(_Loose):
    index: int | None = None
    why: str | None = None


class _Port(_Loose):
    free: bool
    owner: str | None = None


class _Found(_Loose):
    present: bool = False
    why: str | None = None


class _Peer(_Loose):
    reachable: bool = False
    why: str | None = None


class FactsAnswer(_Loose):
    """What the node helper's ``facts`` says, as the checks read it."""

    iface: _Iface
    gid: _Gid
    ports: dict[int, _Port] = {}
    model: _Found = _Found()
    peers: dict[str, _Peer] = {}
    rdma_devices: Any = None


def node_facts(dep: Deployment, host: Host, ports: list[int], peers: list[str]) -> dict[str, Any]:
    host.run(["true"], change=False)  # raises NodeUnreachable first, before staging
    return run_helper(host, HELPER, facts_args(dep, host.name, ports, peers), result=FactsAnswer,
                      where=f"{host.name}: {HELPER} facts", timeout=60).model_dump()


def _check_verified(dep: Deployment, host: Host, meta: dict[str, Any], pf: Preflight) -> None:
    """Every file of the model verified on the node, by ``model.verify``'s records (quick: no
    hashing here; a file changed since it was verified counts as not verified)."""
    try:
        state = model.node_state(pf.ctx, host, model.stage_for(host, meta), quick=True)
    except model.ModelError as e:
        pf.fail(host.name, str(e).removeprefix(f"{host.name}: "))
        return
    bad = state["missing"] + list(state["differ"])
    if bad:
        pf.fail(host.name, f"weights not verified in {dep.profile.model.path}: "
                f"{model.describe_bad(state)} (model.verify, model.sync)")
    elif state["unchecked"]:
        pf.fail(host.name, f"weights not verified in {dep.profile.model.path}: "
                f"{len(state['unchecked'])} file(s) never verified (model.verify --nodes {host.name})")


def model_metadata(dep: Deployment) -> tuple[dict[str, Any] | None, str]:
    """The files the engine loads, as the head records them (decided from the hub or the cache
    when it records none); (None, why) when none answers: then the weights are checked for
    presence only."""
    try:
        meta, _ = model_select.selected(dep)
        return meta, ""
    except model.ModelError as e:
        return None, str(e)


def _check_node(dep: Deployment, engine: Engine, host: Host, got: dict[str, Any],
                pf: Preflight, meta: dict[str, Any] | None) -> None:
    node = dep.profile.node(host.name)
    link = node.link
    iface = got["iface"]
    if not iface["exists"]:
        pf.fail(host.name, f"fast link {link.interface} does not exist")
    elif not iface["up"]:
        pf.fail(host.name, f"fast link {link.interface} is down")
    elif link.address not in iface["addrs"]:
        has = ", ".join(iface["addrs"]) or "none"
        pf.fail(host.name, f"fast link {link.interface} lacks the profile's address {link.address} "
                f"(has: {has})")
    gid = got["gid"]
    if link.hcas and gid["index"] is None and "NCCL_IB_GID_INDEX" not in engine.env:
        pf.fail(host.name, f"no RoCE v2 GID for {link.address} on {', '.join(link.hcas)} "
                f"({gid['why'] or 'none found'}); set engines[].env.NCCL_IB_GID_INDEX to override")
    for port, st in sorted(got["ports"].items(), key=lambda kv: int(kv[0])):
        if not st["free"]:
            owner = f" by {st['owner']}" if st.get("owner") else ""
            pf.fail(host.name, f"port {port} is already in use{owner}")
    model = got.get("model") or {}
    if not model.get("present"):
        pf.fail(host.name, f"weights missing in {dep.profile.model.path}: {model.get('why')}")
    elif meta is not None:
        _check_verified(dep, host, meta, pf)
    for addr, res in got["peers"].items():
        if not res.get("reachable"):
            peer = next((n.name for n in dep.profile.nodes if n.link.address == addr), addr)
            pf.fail(host.name, f"cannot reach {peer} at {addr} on the fast link ({res.get('why')})")
    pf.facts[host.name] = NodeFacts(gid_index=gid["index"], rdma_devices=bool(got["rdma_devices"]))


def _check_gpu(host: Host, pf: Preflight) -> None:
    procs, err = gpu_processes(host)
    if procs is None:
        pf.fail(host.name, err)
    elif procs:
        pf.fail(host.name, "GPU busy: " + ", ".join(map(str, procs)))


def _check_images(dep: Deployment, ref: str, hosts: list[Host], pf: Preflight) -> None:
    head = dep.profile.head.name
    ids: dict[str, str | None] = {}
    # the head first: a pin by digest resolves there only, the workers hold it by that ID
    for h in sorted(hosts, key=lambda h: h.name != head):
        want = ids.get(head) if image_ops.pinned(ref) and h.name != head else ref
        info = inspect_image(h, want) if want else None
        ids[h.name] = info.get("Id") if info else None
    if ids.get(head) is None:
        pf.fail(head, f"no image {ref} on the head (image.build or a pull first)")
        return
    pf.image_id = ids[head]
    # the head's image is the one image.probe judged: a worker without it, or with another
    # image under the same name (an older build), gets the head's shipped (image.ship sends
    # only the layers it lacks)
    pf.ship_to = [n for n, i in ids.items() if i != ids[head]]


def check_pins(ctx: Ctx) -> bool:
    """Before anything stops: every candidate's tag still names the image image.probe decided
    on (``ops.image.moved``); each one that moved is one failed result. True when none did."""
    try:
        lines = image_ops.moved(ctx.dep)
    except HostError as e:
        lines = [str(e)]
    for line in lines:
        ctx.failed(line, ctx.dep.profile.head.name, part=PART)
    return not lines


def engine_version(dep: Deployment, engine: Engine) -> str | None:
    """The engine version ``image.probe`` found in the image this engine serves from (None
    before it has probed that image)."""
    rec = image_ops.decision(dep)
    chosen = rec.engines.get(engine.name) if rec else None
    if rec is None or chosen is None:
        return None
    for cand in rec.candidates:
        if cand.image == chosen.image and cand.engine == engine.software:
            version = (cand.model_extra or {}).get("engine_version")
            return str(version) if version else None
    return None


def _check_flags(dep: Deployment, engine: Engine, lau: Launch, pf: Preflight) -> str:
    """Every container's engine command line against the engine version's own parser
    (``sparkdeploy.engines.flags``); a refused flag is a problem on that node. Returns what was
    checked, for the ok line."""
    version = engine_version(dep, engine)
    if version is None:
        return (f"flags not checked: no image.probe record names the {engine.software} "
                f"version of {engine.image}")
    for c in lau.containers:
        if c.engine_args is None:
            continue
        try:
            engine_flags.check_args(engine.software, version, list(c.engine_args))
        except engine_flags.FlagError as e:
            pf.fail(c.node, f"{engine.name}: {e}")
            return "flags refused"
    return f"flags checked against {engine.software} {engine_flags.manifest_version(version)}"


def check_flags(ctx: Ctx, engines: list[Engine], api_key: bool) -> bool:
    """Before anything of a serving deployment is removed (``serve.up`` replacing what the
    nodes run): every engine's command lines against its probed version's flags, as the
    preflight checks them (a typo must not cost the running model); each refusal one failed
    result. True when none was refused."""
    pf = Preflight(ctx)
    for engine in engines:
        try:
            draft = launch(ctx.dep.profile, engine, {}, api_key)
        except EngineError:
            continue  # the engine's own attempt says it, one line
        _check_flags(ctx.dep, engine, draft, pf)
    return not pf.problems


def check(ctx: Ctx, engine: Engine, lau: Launch) -> Preflight:
    """Check every node the launch uses, reporting as part of ``ctx``'s step; nothing is
    changed on any node."""
    dep = ctx.dep
    pf = Preflight(ctx)
    names = list(dict.fromkeys(c.node for c in lau.containers))
    hosts = [dep.host(n) for n in names]
    head = dep.profile.head.name
    peers = [dep.profile.node(n).link.address for n in names if n != head]

    def one(h: Host) -> dict[str, Any] | str:
        ports = sorted({p for c in lau.on(h.name) for p in c.ports})
        try:
            return node_facts(dep, h, ports, peers if h.name == head else [])
        except NodeUnreachable:
            raise  # one failed result for the node, from the fan-out
        except HostError as e:
            return str(e).removeprefix(f"{h.name}: ")

    gathered = ctx.each(hosts, one, parallel=True)
    meta, why = model_metadata(dep)
    for h, got in zip(hosts, gathered, strict=True):
        if isinstance(got, str):
            pf.fail(h.name, got)
        elif got is not None:
            _check_node(dep, engine, h, got, pf, meta)
            if dep.profile.placement is None:  # a placed model shares the GPU: serve.add's fit
                _check_gpu(h, pf)
    if None not in gathered:
        _check_images(dep, engine.image, hosts, pf)
    pf.image_digest = image_ops.engine_digest(dep, engine.name)
    flags = _check_flags(dep, engine, lau, pf)
    if not pf.problems:
        ship = f"; image to ship to {', '.join(pf.ship_to)}" if pf.ship_to else ""
        weights = "weights verified" if meta is not None else f"weights present (not verified: {why})"
        ctx.ok(f"{len(hosts)} node(s) ready for {engine.name}: {weights}; {flags}{ship}",
               part=PART)
    return pf
