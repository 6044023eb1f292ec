"""``model.sync``: the weights head -> workers over the fast link, pipelined.

A file is sent as soon as the head's record (``<path>/.sparkdeploy/verified.jsonl``, written by
the downloader as each file completes and is hashed) says it is complete and verified, so the
sync may start while ``model.download`` runs and the workers finish shortly after the head.

On each receiver one helper (``model_node.py receive``, a ``Receiver`` here) lives as long as
the sync: it says what the node holds and how much room it has, starts the rsync daemon once
it hears which files will come, and checks each file (size and sha256 against the same hub
metadata) as soon as rsync renames it into place, beside the transfers still running, then
records it. So one rsync per stream can carry many files, and a worker that holds a verified
file serves it to the next workers at once.

Transports (``model.sync.transport``):

- ``rsyncd`` (default): the receiver's rsync daemon is bound to its fast-link address only
  (``hosts allow`` = the deployment's link addresses), one module at the model path, one user
  whose one-time secret reaches the daemon (a 0600 file in a private 0700 directory) and each
  sender (``--password-file=-``) through SSH stdin. Several streams per node (``streams``), no
  SSH cipher in the data path. The daemon stops and its directory goes when the helper's stdin
  ends: when the sync ends, whatever happened, or when its SSH connection is gone.
- ``ssh``: plain ``rsync`` over SSH from the sender to the receiver's link address (the
  fallback; the nodes must trust each other's host keys, as for ``image.ship``).

Interrupted transfers keep their partial data (``--partial-dir``) and a re-run resumes them;
files already verified on a worker are never sent again.
"""

from __future__ import annotations

import contextlib
import json
import queue
import secrets as pysecrets
import shlex
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from sparkdeploy.core import threads
from sparkdeploy.core.outcomes import Result
from sparkdeploy.core.wait import Stop, WaitTimeout, wait_for
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.fanout import Outcome, pick_source
from sparkdeploy.node.hosts import Feed, Host, peer_ssh_argv
from sparkdeploy.node.nodeops import HelperFailed, NodeUnreachable, helper_error, run_helper
from sparkdeploy.ops import Ctx
from sparkdeploy.ops.model import (
    GB,
    SCRIPT,
    FileReport,
    ModelError,
    ReadyReport,
    ReceiverState,
    Staged,
    disk_check,
    node_state,
    short_of,
    stage_for,
    total_bytes,
)

SYNC = "model.sync"
PARTIAL = ".sparkdeploy/partial"
START_GRACE_S = 180.0
"""How long a sync waits for a download to show up on the head before giving up."""
DISK_FULL = ("No space left on device", "ENOSPC", "Disk quota exceeded")
HELPER_TIMEOUT_S = 24 * 3600
"""The longest a receiving helper or a stream's rsync may run."""


def rsync_available(host: Host) -> str | None:
    """None when rsync is on the node, else the one line to show."""
    r = host.run(["rsync", "--version"], change=False)
    if r.ok:
        return None
    return f"{host.name}: rsync is not installed (install it: apt-get install rsync)"


def receive_argv(dep: Deployment, dst: Host, st: Staged, allow: list[str] | None) -> list[str]:
    """The helper that receives on ``dst``; ``allow`` (rsyncd): the addresses its daemon admits
    (``run_helper`` runs it only while its staged files match)."""
    m = dep.profile.model
    argv = ["python3", st.script, "receive", "--dir", m.path, "--spec", st.spec]
    if allow is not None:
        argv += ["--address", dst.node.link.address, "--port", str(m.sync.port),
                 "--allow", ",".join(allow), "--max-connections", str(2 * m.sync.streams + 2)]
    return argv


class ReceiveReport(BaseModel):
    """What ``receive`` reports last, when nothing more comes (its counts: kept, not read)."""

    model_config = ConfigDict(extra="allow")


EVENTS: dict[str, type[BaseModel]] = {"file": FileReport, "state": ReceiverState, "ready": ReadyReport}
"""The events ``receive`` says while it runs."""


