"""``link.check``, the link doctor: the fast link as every node shows it, against the profile.

On every node (``link_node.py facts``, at once): the link's interface present, up, with the
profile's address and a jumbo MTU; no other interface in the link's subnet; every HCA the
profile lists present, its port ACTIVE, with a RoCE v2 GID for the node's address. For every
pair of nodes: one MTU at both ends. From the profile: the address every engine advertises
(``SGLANG_HOST_IP``, ``VLLM_HOST_IP``, Ray's node IP, ``MASTER_ADDR`` after the profile's
``env`` and ``args``) is the node's fast-link address. Then from the head to each worker: one
do-not-fragment ping of the MTU's size over the link's interface, and the bandwidth
(``iperf3`` when both nodes have it, else ``link_stream.py``'s timed TCP stream, for
``link.test_seconds``) against ``link.expect_gbps``.

Each problem is one failed result naming the node, the interface and both values; a node
without any is one ok line. ``deploy.all`` runs it before the download (``model.download``
needs it) and ``inv serve.up`` before it starts an engine.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sparkdeploy.core import threads
from sparkdeploy.core.errors import PartFailed
from sparkdeploy.core.wait import retry
from sparkdeploy.node import link_doctor as doc
from sparkdeploy.node.hosts import Host
from sparkdeploy.node.link import LinkFacts, read_facts
from sparkdeploy.node.nodeops import HelperFailed, run_helper, stage_script
from sparkdeploy.profile.config import Node
from sparkdeploy.steps.registry import StepContext, step

STEP = "link.check"
HELPER = "link_stream.py"
IPERF_TRIES = 5


class _Answer(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Tools(_Answer):
    iperf3: str | None = None


class Streamed(_Answer):
    bytes: int = Field(ge=0)
    seconds: float = Field(ge=0)


def _facts(ctx: StepContext, host: Host) -> LinkFacts | None:
    try:
        return read_facts(host)
    except HelperFailed as e:
        raise PartFailed(str(e).removeprefix(f"{host.name}: "), host.name) from None


def _summary(node: Node, facts: LinkFacts) -> str:
    nd = facts.netdev(node.link.interface)
    net = doc.link_network(node, nd)
    hcas = ", ".join(node.link.hcas)
    gids = sorted(set(doc.gid_indexes(node, facts).values()))
    return (f"{node.link.interface} up, {node.link.address}"
            + (f"/{net.prefixlen}" if net else "") + f", MTU {nd.mtu if nd else '?'}"
            + (f"; {hcas} ACTIVE, RoCE v2 GID index {', '.join(map(str, gids))}" if hcas else ""))


def _report(ctx: StepContext, problems: list[doc.Problem]) -> None:
    for p in problems:
        ctx.failed(p.line, p.node, interface=p.interface)


@step(STEP)
def check(ctx: StepContext) -> None:
    """The fast link of every node, every pair, the engines' addresses, reach and bandwidth."""
    dep = ctx.dep
    prof = dep.profile
    hosts = [dep.host(n.name) for n in prof.nodes]
    got = ctx.each(hosts, lambda h: _facts(ctx, h), parallel=True)
    facts = dict(zip([n.name for n in prof.nodes], got, strict=True))
    for node in prof.nodes:
        f = facts[node.name]
        if f is None:
            continue
        problems = doc.node_problems(node, f, prof.link.min_mtu)
        _report(ctx, problems)
        if not problems:
            ctx.ok(_summary(node, f), node.name)
    _report(ctx, doc.pair_problems(prof, facts))
    _report(ctx, doc.advertised_problems(prof))
    head = prof.head
    for worker in prof.workers:
        _reach(ctx, head, worker, facts)


def _reach(ctx: StepContext, head: Node, worker: Node, facts: dict[str, LinkFacts | None]) -> None:
    """The head's do-not-fragment ping to ``worker``, then the bandwidth between them."""
    dep = ctx.dep
    ends = [n.name for n in (head, worker) if not doc.usable(n, facts.get(n.name))]
    if ends:
        ctx.skipped(f"{head.name} -> {worker.name} not tested: the link of {', '.join(ends)} is "
                    "not up with the profile's address (above)", worker.name)
        return
    mtu = doc.mtu_of(head, facts[head.name]) or dep.profile.link.min_mtu
    argv = doc.ping_argv(head.link.interface, mtu, worker.link.address)
    r = dep.host(head.name).run(argv, change=False, timeout=15)
    if not r.ok:
        ctx.failed(f"{head.link.interface}: {head.name} cannot reach {worker.name} at "
                   f"{worker.link.address} with a {mtu}-byte unfragmented packet (ping -M do -s "
                   f"{mtu - 28}): {doc.ping_why(r.stdout, r.stderr)}", worker.name,
                   interface=head.link.interface)
        return
    if ctx.dry:
        ctx.would(f"measure {head.name} -> {worker.name} for {dep.profile.link.test_seconds:g} s",
                  worker.name)
        return
    _bandwidth(ctx, head, worker)


