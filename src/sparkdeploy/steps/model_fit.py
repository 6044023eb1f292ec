"""``model.fit``: each node's share under the engine's TP x PP (the weights' slice, the KV cache
for the engine's context, the engine's reserve: the fit calculator, ``sparkdeploy.model.estimate``, on
the model's config.json) against the memory that node reports its GPUs can use, and the engine's
memory fraction against what the node can give, before a byte is downloaded (``model.download``
and ``model.sync`` need it).

The weights' size is that of the files the engine loads (``ops.model_select.selected``: the
head's record when there is one, else decided from the hub's listing and index, cached); the
config.json and the engine's inputs are ``ops.model_fit``'s; each node's memory is its own report
(``sparkdeploy.node.memory``: nvidia-smi's figures, or ``/proc/meminfo`` on a GB10). Every engine of
the profile is checked (``serve.up`` may fall back to any of them); the first that fits on every
node is the verdict, one ok line per node; an engine that does not fit is one skipped line.
When none fits, one line per node for the engine ``serve.up`` tries first: failed where it does
not fit, naming both numbers.

It runs after ``services.stop`` (in ``deploy.all``): the units that held the head's GPU are
stopped first, so their memory counts as usable. ``profile.check`` refused before that what
cannot fit even with every unit stopped.
"""

from __future__ import annotations

from typing import Any

from sparkdeploy.core.errors import PartFailed, StepFailed
from sparkdeploy.core.fingerprint import Fingerprint
from sparkdeploy.model import estimate as est
from sparkdeploy.model import fit
from sparkdeploy.model.estimate import EstimateError
from sparkdeploy.model.fit import FitError
from sparkdeploy.node.memory import NodeMemory
from sparkdeploy.ops.model_fit import Sized, gpu_nodes, model_config, node_memory, size
from sparkdeploy.ops.model_select import selected
from sparkdeploy.profile.config import Engine
from sparkdeploy.steps.registry import StepContext, step

FIT = "model.fit"
PRECHECK = "model.precheck"


def checks(ctx: StepContext, cfg: Any, weights: int,
           mem: dict[str, NodeMemory]) -> dict[str, list[Sized]]:
    """{engine: its sizing on every node}; an engine the calculator refuses (a TP the heads do
    not divide, args it cannot read) is one failed line."""
    p = ctx.dep.profile
    out: dict[str, list[Sized]] = {}

    def one(e: Engine) -> None:
        try:
            out[e.name] = [size(cfg, e, node=n.name, gpus=n.gpus, weights=weights,
                                reserve_gib=p.fit.reserve(e.name),
                                gpu_usable=mem[n.name].gpu_usable or 0,
                                gpu_total=mem[n.name].gpu_total or 0,
                                memory_source=mem[n.name].source)
                           for n in gpu_nodes(ctx)]
        except (FitError, EstimateError) as e_:
            raise PartFailed(f"engine {e.name}: {e_}") from None

    ctx.each(p.engines, one)
    return out


def report(ctx: StepContext, weights: int, by_engine: dict[str, list[Sized]],
           mem: dict[str, NodeMemory], note: str, upper: bool = False) -> None:
    fitting, lines = fit.verdict({e: [s.check for s in ss] for e, ss in by_engine.items()})
    for e, ss in by_engine.items():
        bad = [s.check for s in ss if not s.check.fits]
        if fitting is not None and bad:
            ctx.skipped(f"{'; '.join(c.line() for c in bad)} ({fitting} does)", engine=e)
    sized = {(s.check.engine, s.check.node): s for ss in by_engine.values() for s in ss}
    for c in lines:
        m = mem[c.node]
        s = sized[(c.engine, c.node)]
        kind = f"{'unified' if m.unified else 'own'} memory{f', usable {m.source}' if upper else ''}"
        why = (f"{c.line()} ({kind}; weights "
               f"{fit.gib(weights)}{note}; {s.sources()})")
        details: dict[str, Any] = {"engine": c.engine, "need": c.need, "usable": c.usable,
                                   "asks": c.asks, "total": c.total, "kv": c.kv,
                                   "tp": s.estimate.tp, "pp": s.estimate.pp}
        (ctx.ok if c.fits else ctx.failed)(why, c.node, **details)


def freed(ctx: StepContext, mem: dict[str, NodeMemory], held: dict[str, int]) -> dict[str, NodeMemory]:
    """Each node's memory as it will be once an engine holding ``held`` bytes there is gone
    (``serve.swap``: the old engine still serves while the new model's fit is checked), never
    more than the node's total."""
    p = ctx.dep.profile
    return {n: m.model_copy(update={"gpu_usable": min(
        (m.gpu_usable or 0) + held.get(n, 0) // max(p.node(n).gpus, 1),
        m.gpu_total or 0)}) for n, m in mem.items()}


