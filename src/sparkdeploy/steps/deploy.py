"""``deploy.purge`` (``deploy.rollback --purge``): the weights and sparkdeploy's images off the
nodes. The plans ``deploy.all`` and ``deploy.rollback`` run are in ``sparkdeploy.run.plan``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sparkdeploy.core import labels as lbl
from sparkdeploy.core.outcomes import Result
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import CmdResult, Host
from sparkdeploy.node.nodeops import docker, inspect_image
from sparkdeploy.ops.image import chosen
from sparkdeploy.steps.registry import StepContext, step

PURGE = "deploy.purge"
LABEL_BUILT = lbl.BASE_ID


# --- purge (rollback --purge) ----------------------------------------------------------------

CREATED = ".sparkdeploy/created"
"""The marker the node helper leaves in a model dir it made (``model_node.py``'s META/CREATED):
``--purge`` removes a model dir only when it carries it, never a path it was merely given."""


def remove_model_dir(host: Host, path: str) -> tuple[str, str]:
    """Remove the model dir ``path`` on ``host`` when sparkdeploy made it: (status, why)."""
    marked = host.run(["test", "-f", f"{path.rstrip('/')}/{CREATED}"], change=False)
    if not marked.ok:
        return "skipped", (f"{path} was not made by sparkdeploy (no {CREATED} in it): left in "
                           "place, remove what you want of it yourself")
    r = host.run(["rm", "-rf", "--", path], sudo=True)
    if r.dry:
        return "skipped", f"would remove {path} (sparkdeploy made it)"
    return ("changed", f"removed {path}") if r.ok else ("failed", f"rm {path}: {r.one_line_error()}")


def purge_targets(dep: Deployment) -> list[str]:
    """What ``--purge`` removes, one line each (shown before asking)."""
    out = [f"{n.name}: the weights in {dep.profile.model.path} (if sparkdeploy made that directory)"
           for n in dep.profile.nodes]
    out += [f"{n.name}: images built by sparkdeploy (label {LABEL_BUILT})" for n in dep.profile.nodes]
    refs = _shipped_refs(dep)
    out += [f"{n.name}: {', '.join(refs)} (shipped there by sparkdeploy)" for n in dep.profile.workers]
    return out


def _shipped_refs(dep: Deployment) -> list[str]:
    refs = [e.image for e in dep.profile.engines]
    c = chosen(dep)
    refs += [v for v in (c.get("serve_image"), c.get("image")) if v]
    return list(dict.fromkeys(refs))


@step(PURGE, needs=("serve.down",))
def purge(ctx: StepContext, **_: Any) -> None:
    """Remove the weights and sparkdeploy's images (built on any node, shipped to workers)."""
    dep = ctx.dep
    workers = {n.name for n in dep.profile.workers}

    def said(r: CmdResult) -> Callable[..., Result]:
        return ctx.skipped if r.dry else ctx.changed if r.ok else ctx.failed

    def one(host: Host) -> None:
        status, why = remove_model_dir(host, dep.profile.model.path)
        {"skipped": ctx.skipped, "changed": ctx.changed, "failed": ctx.failed}[status](why, host.name)
        ls = host.run(docker(host, "image", "ls", "-q", "--filter", f"label={LABEL_BUILT}"), change=False)
        ids = sorted(set(ls.stdout.split())) if ls.ok else []
        refs = [ref for ref in _shipped_refs(dep) if host.name in workers and inspect_image(host, ref)]
        gone = ids + refs
        if not gone:
            ctx.ok("no sparkdeploy image here", host.name)
            return
        r = host.run(docker(host, "image", "rm", "--force", "--", *gone))
        said(r)(f"removed images {', '.join(x[:19] for x in gone)}" if r.ok
                else f"docker image rm: {r.one_line_error()}", host.name)

    ctx.each([dep.host(n.name) for n in dep.profile.nodes], one)
