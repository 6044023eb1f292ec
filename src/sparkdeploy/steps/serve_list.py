"""``serve.list``: what serves where on the profile's nodes, read from the nodes themselves.

Every engine container sparkdeploy starts carries its deployment, engine, recipe and port in
its labels (``core.labels``), so one ``docker ps`` per node tells any controller, a fresh clone
included, which models are placed on which nodes. Each one found is a line and an entry:

- ``recipe``: the recipe its containers carry (None when they carry none);
- ``repo``: the model its engine lists on ``/v1/models``, else the recipe's, else the profile's
  when the containers are this profile's deployment;
- ``nodes``: the nodes it has containers on, in the profile's order;
- ``url``: the engine's own address (the node of the container holding the API port);
- ``loaded``: every container running and the engine answering ``/health`` and listing a model;
- ``on_demand``: placed with ``serve.add --on-demand`` (the gateway loads it on a request); one
  not loaded has no container, and its unit on the head says it is there.

A node that cannot be reached is a failed line; the others are still listed.
"""

from __future__ import annotations

from typing import Any

from sparkdeploy.core import labels
from sparkdeploy.node import endpoint as ep
from sparkdeploy.node.hosts import Host
from sparkdeploy.ops import placement as pl
from sparkdeploy.ops.serve_containers import Placed, ours, placed
from sparkdeploy.profile import recipes as rcp
from sparkdeploy.steps.registry import StepContext, step

STEP_LIST = "serve.list"


def _recipe_repo(name: str, dirs: list[str]) -> str | None:
    try:
        model = rcp.read(name, rcp.directories(dirs), "serve.list").part.get("model") or {}
    except rcp.ProfileError:
        return None
    repo = model.get("repo")
    return repo if isinstance(repo, str) else None


def entry(ctx: StepContext, p: Placed) -> dict[str, Any]:
    """What ``serve.list`` says of one placed engine (its JSON entry)."""
    prof = ctx.dep.profile
    listed = ep.models(p.url) if p.url and p.running else []
    loaded = bool(listed) and ep.health(p.url or "")
    repo = (listed[0] if listed else
            (_recipe_repo(p.recipe, prof.recipes) if p.recipe else None)
            or (prof.model.repo if p.deployment == prof.name else None))
    placement = next((x for x in map(pl.read_label, (c.placement for c in p.containers)) if x), None)
    return {"recipe": p.recipe or None, "repo": repo, "nodes": list(p.nodes), "url": p.url,
            "loaded": loaded, "engine": p.engine, "deployment": p.deployment,
            "on_demand": bool(placement and placement.on_demand)}


def registered(ctx: StepContext, u: pl.Registered) -> tuple[dict[str, Any], Placed]:
    """The entry of a model on demand not loaded (its unit on the head, no container)."""
    dep = ctx.dep
    p = u.placement
    engine = (u.unit or "").removeprefix("sparkdeploy-").removesuffix(".service")
    url = ep.engine_url(dep.host(u.node), u.port) if u.port else None
    name = pl.deployment_name(p.of, p.recipe)
    e: dict[str, Any] = {"recipe": p.recipe, "repo": _recipe_repo(p.recipe, dep.profile.recipes),
         "nodes": list(p.nodes), "url": url, "loaded": False, "engine": engine,
         "deployment": name, "on_demand": True}
    return e, Placed(name, engine, p.recipe, tuple(p.nodes), url, ())


def _line(e: dict[str, Any], p: Placed) -> str:
    what = e["recipe"] or e["repo"] or f"deployment {e['deployment']}"
    repo = f" ({e['repo']})" if e["recipe"] and e["repo"] else ""
    where = f"{e['engine']} on {', '.join(e['nodes'])}" + (f" at {e['url']}" if e["url"] else "")
    how = ", on demand" if e["on_demand"] else ""
    if e["loaded"]:
        return f"{what}{repo}: {where}, loaded{how}"
    if e["on_demand"] and not p.containers:
        return f"{what}{repo}: {where}, not loaded, on demand (its first request loads it)"
    stopped = [c.name for c in p.containers if not c.running]
    why = (f"not running: {', '.join(stopped)}" if stopped else
           "no API port on its containers" if not e["url"] else f"{e['url']} does not serve")
    return f"{what}{repo}: {where}, not loaded ({why})"


@step(STEP_LIST)
def serve_list(ctx: StepContext) -> None:
    """Every model sparkdeploy has placed on the profile's nodes: recipe, repo, nodes, URL,
    loaded or not (``placed``: entry per engine of any deployment)."""
    dep = ctx.dep
    hosts = [dep.host(n.name) for n in dep.profile.nodes]

    def one(h: Host) -> list[labels.Container]:
        return ours(h, None)

    found = dict(zip((h.name for h in hosts), ctx.each(hosts, one), strict=True))
    listing = {n: cs for n, cs in found.items() if cs is not None}
    models = placed(dep, listing)
    entries = [entry(ctx, p) for p in models]
    # a model on demand not loaded has no container: its unit on the head says it is there
    head = dep.host(dep.profile.head.name)
    for u in (ctx.each([head], lambda h: pl.units_of(h, dep.profile.name))[0] or []):
        if u.placement.on_demand and u.node == u.placement.nodes[0] and not any(
                e["deployment"] == pl.deployment_name(u.placement.of, u.placement.recipe)
                for e in entries):
            e, p = registered(ctx, u)
            entries.append(e)
            models.append(p)
    for e, p in zip(entries, models, strict=True):
        ctx.ok(_line(e, p), placed=e)
    if not models and listing:
        ctx.ok(f"nothing placed on {', '.join(listing)}")
