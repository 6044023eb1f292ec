"""``model.download``: the weights, verified, into ``model.path`` on the head (what it runs and
how: ``sparkdeploy.ops.model``).

``model.sync``: see ``sparkdeploy.steps.model_sync``; ``model.verify``: see
``sparkdeploy.steps.model_verify``.
"""

from __future__ import annotations

from sparkdeploy.core.errors import PartFailed
from sparkdeploy.core.fingerprint import Fingerprint, head
from sparkdeploy.ops.model import DOWNLOAD, ModelError, download_on, own_lock
from sparkdeploy.ops.model_select import describe, selected
from sparkdeploy.steps.registry import StepContext, step


@step(DOWNLOAD, needs=("model.fit", "link.check"), long=True,
      fingerprint=Fingerprint("model", also=head))
def download(ctx: StepContext, node: str | None = None) -> None:
    """Download the weights on the head, verified (resumes; only what is missing): the files
    the engine loads, decided from the hub's listing and index and recorded on the head."""
    dep = ctx.dep
    host = dep.host(node or dep.profile.head.name)
    try:
        meta, note = selected(dep, refresh=True)
    except ModelError as e:  # refused before anything is held or written: the head's failure
        raise PartFailed(str(e), host.name) from None
    with own_lock(dep, DOWNLOAD):
        download_on(ctx, host, meta, "; ".join(n for n in (describe(meta), note) if n))
