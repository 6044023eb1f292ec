"""Several models on one cluster (``serve.add`` / ``serve.remove``): where a recipe's model goes,
what the models already there hold, and the deployment a placed model runs as.

A placed model is a deployment of its own beside the profile's, named ``<profile>.<recipe>``: the
profile with the recipe's model part on the chosen nodes only (``config.load_placed``: the first
of them its head, the engines' layout filled for their GPUs), its engines renamed
``<recipe>-<engine>`` (so its containers, persisted units and the supervisors' specs never meet
another model's), every port of its engines moved by an offset no other model on the cluster
uses, and the memory fraction its engines may take set in their args (vLLM's
``--gpu-memory-utilization`` and SGLang's ``--mem-fraction-static`` are per instance: vLLM's
``gpu_memory_utilization`` help says so). Its containers carry that placement as a label
(``labels.PLACEMENT``), so any controller, a fresh clone included, derives the same deployment
from the nodes again.

The fit (``choose``): each node's room is the smaller of what it reports usable now
(``MemAvailable`` on a GB10: what every engine and the owner's own services hold already counts
as used) and its total less the OS's share less what the placed models claim there (their
fraction of the total: an engine still loading has not taken its share yet). The recipe's model
is sized by the fit calculator (its config.json, weights, context, the layout the recipe states
for that many nodes) on the fewest nodes that hold it (one node before two, the roomiest first),
or on the nodes given; its engines get the fraction of the node that its estimate needs.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path

from sparkdeploy import engines
from sparkdeploy.core import labels
from sparkdeploy.core.outside import OutsideError, parsed
from sparkdeploy.model import estimate as est
from sparkdeploy.model import fit
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host
from sparkdeploy.ops.serve_containers import SERVE_DIR
from sparkdeploy.profile import recipes as rcp
from sparkdeploy.profile.config import Engine, Placement, Profile, ProfileError, load_placed

OS_SHARE = 0.05
"""The share of a node's total no placement counts on (the OS, the page cache it needs): the
same 5 % ``model.precheck`` leaves the OS of a unified-memory node."""
MAX_OFFSET = 1000


class PlacementError(ProfileError):
    """A placement that cannot be derived (a name too long, a port past 65535)."""


def deployment_name(base: str, recipe: str) -> str:
    return f"{base}.{recipe}"


def engine_name(recipe: str, engine: str) -> str:
    """``<recipe>-<engine>`` in the characters an engine name allows (at most 63)."""
    slug = re.sub(r"[^a-z0-9-]+", "-", recipe.lower()).strip("-")
    name = f"{slug}-{engine}"
    if len(name) > 63:
        raise PlacementError(f"recipe {recipe}: the engine name {name!r} is longer than 63 "
                             "characters (a shorter recipe name)")
    return name


def _moved(port: int, offset: int, what: str) -> int:
    if port + offset > 65535:
        raise PlacementError(f"{what} {port} + the placement's offset {offset} is past 65535")
    return port + offset


def with_fraction(e: Engine, fraction: float | None) -> list[str]:
    """The engine's args with the placement's memory fraction (the recipe's own, when it names
    one, is kept)."""
    args = list(e.args)
    if fraction is None or fit.memory_fraction(args) is not None:
        return args
    return [*args, engines.kind(e.kind).memory_fraction_flag, f"{fraction:.2f}"]


def derive(path: str | Path, base: Profile, pl: Placement) -> Profile:
    """The deployment profile of the model ``pl`` places beside ``base`` (read from the same
    profile file, the recipe looked up where ``base`` looks)."""
    p = load_placed(path, pl.recipe, list(pl.nodes), tuple(base.recipes))
    renamed = {e.name: engine_name(pl.recipe, e.name) for e in p.engines}
    engines = [e.model_copy(update={
        "name": renamed[e.name], "port": _moved(e.port, pl.offset, "port"),
        "dist_port": None if e.dist_port is None else _moved(e.dist_port, pl.offset, "dist_port"),
        "args": with_fraction(e, pl.fraction)}) for e in p.engines]
    reserve = {renamed.get(k, k): v for k, v in p.fit.engines.items()}
    return p.model_copy(update={
        "name": deployment_name(base.name, pl.recipe), "engines": engines,
        "serve": p.serve.model_copy(update={
            "group_port": _moved(p.serve.group_port, pl.offset, "serve.group_port")}),
        "fit": p.fit.model_copy(update={"engines": reserve}),
        "metrics": p.metrics.model_copy(update={"enabled": False}),
        "placement": pl, "endpoint": None})


def deployment(base: Deployment, pl: Placement) -> Deployment:
    """``base``'s deployment for the model ``pl`` places: the same state dir, event stream and
    clocks, a ``Host`` per node of the placement."""
    prof = derive(base.profile_path, base.profile, pl)
    hosts = {n.name: Host(n, prof.ssh, base.hosts[n.name].ctx, base.state) for n in prof.nodes}
    return Deployment(prof, base.profile_path, base.state, hosts, dry=base.dry, sleep=base.sleep,
                      clock=base.clock, wall=base.wall, events=base.events)


# --- what the nodes hold ----------------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """A model placed beside ``base``, as its containers' labels say."""

    placement: Placement
    deployment: str
    containers: tuple[tuple[str, labels.Container], ...]
    """(node, container) of its engine containers."""
    unit: Registered | None = None
    """Its persisted unit on its head, when it has one."""

    @property
    def running(self) -> bool:
        return all(c.running for _, c in self.containers)

    @property
    def loaded(self) -> bool:
        """Its containers there and running (a model on demand not loaded has none)."""
        return bool(self.containers) and self.running

    @property
    def port(self) -> int | None:
        return next((c.port for _, c in self.containers if c.port), None)


