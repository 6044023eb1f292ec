"""`inv model.*`: download the weights on the head, verify them, sync them to the workers.

model.download and model.sync each hold a lock of their own (not the deployment's), so the
sync can run beside the download and send each file as soon as the head has verified it."""

import json as _json

from invoke import Collection
from invoke.exceptions import Exit

from sparkdeploy.model import estimate as est
from sparkdeploy.tasks import _flags as flags
from sparkdeploy.tasks import _swap
from sparkdeploy.tasks._common import exits, run_step
from sparkdeploy.tasks._flags import task


@task(default=True, help={"nodes": "the node to download on (default: the head)",
                          "node": "deprecated: --nodes", "profile": "profile file"})
def download(c, nodes=None, profile=None, node=None):
    """Download the weights on the head, verified: the files the engine loads (the safetensors
    index's shards, configs, tokenizer, template; model.allow_patterns adds more), recorded on
    the head for sync and verify; a re-run fetches only what is missing. The token comes from
    HF_TOKEN or the hub login and reaches the node by stdin."""
    flag, picked = flags.nodes(nodes, node=node)
    if picked is not None and (picked == "all" or len(flags.name_list(flag, picked)) != 1):
        raise flags.usage(flag, f"downloads on one node, not {picked!r}")
    run_step(c, "model.download", node=picked, flag=flag, profile=profile, lock=False)


@task(help={"nodes": "node(s): NAME[,NAME...] or all (default: all)", "node": "deprecated: --nodes",
            "repair": "re-fetch (head) or re-send (workers) only the files that differ",
            "profile": "profile file"})
def verify(c, nodes=None, repair=False, profile=None, node=None):
    """Check every file's size and sha256 against the hub's metadata (cached for offline use)."""
    flag, picked = flags.nodes(nodes, node=node)
    run_step(c, "model.verify", node=picked, flag=flag, repair=repair, profile=profile,
             lock=repair)


@task(help={"to": "worker(s): NAME[,NAME...] or all (default: all)", "nodes": "the same as --to",
            "profile": "profile file"})
def sync(c, to=None, profile=None, nodes=None):
    """Copy the weights to the workers over the fast link as the head completes each file."""
    flag, picked = flags.nodes(nodes, to=to)
    run_step(c, "model.sync", to=picked or "all", flag=flag, profile=profile, lock=False)


@task(help={"profile": "profile file"})
def fit(c, profile=None):
    """Check that each node's share (weights, KV cache for the engine's context, reserve: the fit
    calculator on the model's config.json under the engine's TP x PP) and the engine's memory
    fraction fit the memory the node reports (before downloading; exit 1 when not)."""
    run_step(c, "model.fit", profile=profile, lock=False)


@task(help={"yes": "do not ask before removing", "profile": "profile file"})
def prune(c, yes=False, profile=None):
    """Remove other models' weights from every node (never the serving model's; model.keep of
    the others, the most recent, stay): lists them per node with sizes and asks unless --yes."""
    _swap.prune(c, yes=yes, profile=profile)


@task(name="estimate", help={
    "config": "the model's config.json",
    "weights_gb": "the weights' size in GB (10^9 bytes) of the files the engine loads",
    "nodes": "nodes, one GPU each",
    "memory_gib": "GiB an engine may use on each node (default: a GB10's, about 101)",
    "tp": "tensor-parallel size (default: the layout the engines accept, TP first)",
    "context": "tokens per sequence (default: the config's max_position_embeddings)",
    "seqs": "sequences held at once (default 1)", "kv_dtype": "auto, fp8 or bf16 (default auto)",
    "json": "print the estimate as JSON"})
def estimate_(c, config, nodes, weights_gb, memory_gib=None, context=None, seqs=None,
              kv_dtype=None, tp=None, json=False):
    """Offline: does the model of CONFIG fit NODES nodes of MEMORY_GIB each? The layout the
    engines accept, then per node the weights' share, the KV cache and the engine's reserve,
    every figure with its source (exit 1 when it does not fit)."""
    path = flags.input_file("--config", config)
    n = flags.integer("--nodes", nodes, min=1)
    mem = flags.number("--memory-gib", memory_gib, gt=0)
    tp_ = flags.integer("--tp", tp, min=1)
    weights = flags.number("--weights-gb", weights_gb, gt=0)
    ctx = flags.integer("--context", context, min=1)
    s = flags.integer("--seqs", seqs, default=1, min=1)
    kv = flags.choice("--kv-dtype", kv_dtype, est.KV_DTYPES) or "auto"
    with exits("model.estimate"):
        e = est.estimate(est.load_config(path), weights_bytes=(weights or 0) * 1e9,
                         nodes=n or 1, memory_gib=mem or est.GB10_USABLE_GIB,
                         memory_source="--memory-gib" if mem else est.GB10_SOURCE, context=ctx,
                         seqs=s or 1, kv=kv, tp=tp_)
    print(_json.dumps(e.as_json(), indent=2) if json else "\n".join(e.lines()), flush=True)
    if not e.fits:
        raise Exit(code=1)


ns = Collection("model", download, verify, sync, fit, prune, estimate_)
