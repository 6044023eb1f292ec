"""The checks ``serve.swap`` runs in its prepare phase, before anything is downloaded or
stopped (the swap itself: ``sparkdeploy.run.swap``): ``swap.fit`` (the new model against each
node's memory as it will be once the old engine is gone: ``model.fit`` with what the old
engine's containers hold, ``ops.swap.held``, counted as usable), ``swap.disk`` (the new weights
against each node's free disk, the old weights kept: refused with free and needed bytes and what
``model.prune`` would free), ``swap.flags`` (every engine command line of the new deployment
against the parser of the engine version ``image.probe`` found).
"""

from __future__ import annotations

from pathlib import PurePosixPath

from sparkdeploy.engines import EngineError, launch
from sparkdeploy.model import fit
from sparkdeploy.node import memory
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.nodeops import HelperFailed, free_space
from sparkdeploy.ops import serve_preflight
from sparkdeploy.ops import swap as ops
from sparkdeploy.ops.model import GB, ModelError, short_of
from sparkdeploy.ops.model_select import selected
from sparkdeploy.ops.serve_containers import ours
from sparkdeploy.steps.registry import StepContext, step

FIT, DISK, FLAGS = "swap.fit", "swap.disk", "swap.flags"


def old_containers(old: Deployment, node: str) -> list[str]:
    """The running containers of the old deployment on ``node`` (by their labels)."""
    return [c.name for c in ours(old.host(node), old.profile.name) if c.running]


def old_demand(old: Deployment, engine: str | None, totals: dict[str, int]) -> dict[str, int]:
    """{node: bytes} the old engine asked for there, as ``model.fit`` reckons it for that
    engine: its memory fraction x the node's total, else its weights' share + reserve ({} when
    the old engine or its weights' sizes are not known)."""
    eng = next((e for e in old.profile.engines if e.name == engine), None)
    if eng is None:
        return {}
    try:
        fraction = fit.memory_fraction(eng.args)
        meta, _ = selected(old)
    except (ModelError, fit.FitError):
        return {}
    ranks = max(eng.tensor_parallel * eng.pipeline_parallel, 1)
    per_gpu = fit.weight_bytes(meta["files"]) / ranks + old.profile.fit.reserve(eng.name) * fit.GIB
    return {n.name: int(fraction[1] * totals[n.name] if fraction else per_gpu * n.gpus)
            for n in old.profile.nodes if n.name in totals}


@step(FIT)
def swap_fit(ctx: StepContext, old: Deployment | None = None, engine: str | None = None) -> None:
    """The new model (``ctx.dep``) against each node's memory once ``old``'s engine (named
    ``engine``) is gone: ``model.fit`` with what that engine holds counted as usable. What it
    holds is the larger of ``docker stats``' figure for its containers (``ops.swap.held``) and
    what it asked for (``old_demand``): on a GB10 the CUDA allocations may not be charged to the
    container's cgroup, and ``nvidia-smi`` gives no per-process memory there."""
    dep = ctx.dep
    nodes = [n.name for n in dep.profile.nodes if n.gpus > 0]
    stats = {n: ops.held(dep.host(n), old_containers(old, n)) if old else 0 for n in nodes}
    asked: dict[str, int] = {}
    if old is not None and engine is not None:
        totals = {}
        for n in nodes:
            try:
                m = memory.read(dep.host(n))
            except HelperFailed:
                continue
            if m.gpu_total is not None:
                totals[n] = m.gpu_total * max(m.gpus, 1)
        asked = old_demand(old, engine, totals)
    ctx.call("model.fit", held={n: max(stats[n], asked.get(n, 0)) for n in nodes})


def present_bytes(ctx: StepContext, node: str, path: str) -> int:
    """Bytes already under the new model's directory on ``node`` (a re-run resumes)."""
    parent = str(PurePosixPath(path).parent)
    got = ops.model_dirs(ctx.dep.host(node), parent).get(path.rstrip("/"))
    return got.bytes if got else 0


def prunable(ctx: StepContext, node: str, protect: list[str]) -> list[ops.ModelDir]:
    """What ``model.prune`` would remove on ``node`` with ``protect`` (the serving model's
    directory, the new one's) left: ``ops.swap.to_prune`` with the profile's ``model.keep``."""
    p = ctx.dep.profile.model
    dirs = ops.model_dirs(ctx.dep.host(node), str(PurePosixPath(p.path).parent))
    return ops.to_prune(dirs, protect, p.keep)


@step(DISK)
def swap_disk(ctx: StepContext, keep: list[str] | None = None) -> None:
    """The new weights against each node's free disk, the old weights staying (``keep``: the
    directories that stay); one failed line per node short of room, with both numbers and
    what ``model.prune`` would free there."""
    dep = ctx.dep
    meta, _ = selected(dep)
    need = sum(int(f["size"]) for f in meta["files"])
    path = dep.profile.model.path

    def one(node: str) -> None:
        host = dep.host(node)
        got = free_space(host, path)
        if got is None:
            ctx.failed(f"{node}: cannot read the free space for {path}", node)
            return
        missing = max(0, need - present_bytes(ctx, node, path))
        short = short_of(dep, host, missing, *got)
        if short is None:
            ctx.ok(f"{node}: {got[0] / GB:.2f} GB free on {got[1]}, the new weights need "
                   f"{missing / GB:.2f} GB more (the old weights stay)", node,
                   free=got[0], need=missing)
            return
        extra = prunable(ctx, node, [*(keep or []), path])
        freed = sum(d.bytes for d in extra)
        what = (f"; model.prune would free {freed / GB:.2f} GB ("
                + ", ".join(f"{d.path} {d.bytes / GB:.2f} GB" for d in extra) + ")"
                if extra else f"; model.prune would free nothing (model.keep: "
                f"{dep.profile.model.keep} other model(s) stay)")
        ctx.failed(short.why + what, node, **short.details, prunable=freed)

    ctx.each([n.name for n in dep.profile.nodes], one)


@step(FLAGS)
def swap_flags(ctx: StepContext) -> None:
    """Every engine command line of the new deployment against the parser of the engine
    version ``image.probe`` found (``serve_preflight``'s check, before anything stops)."""
    dep = ctx.dep
    for eng in dep.profile.engines:
        with ctx.failing(EngineError, lead=f"{eng.name}: ") as caught:
            lau = launch(dep.profile, eng, {})
        if caught.error is not None:
            continue
        pf = serve_preflight.Preflight(ctx)
        said = serve_preflight._check_flags(dep, eng, lau, pf)
        if not pf.problems:
            ctx.ok(f"{eng.name}: {said}", engine=eng.name)
