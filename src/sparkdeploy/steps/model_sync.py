"""``model.sync``: the weights head -> workers over the fast link, file by file, pipelined.

A file is sent as soon as the head's record (``<path>/.sparkdeploy/verified.jsonl``, written by
the downloader as each file completes and is hashed) says it is complete and verified, so the
sync may start while ``model.download`` runs and the workers finish shortly after the head.
Each file is verified on arrival (size and sha256 against the same hub metadata) and recorded on
the worker; a worker that holds a verified file serves it to the next workers.

Transports (``model.sync.transport``):

- ``rsyncd`` (default): on each receiver an rsync daemon bound to its fast-link address only
  (``hosts allow`` = the deployment's link addresses), one module at the model path, one user
  whose one-time secret reaches the daemon (a 0600 file in a private 0700 directory) and each
  sender (``--password-file=-``) through SSH stdin. Several files in flight per node
  (``streams``), no SSH cipher in the data path. The daemon is stopped by PID and its directory
  removed when the sync ends, whatever happened.
- ``ssh``: plain ``rsync`` over SSH from the sender to the receiver's link address (the
  fallback; the nodes must trust each other's host keys, as for ``image.ship``).

Interrupted transfers keep their partial data (``--partial-dir``) and a re-run resumes them;
files already verified on a worker are never sent again.
"""

from __future__ import annotations

import secrets as pysecrets
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sparkdeploy.deployment import Deployment
from sparkdeploy.hosts import Host
from sparkdeploy.nodeops import NodeUnreachable
from sparkdeploy.results import Result, changed, failed, ok, skipped
from sparkdeploy.steps.model import (
    GB,
    SCRIPT,
    ModelError,
    Staged,
    disk_check,
    error_line,
    helper_json,
    metadata,
    node_state,
    stage_for,
    total_bytes,
)
from sparkdeploy.wait import Stop, WaitTimeout, wait_for

SYNC = "model.sync"
PARTIAL = ".sparkdeploy/partial"
START_GRACE_S = 180.0
"""How long a sync waits for a download to show up on the head before giving up."""
CHECKS_PER_RECEIVER = 2
DISK_FULL = ("No space left on device", "ENOSPC", "Disk quota exceeded")


@dataclass
class Daemon:
    host: Host
    pid: int
    port: int
    private: str
    stopped: bool = False  # set by _run when it stops the daemon before the sync ends


def rsync_available(host: Host) -> str | None:
    """None when rsync is on the node, else the one line to show."""
    r = host.run(["rsync", "--version"], change=False)
    if r.ok:
        return None
    return f"{host.name}: rsync is not installed (install it: apt-get install rsync)"


def serve_argv(dep: Deployment, dst: Host, st: Staged, allow: list[str]) -> list[str]:
    s = dep.profile.model.sync
    return st.run(["python3", st.script, "serve", "--address", dst.node.link.address, "--port",
                   str(s.port), "--dir", dep.profile.model.path, "--allow", ",".join(allow),
                   "--max-connections", str(2 * s.streams + 2)])


def start_daemon(dep: Deployment, dst: Host, st: Staged, secret: str, allow: list[str]) -> Daemon:
    out = helper_json(dst, serve_argv(dep, dst, st, allow),
                      f"cannot start the rsync daemon on {dst.node.link.address}",
                      input=secret + "\n", timeout=60)
    return Daemon(dst, int(out["pid"]), int(out["port"]), out["private"])


def stop_daemon(d: Daemon, st: Staged) -> None:
    d.host.run(st.run(["python3", st.script, "unserve", "--pid", str(d.pid), "--private",
                       d.private]), timeout=60)


