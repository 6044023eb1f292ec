"""``nox -s perf -- model``: the weights' download and fan-out, measured on the lab.

A hub of its own on the controller's management address serves a generated repo of
``SIZE_MB`` (>= 1 GB, ``SHARDS`` shards) at ``LIMIT_BPS``; the weights go to a path of their
own on both nodes (``PATH``), emptied first. Figures, in this order:

- ``model.fanout_lag_ratio``: ``model.download`` and ``model.sync --to spark2`` started
  together; (worker complete - head complete) / the time ``model.sync`` takes to send the
  largest file alone (measured after, same run).
- ``model.resync_seconds``: download + sync + verify again with everything present (the hub
  must serve no file body, the sync send nothing).
- ``model.download_rate_fraction``: the downloader's achieved rate (bytes it fetched / its
  seconds) / the hub's limit.
- ``model.sync_speedup``: bytes / seconds of ``model.sync`` of the downloaded weights to an
  emptied worker, over the same for ``rsync -a`` over SSH head -> worker's link address (the
  best of three alternating runs each; stderr shows every run and the CPU it kept busy).
- ``model.selected_ratio``: ``model.download`` of the lab hub's gpt-oss-shaped repository
  (``lab.hub_layouts``: its weights three times, root, ``original/`` and ``metal/``, as the real
  one's 3 x 65 GB) into an emptied head; the bytes of file bodies the hub served / the bytes of
  the files the engine loads (the root shards the index names, config, tokenizer, template and
  generation config, as the layout declares them). 1.00 when only those are fetched; about 3
  when every file is (``allow_patterns: ["*"]``, the default before the selection).

Needs root and the lab (brought up if needed).
"""

from __future__ import annotations

import os
import shlex
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from sparkdeploy.node.deployment import DEFAULTS, Deployment, load
from sparkdeploy.ops import model as model_ops
from sparkdeploy.steps import model, model_sync, model_verify

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "configs" / "lab.yaml"
PATH = "/srv/models/perf-weights"
SIZE_MB = 1100
SHARDS = 10
LIMIT_BPS = 30_000_000
PORT = 8902
RATIO_REPO = "openai/gpt-oss-120b"
RATIO_MB = 32
"""Data bytes of each of the gpt-oss-shaped repository's three copies of its weights."""


def _say(msg: str) -> None:
    print(f"[perf model] {msg}", file=sys.stderr, flush=True)


def _must(results, what: str):
    bad = [r for r in results if r.failed]
    if bad:
        raise SystemExit(f"{what} failed: {bad[0].why}")
    return results


