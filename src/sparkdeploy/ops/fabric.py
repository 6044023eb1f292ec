"""``link.fabric``'s decisions: the ranks' containers (the engine's own, running the all-reduce
program instead of the engine), the figures nccl-tests would print, and the verdict.

Pure but for nothing: no node is asked here (``steps/link_fabric.py`` runs the containers).

The figures are nccl-tests' (``doc/PERFORMANCE.md`` in NVIDIA/nccl-tests): the algorithm
bandwidth ``algbw = S / t`` (S the buffer's bytes, t one all-reduce's time), and the bus
bandwidth ``busbw = algbw * 2(n-1)/n`` for all_reduce over n ranks, the figure to hold against
what the hardware carries whatever the number of ranks; in GB/s of 1e9 bytes, as nccl-tests
prints them.
"""

from __future__ import annotations

from dataclasses import replace

from pydantic import BaseModel, ConfigDict, Field

from sparkdeploy.core import labels as lbl
from sparkdeploy.engines import ContainerSpec, Launch
from sparkdeploy.engines.base import Mount
from sparkdeploy.profile.config import Profile

STEP = "link.fabric"
PROGRAM = "fabric_allreduce.py"
"""The rank's program, shipped in ``sparkdeploy/data/`` (it imports torch: no node helper)."""
TARGET = "/sparkdeploy/fabric_allreduce.py"
"""Where the staged program is mounted in the engine's image."""
MIB = 1 << 20
SIZES = tuple(MIB * 4 ** k for k in range(6))
"""1 MiB to 1 GiB, each four times the last (1, 4, 16, 64, 256, 1024 MiB)."""
GB = 1e9
PORT = 29511
"""The rendezvous port on the head's fast-link address (beside vLLM's 29501)."""
ROLE = "fabric"
OK, DEGRADED, HANG, WRONG_INTERFACE, FAILED = "ok", "degraded", "hang", "wrong-interface", "failed"
SKIPPED = "skipped"
"""The image's python3 has no torch (the lab's engine stand-ins): nothing to test with."""
NO_TORCH = 3
"""The rank's exit status when its python3 cannot import torch.distributed."""
ON_LINK = 0.5
"""The least share of what the all-reduce must have sent that the link's interface (or its
RDMA ports) must show: under it, with another interface showing it, the verdict is
``wrong-interface``."""


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RankSize(_Loose):
    bytes: int = Field(gt=0)
    iters: int = Field(ge=1)
    seconds: float = Field(gt=0, allow_inf_nan=False)


class RankReport(_Loose):
    """One rank's answer (the program's last JSON line)."""

    rank: int = Field(ge=0)
    world: int = Field(ge=1)
    backend: str
    sizes: list[RankSize] = []
    stopped: str | None = None
    sent: dict[str, dict[str, int]] = {}
    """{"netdev": {interface: bytes sent}, "rdma": {"hca/port": bytes sent}} while timed."""
    joined_s: float | None = None


class Size(BaseModel):
    bytes: int
    algbw_gbs: float
    busbw_gbs: float


class Fabric(BaseModel):
    """What ``inv link.fabric --json`` prints (the issue's shape), and the record's core."""

    verdict: str
    expected_gbs: float | None
    sizes: list[Size]
    why: str


# --- the ranks' containers ---------------------------------------------------------------


def program_args(world: int, rank: int, head_addr: str, port: int, sizes: tuple[int, ...],
                 budget: float) -> tuple[str, ...]:
    return (TARGET, "--rank", str(rank), "--world", str(world), "--master-addr", head_addr,
            "--master-port", str(port), "--backend", "auto",
            "--sizes", ",".join(map(str, sizes)), "--budget", f"{budget:g}")


def rank_specs(profile: Profile, lau: Launch, staged: dict[str, str], sizes: tuple[int, ...],
               budget: float, port: int = PORT) -> list[ContainerSpec]:
    """One container per node, the engine's own on that node (its image, host network, the
    link's environment, its GPU and device flags) running the all-reduce rank instead of the
    engine: rank 0 on the head, listening on the head's fast-link address. ``staged``: the
    program's path on each node."""
    first: dict[str, ContainerSpec] = {}
    for c in lau.containers:
        first.setdefault(c.node, c)
    order = [profile.head.name, *(n.name for n in profile.workers)]
    nodes = [n for n in order if n in first]
    head_addr = profile.head.link.address
    out = []
    for rank, node in enumerate(nodes):
        spec = first[node]
        out.append(replace(
            spec, role=f"{ROLE}-rank{rank}", rank=rank, entrypoint="python3",
            argv=program_args(len(nodes), rank, head_addr, port, sizes, budget),
            mounts=(Mount(staged[node], TARGET),), ports=(port,) if rank == 0 else (),
            volumes=(), volumes_from=None, pid_from=None, secret_env=(),
            labels=tuple(sorted({lbl.DEPLOYMENT: profile.name, lbl.ROLE: ROLE}.items()))))
    return out


def sizes_for(max_bytes: int | None) -> tuple[int, ...]:
    """``SIZES`` up to ``max_bytes`` (the profile's cap; None: all of them)."""
    return tuple(s for s in SIZES if max_bytes is None or s <= max_bytes) or SIZES[:1]


# --- the figures -------------------------------------------------------------------------