def _bandwidth(ctx: StepContext, head: Node, worker: Node) -> None:
    dep = ctx.dep
    hh, wh = dep.host(head.name), dep.host(worker.name)
    try:
        with threads.pool(2) as ends:  # both ends' answers are needed: an unreachable one stops it
            scripts = list(ends.map(lambda h: stage_script(h, HELPER), [hh, wh]))
        tools = [run_helper(h, HELPER, ["tools"], result=Tools, where=f"{h.name}: {HELPER} tools",
                            script=s, timeout=30) for h, s in zip((hh, wh), scripts, strict=True)]
        if all(t.iperf3 for t in tools):
            gbps, why, tool = _iperf(ctx, hh, wh, head, worker)
        else:
            gbps, why, tool = _stream(ctx, hh, wh, head, worker, scripts)
    except HelperFailed as e:
        gbps, why, tool = None, str(e), "stream"
    if gbps is None:
        ctx.failed(f"{worker.link.interface}: {head.name} -> {worker.name}: bandwidth not measured "
                   f"({tool}): {why}", worker.name, interface=worker.link.interface)
        return
    expect = dep.profile.link.expect_gbps
    p = doc.bandwidth_problem(head, worker, gbps, expect, tool)
    if p:
        _report(ctx, [p])
        return
    ctx.ok(f"{head.name} -> {worker.name}: {gbps:.2f} Gb/s ({tool}, "
           f"{dep.profile.link.test_seconds:g} s)"
           + (f", expected >= {expect:g}" if expect is not None else ", nothing expected"),
           worker.name, gbps=round(gbps, 3), tool=tool)


def _stream(ctx: StepContext, hh: Host, wh: Host, head: Node, worker: Node,
            scripts: list[str]) -> tuple[float | None, str, str]:
    """The timed TCP stream: the receiver on the worker's fast-link address, the sender on the
    head from its own; the receiver's count is the measurement."""
    link = ctx.dep.profile.link
    port = str(link.test_port)

    def receive() -> Any:
        return run_helper(wh, HELPER, ["serve", "--bind", worker.link.address, "--port", port,
                                       "--wait", "15"], result=Streamed, script=scripts[1],
                          where=f"{worker.name}: {HELPER} serve", timeout=link.test_seconds + 45)

    def send() -> Any:
        return run_helper(hh, HELPER, ["send", "--to", worker.link.address, "--port", port,
                                       "--seconds", f"{link.test_seconds:g}", "--bind",
                                       head.link.address], result=Streamed, script=scripts[0],
                          where=f"{head.name}: {HELPER} send", timeout=link.test_seconds + 45)

    with threads.pool(2) as p:
        received, sent = p.map(_catching, [receive, send])
    if isinstance(received, HelperFailed):
        return None, str(received), "stream"
    if isinstance(sent, HelperFailed):
        return None, str(sent), "stream"
    gbps = doc.stream_gbps(received.bytes, received.seconds)
    return gbps, "" if gbps is not None else "nothing arrived", "stream"


def _catching(call: Any) -> Any:
    try:
        return call()
    except HelperFailed as e:
        return e


def _iperf(ctx: StepContext, hh: Host, wh: Host, head: Node,
           worker: Node) -> tuple[float | None, str, str]:
    """``iperf3``: a one-off server on the worker's fast-link address, the client on the head."""
    dep = ctx.dep
    link = dep.profile.link
    port = str(link.test_port)
    wait = int(link.test_seconds + 15)
    server = ["timeout", str(wait), "iperf3", "-s", "-1", "-B", worker.link.address, "-p", port]
    client = ["iperf3", "-c", worker.link.address, "-B", head.link.address, "-p", port,
              "-t", f"{link.test_seconds:g}", "-J"]

    def serve() -> Any:
        return wh.run(server, change=False, timeout=wait + 5)

    def once() -> tuple[float | None, str]:
        return doc.iperf_gbps(hh.run(client, change=False, timeout=link.test_seconds + 30).stdout)

    def measure() -> tuple[float | None, str]:
        # refused: the server is not listening yet
        return retry(once, tries=IPERF_TRIES, again=lambda got: got[0] is None and "connect" in got[1],
                     interval=0.3, sleep=dep.sleep)

    with threads.pool(2) as p:
        served, measured = p.submit(serve), p.submit(measure)
    served.result()
    gbps, why = measured.result()
    return gbps, why, "iperf3"
