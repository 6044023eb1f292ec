"""What ``model.fit`` and ``profile.check`` share: the model's config.json, and the fit
calculator (``sparkdeploy.model.estimate``) run for one engine of the profile on one node's memory.

The config.json comes from, first first: the recipe the profile names (its config file ships
beside it) when the recipe is for the profile's repo; the head's model dir (what the engine
will read); the hub, at the selection's commit. The engine's TP x PP are the profile's; its
context, sequences and KV cache dtype come from its args where given (``fit.CONTEXT_FLAGS``,
``fit.SEQS_FLAGS``, ``fit.KV_DTYPE_FLAGS``), else the config's ``max_position_embeddings``
(what both engines default to), one sequence (the least an engine must hold at full context)
and ``auto``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from sparkdeploy.core.errors import PartFailed
from sparkdeploy.core.outside import OutsideError
from sparkdeploy.model import estimate as est
from sparkdeploy.model import fit
from sparkdeploy.model.fit import GIB, Check
from sparkdeploy.node import memory
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host, HostError
from sparkdeploy.node.memory import NodeMemory
from sparkdeploy.node.nodeops import HelperFailed
from sparkdeploy.ops import Ctx
from sparkdeploy.ops.model import ModelError, fetch_file
from sparkdeploy.profile.config import Engine, read_recipe
from sparkdeploy.profile.overlays import ProfileError
from sparkdeploy.profile.recipes import directories

CONFIG = "config.json"


def model_config(dep: Deployment, commit: str | None) -> tuple[Any, str]:
    """(the model's config.json, parsed; where it came from). ``ModelError`` (one line) when
    none can be read, ``EstimateError`` when what was read is not JSON."""
    p = dep.profile
    if p.recipe:
        try:
            r = read_recipe(p.recipe, directories(p.recipes), "sparkdeploy.recipe")
        except ProfileError as e:
            raise ModelError(str(e)) from None
        if (r.part.get("model") or {}).get("repo") == p.model.repo:
            try:
                return r.config(), f"recipe {r.name}'s {r.about['config']}"
            except ProfileError as e:
                raise ModelError(str(e)) from None
    path = f"{p.model.path.rstrip('/')}/{CONFIG}"
    why = []
    try:
        got = dep.host(p.head.name).run(["cat", "--", path], change=False)
        if got.ok:
            return est.parse_config(got.stdout.encode(), f"{p.head.name}:{path}"), f"{p.head.name}:{path}"
        why.append(f"{p.head.name}:{path}: {got.one_line_error()}")
    except HostError as e:
        why.append(str(e))
    if commit:
        where = f"the hub's {p.model.repo}@{commit[:12]} {CONFIG}"
        try:
            return est.parse_config(fetch_file(dep, commit, CONFIG), where), where
        except OutsideError as e:
            why.append(str(e))
    raise ModelError(f"no {CONFIG} to size the model from: {'; '.join(why)}")


@dataclass(frozen=True)
class Sized:
    """One engine sized on one node: the calculator's estimate and the fit check of it."""

    estimate: est.Estimate
    check: Check
    seqs_source: str

    def sources(self) -> str:
        """Where the layout, context, sequences and KV dtype came from, in words."""
        e = self.estimate
        return (f"TP={e.tp} x PP={e.pp} (the profile's engine); context {int(e.context.value)} "
                f"({e.context.source}); {e.seqs} sequence(s) ({self.seqs_source}); KV cache "
                f"{e.kv_dtype.value:g} byte(s) per element ({e.kv_dtype.source})")


def size(cfg: Any, engine: Engine, *, node: str, gpus: int, weights: float, reserve_gib: float,
         gpu_usable: int, gpu_total: int, memory_source: str) -> Sized:
    """``engine`` on ``node`` (``gpus`` GPUs of ``gpu_usable`` / ``gpu_total`` bytes each): the
    calculator on the profile's TP x PP, the heaviest pipeline stage (``EstimateError`` or
    ``FitError``: one line)."""
    args = list(engine.args)
    ctx = fit.arg_count(args, fit.CONTEXT_FLAGS)
    seqs = fit.arg_count(args, fit.SEQS_FLAGS)
    kv, kv_source = fit.kv_choice(args)
    tp, pp = engine.tensor_parallel, engine.pipeline_parallel
    e = est.estimate(cfg, weights_bytes=weights, weights_source="the selected weight files",
                     nodes=tp * pp, memory_gib=gpu_usable / GIB, memory_source=memory_source,
                     context=ctx[1] if ctx else None, seqs=seqs[1] if seqs else 1, kv=kv,
                     reserve_gib=reserve_gib, tp=tp)
    if ctx:
        e = replace(e, context=est.Figure(e.context.value, f"{ctx[0]} in the engine's args"))
    if kv != "auto" or not kv_source.startswith("no "):
        e = replace(e, kv_dtype=est.Figure(e.kv_dtype.value, kv_source))
    w = e.worst
    c = fit.check(node, engine.name, gpus=gpus, weights=w.weights, kv=w.kv,
                  kv_for=f"{int(e.context.value)} tokens x {e.seqs} sequence(s)",
                  reserve=w.reserve, gpu_usable=gpu_usable, gpu_total=gpu_total, args=args)
    said = (f"{seqs[0]} in the engine's args" if seqs else
            f"none of {', '.join(fit.SEQS_FLAGS)} in its args: one, the least an engine holds "
            "at full context")
    return Sized(e, c, said)


def node_memory(ctx: Ctx) -> dict[str, NodeMemory]:
    """{node: its memory report} for every node that answered (one failed line each other)."""
    dep = ctx.dep
    got: dict[str, NodeMemory] = {}

    def one(host: Host) -> None:
        try:
            m = memory.read(host)
        except HelperFailed as e:
            raise PartFailed(str(e), host.name) from None
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


def gpu_nodes(ctx: Ctx) -> list:
    """The profile's nodes that hold a rank (a node with no GPU holds no weights)."""
    return [n for n in ctx.dep.profile.nodes if n.gpus > 0]
