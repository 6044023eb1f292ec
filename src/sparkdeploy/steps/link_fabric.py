"""``link.fabric``: an all-reduce across every node inside the engine's own image, launched as
the engine is (``ops.fabric``), and where the nodes have RDMA devices a perftest per device.

The ranks: the program (``sparkdeploy/data/fabric_allreduce.py``) staged on every node like a
helper and mounted read only into the engine's container spec for that node (its image,
``--network=host``, the link's environment, its GPU and device flags), started detached, rank 0
on the head first (it listens on the head's fast-link address), then waited on with one
deadline (``link.fabric_timeout_s``): ranks still running then are a hang, named with their
last log line. Every rank's container is removed however it ended. The verdict
(``ops.fabric.judge``) is one result on the head: ok, or failed naming what is wrong (degraded,
hang, wrong-interface, failed), with the figures in its details; the figures go in a record
(``FabricRecord``) that ``deploy.all``'s record and ``serve.status`` show.

``deploy.all`` runs it after ``link.check`` and ``image.ship`` and before ``serve.up``; its
fingerprint is the link, the nodes and the image (by tag, and by ID on the head), and an
unchanged fingerprint reuses the last outcome.
"""

from __future__ import annotations

import re
from typing import Any

from sparkdeploy.core import labels as lbl
from sparkdeploy.core import packaged, threads
from sparkdeploy.core.fingerprint import Fingerprint
from sparkdeploy.core.records import FabricRecord
from sparkdeploy.core.wait import Stop, WaitTimeout, retry, wait_for
from sparkdeploy.engines import ContainerSpec, EngineError
from sparkdeploy.engines.base import run_args
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host
from sparkdeploy.node.nodeops import (
    HelperFailed,
    docker,
    helper_error,
    parse_progress,
    parse_report,
    stage,
    verified,
)
from sparkdeploy.ops import fabric as fab
from sparkdeploy.ops.image import chosen, image_id
from sparkdeploy.ops.serve import engine_of, running_launch
from sparkdeploy.profile.config import Engine
from sparkdeploy.steps.registry import StepContext, step

POLL_S = 2.0
PERFTEST = "ib_write_bw"


def fabric_engine(dep: Deployment, name: str | None = None) -> Engine:
    """The engine named, else the one serving (serve.up's record), else the profile's first."""
    return engine_of(dep, name) or dep.profile.engines[0]


def fabric_image(dep: Deployment) -> dict[str, Any]:
    """The image the ranks run, by tag (the engine's, and the one image.probe chose)."""
    return {"image": fabric_engine(dep).image, "serve_image": chosen(dep).get("serve_image")}


def fabric_image_id(dep: Deployment) -> dict[str, Any]:
    """The image the ranks run by ID on the head (asks the head): a tag rebuilt tests again."""
    return {"image_id": image_id(dep, fabric_engine(dep).image)}


@step(fab.STEP, needs=("link.check", "image.ship"),
      fingerprint=Fingerprint("link", "nodes", also=fabric_image, asks=fabric_image_id), reuse=True)
def fabric(ctx: StepContext, engine: str | None = None) -> None:
    """An all-reduce across the nodes in the engine's image, 1 MiB to 1 GiB, against the link."""
    dep = ctx.dep
    eng = fabric_engine(dep, engine)
    head = dep.profile.head.name
    sizes = fab.sizes_for(dep.profile.link.fabric_max_bytes)
    if ctx.dry:
        what = (f"run an all-reduce of {sizes[0] // fab.MIB} to {sizes[-1] // fab.MIB} MiB in "
                f"{eng.image} on {', '.join(n.name for n in dep.profile.nodes)}")
        ctx.would(what, head, fabric=fab.skipped(dep.profile, f"would {what}").model_dump())
        return
    with ctx.failing(EngineError, node=head, lead=f"{eng.name}: ") as caught:
        lau = running_launch(dep, eng)
    if caught.result is not None:
        return
    content = packaged.data(fab.PROGRAM).read_text()
    staged = {n.name: stage(dep.host(n.name), fab.PROGRAM, content) for n in dep.profile.nodes}
    link = dep.profile.link
    specs = fab.rank_specs(dep.profile, lau, staged, sizes, link.fabric_budget_s, link.fabric_port)
    if len(specs) < 2:
        why = f"one node: no link to test ({eng.name} runs on {head} alone)"
        ctx.skipped(why, head, fabric=fab.skipped(dep.profile, why).model_dump())
        return
    result, reports = run_ranks(ctx, specs, staged)
    _perftests(ctx, specs)
    backend = next((r.backend for r in reports.values()), None)
    dep.records.write(FabricRecord(**result.model_dump(), engine=eng.name, image=eng.image,
                                   backend=backend, nodes=[s.node for s in specs]))
    say = {fab.OK: ctx.ok, fab.SKIPPED: ctx.skipped}.get(result.verdict, ctx.failed)
    say(f"{result.verdict}: {result.why}", head, fabric=result.model_dump())


