"""``serve.add``: place a recipe's model beside what the cluster serves, behind one endpoint.

Where it goes and what the nodes hold are ``steps/serve_add.py``'s (``place``: the fit, the
refusals, the ports); here the run: the new model's weights and image staged on its nodes and its
flags checked (``swap.staged``, the swap's prepare phase), ``serve.up`` of its own deployment,
``serve.persist`` of it when the profile's deployment is persisted (its own units and watchdog),
then ``serve.gateway``. Nothing that already serves is stopped or restarted; a refusal or a
failure before ``serve.up`` leaves the nodes serving as they were.

``--on-demand`` registers the model instead: staged and checked the same way, on the head, its
unit installed there but neither started nor enabled (``serve.persist`` with ``idle``); the
gateway starts it on the first request for it, and stops the least recently used model on
demand when the memory requires (``helpers/gateway.py``).
"""

from __future__ import annotations

from sparkdeploy.core.errors import StepFailed
from sparkdeploy.core.outcomes import Result
from sparkdeploy.engines.base import API_KEY_ENV
from sparkdeploy.node import endpoint as ep
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.ops import placement as pl
from sparkdeploy.ops.serve_containers import serving
from sparkdeploy.profile.config import ProfileError
from sparkdeploy.run.swap import failed, persisted, staged
from sparkdeploy.steps import serve_add as sa
from sparkdeploy.steps.registry import StepContext, run_one

STEP = "serve.add"


def body(ctx: StepContext, recipe: str, nodes: str | None = None, on_demand: bool = False) -> None:
    """Place ``recipe``'s model where it fits beside what serves, bring it up (``on_demand``:
    register it, for the gateway to load), put the gateway in front of every model."""
    base = ctx.dep
    if base.profile.placement is not None:
        ctx.failed(f"{base.profile.name} is itself a placed model: add beside "
                   f"{base.profile.placement.of}")
        return
    if on_demand and ep.api_key():
        ctx.failed(f"--on-demand: {API_KEY_ENV} is set, and the gateway starting the model's "
                   "engine on a request would need the key stored on the node; not placed")
        return
    listing = sa.cluster(ctx)
    if listing is None:
        return
    placed = sa.placements(ctx, listing)
    mine = next((f for f in placed if f.placement.recipe == recipe), None)
    try:
        asked = sa.given_nodes(ctx, nodes)
    except ProfileError as e:
        raise StepFailed(str(e)) from None
    if mine is not None and asked and asked != list(mine.placement.nodes):
        ctx.failed(f"{recipe} is placed on {', '.join(mine.placement.nodes)} already: "
                   f"serve.remove --recipe {recipe} first to move it")
        return
    if mine is not None and mine.placement.on_demand != on_demand:
        how = "on demand" if mine.placement.on_demand else "always loaded"
        ctx.failed(f"{recipe} is placed {how} already: serve.remove --recipe {recipe} first to "
                   "change it")
        return
    placement = (mine.placement if mine is not None
                 else sa.place(ctx, recipe, asked, listing, placed, on_demand))
    if placement is None:
        return
    try:
        new = pl.deployment(base, placement)
    except ProfileError as e:
        raise StepFailed(str(e)) from None
    if on_demand:
        register(ctx, new, recipe, staging=mine is None or mine.unit is None)
        return
    now = next(((e.name, got) for e in new.profile.engines
                if mine is not None and mine.running and (got := serving(new, e)).url), None)
    engine: str | None
    if now is not None:
        engine = now[0]
        ctx.ok(f"{recipe} serves on {', '.join(placement.nodes)} as placed, since "
               f"{now[1].since or '?'}", engine=engine, endpoint=now[1].url)
    else:
        why = staged(ctx, new, name=STEP)
        if why is not None:
            ctx.failed(f"{recipe}: {why}; nothing that serves was touched")
            return
        up = ctx.call("serve.up", on=new)
        if failed(up):
            ctx.failed(f"{recipe} did not come up: {failed(up)[-1].why}")
            return
        engine = next((r.details["engine"] for r in up if r.details.get("endpoint")), None)
    # the model keeps what the profile's deployment has: persisted units and their watchdog
    if persisted(base) and not persisted(new):
        if failed(ctx.call("serve.persist", on=new, engine=engine)):
            return  # said; the model serves, not persisted
    ctx.call(sa.STEP_GATEWAY)


def register(ctx: StepContext, new: Deployment, recipe: str, staging: bool) -> None:
    """A model on demand: its weights and image staged on the head and its flags checked, as for
    any placed model, then its unit installed there, neither started nor enabled (the gateway
    starts it on the first request for it), then the gateway. Registered already (not
    ``staging``): its unit is left as it is, loaded or not."""
    if staging:
        why = staged(ctx, new, name=STEP)
        if why is not None:
            ctx.failed(f"{recipe}: {why}; nothing that serves was touched")
            return
        engine = new.profile.engines[0].name  # the recipe's first engine: no fallback on demand
        if failed(ctx.call("serve.persist", on=new, engine=engine, idle=True)):
            return
    else:
        head = new.profile.head.name
        ctx.ok(f"{recipe} is registered on demand on {head}, as placed")
    ctx.call(sa.STEP_GATEWAY)


def run(dep: Deployment, recipe: str, nodes: str | None = None,
        on_demand: bool = False) -> list[Result]:
    """``serve.add`` of ``recipe`` beside ``dep`` (``nodes``: on those nodes; ``on_demand``:
    registered, loaded by the gateway on a request)."""
    return run_one(dep, STEP, body=body, recipe=recipe, nodes=nodes, on_demand=on_demand)