def busy_cpu() -> float:
    """Seconds the machine's CPUs have been busy since boot (the lab's nodes share them)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait


def wipe(dep: Deployment, node: str) -> None:
    r = dep.host(node).run(["rm", "-rf", "--", PATH])
    if not r.ok:
        raise SystemExit(f"{node}: cannot empty {PATH}: {r.one_line_error()}")


def run() -> dict[str, float]:
    from sparkdeploy.lab import hub, layout, lifecycle

    why = lifecycle.preflight()
    if why:
        raise SystemExit(f"perf model needs the lab: {why}")
    _say("lab.up")
    bad = [r for r in lifecycle.up(nodes=2, flavor=layout.DEFAULT_DOCKERD) if r.failed]
    if bad:
        raise SystemExit("lab.up failed: " + "; ".join(r.why for r in bad))
    dep = load(PROFILE, ROOT / DEFAULTS["state_dir"] / "perf-model")
    controller = urlsplit(dep.profile.model.endpoint or "").hostname or "127.0.0.1"
    _say(f"generating a {SIZE_MB} MB repo in {SHARDS} shards (cached after the first run)")
    srv = hub.start_hub(bind=controller, port=PORT, size_mb=SIZE_MB, shards=SHARDS,
                        bandwidth_bps=LIMIT_BPS, recipes=True, recipe_size_mb=RATIO_MB)
    try:
        m = dep.profile.model.model_copy(update={"path": PATH, "endpoint": srv.url})
        dep.profile = dep.profile.model_copy(update={"model": m})
        figures = measure(dep, srv)
        wipe(dep, dep.profile.head.name)
        figures["selected_ratio"] = selected_ratio(dep, srv)
        _say(f"gpt-oss-shaped repo: fetched / loaded = {figures['selected_ratio']:.2f}")
        return figures
    finally:
        srv.stop()
        for n in (dep.profile.head.name, dep.profile.workers[0].name):
            wipe(dep, n)


def engine_bytes(srv, repo_id: str) -> int:
    """The bytes of the files the engine loads in the hub's ``repo_id``, from its layout's
    declaration (not from the selection measured): the root shards its index names, config,
    generation config, tokenizer and template files, the index itself."""
    from sparkdeploy.lab import hub_layouts

    layout = next(la for la in hub_layouts.LAYOUTS if la.repo_id == repo_id)
    repo = srv.state.repos[repo_id]
    names = [*layout.root_weights(), *layout.tokenizer, "config.json", "generation_config.json",
             "model.safetensors.index.json"]
    return sum(repo.files[n].size for n in names)


def selected_ratio(dep: Deployment, srv, repo_id: str = RATIO_REPO) -> float:
    """``model.download`` of ``repo_id`` from the hub ``srv`` into the profile's (emptied) model
    path on the head: the file bodies the hub served, over the bytes the engine loads."""
    m = dep.profile.model.model_copy(update={"repo": repo_id, "endpoint": srv.url})
    dep.profile = dep.profile.model_copy(update={"model": m})
    srv.set_knobs(reset_stats=True)
    [res] = _must(model.download(dep), f"model.download of {repo_id}")
    _say(f"download of {repo_id}: {res.why}")
    served = sum(q["bytes"] for q in srv.stats()["requests"]
                 if q["method"] == "GET" and q.get("file") and q["status"] in (200, 206))
    return served / engine_bytes(srv, repo_id)


def measure(dep: Deployment, srv) -> dict[str, float]:
    head, worker = dep.profile.head.name, dep.profile.workers[0].name
    wipe(dep, head)
    wipe(dep, worker)
    figures: dict[str, float] = {}
    from sparkdeploy.core.events import Echo, PlainRenderer, Result

    plain = PlainRenderer(sys.stderr, progress_every=10.0)
    dep.events.listeners.append(lambda e: plain(e) if isinstance(e, (Echo, Result)) else None)
    for h in dep.hosts.values():  # show every command with its time (where the seconds go)
        if h.ctx is not None:
            h.ctx.config.run.echo = True
    meta, _ = model_ops.metadata(dep)
    total = model_ops.total_bytes(meta)
    _say(f"{len(meta['files'])} files, {total / 1e9:.2f} GB, hub limited to {LIMIT_BPS / 1e6:.0f} MB/s")

    # -- download and sync started together
    ends: dict[str, float] = {}
    results: dict[str, list] = {}

    def go(name: str, fn) -> None:
        results[name] = fn()
        ends[name] = time.monotonic()

    t0 = time.monotonic()
    threads = [threading.Thread(target=go, args=("download", lambda: model.download(dep))),
               threading.Thread(target=go, args=("sync", lambda: model_sync.sync(dep, worker)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _must(results["download"], "model.download")
    _must(results["sync"], "model.sync")
    dl = results["download"][0]
    _say(f"download: {dl.why}")
    _say(f"sync: {results['sync'][0].why}")
    _say(f"head complete after {ends['download'] - t0:.1f}s, worker after {ends['sync'] - t0:.1f}s")
    largest = max(meta["files"], key=lambda f: f["size"])["path"]
    r = dep.host(worker).run(["rm", "-f", "--", f"{PATH}/{largest}"])
    assert r.ok
    t1 = time.monotonic()
    [alone] = model_sync.sync(dep, worker, only=[largest])
    alone_s = time.monotonic() - t1
    if alone.failed:
        raise SystemExit(f"sync of {largest} alone failed: {alone.why}")
    _say(f"{largest} alone: {alone_s:.2f}s")
    figures["fanout_lag_ratio"] = max(ends["sync"] - ends["download"], 0.0) / alone_s

    # -- everything present: a re-run moves nothing
    srv.set_knobs(reset_stats=True)
    t2 = time.monotonic()
    again = [*model.download(dep), *model_sync.sync(dep, worker), *model_verify.verify(dep)]
    resync = time.monotonic() - t2
    _must(again, "the re-run")
    bodies = [q for q in srv.stats()["requests"] if q["method"] == "GET" and q.get("file")]
    if bodies or any(r.status.value != "ok" for r in again):
        raise SystemExit(f"the re-run moved something: {[r.why for r in again]} {bodies[:2]}")
    figures["resync_seconds"] = resync
    _say(f"re-run with everything present: {resync:.2f}s, no file body served")

    figures["download_rate_fraction"] = dl.details["rate"] / LIMIT_BPS

    # -- sync of downloaded weights vs rsync -a over ssh, the worker emptied before each
    addr = dep.profile.node(worker).link.address
    naive = ["rsync", "-a", "--exclude=.cache", "--exclude=.sparkdeploy", "-e",
             "ssh -o BatchMode=yes -o StrictHostKeyChecking=yes", "--", f"{PATH}/",
             f"{addr}:{PATH}/"]
    ours_t, naive_t = [], []
    for kind in ("naive", "ours", "ours", "naive", "naive", "ours"):
        wipe(dep, worker)
        c3 = busy_cpu()
        t3 = time.monotonic()
        if kind == "naive":
            r = dep.host(head).run(naive, timeout=3600)
            if not r.ok:
                raise SystemExit(f"{shlex.join(naive)}: {r.one_line_error()}")
            naive_t.append(time.monotonic() - t3)
        else:
            _must(model_sync.sync(dep, worker), "model.sync")
            ours_t.append(time.monotonic() - t3)
        _say(f"{kind}: {time.monotonic() - t3:.2f}s for {total / 1e9:.2f} GB "
             f"(the machine's CPUs busy {busy_cpu() - c3:.2f}s meanwhile, {os.cpu_count()} CPUs)")
    figures["sync_speedup"] = (total / min(ours_t)) / (total / min(naive_t))
    order = ["fanout_lag_ratio", "resync_seconds", "download_rate_fraction", "sync_speedup"]
    return {k: figures[k] for k in order}