# --- the ranks ---------------------------------------------------------------------------


def run_ranks(ctx: StepContext, specs: list[ContainerSpec],
              staged: dict[str, str]) -> tuple[fab.Fabric, dict[str, fab.RankReport]]:
    """Start every rank (rank 0 first), wait for them all with the test's deadline, read their
    reports; every rank's container removed however it ended."""
    dep = ctx.dep
    started = lbl.started(fab.STEP, dep.wall())
    try:
        for s in specs:
            h = dep.host(s.node)
            _remove(h, s.name)  # one left by a run that could not remove it
            r = h.run(verified([staged[s.node]], docker(h, *run_args(s, started=started))), timeout=300)
            if not r.ok:
                return fab.broken(dep.profile, f"{s.node}: docker run {s.name}: "
                                               f"{r.one_line_error()}"), {}
        return _wait_and_read(ctx, specs)
    finally:
        for s in specs:
            _remove(dep.host(s.node), s.name)


def _remove(host: Host, name: str) -> None:
    host.run(docker(host, "rm", "--force", name), timeout=60)


def _state(host: Host, name: str) -> tuple[str, int]:
    """(docker's state of the container, its exit code); ("gone", -1) when there is none."""
    r = host.run(docker(host, "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name),
                 change=False, timeout=30)
    words = r.stdout.split() if r.ok else []
    if len(words) != 2 or not words[1].lstrip("-").isdigit():
        return "gone", -1
    return words[0], int(words[1])


def _logs(host: Host, name: str, tail: int | None = None) -> tuple[str, str]:
    more = ["--tail", str(tail)] if tail else []
    r = host.run(docker(host, "logs", *more, name), change=False, timeout=60)
    return r.stdout, r.stderr


NOISE = ("frame #", "<omitting", "Exception raised from", "warnings.warn", "cpu = ")
"""The lines of torch's C++ tracebacks and Python's warnings: never the line that says why."""


def _last_line(host: Host, name: str) -> str:
    """The rank's last words: its stderr's last line that says something (torch's c10d retrying
    its rendezvous, an NCCL warning), else its last progress line."""
    out, err = _logs(host, name, tail=40)
    for text in (err, out):
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(NOISE)]
        if lines:
            return lines[-1][:200]
    return ""


def _wait_and_read(ctx: StepContext, specs: list[ContainerSpec]) -> tuple[fab.Fabric,
                                                                           dict[str, fab.RankReport]]:
    dep = ctx.dep
    prof = dep.profile
    pending: list[str] = [s.node for s in specs]

    def ended() -> bool:
        pending.clear()
        for s in specs:
            state, code = _state(dep.host(s.node), s.name)
            if state in ("exited", "dead", "gone") and code != 0:
                raise Stop(s.node, code)
            if state not in ("exited", "dead"):
                pending.append(s.node)
        return not pending

    timeout = prof.link.fabric_timeout_s
    try:
        wait_for(ended, deadline=timeout, interval=POLL_S, what="the all-reduce's ranks",
                 clock=dep.clock, sleep=dep.sleep,
                 tick=lambda t: ctx.progress(prof.head.name, t, timeout, unit="s",
                                             note=_done(dep.host(specs[0].node), specs[0].name)))
    except WaitTimeout as e:
        tails = {n: _last_line(dep.host(n), _name(specs, n)) for n in pending}
        return fab.hang(prof, e.waited, list(pending), tails), {}
    except Stop as e:
        node, code = e.args
        _, err = _logs(dep.host(node), _name(specs, node))
        said = "\n".join(ln for ln in err.splitlines() if not ln.strip().startswith(NOISE))
        why = helper_error(said, f"it exited {code} without a word")
        if code == fab.NO_TORCH:
            return fab.skipped(prof, f"{node}: not run in {specs[0].image}: {why}"), {}
        return fab.broken(prof, f"{node}: the rank failed: {why}"), {}
    reports = {}
    for s in specs:
        out, err = _logs(dep.host(s.node), s.name)
        try:
            reports[s.node] = parse_report(fab.RankReport, out, f"{s.node}: {fab.PROGRAM}")
        except HelperFailed as e:
            return fab.broken(prof, str(e)), {}
    return fab.judge(prof, reports), reports