class Receiver:
    """The helper on one receiver for as long as a sync concerns it.

    It says what the node holds of the sync's files (``state``), is told which will be sent
    (``expect``: its rsync daemon starts then, with rsyncd), checks each file as it lands,
    beside the transfers still running, and hears which batches have ended (``settle``).
    Commands reach it on stdin (a ``Feed``); stdin's end (``end``) tells it nothing more comes:
    its daemon stops, and it reports what is left and exits. Its reports come back as events
    while it runs (``run_helper``'s streaming form). Waiting for its word ends when it says
    nothing (not even the progress of hashing what the node holds) for
    ``model.sync.stall_timeout_s``."""

    def __init__(self, ctx: Ctx, host: Host, st: Staged, scope: list[str],
                 secret: str | None, allow: list[str]):
        self.ctx, self.host, self.dep = ctx, host, ctx.dep
        dep = ctx.dep
        self.port: int | None = None
        self.error: str | None = None
        self.ending = False  # end() was called
        self.finished = threading.Event()
        self._state: dict[str, Any] | None = None
        self._ready = False
        self._heard = threading.Event()  # state or ready (or the end) came
        self._reports: queue.SimpleQueue[tuple[str, str, str]] = queue.SimpleQueue()
        self._last_word = dep.clock()
        self._feed = Feed()
        self._feed.send((secret + "\n" if secret else "") + json.dumps(scope) + "\n")
        argv = receive_argv(dep, host, st, allow if secret else None)
        self._thread = threading.Thread(target=self._run, args=(st, argv), daemon=True)
        self._thread.start()

    def _on_event(self, kind: str, got: BaseModel | HelperFailed) -> None:
        self._last_word = self.dep.clock()
        if isinstance(got, HelperFailed):  # not JSON, or not what the helper says
            self.error = self.error or str(got).splitlines()[0]
            self._heard.set()
            return
        d: dict[str, Any] = got.model_dump()
        if kind == "file":
            self._reports.put((d["path"], d["state"], d["why"]))
        elif kind == "state":
            self._state = d
            self._heard.set()
        elif kind == "ready":
            self.port = d["port"]
            self._ready = True
            self._heard.set()

    def _on_progress(self, p: dict[str, str]) -> None:
        self._last_word = self.dep.clock()
        self.ctx.progress(self.host.name, int(p.get("bytes", 0)), int(p.get("total", 0)) or None, "B",
                          "hashing")

    def _on_line(self, line: str) -> None:
        self._last_word = self.dep.clock()

    def _run(self, st: Staged, argv: list[str]) -> None:
        where = f"{self.host.name}: receive"
        try:
            run_helper(self.host, SCRIPT, [], result=ReceiveReport, script=st.script, also=[st.spec],
                       wrap=lambda _: argv, where=where, input=self._feed, timeout=HELPER_TIMEOUT_S,
                       change=True, events=EVENTS, on_event=self._on_event,
                       on_progress=self._on_progress, on_line=self._on_line)
        except HelperFailed as e:
            self.error = f"{self.host.name}: receiving failed: {str(e).removeprefix(where + ': ')}"
        except NodeUnreachable as e:
            self.error = str(e)
        finally:
            self._feed.close()
            self.finished.set()
            self._heard.set()

    def _hear(self, came: Callable[[], bool], what: str) -> None:
        silence = self.dep.profile.model.sync.stall_timeout_s

        def heard() -> bool:
            if came():
                return True
            if self.error:  # it said something that is not what the helper says
                raise Stop(self.error)
            if self.finished.is_set():
                raise Stop(self.error or f"{self.host.name}: the receiving helper ended "
                           f"before its {what}")
            if self.dep.clock() - self._last_word > silence:
                raise Stop(f"{self.host.name}: the receiving helper said nothing for "
                           f"{silence}s before its {what}")
            return False

        def until_heard(seconds: float) -> None:
            self._heard.wait(seconds)
            self._heard.clear()

        try:
            wait_for(heard, deadline=HELPER_TIMEOUT_S, interval=1.0, clock=self.dep.clock,
                     sleep=until_heard, what=f"the {what} of the receiving helper on "
                     f"{self.host.name}")
        except (Stop, WaitTimeout) as e:
            raise ModelError(str(e)) from None

    def state(self) -> dict[str, Any]:
        """What the node holds of the sync's files (as ``node_state``), and its free space."""
        self._hear(lambda: self._state is not None, "state")
        assert self._state is not None
        return self._state

    def expect(self, files: list[str]) -> None:
        """``files`` will be sent: returns once the daemon listens (``port``; None without one)."""
        with contextlib.suppress(ValueError):  # the helper has ended: _hear says how
            self._feed.send("expect " + json.dumps(files) + "\n")
        self._hear(lambda: self._ready, "daemon")

    def settle(self, files: list[str]) -> None:
        """The transfer of ``files`` ended: each is reported, landed or not."""
        with contextlib.suppress(ValueError):  # the helper has ended: its end is what counts
            self._feed.send("settle " + json.dumps(files) + "\n")

    def again(self, files: list[str]) -> None:
        """``files``, reported missing, will be sent again (from another sender)."""
        with contextlib.suppress(ValueError):  # the helper has ended: its end is what counts
            self._feed.send("expect " + json.dumps(files) + "\n")

    def end(self) -> None:
        """Nothing more comes: the daemon stops; what is left is reported."""
        self.ending = True
        self._feed.close()

    def reports(self) -> list[tuple[str, str, str]]:
        out = []
        while True:
            try:
                out.append(self._reports.get_nowait())
            except queue.Empty:
                return out

    def join(self, timeout: float = 60) -> None:
        self.end()
        self._thread.join(timeout)


