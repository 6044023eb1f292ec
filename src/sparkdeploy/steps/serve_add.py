"""``serve.add`` / ``serve.remove`` / ``serve.gateway``: several models on one cluster, behind one
endpoint.

``serve.add --recipe R [--nodes A,B]`` places R's model beside what the cluster serves
(``ops.placement``: where it fits, counting what the models there hold; its own deployment,
ports and memory fraction). Before anything is written it refuses, one line with the numbers, a
model that fits nowhere, and a model the cluster already serves. Then the new model's weights
and image go to its nodes and its flags are checked (``swap.prepare``'s steps), and it comes up
with ``serve.up`` (its preflight, its engines in order, its record). Nothing that already
serves is stopped or restarted. Last, ``serve.gateway`` puts the gateway in front of every model,
and the step's last line is ``endpoint: URL``, the gateway's address. A re-run on a placed model
brings it up if it is down, and otherwise changes nothing.

``serve.remove --recipe R`` takes R out of the gateway first (no new request goes there), then
removes its persisted units, if any, and stops its engine (``serve.unpersist`` and ``serve.down``
of its deployment). ``serve.gateway`` writes the gateway's
configuration from the nodes' labels (every model of the profile's deployment and the ones
placed beside it) and restarts it only when that changed; with nothing placed it removes it.
"""

from __future__ import annotations

from typing import Any

from sparkdeploy.core import labels, packaged
from sparkdeploy.core.errors import StepFailed
from sparkdeploy.core.wait import WaitTimeout, wait_for
from sparkdeploy.model import fit
from sparkdeploy.node import endpoint as ep
from sparkdeploy.node.hosts import Host
from sparkdeploy.node.nodeops import PROTOCOL
from sparkdeploy.ops import gateway as gw
from sparkdeploy.ops import placement as pl
from sparkdeploy.ops.model_fit import gpu_nodes, node_memory
from sparkdeploy.ops.serve import put_file
from sparkdeploy.ops.serve_containers import active, ours, unit_files
from sparkdeploy.ops.units import listening, service_unit
from sparkdeploy.profile import recipes as rcp
from sparkdeploy.profile.config import Placement, ProfileError
from sparkdeploy.steps.registry import StepContext, step

STEP_REMOVE = "serve.remove"
STEP_GATEWAY = "serve.gateway"


def cluster(ctx: StepContext) -> dict[str, list[labels.Container]] | None:
    """Every sparkdeploy engine container on every node of the profile (None when a node could
    not be read: said, one line each)."""
    dep = ctx.dep
    hosts = [dep.host(n.name) for n in dep.profile.nodes]
    got = ctx.each(hosts, lambda h: ours(h, None), parallel=True)
    if any(g is None for g in got):
        return None
    return {h.name: g or [] for h, g in zip(hosts, got, strict=True)}


def placements(ctx: StepContext, listing: dict[str, list[labels.Container]]) -> list[pl.Found]:
    """Every model placed beside the profile's deployment: found by its containers' labels and
    by its persisted units' specs (a model on demand not loaded has no container)."""
    dep = ctx.dep
    name = dep.profile.name
    hosts = [dep.host(n.name) for n in dep.profile.nodes]
    units = ctx.each(hosts, lambda h: pl.units_of(h, name), parallel=True)
    return pl.with_units(pl.found(name, listing), [u for got in units for u in got or []])


def repo_of(ctx: StepContext, recipe: str) -> str:
    """The model repo a recipe serves (``RecipeError`` when it cannot be read)."""
    r = rcp.read(recipe, rcp.directories(ctx.dep.profile.recipes), "--recipe")
    return str(r.part["model"]["repo"])