def send_argv(dep: Deployment, src: Host, dst: Host, files: list[str], port: int | None) -> list[str]:
    """The rsync the sender runs for a batch of files (layout kept through ``--relative``)."""
    path = dep.profile.model.path.rstrip("/")
    # --ignore-times: a file is sent because it is not verified there, whatever its size and time
    argv = ["rsync", "-rlt", "--ignore-times", "--relative", "--whole-file", f"--partial-dir={PARTIAL}",
            "--timeout=60"]
    cap = dep.profile.model.sync.bwlimit_mb_s
    if cap is not None:  # rsync counts in KiB/s
        argv.append(f"--bwlimit={max(1, round(cap * 1e6 / 1024))}")
    srcs = [f"{path}/./{rel}" for rel in files]
    if port is not None:  # rsyncd
        return [*argv, "--password-file=-", "--", *srcs,
                f"rsync://sparkdeploy@{dst.node.link.address}:{port}/model/"]
    return [*argv, "-e", "ssh -o BatchMode=yes -o StrictHostKeyChecking=yes", "--", *srcs,
            f"{dst.node.link.address}:{path}/"]


Batch = tuple[tuple[str, ...], str, str]
"""(files, sender, receiver): one rsync stream."""


GROUP_BELOW = 32 * 1024 * 1024
"""Files smaller than this travel together in one rsync; larger ones one per stream, so the
streams stay balanced and each file is verified while the next is on the wire."""


@dataclass
class Plan:
    """Who needs what and who holds what (the scheduling state of one sync).

    A batch occupies a stream of its sender and of its receiver while rsync runs (``sent``
    frees them) and stays in flight until the receiver has verified it (``verified``)."""

    need: dict[str, list[str]]  # receiver -> files still to receive (in send order)
    holders: dict[str, list[str]] = field(default_factory=dict)  # file -> nodes holding it verified
    sizes: dict[str, int] = field(default_factory=dict)  # file -> bytes (unknown: sent alone)
    out_load: dict[str, int] = field(default_factory=dict)  # streams a node sends
    in_load: dict[str, int] = field(default_factory=dict)  # streams a node receives
    busy: set[tuple[str, str]] = field(default_factory=set)  # (file, receiver) in flight
    failed: dict[str, str] = field(default_factory=dict)  # receiver -> why it stopped

    def _batches(self, files: list[str], k: int) -> list[tuple[str, ...]]:
        """Up to ``k`` batches from the head of ``files``: a large file alone, or a run of small
        ones together."""
        out: list[tuple[str, ...]] = []
        cur: list[str] = []
        cur_bytes = 0
        for f in files:
            if len(out) == k:
                break
            size = self.sizes.get(f, GROUP_BELOW)
            if size >= GROUP_BELOW:
                out.append((f,))
                continue
            cur.append(f)
            cur_bytes += size
            if cur_bytes >= GROUP_BELOW:
                out.append(tuple(cur))
                cur, cur_bytes = [], 0
        if cur and len(out) < k:
            out.append(tuple(cur))
        return out

    def next_transfers(self, streams: int, head: str) -> list[Batch]:
        """Batches to start now. A worker holding a file serves it before the head does; no node
        sends or receives more than ``streams`` streams at once; each free stream takes the next
        file ready for its receiver (a run of small files counts as one)."""
        out: list[Batch] = []
        for dst, files in self.need.items():
            if dst in self.failed:
                continue
            avail = [f for f in files if (f, dst) not in self.busy
                     and any(h != dst for h in self.holders.get(f, []))]
            srcs = {h for f in avail for h in self.holders[f] if h != dst}
            for src in sorted(srcs, key=lambda s: (s == head, self.out_load.get(s, 0), s)):
                k = min(streams - self.in_load.get(dst, 0), streams - self.out_load.get(src, 0))
                mine = [f for f in avail if src in self.holders[f] and (f, dst) not in self.busy]
                if k <= 0 or not mine:
                    continue
                for b in self._batches(mine, k):
                    self.busy.update((f, dst) for f in b)
                    out.append((b, src, dst))
                    self.out_load[src] = self.out_load.get(src, 0) + 1
                    self.in_load[dst] = self.in_load.get(dst, 0) + 1
        return out

    def sent(self, batch: Batch) -> None:
        """rsync of ``batch`` ended: its streams are free; its files await verification."""
        _, src, dst = batch
        self.out_load[src] -= 1
        self.in_load[dst] -= 1

    def verified(self, batch: Batch, good: list[str]) -> None:
        files, _, dst = batch
        self.busy.difference_update((f, dst) for f in files)
        for f in good:
            if f in self.need[dst]:
                self.need[dst].remove(f)
                self.holders.setdefault(f, []).append(dst)

    def done(self) -> bool:
        return all(not files or dst in self.failed for dst, files in self.need.items())


