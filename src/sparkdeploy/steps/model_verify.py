"""``model.verify``: every selected file's size, every LFS file's sha256 (the others' git blob
id) against the hub's metadata as the head's selection records it (no hub needed; with no
record, the hub's listing or its cache on the controller); ``--repair`` re-fetches (head,
``model.download``'s way) or re-sends (workers, ``model.sync``'s way) only the files that
differ.
"""

from __future__ import annotations

from typing import Any

from sparkdeploy.core.errors import PartFailed
from sparkdeploy.core.fingerprint import Fingerprint, workers
from sparkdeploy.core.outcomes import Result
from sparkdeploy.node.hosts import Host
from sparkdeploy.ops.model import (
    DOWNLOAD,
    VERIFY,
    ModelError,
    describe_bad,
    download_on,
    in_gb,
    node_state,
    stage_for,
    total_bytes,
)
from sparkdeploy.ops.model_select import selected
from sparkdeploy.ops.model_sync import SYNC, sync_files
from sparkdeploy.steps.registry import StepContext, step


@step(VERIFY, needs=(DOWNLOAD, SYNC), fingerprint=Fingerprint("model", also=workers))
def verify(ctx: StepContext, node: str | None = None, repair: bool = False) -> None:
    """Verify the weights on every node against the selection the head records (the hub's
    sizes and hashes of the files the engine loads)."""
    dep = ctx.dep
    meta, note = selected(dep)
    ctx.each(dep.select(node), lambda host: verify_on(ctx, host, meta, note, repair))


def verify_on(ctx: StepContext, host: Host, meta: dict[str, Any], note: str = "",
              repair: bool = False) -> Result:
    dep = ctx.dep
    m = dep.profile.model
    note = f" ({note})" if note else ""
    try:
        st = stage_for(host, meta)
        state = node_state(ctx, host, st)
    except ModelError as e:
        raise PartFailed(str(e), host.name) from None
    if not state.get("present"):
        return ctx.failed(f"{host.name}: no weights in {m.path} (model.download on the head, "
                      f"model.sync to workers)", host.name)
    bad = state["missing"] + list(state["differ"]) + state["unchecked"]
    total = total_bytes(meta)
    if not bad:
        return ctx.ok(f"{host.name}: {len(state['ok'])} files verified ({in_gb(total)}; hashed "
                  f"{in_gb(state['hashed_bytes'])}, {state['reused']} unchanged since verified) in "
                  f"{state['seconds']:.1f}s{note}", host.name, hashed=state["hashed_bytes"],
                  reused=state["reused"], seconds=state["seconds"])
    if dep.dry and state["unchecked"] and not (state["missing"] or state["differ"]):
        return ctx.skipped(f"{host.name}: would hash {len(state['unchecked'])} files not "
                       f"verified yet", host.name)
    what = describe_bad(state)
    if not repair:
        return ctx.failed(f"{host.name}: {what}; --repair re-fetches only those", host.name,
                      differ=state["differ"], missing=state["missing"])
    names = state["missing"] + list(state["differ"])
    if host.name == dep.profile.head.name:
        res = download_on(ctx.aside(), host, meta, only=names)
    else:
        res = sync_files(ctx.aside(), [host], meta, only=names)
    if res.failed:
        return ctx.failed(f"{host.name}: {what}; repair failed: {res.why}", host.name)
    return ctx.changed(f"{host.name}: {what}; repaired ({res.why})", host.name,
                   repaired=names)
