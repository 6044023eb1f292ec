"""``model.download``: the weights, verified, into ``model.path`` on the head (what it runs and
how: ``sparkdeploy.ops.model``).

``model.sync``: see ``sparkdeploy.steps.model_sync``; ``model.verify``: see
``sparkdeploy.steps.model_verify``.
"""

from __future__ import annotations

from sparkdeploy.ops.model import DOWNLOAD, ModelError, download_on, metadata, own_lock
from sparkdeploy.steps.registry import StepContext, step


@step(DOWNLOAD, needs=("model.fit", "link.check"), long=True)
def download(ctx: StepContext, node: str | None = None) -> None:
    """Download the weights on the head, verified (resumes; only what is missing)."""
    dep = ctx.dep
    host = dep.host(node or dep.profile.head.name)
    try:
        meta, note = metadata(dep)
    except ModelError as e:  # refused before anything is held or written
        ctx.failed(str(e), host.name)
        return
    with own_lock(dep, DOWNLOAD):
        download_on(ctx, host, meta, note)