def sync(dep: Deployment, to: str = "all") -> list[Result]:
    head = dep.profile.head.name
    targets = [h for h in (dep.select(to) if to != "all" else
                           [dep.host(n.name) for n in dep.profile.workers]) if h.name != head]
    if not targets:
        return [dep.report(ok(SYNC, "no worker to sync to"))]
    try:
        meta, note = metadata(dep)
    except ModelError as e:
        return [dep.report(failed(SYNC, str(e)))]
    res = sync_files(dep, targets, meta, note=note)
    return [dep.report(res)]


def sync_files(dep: Deployment, targets: list[Host], meta: dict[str, Any],
               only: list[str] | None = None, step_name: str = SYNC, note: str = "") -> Result:
    m = dep.profile.model
    s = m.sync
    head = dep.host(dep.profile.head.name)
    order = [f["path"] for f in meta["files"] if only is None or f["path"] in set(only)]
    sizes = {f["path"]: f["size"] for f in meta["files"]}
    note = f" ({note})" if note else ""
    staged: dict[str, Staged] = {}
    daemons: list[Daemon] = []
    secret = pysecrets.token_urlsafe(32) if s.transport == "rsyncd" else None
    allow = [n.link.address for n in dep.profile.nodes]

    def prepare(h: Host) -> dict[str, Any]:
        """One node's setup, beside the others': the round trips, not the bytes, are what a
        sync of weights already in place costs."""
        staged[h.name] = stage_for(h, meta)
        if h is head:  # what the head holds already (records only); rsync there
            state = node_state(dep, h, staged[h.name], only=order, quick=True, step_name=step_name)
            return {"state": state, "rsync": rsync_available(h)}
        state = node_state(dep, h, staged[h.name], only=order, quick=True, step_name=step_name)
        if state["unchecked"] and not dep.dry:  # present, right size, not yet verified here
            state = node_state(dep, h, staged[h.name], only=order, step_name=step_name)
        have = set(state["ok"])
        need = [f for f in order if f not in have]
        out: dict[str, Any] = {"need": need}
        if not need:
            return out
        out["short"] = disk_check(dep, h, total_bytes(meta, need), step_name)
        out["rsync"] = rsync_available(h)
        if secret is not None and not dep.dry and out["short"] is None and out["rsync"] is None:
            d = start_daemon(dep, h, staged[h.name], secret, allow)
            daemons.append(d)
        return out

    try:
        nodes = [head, *targets]
        ready = dict(zip([h.name for h in nodes], each(prepare, nodes), strict=True))
        need = {t.name: ready[t.name]["need"] for t in targets}
        if not any(need.values()):
            names = ", ".join(t.name for t in targets)
            return ok(step_name, f"{names}: all {len(order)} files already there and verified "
                      f"({total_bytes(meta, order) / GB:.2f} GB){note}", ",".join(need))
        short = [ready[t.name]["short"] for t in targets if ready[t.name].get("short")]
        if short:
            return short[0]
        for h in nodes:
            why = ready[h.name].get("rsync")
            if why:
                return failed(step_name, why, h.name)
        if dep.dry:
            parts = [f"{len(v)} files ({total_bytes(meta, v) / GB:.2f} GB) to {k}"
                     for k, v in need.items() if v]
            return skipped(step_name, f"would send {', '.join(parts)} over {s.transport}{note}")
        plan = Plan(need={k: v for k, v in need.items() if v}, sizes=sizes)
        head_state = ready[head.name]["state"]
        for f in head_state["ok"]:
            plan.holders.setdefault(f, []).append(head.name)
        ports: dict[str, int | None] = {t.name: None for t in targets}
        for d in daemons:
            ports[d.host.name] = d.port
        return _run(dep, head, targets, plan, staged, ports, secret, sizes, order,
                    step_name, note, daemons, head_state)
    except (ModelError, NodeUnreachable) as e:
        return failed(step_name, str(e), getattr(e, "node", None))
    finally:
        # the ones _run stopped early (nothing left to send to them) are gone already
        each(lambda d: stop_daemon(d, staged[d.host.name]), [d for d in daemons if not d.stopped])


