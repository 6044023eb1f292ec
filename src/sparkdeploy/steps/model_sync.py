"""``model.sync``: the weights head -> workers over the fast link, pipelined (how:
``sparkdeploy.ops.model_sync``)."""

from __future__ import annotations

from sparkdeploy.core.fingerprint import Fingerprint, workers
from sparkdeploy.ops.model import DOWNLOAD, ModelError, own_lock
from sparkdeploy.ops.model_select import selected
from sparkdeploy.ops.model_sync import SYNC, sync_files
from sparkdeploy.steps.registry import StepContext, step


@step(SYNC, needs=("model.fit",), after_start=(DOWNLOAD,), long=True,
      fingerprint=Fingerprint("model", also=workers))
def sync(ctx: StepContext, to: str = "all", only: list[str] | None = None) -> None:
    """Copy the weights (or the files ``only``) to the workers over the fast link, file by file
    as the head completes them (starts while model.download runs: no need on it)."""
    dep = ctx.dep
    head = dep.profile.head.name
    targets = [h for h in (dep.select(to) if to != "all" else
                           [dep.host(n.name) for n in dep.profile.workers]) if h.name != head]
    if not targets:
        ctx.ok("no worker to sync to")
        return
    try:  # the head's record while it is for the commit the revision names now: a moved revision
        meta, note = selected(dep, refresh=True)  # is a change, its files are not there yet
    except ModelError as e:  # no hub and no cache: the head's record of the files
        meta, note = selected(dep)
        note = "; ".join(n for n in (note, f"the revision's commit not checked: {e}") if n)
    with own_lock(dep, SYNC):
        sync_files(ctx, targets, meta, only=only, note=note)