def _done(host: Host, name: str) -> str:
    """What rank 0 says it has done so far (its last progress line): the ranks joined, a size."""
    out, _ = _logs(host, name, tail=5)
    said = [p for p in map(parse_progress, out.splitlines()) if p]
    last = said[-1] if said else {}
    if "size" in last and last["size"].isdigit():
        return f"{int(last['size']) // fab.MIB} MiB reduced"
    return "every rank joined" if "joined" in last else "waiting for the ranks to join"


def _name(specs: list[ContainerSpec], node: str) -> str:
    return next(s.name for s in specs if s.node == node)


# --- RDMA: a perftest per device ---------------------------------------------------------


def _perftests(ctx: StepContext, specs: list[ContainerSpec]) -> None:
    """``ib_write_bw`` head -> each worker, per HCA the profile lists, where both nodes have
    RDMA devices (``/dev/infiniband``, as the engine's spec passes them) and perftest; skipped
    (one line of why) where they do not."""
    dep = ctx.dep
    head = specs[0]
    without = [s.node for s in specs if "/dev/infiniband" not in s.devices]
    if without:
        ctx.skipped(f"perftest ({PERFTEST}) not run: {', '.join(without)} has no RDMA device "
                    "(/dev/infiniband; the lab's RoCE HCAs are sysfs stand-ins, with no device "
                    "behind them)", head.node)
        return
    for w in specs[1:]:
        hn, wn = dep.profile.node(head.node), dep.profile.node(w.node)
        if not (_has(dep.host(head.node)) and _has(dep.host(w.node))):
            ctx.skipped(f"perftest ({PERFTEST}) not run: not installed on both {head.node} and "
                        f"{w.node} (the perftest package)", w.node)
            continue
        for hca_h, hca_w in zip(hn.link.hcas, wn.link.hcas, strict=False):
            _perftest(ctx, head, w, hca_h, hca_w)


def _perftest(ctx: StepContext, head: ContainerSpec, worker: ContainerSpec, hca_h: str,
              hca_w: str) -> None:
    dep = ctx.dep
    hh, wh = dep.host(head.node), dep.host(worker.node)
    gid = {s.node: s.environment.get("NCCL_IB_GID_INDEX") for s in (head, worker)}
    secs = f"{dep.profile.link.test_seconds:g}"

    def argv(hca: str, node: str) -> list[str]:
        index = gid[node]
        return [PERFTEST, "-d", hca, *(["-x", index] if index else []), "-F",
                "--report_gbits", "-D", secs]

    server = ["timeout", "30", *argv(hca_w, worker.node)]
    client = [*argv(hca_h, head.node), dep.profile.node(worker.node).link.address]

    def measure() -> Any:
        # the server may not be listening yet: a few tries half a second apart
        return retry(lambda: hh.run(client, change=False, timeout=60), tries=10, interval=0.5,
                     again=lambda r: not r.ok and "Couldn't connect" in r.stdout + r.stderr,
                     sleep=dep.sleep)

    with threads.pool(2) as p:
        served, measured = p.submit(lambda: wh.run(server, change=False, timeout=40)), p.submit(measure)
    served.result()
    gbps = perftest_gbps(measured.result().stdout)
    where = f"{hca_h} -> {worker.node}'s {hca_w}"
    if gbps is None:
        ctx.failed(f"{PERFTEST} {where}: no bandwidth in its output", worker.node, interface=hca_w)
        return
    expect = dep.profile.link.expect_gbps
    say = ctx.failed if expect is not None and gbps < expect else ctx.ok
    say(f"{PERFTEST} {where}: {gbps:.1f} Gb/s" + (f" (expected >= {expect:g})" if expect else ""),
        worker.node, interface=hca_w, gbps=gbps)


def _has(host: Host) -> bool:
    return host.run(["sh", "-c", f"command -v {PERFTEST}"], change=False, timeout=30).ok


def perftest_gbps(out: str) -> float | None:
    """The ``BW average[Gb/sec]`` of ``ib_write_bw --report_gbits``'s table, None without one."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if "BW average" not in line:
            continue
        for row in lines[i + 1:]:  # #bytes #iterations BW-peak BW-average MsgRate
            cells = row.split()
            if len(cells) >= 4 and re.fullmatch(r"\d+", cells[0]):
                try:
                    return float(cells[3])
                except ValueError:
                    return None
    return None