def send_argv(dep: Deployment, src: Host, dst: Host, files: list[str], port: int | None) -> list[str]:
    """The rsync the sender runs for a batch of files (layout kept through ``--relative``)."""
    path = dep.profile.model.path.rstrip("/")
    # --ignore-times: a file is sent because it is not verified there, whatever its size and
    # time; --checksum-choice=none: rsync's own checksum of the data is redundant, the receiver
    # checks each file's sha256 as it lands (none also implies --whole-file)
    argv = ["rsync", "-rlt", "--ignore-times", "--relative", "--whole-file",
            "--checksum-choice=none", f"--partial-dir={PARTIAL}", "--timeout=60"]
    cap = dep.profile.model.sync.bwlimit_mb_s
    if cap is not None:  # rsync counts in KiB/s
        argv.append(f"--bwlimit={max(1, round(cap * 1e6 / 1024))}")
    srcs = [f"{path}/./{rel}" for rel in files]
    if port is not None:  # rsyncd
        return [*argv, "--password-file=-", "--", *srcs,
                f"rsync://sparkdeploy@{dst.node.link.address}:{port}/model/"]
    return [*argv, "-e", shlex.join(peer_ssh_argv()), "--", *srcs,
            f"{dst.node.link.address}:{path}/"]


Batch = tuple[tuple[str, ...], str, str]
"""(files, sender, receiver): one rsync stream."""