def read_label(text: str) -> Placement | None:
    """A container's ``PLACEMENT`` label (None: none, or not one sparkdeploy wrote)."""
    if not text:
        return None
    try:
        return Placement.model_validate(parsed(text, "the placement label"))
    except (OutsideError, ValueError):
        return None


def found(base: str, on_nodes: dict[str, list[labels.Container]]) -> list[Found]:
    """The models placed beside deployment ``base`` on the nodes ({node: every sparkdeploy
    engine container on it}), in the order first seen."""
    out: dict[str, tuple[Placement, list[tuple[str, labels.Container]]]] = {}
    for node, cs in on_nodes.items():
        for c in cs:
            pl = read_label(c.placement)
            if pl is None or pl.of != base or c.deployment != deployment_name(base, pl.recipe):
                continue
            out.setdefault(c.deployment, (pl, []))[1].append((node, c))
    return [Found(pl, name, tuple(cs)) for name, (pl, cs) in out.items()]


SPECS = SERVE_DIR
"""Where the persisted units' specs are."""


@dataclass(frozen=True)
class Registered:
    """A placed model's persisted unit on a node, as its spec says (loaded or not)."""

    placement: Placement
    node: str
    unit: str | None
    """Its ``sparkdeploy-<engine>.service``."""
    port: int | None
    """Its engine's API port (the head's unit's canary port)."""


def from_spec(text: str, base: str, node: str = "") -> Registered | None:
    """The placement a persisted unit's spec runs (its containers' ``--label=`` arguments), when
    it is one beside ``base``."""
    try:
        spec = parsed(text, "a unit's spec")
    except OutsideError:
        return None
    if not isinstance(spec, dict):
        return None
    stages = spec.get("stages")
    for st in stages if isinstance(stages, list) else []:
        for c in (st.get("containers") if isinstance(st, dict) else None) or []:
            for a in (c.get("run") if isinstance(c, dict) else None) or []:
                if isinstance(a, str) and a.startswith(f"--label={labels.PLACEMENT}="):
                    pl = read_label(a.split("=", 2)[2])
                    if pl is not None and pl.of == base:
                        unit, canary = spec.get("unit"), spec.get("canary")
                        port = canary.get("port") if isinstance(canary, dict) else None
                        return Registered(pl, node, unit if isinstance(unit, str) else None,
                                          port if isinstance(port, int) else None)
    return None