def served(ctx: StepContext, listing: dict[str, list[labels.Container]],
           placed: list[pl.Found]) -> dict[str, tuple[str, str, int]]:
    """{model repo: (deployment, node, port)} of every engine behind the gateway: the profile's
    own deployment's and each placed model's (the node of its container with the API port)."""
    prof = ctx.dep.profile
    out: dict[str, tuple[str, str, int]] = {}
    own = next(((n, c) for n, cs in listing.items() for c in cs
                if c.deployment == prof.name and c.port), None)
    if own is not None:  # its containers say which recipe serves (deploy.all --recipe, a swap)
        repo = repo_of(ctx, own[1].recipe) if own[1].recipe else prof.model.repo
        out[repo] = (prof.name, own[0], own[1].port or 0)
    for f in placed:
        api = next(((n, c.port) for n, c in f.containers if c.port), None)
        if api is None and f.placement.on_demand and f.unit is not None and f.unit.port:
            api = (f.unit.node, f.unit.port)  # registered, not loaded: its unit says where
        if api is None:
            continue
        try:
            repo = repo_of(ctx, f.placement.recipe)
        except rcp.RecipeError as e:
            raise StepFailed(f"placed model {f.placement.recipe}: {e}") from None
        out[repo] = (f.deployment, api[0], api[1])
    return out


def given_nodes(ctx: StepContext, nodes: str | None) -> list[str] | None:
    """``--nodes`` as the profile's node names, in the profile's order (``ProfileError``)."""
    if not nodes:
        return None
    names = [n.strip() for n in nodes.split(",") if n.strip()]
    have = [n.name for n in gpu_nodes(ctx)]
    bad = [n for n in names if n not in have]
    if bad or not names:
        raise ProfileError(f"--nodes: {', '.join(bad) or repr(nodes)}: not a node with a GPU in the "
                           f"profile (nodes: {', '.join(have)})")
    return [n for n in have if n in names]


def rooms(ctx: StepContext, placed: list[pl.Found],
          evicting: bool = False) -> dict[str, pl.Room] | None:
    """Each GPU node's room for a new model (``evicting``: for a model on demand; None when a
    node gave no figures: said)."""
    mem = node_memory(ctx)
    if len(mem) < len(gpu_nodes(ctx)):
        return None
    claims = pl.held(placed)
    return {n: pl.Room(n, m.gpu_total or 0, m.gpu_usable or 0, claims.get(n, ()), evicting)
            for n, m in mem.items()}


def place(ctx: StepContext, recipe: str, given: list[str] | None,
          listing: dict[str, list[labels.Container]], placed: list[pl.Found],
          on_demand: bool = False) -> Placement | None:
    """Where the new model goes (None: refused, said). A model on demand goes on the head alone
    (the gateway there loads it), in the room the other models on demand leave when evicted."""
    prof = ctx.dep.profile
    try:
        r = rcp.read(recipe, rcp.directories(prof.recipes), "--recipe")
    except ProfileError as e:
        raise StepFailed(str(e)) from None
    repo = str(r.part["model"]["repo"])
    there = served(ctx, listing, placed)
    if repo in there:
        who, node, port = there[repo]
        ctx.failed(f"{repo} already serves on the cluster ({who}, {node}:{port}): one engine per "
                   "model behind the gateway")
        return None
    head = prof.head.name
    if on_demand and given not in (None, [head]):
        ctx.failed(f"--on-demand: a model on demand is loaded by the gateway on the head, "
                   f"{head}; not on {', '.join(given or [])}")
        return None
    room = rooms(ctx, placed, evicting=on_demand)
    if room is None:
        return None
    if on_demand:
        room = {head: room[head]} if head in room else {}
        given = [head] if room else None
        if not room:
            ctx.failed(f"--on-demand: the head, {head}, has no GPU figures to place on")
            return None
    choice = pl.choose(r, room, given, prof.fit.reserve_gib)
    if isinstance(choice, list):
        ctx.failed(pl.refusal(recipe, choice, room), recipe=recipe,
                   rooms={n: {"total": x.total, "available": x.available, "usable": x.usable,
                              "held": {h.name: h.fraction for h in x.held}}
                          for n, x in room.items()})
        return None
    engines = r.part.get("engines") or []
    own = fit.memory_fraction([str(a) for a in (engines[0].get("args") or [])]) if engines else None
    fraction = own[1] if own else choice.fraction
    if own and own[1] * min(room[n].total for n in choice.nodes) > min(
            room[n].usable for n in choice.nodes):
        ctx.failed(pl.refusal(recipe, [f"its {own[0]} {own[1]:g} asks more than "
                                       f"{', '.join(choice.nodes)} can give"], room))
        return None
    taken = pl.profile_ports(prof) | {c.port for cs in listing.values() for c in cs if c.port}
    try:
        k = pl.free_offset(ctx.dep.profile_path, prof, recipe, list(choice.nodes), taken,
                           {f.placement.offset for f in placed})
    except ProfileError as e:
        raise StepFailed(str(e)) from None
    placement = Placement(of=prof.name, recipe=recipe, nodes=list(choice.nodes), offset=k,
                          fraction=fraction, on_demand=on_demand)
    how = ", on demand (the models on demand there take turns)" if on_demand else ""
    ctx.ok(f"{recipe} ({repo}) fits on {', '.join(choice.nodes)}{how}: {choice.estimate.why()}; "
           f"its engines may take {fraction:g} of each node's memory; ports +{k}",
           placement=placement.model_dump(mode="json"))
    return placement