@dataclass
class Schedule:
    """Who needs what and who holds what (the scheduling state of one sync).

    A batch occupies a stream of its sender and of its receiver while rsync runs (``sent``
    frees them); each of its files stays in flight until the receiver has checked it
    (``resolved``)."""

    need: dict[str, list[str]]  # receiver -> files still to receive (in send order)
    holders: dict[str, list[str]] = field(default_factory=dict)  # file -> nodes holding it verified
    sizes: dict[str, int] = field(default_factory=dict)  # file -> bytes
    out_load: dict[str, int] = field(default_factory=dict)  # streams a node sends
    in_load: dict[str, int] = field(default_factory=dict)  # streams a node receives
    busy: set[tuple[str, str]] = field(default_factory=set)  # (file, receiver) in flight
    failed: dict[str, str] = field(default_factory=dict)  # receiver -> why it stopped
    lost: dict[str, str] = field(default_factory=dict)  # sender -> why it sends no more
    via: dict[tuple[str, str], str] = field(default_factory=dict)  # (file, receiver) -> sender
    head_to: dict[str, str] = field(default_factory=dict)  # file -> the one receiver the head sends it
    pair_load: dict[tuple[str, str], int] = field(default_factory=dict)  # streams sender -> receiver

    def _batches(self, files: list[str], k: int) -> list[tuple[str, ...]]:
        """``files`` over up to ``k`` streams, even in bytes (each file, largest first, onto the
        stream with the fewest bytes, then files, so far); each stream's files in send order.
        One rsync per stream carries all of its files: the receiver checks each as it lands."""
        n = min(k, len(files))
        bins: list[list[str]] = [[] for _ in range(n)]
        load = [0] * n
        for f in sorted(files, key=lambda x: -self.sizes.get(x, 0)):
            i = min(range(n), key=lambda j: (load[j], len(bins[j]), j))
            bins[i].append(f)
            load[i] += self.sizes.get(f, 0)
        pos = {f: i for i, f in enumerate(files)}
        return [tuple(sorted(b, key=pos.__getitem__)) for b in bins]

    def sources(self, f: str, dst: str, head: str) -> list[str]:
        """The nodes that may send ``f`` to ``dst``: they hold it verified, and neither failed
        as a receiver nor was lost as a sender. The head sends each file once: not while a
        worker holds it, or it is on its way to one, from the head."""
        ok = [h for h in self.holders.get(f, [])
              if h != dst and h not in self.failed and h not in self.lost]
        if head in ok and (any(h != head for h in ok) or any(
                g == f and self.via.get((g, x)) == head and x not in self.failed
                for g, x in self.busy) or self._head_sends(f) != dst):
            ok.remove(head)
        return ok

    def _head_sends(self, f: str) -> str | None:
        """The receiver the head sends ``f`` to: the files go round the receivers (the one
        with the fewest so far), so the head's link feeds every worker at once and each relays
        its share to the others; another is chosen when that one failed or has it."""
        to = self.head_to.get(f)
        if to is None or to in self.failed or f not in self.need.get(to, []):
            count = {d: 0 for d in self.need}
            for d in self.head_to.values():
                count[d] = count.get(d, 0) + 1
            wanting = [d for d, files in self.need.items() if f in files and d not in self.failed]
            if not wanting:
                return None
            to = self.head_to[f] = min(wanting, key=lambda d: count[d])
        return to

    def head_share(self, streams: int) -> int:
        """Streams the head gives one receiver: its streams split over the receivers still
        waiting (at least one), so no receiver's share waits behind another's."""
        waiting = [d for d, files in self.need.items() if files and d not in self.failed]
        return max(1, streams // max(1, len(waiting)))

    def next_transfers(self, streams: int, head: str) -> list[Batch]:
        """Batches to start now, as a tree per file (``fanout.pick_source``): the head sends each
        file once, the workers holding it serve the rest, the least loaded first (so the
        holders double); no node sends or receives
        more than ``streams`` streams at once; the files ready for a receiver are spread over
        the streams free for it."""
        out: list[Batch] = []
        for dst, files in self.need.items():
            if dst in self.failed:
                continue
            may = {f: self.sources(f, dst, head) for f in files if (f, dst) not in self.busy}
            avail = [f for f in files if may.get(f)]
            srcs = list(dict.fromkeys(h for f in avail for h in may[f]))
            while srcs:
                src = pick_source(srcs, head, self.out_load)
                srcs.remove(src)
                k = min(streams - self.in_load.get(dst, 0), streams - self.out_load.get(src, 0))
                if src == head:
                    k = min(k, self.head_share(streams) - self.pair_load.get((head, dst), 0))
                mine = [f for f in avail if src in may[f] and (f, dst) not in self.busy]
                if k <= 0 or not mine:
                    continue
                for b in self._batches(mine, k):
                    self.busy.update((f, dst) for f in b)
                    self.via.update(((f, dst), src) for f in b)
                    out.append((b, src, dst))
                    self.out_load[src] = self.out_load.get(src, 0) + 1
                    self.pair_load[src, dst] = self.pair_load.get((src, dst), 0) + 1
                    self.in_load[dst] = self.in_load.get(dst, 0) + 1
        return out

    def lose(self, src: str, why: str) -> None:
        """``src`` failed while sending: it sends no more; what it did not deliver waits for
        another sender."""
        self.lost.setdefault(src, why)

    def retry(self, f: str, dst: str) -> bool:
        """``f`` did not reach ``dst`` because its sender was lost: it waits for another."""
        if self.via.get((f, dst)) not in self.lost:
            return False
        self.busy.discard((f, dst))
        return True

    def sent(self, batch: Batch) -> None:
        """rsync of ``batch`` ended: its streams are free; its files await their check."""
        _, src, dst = batch
        self.out_load[src] -= 1
        self.pair_load[src, dst] -= 1
        self.in_load[dst] -= 1

    def resolved(self, f: str, dst: str, good: bool) -> None:
        """``dst`` checked ``f``: verified there (it may serve it now), or not."""
        self.busy.discard((f, dst))
        if good and f in self.need[dst]:
            self.need[dst].remove(f)
            self.holders.setdefault(f, []).append(dst)

    def waiting_only(self, dst: str) -> bool:
        """Everything ``dst`` still needs is in flight (or it failed): nothing more goes to it."""
        return dst in self.failed or all(
            (f, dst) in self.busy and self.via.get((f, dst)) not in self.lost
            for f in self.need[dst])

    def done(self) -> bool:
        return all(not files or dst in self.failed for dst, files in self.need.items())


def sync_files(ctx: Ctx, targets: list[Host], meta: dict[str, Any],
               only: list[str] | None = None, note: str = "") -> Result:
    """Send ``targets`` the files (of ``only``) they lack, as the step ``ctx`` reports for
    (``model.verify --repair`` too); one result."""
    dep = ctx.dep
    m = dep.profile.model
    s = m.sync
    head = dep.host(dep.profile.head.name)
    order = [f["path"] for f in meta["files"] if only is None or f["path"] in set(only)]
    sizes = {f["path"]: f["size"] for f in meta["files"]}
    note = f" ({note})" if note else ""
    staged: dict[str, Staged] = {}
    receivers: dict[str, Receiver] = {}
    secret = pysecrets.token_urlsafe(32) if s.transport == "rsyncd" else None
    allow = [n.link.address for n in dep.profile.nodes]

    def prepare(h: Host) -> dict[str, Any]:
        """One node's setup, beside the others': the round trips, not the bytes, are what a
        sync of weights already in place costs."""
        staged[h.name] = stage_for(h, meta)
        if h is head:  # what the head holds already (records only); rsync there
            with threads.pool(2) as p:
                held = p.submit(node_state, ctx, h, staged[h.name], only=order, quick=True)
                rsync = p.submit(rsync_available, h)
            return {"state": held.result(), "rsync": rsync.result()}
        if dep.dry:  # records only; nothing starts on the node
            state = node_state(ctx, h, staged[h.name], only=order, quick=True)
            need = _lacking(order, state)
            return {"need": need,
                    "short": disk_check(dep, h, total_bytes(meta, need)) if need else None,
                    "rsync": rsync_available(h) if need else None}
        # the receiver hashes what is there without a record, then waits to hear what comes
        r = receivers[h.name] = Receiver(ctx, h, staged[h.name], order, secret, allow)
        state = r.state()
        need = _lacking(order, state)
        short = short_of(dep, h, total_bytes(meta, need), state["free"], state["mount"]) \
            if need else None
        if need and short is None:
            r.expect(need)
        else:
            r.end()
        return {"need": need, "short": short}

    try:
        nodes = [head, *targets]
        # every node's setup is needed to go on: an unreachable one stops the step (no ctx.each)
        with threads.pool(len(nodes)) as p:
            ready = dict(zip([h.name for h in nodes], p.map(prepare, nodes), strict=True))
        need = {t.name: ready[t.name]["need"] for t in targets}
        if not any(need.values()):
            names = ", ".join(t.name for t in targets)
            return ctx.ok(f"{names}: all {len(order)} files already there and verified "
                      f"({total_bytes(meta, order) / GB:.2f} GB){note}", ",".join(need))
        short = [ready[t.name]["short"] for t in targets if ready[t.name].get("short")]
        if short:
            return ctx.failed(short[0].why, short[0].node, **short[0].details)
        for h in nodes:
            why = ready[h.name].get("rsync")
            if why:
                return ctx.failed(why, h.name)
        if dep.dry:
            parts = [f"{len(v)} files ({total_bytes(meta, v) / GB:.2f} GB) to {k}"
                     for k, v in need.items() if v]
            return ctx.skipped(f"would send {', '.join(parts)} over {s.transport}{note}")
        plan = Schedule(need={k: v for k, v in need.items() if v}, sizes=sizes)
        head_state = ready[head.name]["state"]
        for f in head_state["ok"]:
            plan.holders.setdefault(f, []).append(head.name)
        sending_to = {k: r for k, r in receivers.items() if k in plan.need}
        return _Transfers(ctx, head, targets, plan, staged, sending_to, secret, order,
                          head_state).run(note)
    except ModelError as e:
        return ctx.failed(str(e), getattr(e, "node", None))
    finally:
        # a receiver's daemon stops when its stdin ends, whatever happened here
        with threads.pool(len(receivers)) as p:
            list(p.map(lambda r: r.join(), list(receivers.values())))


def _lacking(order: list[str], state: dict[str, Any]) -> list[str]:
    """The files of ``order`` a node's state does not have verified, in order."""
    have = set(state["ok"])
    return [f for f in order if f not in have]


class _Transfers:
    """One sync under way, the state its parts share: the plan, the rsyncs running, what each
    receiver has checked so far, and the head's download as it goes on."""

    def __init__(self, ctx: Ctx, head: Host, targets: list[Host], plan: Schedule,
                 staged: dict[str, Staged], receivers: dict[str, Receiver], secret: str | None,
                 order: list[str], head_state: dict[str, Any]):
        self.ctx, self.head, self.targets, self.plan = ctx, head, targets, plan
        self.dep = dep = ctx.dep
        self.staged, self.receivers, self.secret = staged, receivers, secret
        self.order = order
        self.s = dep.profile.model.sync
        self.hosts = {h.name: h for h in [head, *targets]}
        self.totals = {k: sum(plan.sizes[f] for f in v) for k, v in plan.need.items()}
        self.moved = dict.fromkeys(plan.need, 0)
        self.first_seen = self.last_head_poll = dep.clock()  # the head's state came with the setup
        self.head_running = bool(head_state.get("download_running"))
        self.sending: dict[Future, Batch] = {}  # rsync running
        self.errors: dict[str, str] = {}
        self.pool = threads.pool(self.s.streams * len(targets))

    def run(self, note: str) -> Result:
        started = self.dep.clock()
        try:
            while not self.finished():
                # a short interval: a stream idles from its rsync's end to the next probe
                wait_for(self.probe, deadline=self.s.stall_timeout_s, interval=0.02,
                         what="a file to become ready on the head or to arrive on a worker",
                         clock=self.dep.clock, sleep=self.dep.sleep)
        except Stop as e:
            _drain(self.sending)
            return self.ctx.failed(f"{e}; {self.kept()}", self.head.name)
        except WaitTimeout as e:
            _drain(self.sending)
            return self.ctx.failed(f"stalled: {e}; {self.kept()}")
        finally:
            self.pool.shutdown(wait=True)
        return self.outcome(self.dep.clock() - started, note)

    def send(self, batch: Batch) -> tuple[Outcome, str]:
        """rsync one batch: ``OK``, or whose failure it was and why (what arrived is still
        verified). A sender that cannot be reached is the sender's failure."""
        files, src, dst = batch
        try:
            r = self.hosts[src].run(
                send_argv(self.dep, self.hosts[src], self.hosts[dst], list(files),
                          self.receivers[dst].port),
                input=(self.secret + "\n") if self.secret else None, timeout=HELPER_TIMEOUT_S)
        except NodeUnreachable as e:
            return (Outcome.SOURCE if e.node == src else Outcome.TARGET), str(e)
        if r.ok:
            return Outcome.OK, ""
        text = r.stderr
        if any(k in text for k in DISK_FULL):
            return Outcome.TARGET, f"disk full on {dst} ({self.dep.profile.model.path})"
        return Outcome.TARGET, (f"sending {len(files)} files {src} -> {dst} failed: "
                                f"{helper_error(text, r.one_line_error())}")

    def fail(self, dst: str, why: str) -> None:
        self.errors.setdefault(dst, why)
        self.plan.failed.setdefault(dst, why)

    def refresh_head(self) -> None:
        """What the head holds now; ``Stop`` when it lacks files and no download runs there."""
        plan, head = self.plan, self.head
        self.last_head_poll = self.dep.clock()
        waiting = [f for f in self.order if head.name not in plan.holders.get(f, [])
                   and any(f in v for v in plan.need.values())]
        if not waiting:
            return
        state = node_state(self.ctx, head, self.staged[head.name], only=waiting, quick=True)
        for f in state["ok"]:
            plan.holders.setdefault(f, []).insert(0, head.name)
        self.head_running = bool(state.get("download_running"))
        still = _lacking(waiting, state)
        if still and not self.head_running and self.dep.clock() - self.first_seen > START_GRACE_S:
            raise Stop(f"{head.name} lacks {len(still)} files (e.g. {still[0]}) and no "
                       f"download is running there (run model.download)")

    def finished(self) -> bool:
        return not self.sending and all(r.finished.is_set() for r in self.receivers.values())

    def probe(self) -> bool:
        """One round: collect ended rsyncs and checked files, start what may start; True once
        all is done, else whether anything moved (for the stall deadline)."""
        progressed = self.collect_sent()
        progressed = self.collect_checked() or progressed
        if self.finished():
            return True
        if self.dep.clock() - self.last_head_poll >= 0.5:
            before = sum(len(v) for v in self.plan.holders.values())
            self.refresh_head()
            progressed = progressed or sum(len(v) for v in self.plan.holders.values()) > before
        for batch in self.plan.next_transfers(self.s.streams, self.head.name):
            self.sending[self.pool.submit(self.send, batch)] = batch
        return progressed

    def collect_sent(self) -> bool:
        """The rsyncs that ended: their streams take the next files while the last are checked."""
        done = [f for f in self.sending if f.done()]
        for fut in done:
            files, src, dst = batch = self.sending.pop(fut)
            self.plan.sent(batch)
            outcome, why = fut.result()
            if outcome is Outcome.SOURCE:
                self.plan.lose(src, why)
                self.errors.setdefault(src, why)
            elif outcome is Outcome.TARGET:
                self.fail(dst, why)
            self.receivers[dst].settle(list(files))
        return bool(done)

    def collect_checked(self) -> bool:
        """What each receiver checked since; a receiver that nothing more goes to is ended."""
        progressed = False
        plan = self.plan
        for dst, rcv in self.receivers.items():
            for f, state, why in rcv.reports():
                progressed = True
                plan.resolved(f, dst, state == "ok")
                if state == "ok":
                    self.moved[dst] += plan.sizes[f]
                    self.ctx.progress(
                        dst, self.moved[dst], self.totals[dst], "B",
                        f"{len(self.order) - len(plan.need[dst])}/{len(self.order)} files")
                elif plan.retry(f, dst):
                    rcv.again([f])  # its sender was lost: another sends it
                elif dst not in plan.failed:
                    self.fail(dst, f"{f} arrived on {dst} but {why}" if state == "differ"
                              else f"{f} did not arrive on {dst}")
            if rcv.finished.is_set() and not rcv.ending and dst not in plan.failed:
                self.fail(dst, rcv.error or f"{dst}: the receiving helper ended early")
            if not rcv.ending and plan.waiting_only(dst) and not any(
                    b[2] == dst for b in self.sending.values()):
                rcv.end()  # nothing more goes to it: its listener goes now, beside the last checks
        return progressed

    def kept(self) -> str:
        return _kept(self.plan, self.targets, self.order)

    def outcome(self, secs: float, note: str) -> Result:
        for dst, rcv in self.receivers.items():
            if rcv.error and dst not in self.errors:  # it ended, but not cleanly
                self.errors[dst] = rcv.error
        if self.errors:
            dst, why = next(iter(self.errors.items()))
            return self.ctx.failed(f"{why}; {self.kept()}, a re-run resumes", dst)
        total = sum(self.moved.values())
        names = ", ".join(t.name for t in self.targets if t.name in self.totals)
        return self.ctx.changed(f"{names}: sent {sum(1 for _ in _sent(self.plan))} files "
                       f"({total / GB:.2f} GB) over {self.s.transport} in {secs:.1f}s "
                       f"({total / max(secs, 1e-6) / 1e6:.0f} MB/s), verified on arrival{note}",
                       ",".join(self.totals), bytes=total, seconds=secs,
                       transport=self.s.transport)


def _sent(plan: Schedule):
    for f, nodes in plan.holders.items():
        for n in nodes:
            if n in plan.need:
                yield f, n


def _drain(running: dict[Future, Any]) -> None:
    for fut in list(running):
        fut.result()


def _kept(plan: Schedule, targets: list[Host], order: list[str]) -> str:
    parts = [f"{t.name} has {len(order) - len(plan.need.get(t.name, []))}/{len(order)} files "
             f"verified" for t in targets]
    return "; ".join(parts)


__all__ = ["SYNC", "Schedule", "Receiver", "receive_argv", "send_argv", "sync_files", "SCRIPT"]
