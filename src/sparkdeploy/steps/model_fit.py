"""``model.fit``: the weights' share of each node, plus the engine's reserve, against the memory
that node reports its GPUs can use, and the engine's memory fraction against what the node can
give, before a byte is downloaded (``model.download`` and ``model.sync`` need it).

The weights' size is that of the files the engine loads (``ops.model_select.selected``: the
head's record when there is one, else decided from the hub's listing and index, cached); each
node's memory is its own report (``sparkdeploy.memory``: nvidia-smi's figures, or
``/proc/meminfo`` on a GB10). The arithmetic is ``sparkdeploy.fit``. Every engine of the
profile is checked (``serve.up`` may fall back to any of them); the first that fits on every
node is the verdict, one ok line per node; an engine that does not fit is one skipped line.
When none fits, one line per node for the engine ``serve.up`` tries first: failed where it does
not fit, naming both numbers.

It runs after ``services.stop`` (in ``deploy.all``): the units that held the head's GPU are
stopped first, so their memory counts as usable.
"""

from __future__ import annotations

from typing import Any

from sparkdeploy import fit, memory
from sparkdeploy.fit import Check, FitError
from sparkdeploy.hosts import Host
from sparkdeploy.memory import NodeMemory
from sparkdeploy.nodeops import HelperFailed
from sparkdeploy.ops.model import ModelError
from sparkdeploy.ops.model_select import selected
from sparkdeploy.steps.registry import StepContext, step

FIT = "model.fit"


def node_memory(ctx: StepContext) -> dict[str, NodeMemory]:
    """{node: its memory report} for every node that answered (one failed line each other)."""
    dep = ctx.dep
    got: dict[str, NodeMemory] = {}

    def one(host: Host) -> None:
        try:
            m = memory.read(host)
        except HelperFailed as e:
            ctx.failed(str(e), host.name)
            return
        want = dep.profile.node(host.name).gpus
        if m.gpu_usable is None or m.gpu_total is None:
            ctx.failed(f"{host.name}: no memory figures: {m.why or 'none given'}", host.name)
        elif m.gpus < want:
            ctx.failed(f"{host.name}: the profile gives it {want} GPUs, nvidia-smi lists {m.gpus}",
                       host.name)
        else:
            got[host.name] = m

    ctx.each([dep.host(n.name) for n in gpu_nodes(ctx)], one, parallel=True)
    return got


def gpu_nodes(ctx: StepContext) -> list:
    """The profile's nodes that hold a rank (a node with no GPU holds no weights)."""
    return [n for n in ctx.dep.profile.nodes if n.gpus > 0]


def checks(ctx: StepContext, weights: int, mem: dict[str, NodeMemory]) -> dict[str, list[Check]]:
    """{engine: its check on every node}; an engine whose args cannot be read is one failed line."""
    p = ctx.dep.profile
    out: dict[str, list[Check]] = {}
    for e in p.engines:
        try:
            out[e.name] = [fit.check(n.name, e.name, gpus=n.gpus, weights=weights,
                                     parallel=e.tensor_parallel * e.pipeline_parallel,
                                     reserve_gib=p.fit.reserve(e.name),
                                     gpu_usable=mem[n.name].gpu_usable or 0,
                                     gpu_total=mem[n.name].gpu_total or 0, args=e.args)
                           for n in gpu_nodes(ctx)]
        except FitError as e_:
            ctx.failed(f"engine {e.name}: {e_}")
    return out


def report(ctx: StepContext, weights: int, by_engine: dict[str, list[Check]],
           mem: dict[str, NodeMemory], note: str) -> None:
    fitting, lines = fit.verdict(by_engine)
    for e, cs in by_engine.items():
        bad = [c for c in cs if not c.fits]
        if fitting is not None and bad:
            ctx.skipped(f"{'; '.join(c.line() for c in bad)} ({fitting} does)", engine=e)
    for c in lines:
        m = mem[c.node]
        why = f"{c.line()} ({'unified' if m.unified else 'own'} memory; weights {fit.gib(weights)}{note})"
        details: dict[str, Any] = {"engine": c.engine, "need": c.need, "usable": c.usable,
                                   "asks": c.asks, "total": c.total}
        (ctx.ok if c.fits else ctx.failed)(why, c.node, **details)


def freed(ctx: StepContext, mem: dict[str, NodeMemory], held: dict[str, int]) -> dict[str, NodeMemory]:
    """Each node's memory as it will be once an engine holding ``held`` bytes there is gone
    (``serve.swap``: the old engine still serves while the new model's fit is checked), never
    more than the node's total."""
    p = ctx.dep.profile
    return {n: m.model_copy(update={"gpu_usable": min(
        (m.gpu_usable or 0) + held.get(n, 0) // max(p.node(n).gpus, 1),
        m.gpu_total or 0)}) for n, m in mem.items()}


@step(FIT, needs=("services.stop",))
def model_fit(ctx: StepContext, held: dict[str, int] | None = None) -> None:
    """Check that each node's share of the weights and the engines' memory fraction fit the
    memory the node reports, before anything is downloaded. ``held``: {node: bytes} an engine
    that will be gone by then holds now (counted as usable)."""
    dep = ctx.dep
    try:
        meta, note = selected(dep)
    except ModelError as e:
        ctx.failed(str(e))
        return
    weights = fit.weight_bytes(meta["files"])
    mem = node_memory(ctx)
    if len(mem) < len(gpu_nodes(ctx)):
        return  # a node without figures was one failed line already
    said = f"; {note}" if note else ""
    if held is not None:
        mem = freed(ctx, mem, held)
        said += "; usable counts what the engine to be replaced holds: " + \
            ", ".join(f"{n} {fit.gib(b)}" for n, b in held.items())
    by_engine = checks(ctx, weights, mem)
    if by_engine:
        report(ctx, weights, by_engine, mem, said)