def units_of(host: Host, base: str) -> list[Registered]:
    """The placements beside ``base`` whose persisted units are on the node, whether their
    containers run now or not (a unit between two starts of its engine has none, and a model on
    demand not loaded has none)."""
    r = host.run(["sh", "-c", 'for f in "$1"/*.json; do [ -e "$f" ] && { echo "$f"; cat -- "$f"; '
                  'echo; echo "#end"; }; done; true', "sh", SPECS], change=False, sudo=True)
    out: list[Registered] = []
    for block in r.stdout.split("#end\n"):
        path, _, text = block.partition("\n")
        got = from_spec(text, base, host.name) if path.endswith(".json") else None
        if got is not None and got.placement not in [x.placement for x in out]:
            out.append(got)
    return out


def with_units(placed: list[Found], units: list[Registered]) -> list[Found]:
    """``placed`` (found by their containers) with their units (the one on the placement's
    first node before another), and the models found only by their units (on demand and not
    loaded, or between two starts of their engine)."""
    def unit(p: Placement) -> Registered | None:
        mine = [u for u in units if u.placement == p]
        return next((u for u in mine if u.node == p.nodes[0]), mine[0] if mine else None)

    out = [Found(f.placement, f.deployment, f.containers, unit(f.placement)) for f in placed]
    for u in units:
        p = u.placement
        if all(f.placement != p for f in out):
            out.append(Found(p, deployment_name(p.of, p.recipe), (), unit(p)))
    return out


@dataclass(frozen=True)
class Held:
    """What one model claims on one node."""

    name: str
    """Its recipe (or deployment, for the profile's own)."""
    fraction: float
    on_demand: bool = False
    loaded: bool = True


@dataclass(frozen=True)
class Room:
    """One node's memory for a new placement (bytes, per GPU).

    The models on demand on a node take turns: one always-loaded model placed there must leave
    room for the largest of them (``claimed``), and a new model on demand may take what they
    hold, which the gateway evicts for it (``evicting``)."""

    node: str
    total: int
    available: int
    """What the node reports usable now (``MemAvailable`` on a GB10)."""
    held: tuple[Held, ...] = ()
    evicting: bool = False
    """The room for a model on demand: the others on demand count for nothing, and what the
    loaded ones hold now counts as available."""

    @property
    def claimed(self) -> int:
        always = sum(h.fraction for h in self.held if not h.on_demand)
        turns = [h.fraction for h in self.held if h.on_demand]
        return int((always + (0 if self.evicting or not turns else max(turns))) * self.total)

    @property
    def usable(self) -> int:
        freed = self.evictable if self.evicting else 0
        return max(0, min(self.available + freed, int(self.total * (1 - OS_SHARE)) - self.claimed))

    @property
    def evictable(self) -> int:
        """What the loaded models on demand hold (the gateway's to evict)."""
        return int(sum(h.fraction for h in self.held if h.on_demand and h.loaded) * self.total)

    def line(self) -> str:
        def how(h: Held) -> str:
            return "" if not h.on_demand else ", on demand, loaded" if h.loaded else ", on demand"
        held = "".join(f", {h.name} holds {fit.gib(h.fraction * self.total)} ({h.fraction:g} of it"
                       f"{how(h)})" for h in self.held)
        return (f"{self.node}: {fit.gib(self.usable)} usable of {fit.gib(self.total)} "
                f"({fit.gib(self.available)} available now{held})")


def held(placed: list[Found]) -> dict[str, tuple[Held, ...]]:
    """{node: the placed models' claims there} (a model on demand not loaded has no container:
    its placement names its nodes)."""
    out: dict[str, list[Held]] = {}
    for f in placed:
        if f.placement.fraction is None:
            continue
        nodes = [n for n, _ in f.containers] or list(f.placement.nodes)
        for node in dict.fromkeys(nodes):
            out.setdefault(node, []).append(Held(f.placement.recipe, f.placement.fraction,
                                                 f.placement.on_demand, f.loaded))
    return {n: tuple(h) for n, h in out.items()}