def sized_up(ctx: StepContext, upper: bool, held: dict[str, int] | None = None) -> None:
    """``model.fit``'s check (``upper``: ``model.precheck``'s, on ``at_most`` of each node's
    memory): one failed line when the weights, the config or a node's figures are missing.
    ``held``: {node: bytes} an engine that will be gone by then holds now (counted as usable)."""
    dep = ctx.dep
    meta, note = selected(dep)
    weights = fit.weight_bytes(meta["files"])
    cfg, cfg_source = model_config(dep, meta.get("commit"))
    try:
        est.read_config(cfg)
    except EstimateError as e:  # the model's config, not the user's input: this step's failure
        raise StepFailed(str(e)) from None
    mem = node_memory(ctx)
    if len(mem) < len(gpu_nodes(ctx)):
        return  # a node without figures was one failed line already
    said = f"; {note}" if note else ""
    if upper:
        mem = {n: at_most(m) for n, m in mem.items()}
    if held is not None:
        mem = freed(ctx, mem, held)
        said += "; usable counts what the engine to be replaced holds: " + \
            ", ".join(f"{n} {fit.gib(b)}" for n, b in held.items())
    by_engine = checks(ctx, cfg, weights, mem)
    if by_engine:
        report(ctx, weights, by_engine, mem, f"{said}; config {cfg_source}", upper)
    if upper and ctx.results and any(r.failed for r in ctx.results):
        fewest(ctx, cfg, weights, mem)


OS_SHARE_GIB = 4.0
OS_SHARE_FRACTION = 0.05
"""What ``model.precheck`` leaves the operating system of a unified-memory node with every unit
stopped: the smaller of 4 GiB and 5 % of MemTotal, less than the 8.6 GiB (7 %) an idle DGX OS
held on the recorded GB10 (MemTotal 121.7 GiB, MemAvailable 113.1 GiB:
tests/unit/data/memory/gb10-meminfo.txt), so the bound stays above what the node can really
give on a small node too (a smaller share only loosens an upper bound; ``model.fit`` decides)."""


def at_most(m: NodeMemory) -> NodeMemory:
    """What the node's GPUs could use at most with every unit stopped, an upper bound: on
    unified memory (a GB10) ``MemAvailable`` counts what the units hold as used, so MemTotal
    less the OS's share; on a discrete GPU its whole memory.total. Never less than usable now."""
    total, now = m.gpu_total or 0, m.gpu_usable or 0
    if m.unified:
        share = int(min(OS_SHARE_GIB * fit.GIB, OS_SHARE_FRACTION * total * max(m.gpus, 1)))
        share //= max(m.gpus, 1)
        bound, how = total - share, f"MemTotal less {fit.gib(share)} for the OS"
    else:
        bound, how = total, "memory.total"
    return m.model_copy(update={"gpu_usable": max(now, bound),
                                "source": f"at most, every unit stopped: {how}"})


def fewest(ctx: StepContext, cfg: Any, weights: int, mem: dict[str, NodeMemory]) -> None:
    """With a recipe: the fewest nodes of this memory it needs (the fit calculator's layout)."""
    p = ctx.dep.profile
    if not p.recipe:
        return
    gib = min((m.gpu_usable or 0) for m in mem.values()) / fit.GIB
    first = p.engines[0]
    ctx_len = fit.arg_count(list(first.args), fit.CONTEXT_FLAGS)
    e = est.min_nodes(cfg, weights_bytes=weights, memory_gib=gib,
                      context=ctx_len[1] if ctx_len else None,
                      reserve_gib=p.fit.reserve(first.name))
    have = sum(n.gpus for n in gpu_nodes(ctx))
    need = (f"needs {e.nodes} node(s) of {gib:.1f} GiB (TP={e.tp} x PP={e.pp})" if e else
            f"fits no cluster of up to 8 nodes of {gib:.1f} GiB")
    ctx.failed(f"recipe {p.recipe} {need}; the profile has {have} GPU(s)")


SIZED = Fingerprint("model", "engines", "nodes", "fit")
"""The model, the engines, the nodes and the reserve: unchanged since a fit that passed, the fit
is not measured again (this deployment's own engine, serving by then, holds the memory a second
measurement would miss)."""


@step(PRECHECK, needs=("hosts.check",), fingerprint=SIZED, reuse=True)
def model_precheck(ctx: StepContext) -> None:
    """Before anything stops or downloads: could the model fit even with every unit stopped
    (each node's memory at most, ``at_most``)? Refuses what cannot, with the numbers."""
    sized_up(ctx, upper=True)


@step(FIT, needs=("services.stop",), fingerprint=SIZED, reuse=True)
def model_fit(ctx: StepContext, held: dict[str, int] | None = None) -> None:
    """Check that each node's share (weights, KV cache, reserve: the fit calculator on the
    model's config.json) and the engines' memory fraction fit the memory the node reports,
    before anything is downloaded. ``held``: {node: bytes} an engine that will be gone by
    then holds now (``serve.swap``)."""
    sized_up(ctx, upper=False, held=held)
