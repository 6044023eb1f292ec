"""``model.prune``: remove other models' weights from the nodes, never the serving model's, and
keep the ``model.keep`` most recently written of the others (a swap back to one of them fetches
nothing). What counts as a model is a directory holding a ``config.json`` beside the profile's
model directory (``ops.swap.model_dirs``); ``inv model.prune`` lists it per node with sizes and
asks before this step removes anything."""

from __future__ import annotations

from pathlib import PurePosixPath

from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host
from sparkdeploy.ops import swap as ops
from sparkdeploy.ops.model import GB
from sparkdeploy.steps.registry import StepContext, step

PRUNE = "model.prune"


def targets(dep: Deployment, host: Host, serving: str) -> list[ops.ModelDir]:
    """What the step would remove on ``host`` with ``serving`` (the serving model's path) and
    both models of a swap under way (the head's record) left."""
    m = dep.profile.model
    dirs = ops.model_dirs(host, str(PurePosixPath(m.path).parent))
    swapping = ops.under_way(dep.host(dep.profile.head.name), dep.profile.name)
    return ops.to_prune(dirs, [serving, *swapping], m.keep)


def listing(dirs: list[ops.ModelDir]) -> str:
    return ", ".join(f"{d.path} ({d.bytes / GB:.2f} GB)" for d in dirs)


@step(PRUNE)
def prune(ctx: StepContext, serving: str | None = None) -> None:
    """Remove the other models' directories beyond ``model.keep`` on every node; ``serving``:
    the serving model's directory (default: the profile's), never removed."""
    dep = ctx.dep
    keep_path = serving or dep.profile.model.path

    def one(h: Host) -> None:
        gone = targets(dep, h, keep_path)
        if not gone:
            ctx.ok(f"nothing to remove (model.keep: {dep.profile.model.keep}; serving "
                   f"{keep_path})", h.name)
            return
        freed = sum(d.bytes for d in gone)
        if dep.dry:
            h.run(["rm", "-rf", "--", *(d.path for d in gone)], sudo=True)
            ctx.would(f"remove {listing(gone)}: {freed / GB:.2f} GB", h.name)
            return
        r = h.run(["rm", "-rf", "--", *(d.path for d in gone)], sudo=True, timeout=1800)
        if not r.ok:
            ctx.failed(f"rm: {r.one_line_error()}", h.name)
            return
        ctx.changed(f"removed {listing(gone)}: {freed / GB:.2f} GB freed", h.name, freed=freed)

    ctx.each([dep.host(n.name) for n in dep.profile.nodes], one)