@step(STEP_REMOVE)
def remove(ctx: StepContext, recipe: str | None = None) -> None:
    """Take ``recipe``'s model (None: every placed one) out of the gateway, then stop its
    engine."""
    base = ctx.dep
    listing = cluster(ctx)
    if listing is None:
        return
    name = base.profile.name
    # one persisted between two starts of its engine, or on demand and not loaded, has no
    # container: its unit says it is there
    gone = [f.placement for f in placements(ctx, listing)
            if recipe is None or f.placement.recipe == recipe]
    if not gone:
        if recipe is not None:
            ctx.ok(f"{recipe} is not placed beside {name}")
        else:  # nothing placed: a gateway left from before goes too
            _no_gateway(ctx)
        return
    deps = []
    for p in gone:
        try:
            deps.append(pl.deployment(base, p))
        except ProfileError as e:
            raise StepFailed(f"{p.recipe}: {e}") from None
    ctx.call(STEP_GATEWAY, leaving=[pl.deployment_name(name, p.recipe) for p in gone])
    for new in deps:  # its units first (a removed model must not come back at boot)
        ctx.call("serve.unpersist", on=new)
        ctx.call("serve.down", on=new, keep_metrics=True)


# --- the gateway ------------------------------------------------------------------------------


def _put(host: Host, path: str, content: str, private: bool) -> bool:
    return put_file(host, path, content, "0600" if private else "0644", keep_previous=False,
                    private=private)


LIST_DEADLINE_S = 15.0
"""How long the gateway's ``/v1/models`` may take: it asks every engine at once, each within its
5 s (``helpers/gateway.BACKEND_TIMEOUT_S``), so its answer comes after the slowest engine's."""


def _models(url: str, want: list[str]) -> list[str] | None:
    listed = ep.models(url, deadline=LIST_DEADLINE_S)
    return listed if all(m in listed for m in want) else None


def on_demand_loads(ctx: StepContext, placed: list[pl.Found]) -> gw.OnDemand | None:
    """The models on demand the gateway loads: each one's unit on the head and what it takes
    there, and what they may hold together (the head's room beside the models always loaded,
    under ``gateway.on_demand_gib``). None when the head gave no figures (said)."""
    prof = ctx.dep.profile
    mine = [f for f in placed if f.placement.on_demand and f.unit is not None and f.unit.unit]
    if not mine:
        return gw.OnDemand({}, None)
    room = rooms(ctx, placed, evicting=True)
    if room is None:
        return None
    head = room.get(prof.head.name)
    if head is None:
        ctx.failed(f"{prof.head.name}: no GPU figures for the models on demand")
        return None
    budget = max(1, int(head.total * (1 - pl.OS_SHARE)) - head.claimed)  # 0: nothing loads
    if prof.gateway.on_demand_gib is not None:
        budget = min(budget, int(prof.gateway.on_demand_gib * fit.GIB))
    return gw.OnDemand({f.deployment: gw.Load(str(f.unit.unit),
                                              int((f.placement.fraction or 0) * head.total))
                        for f in mine if f.unit is not None}, budget)