def each(fn, items: list) -> list:
    """``fn`` over ``items`` at once (one thread each), results in order; the first exception
    is raised once all have ended."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        futs = [pool.submit(fn, x) for x in items]
        return [f.result() for f in futs]


def _run(dep: Deployment, head: Host, targets: list[Host], plan: Plan,
         staged: dict[str, Staged], ports: dict[str, int | None], secret: str | None,
         sizes: dict[str, int], order: list[str], step_name: str, note: str,
         daemons: list[Daemon], head_state: dict[str, Any]) -> Result:
    s = dep.profile.model.sync
    hosts = {h.name: h for h in [head, *targets]}
    totals = {k: sum(sizes[f] for f in v) for k, v in plan.need.items()}
    moved = dict.fromkeys(plan.need, 0)
    started = time.monotonic()
    first_seen = time.monotonic()
    last_head_poll = time.monotonic()  # the head's state came with the setup
    head_running = bool(head_state.get("download_running"))
    sending: dict[Future, Batch] = {}  # rsync running
    futures: dict[Future, Batch] = {}  # sent, being verified on the receiver
    errors: dict[str, str] = {}

    def send(batch: Batch) -> str | None:
        """rsync one batch; None, or why it failed (what arrived is still verified)."""
        files, src, dst = batch
        try:
            r = hosts[src].run(send_argv(dep, hosts[src], hosts[dst], list(files), ports[dst]),
                               input=(secret + "\n") if secret else None, timeout=24 * 3600)
        except NodeUnreachable as e:
            return str(e)
        if r.ok:
            return None
        text = r.stderr
        if any(k in text for k in DISK_FULL):
            return f"disk full on {dst} ({dep.profile.model.path})"
        return (f"sending {len(files)} files {src} -> {dst} failed: "
                f"{error_line(text, r.one_line_error())}")

    def check(dst: str, arrived: list[tuple[Batch, str | None]]
              ) -> list[tuple[Batch, list[str], str | None]]:
        """Verify on arrival, beside the next files on the wire: every batch whose rsync ended
        since the receiver's last check, in one helper run. Per batch: (verified, error)."""
        files = [f for batch, _ in arrived for f in batch[0]]
        try:
            got = node_state(dep, hosts[dst], staged[dst], only=files, step_name=step_name,
                             progress=False)
        except (ModelError, NodeUnreachable) as e:
            return [(batch, [], err or str(e)) for batch, err in arrived]
        out = []
        for batch, err in arrived:
            good = [f for f in batch[0] if f in got["ok"]]
            bad = [f for f in batch[0] if f not in got["ok"]]
            if err is None and bad:
                why = got["differ"].get(bad[0]) or ("missing" if bad[0] in got["missing"]
                                                    else "not verified")
                err = f"{bad[0]} arrived on {dst} but {why}"
            out.append((batch, good, err))
        return out

    def refresh_head() -> None:
        nonlocal last_head_poll, head_running
        last_head_poll = time.monotonic()
        waiting = [f for f in order if head.name not in plan.holders.get(f, [])
                   and any(f in v for v in plan.need.values())]
        if not waiting:
            return
        state = node_state(dep, head, staged[head.name], only=waiting, quick=True, step_name=step_name)
        for f in state["ok"]:
            plan.holders.setdefault(f, []).insert(0, head.name)
        head_running = bool(state.get("download_running"))
        still = [f for f in waiting if f not in state["ok"]]
        if still and not head_running and time.monotonic() - first_seen > START_GRACE_S:
            raise Stop(f"{head.name} lacks {len(still)} files (e.g. {still[0]}) and no "
                       f"download is running there (run model.download)")

    pool = ThreadPoolExecutor(max_workers=max(1, s.streams * len(targets)))
    verifiers = ThreadPoolExecutor(max_workers=max(1, CHECKS_PER_RECEIVER * len(targets)))

    arrived: dict[str, list[tuple[Batch, str | None]]] = {}  # receiver -> sent, to check

    def probe() -> bool:
        progressed = False
        for fut in [f for f in sending if f.done()]:
            batch = sending.pop(fut)
            plan.sent(batch)  # its streams take the next files while it is verified
            arrived.setdefault(batch[2], []).append((batch, fut.result()))
            progressed = True
        for fut in [f for f in futures if f.done()]:
            futures.pop(fut)
            for batch, good, err in fut.result():
                dst = batch[2]
                plan.verified(batch, good)
                moved[dst] += sum(sizes[f] for f in good)
                dep.events.progress(step_name, dst, moved[dst], totals[dst], "B",
                                    f"{len(order) - len(plan.need[dst])}/{len(order)} files")
                if err is not None:
                    errors.setdefault(dst, err)
                    plan.failed.setdefault(dst, err)
            progressed = True
        for dst in [d for d, v in arrived.items() if v]:
            # two checks at a time per receiver, each of all that arrived since: the last file
            # is checked as soon as it lands, and Python starts once per wave, not per file
            if sum(1 for b in futures.values() if b[2] == dst) < CHECKS_PER_RECEIVER:
                todo = arrived.pop(dst)
                futures[verifiers.submit(check, dst, todo)] = todo[0][0]
        for d in daemons:
            # nothing left to send to it (a failed check ends that receiver's sync): its
            # listener goes now, beside the last checks
            name = d.host.name
            if not d.stopped and not any(b[2] == name for b in sending.values()) and (
                    name in plan.failed or all((f, name) in plan.busy for f in plan.need[name])):
                d.stopped = True
                pool.submit(stop_daemon, d, staged[name])
        if plan.done() and not futures and not sending and not arrived:
            return True
        if time.monotonic() - last_head_poll >= 0.5:
            before = sum(len(v) for v in plan.holders.values())
            refresh_head()
            progressed = progressed or sum(len(v) for v in plan.holders.values()) > before
        for batch in plan.next_transfers(s.streams, head.name):
            sending[pool.submit(send, batch)] = batch
        return progressed

    try:
        while not (plan.done() and not futures and not sending and not arrived):
            # a short interval: a stream idles from its rsync's end to the next probe
            wait_for(probe, deadline=s.stall_timeout_s, interval=0.02,
                     what="a file to become ready on the head or to arrive on a worker",
                     clock=dep.clock, sleep=dep.sleep)
    except Stop as e:
        _drain(sending, futures)
        return failed(step_name, f"{e}; {_kept(plan, targets, order)}", head.name)
    except WaitTimeout as e:
        _drain(sending, futures)
        return failed(step_name, f"stalled: {e}; {_kept(plan, targets, order)}")
    finally:
        pool.shutdown(wait=True)
        verifiers.shutdown(wait=True)
    secs = time.monotonic() - started
    if errors:
        dst, why = next(iter(errors.items()))
        return failed(step_name, f"{why}; {_kept(plan, targets, order)}, a re-run resumes", dst)
    total = sum(moved.values())
    names = ", ".join(t.name for t in targets if t.name in totals)
    return changed(step_name, f"{names}: sent {sum(1 for _ in _sent(plan))} files "
                   f"({total / GB:.2f} GB) over {s.transport} in {secs:.1f}s "
                   f"({total / max(secs, 1e-6) / 1e6:.0f} MB/s), verified on arrival{note}",
                   ",".join(totals), bytes=total, seconds=secs, transport=s.transport)


def _sent(plan: Plan):
    for f, nodes in plan.holders.items():
        for n in nodes:
            if n in plan.need:
                yield f, n


def _drain(*running: dict[Future, Any]) -> None:
    for futures in running:
        for fut in list(futures):
            fut.result()


def _kept(plan: Plan, targets: list[Host], order: list[str]) -> str:
    parts = [f"{t.name} has {len(order) - len(plan.need.get(t.name, []))}/{len(order)} files "
             f"verified" for t in targets]
    return "; ".join(parts)


__all__ = ["SYNC", "Plan", "send_argv", "serve_argv", "sync", "sync_files", "SCRIPT"]