# --- the fit ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    nodes: tuple[str, ...]
    estimate: est.Estimate
    fraction: float
    """The share of the node's total its engines are given: what the estimate needs."""


def sized(recipe: rcp.Recipe, nodes: int, usable: int, reserve_gib: float) -> est.Estimate:
    """The fit calculator on ``nodes`` nodes of ``usable`` bytes (``EstimateError``,
    ``RecipeError`` when the recipe cannot say)."""
    stated = recipe.stated(nodes)
    return est.estimate(recipe.config(), weights_bytes=recipe.weights_bytes,
                        weights_source=recipe.about["weights"]["source"], nodes=nodes,
                        memory_gib=max(usable, 1) / fit.GIB, memory_source="room beside the placed models",
                        context=recipe.context, reserve_gib=reserve_gib,
                        tp=stated["tp"] if stated else None)


def candidates(rooms: dict[str, Room], given: list[str] | None) -> list[tuple[str, ...]]:
    """The node sets to try: the given ones, else every set from one node up; within a size,
    the nodes holding the fewest placed models first (models spread over the nodes), then the
    roomiest (the profile's order breaks ties)."""
    if given:
        return [tuple(given)]
    names = list(rooms)
    out: list[tuple[str, ...]] = []
    for k in range(1, len(names) + 1):
        sets = list(itertools.combinations(names, k))
        sets.sort(key=lambda s: (sum(len(rooms[n].held) for n in s),
                                 -min(rooms[n].usable for n in s)))
        out += sets
    return out


def choose(recipe: rcp.Recipe, rooms: dict[str, Room], given: list[str] | None,
           reserve_gib: float) -> Choice | list[str]:
    """Where the recipe's model fits, or why nowhere (one line per node count tried: the best
    set's estimate)."""
    why: dict[int, str] = {}
    for s in candidates(rooms, given):
        usable = min(rooms[n].usable for n in s)
        try:
            e = sized(recipe, len(s), usable, reserve_gib)
        except (est.EstimateError, rcp.RecipeError) as x:
            why.setdefault(len(s), f"on {len(s)} node(s): {x}")
            continue
        if e.fits:
            total = min(rooms[n].total for n in s)
            return Choice(s, e, min(1.0, math.ceil(e.worst.need / total * 100) / 100))
        why.setdefault(len(s), f"on {', '.join(s)}: {e.why()}")
    return list(why.values())


def refusal(recipe: str, why: list[str], rooms: dict[str, Room]) -> str:
    """One line: the recipe, each layout's numbers, each node's room and what holds it."""
    return (f"recipe {recipe} does not fit beside what the cluster serves: {'; '.join(why)} "
            f"[{'; '.join(r.line() for r in rooms.values())}]")


def offset(taken_ports: set[int], taken_offsets: set[int], engines: list[Engine],
           group_port: int) -> int:
    """The smallest port offset no placed model uses whose ports are all free of ``taken_ports``
    (the profile's engines', the gateway's, the metrics', every container's API port)."""
    for k in range(1, MAX_OFFSET + 1):
        if k in taken_offsets:
            continue
        ports = {group_port + k, *(e.port + k for e in engines),
                 *(e.dist_port + k for e in engines if e.dist_port is not None)}
        if max(ports) > 65535:
            break
        if not ports & taken_ports:
            return k
    raise PlacementError(f"no port offset up to {MAX_OFFSET} is free for the recipe's engines")


def free_offset(path: str | Path, base: Profile, recipe: str, nodes: list[str],
                taken_ports: set[int], taken_offsets: set[int]) -> int:
    """``offset`` for the recipe's engines as they would run on ``nodes``."""
    p = load_placed(path, recipe, nodes, tuple(base.recipes))
    return offset(taken_ports, taken_offsets, list(p.engines), p.serve.group_port)


def profile_ports(p: Profile) -> set[int]:
    """The ports the profile's own deployment and the cluster's services use."""
    out = {p.serve.group_port, p.gateway.port, p.metrics.port, p.metrics.exporter_port,
           p.metrics.status_port}
    for e in p.engines:
        out |= {e.port, *([e.dist_port] if e.dist_port is not None else [])}
    return out