def _no_gateway(ctx: StepContext) -> None:
    """Nothing is placed: the gateway removed when it is there, said only then."""
    dep = ctx.dep
    head = dep.host(dep.profile.head.name)
    if dep.dry:
        if unit_files(head, [gw.UNIT]):
            ctx.would(f"remove {gw.UNIT} on {head.name}")
    elif gw.remove(head):
        ctx.changed(f"removed {gw.UNIT}: no model is placed beside {dep.profile.name}", head.name)


@step(STEP_GATEWAY)
def gateway(ctx: StepContext, leaving: list[str] | None = None) -> None:
    """The gateway on the head in front of every model on the cluster (``leaving``: placed
    models' deployments left out, ``serve.remove``'s), restarted only when what it routes
    changed; removed when nothing is placed."""
    dep = ctx.dep
    prof = dep.profile
    head = dep.host(prof.head.name)
    listing = cluster(ctx)
    if listing is None:
        return
    placed = [f for f in placements(ctx, listing) if f.deployment not in (leaving or [])]
    if not placed:
        _no_gateway(ctx)
        return
    routes = served(ctx, listing, placed)
    loads = on_demand_loads(ctx, placed)
    if loads is None:
        return
    backends = [gw.Backend(repo, gw.backend_url(dep, node, port), who, loads.get(who))
                for repo, (who, node, port) in routes.items()]
    ours_up = bool(active(head, [gw.UNIT]))
    holder = listening(head).get(prof.gateway.port)
    if holder is not None and not ours_up:
        ctx.failed(f"{head.name}: port {prof.gateway.port} is held by {holder} (gateway.port)")
        return
    url = gw.url(dep)
    models = [b.model for b in backends]
    if dep.dry:
        ctx.would(f"route {', '.join(models)} at {url} ({gw.UNIT} on {head.name})")
        return
    changed = _put(head, gw.PROGRAM_FILE, packaged.helper(gw.PROGRAM).read_text(), False)
    changed = _put(head, gw.TOOLKIT_FILE, packaged.helper(PROTOCOL).read_text(), False) or changed
    changed = _put(head, gw.CONFIG_FILE, gw.config_json(dep, backends, ep.api_key(), loads.budget),
                   True) or changed
    unit = service_unit("gateway", prof.name, head.name, gw.start_argv())
    unit_changed = _put(head, f"{gw.UNIT_DIR}/{gw.UNIT}", unit, False)
    if unit_changed:
        head.run(["systemctl", "daemon-reload"], sudo=True)
    verb = None if ours_up and not (changed or unit_changed) else "restart" if ours_up else "start"
    if verb is not None:
        r = head.run(["systemctl", verb, "--", gw.UNIT], sudo=True, timeout=60)
        if not r.ok:
            ctx.failed(f"{head.name}: systemctl {verb} {gw.UNIT}: {r.one_line_error()}")
            return
    try:
        listed = wait_for(lambda: _models(url, models), deadline=prof.gateway.ready_s, interval=0.5,
                          what="the gateway listing every model", clock=dep.clock, sleep=dep.sleep,
                          describe=lambda _: f"{url}/v1/models lists "
                                             f"{', '.join(ep.models(url, deadline=LIST_DEADLINE_S)) or 'nothing'}")
    except WaitTimeout as e:
        raise StepFailed(f"the gateway at {url} does not list {', '.join(models)} after "
                         f"{e.waited:.0f} s: {e.last}") from None
    details: dict[str, Any] = {"endpoint": url, "models": listed,
                               "backends": {b.model: b.url for b in backends}}
    if verb is not None:
        ctx.changed(f"{verb}ed {gw.UNIT} on {head.name}: {', '.join(models)}", head.name, **details)
    else:
        ctx.ok(f"the gateway routes {', '.join(models)}, as it did", head.name, **details)
    ctx.ok(f"endpoint: {url}", endpoint=url)