def bus_factor(n: int) -> float:
    """nccl-tests' all_reduce bus factor: 2(n-1)/n (PERFORMANCE.md, "AllReduce")."""
    return 2 * (n - 1) / n if n > 0 else 0.0


def figures(sizes: list[RankSize], n: int) -> list[Size]:
    """algbw = bytes / seconds, busbw = algbw * 2(n-1)/n, both in GB/s (1e9 bytes)."""
    return [Size(bytes=s.bytes, algbw_gbs=round(s.bytes / s.seconds / GB, 4),
                 busbw_gbs=round(s.bytes / s.seconds / GB * bus_factor(n), 4)) for s in sizes]


def expected_gbs(profile: Profile) -> float | None:
    """What the link should carry, in GB/s: ``link.expect_gbps`` (Gb/s) / 8; None: unjudged."""
    g = profile.link.expect_gbps
    return round(g / 8, 4) if g is not None else None


def must_send(sizes: list[RankSize], n: int) -> float:
    """The bytes each rank sends in the timed loops of a ring all-reduce: 2(n-1)/n of the buffer
    per all-reduce (what busbw counts)."""
    return sum(s.bytes * s.iters for s in sizes) * bus_factor(n)


def where_sent(report: RankReport, interface: str, hcas: list[str]) -> tuple[float, str, float]:
    """(bytes the link sent: its interface and its HCAs' ports, the busiest other interface,
    what it sent); loopback and docker's bridges are not the link but not a wrong one either."""
    netdev = report.sent.get("netdev", {})
    rdma = report.sent.get("rdma", {})
    on_link = netdev.get(interface, 0) + sum(v for k, v in rdma.items() if k.split("/")[0] in hcas)
    others = {k: v for k, v in netdev.items() if k != interface and k != "lo"}
    busiest = max(others, key=lambda k: others[k], default="")
    return float(on_link), busiest, float(others.get(busiest, 0))


def wrong_interface(profile: Profile, reports: dict[str, RankReport]) -> str | None:
    """Why the collective went over another interface than the link's (None: it did not, or
    the counters cannot say): a node whose link sent under ``ON_LINK`` of what the all-reduce
    must have sent while another interface sent more."""
    for name, rep in reports.items():
        node = profile.node(name)
        need = must_send(rep.sizes, rep.world)
        if need <= 0:
            continue
        on_link, other, sent = where_sent(rep, node.link.interface, node.link.hcas)
        if on_link < ON_LINK * need and sent >= ON_LINK * need:
            return (f"{name}: the all-reduce sent {sent / 1e6:.0f} MB over {other}, "
                    f"{on_link / 1e6:.0f} MB over the link's {node.link.interface} "
                    f"(it must send {need / 1e6:.0f} MB): check NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME")
    return None


def judge(profile: Profile, reports: dict[str, RankReport]) -> Fabric:
    """The verdict of ranks that all answered: wrong-interface, degraded (the best busbw under
    what the link should carry), else ok."""
    expect = expected_gbs(profile)
    head = reports.get(profile.head.name) or next(iter(reports.values()))
    n = head.world
    sizes = figures(head.sizes, n)
    stopped = f"; {head.stopped}" if head.stopped else ""
    if not sizes:
        return Fabric(verdict=FAILED, expected_gbs=expect, sizes=[],
                      why=f"no size measured{stopped}")
    wrong = wrong_interface(profile, reports)
    if wrong:
        return Fabric(verdict=WRONG_INTERFACE, expected_gbs=expect, sizes=sizes, why=wrong)
    best = max(sizes, key=lambda s: s.busbw_gbs)
    said = (f"best busbw {best.busbw_gbs:.3f} GB/s at {best.bytes // MIB} MiB over {n} ranks "
            f"({head.backend})")
    if expect is None:
        return Fabric(verdict=OK, expected_gbs=None, sizes=sizes,
                      why=f"{said}; nothing expected (link.expect_gbps unset){stopped}")
    if best.busbw_gbs < expect:
        return Fabric(verdict=DEGRADED, expected_gbs=expect, sizes=sizes,
                      why=f"{said}, under the {expect:g} GB/s expected "
                          f"(link.expect_gbps {profile.link.expect_gbps:g} Gb/s){stopped}")
    return Fabric(verdict=OK, expected_gbs=expect, sizes=sizes,
                  why=f"{said}, at least the {expect:g} GB/s expected{stopped}")


def hang(profile: Profile, waited: float, pending: list[str], tails: dict[str, str]) -> Fabric:
    """The ranks still running at the deadline: a hang, named with each one's last line."""
    last = "; ".join(f"{n}: {tails[n]}" for n in pending if tails.get(n))
    return Fabric(verdict=HANG, expected_gbs=expected_gbs(profile), sizes=[],
                  why=f"the all-reduce did not end within {waited:.0f} s: rank(s) on "
                      f"{', '.join(pending)} still running, ended and removed"
                      + (f" (last: {last})" if last else ""))


def broken(profile: Profile, why: str) -> Fabric:
    return Fabric(verdict=FAILED, expected_gbs=expected_gbs(profile), sizes=[], why=why)


def skipped(profile: Profile, why: str) -> Fabric:
    return Fabric(verdict=SKIPPED, expected_gbs=expected_gbs(profile), sizes=[], why=why)
