"""What ``cluster.discover`` reads of a node (``helpers/cluster_node.py facts``, one read per
node), how it picks the fast link the way an owner would, and the profile it writes.

Pure where it can be: ``pick_link`` and ``link_warnings`` judge typed facts, ``render`` makes
the profile's text; ``read_node`` and ``read_answers`` are the only reads of a node.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from sparkdeploy.core import checks
from sparkdeploy.core.errors import StepFailed
from sparkdeploy.node.hosts import Host
from sparkdeploy.node.link import HELPER as LINK_HELPER
from sparkdeploy.node.link import LinkFacts, Netdev
from sparkdeploy.node.memory import HELPER as MEMORY_HELPER
from sparkdeploy.node.memory import NodeMemory
from sparkdeploy.node.nodeops import ARCH, run_helper, stage_script

HELPER = "cluster_node.py"
JUMBO = 9000


class _Fact(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class Privilege(_Fact):
    root: bool
    sudo: str
    """``not needed`` (root), ``ok`` (``sudo -n true`` works), ``password``, ``absent``,
    ``denied``."""
    why: str = ""


class Disk(_Fact):
    path: str
    probed: str
    free: int | None = Field(default=None, ge=0)
    mount: str | None = None
    why: str = ""


class Docker(_Fact):
    socket: str
    socket_from: str
    version: str | None = None
    driver: str | None = None
    store: str | None = None
    """``classic`` or ``containerd`` (the containerd image store)."""
    runtimes: list[str] = []
    default_runtime: str | None = None
    nvidia_runtime: bool = False
    why: str = ""


class NodeFacts(_Fact):
    """``cluster_node.py facts``: one node as ``cluster.discover`` reads it."""

    version: int = Field(ge=1)
    machine: str
    python: str
    user: str
    privilege: Privilege
    tools: dict[str, str | None]
    memory: NodeMemory
    disk: Disk
    docker: Docker
    link: LinkFacts

    @property
    def arch(self) -> str | None:
        """``arm64`` / ``amd64`` (None: neither)."""
        return ARCH.get(self.machine)


class Answer(_Fact):
    answered: bool
    how: str


class Answers(_Fact):
    version: int = Field(ge=1)
    answers: dict[str, Answer]


def read_node(host: Host, model_path: str) -> NodeFacts:
    """Everything ``cluster.discover`` needs of ``host``, in one helper run (the link and
    memory helpers staged beside it). ``HelperFailed`` / ``NodeUnreachable`` as ``run_helper``."""
    link = stage_script(host, LINK_HELPER)
    memory = stage_script(host, MEMORY_HELPER)
    return run_helper(host, HELPER, ["facts", "--model-path", model_path, "--link", link,
                                     "--memory", memory],
                      result=NodeFacts, also=[link, memory], where=f"{host.name}: {HELPER} facts",
                      timeout=120)


def read_answers(host: Host, source: str, addrs: list[str]) -> dict[str, Answer]:
    """Whether each of ``addrs`` answers ``host`` from its address ``source``."""
    return run_helper(host, HELPER, ["answers", "--from", source, *addrs], result=Answers,
                      where=f"{host.name}: {HELPER} answers", timeout=60).answers


# --- the link --------------------------------------------------------------------------------


@dataclass(frozen=True)
class End:
    """One node's end of a candidate link."""

    node: str
    interface: str
    address: str
    prefix: int
    hcas: tuple[str, ...]
    mtu: int | None

    @property
    def subnet(self) -> str:
        return str(ipaddress.ip_interface(f"{self.address}/{self.prefix}").network)

    def show(self) -> str:
        return f"{self.node} {self.interface} {self.address}/{self.prefix}"


@dataclass
class Link:
    """A subnet every node reaches on one RDMA-backed interface: each node's end, in node order."""

    subnet: str
    ends: list[End] = field(default_factory=list)

    def show(self) -> str:
        return f"{self.subnet} ({', '.join(e.show() for e in self.ends)})"


class LinkRefused(StepFailed):
    """No link, or more than one: ``str()`` is the one line naming the candidates."""


_DOMAIN = re.compile(r"^(?:roce|en|ib)P(\d+)p")


def _domain(facts: LinkFacts, hca: str) -> int:
    """The PCI domain of an HCA (``0002:01:00.0`` -> 2; by name ``roceP2p1s0f0`` -> 2)."""
    h = facts.hca(hca)
    if h is not None and h.pci and ":" in h.pci:
        return int(h.pci.split(":", 1)[0], 16)
    m = _DOMAIN.match(hca)
    return int(m.group(1)) if m else 0


def port_hcas(facts: LinkFacts, netdev: Netdev) -> tuple[str, ...]:
    """Every HCA of the interface's physical port (both twins on a Spark), domain 0 first."""
    names = {t for h in netdev.hcas for t in facts.twins_of(h)}
    return tuple(sorted(names, key=lambda h: (_domain(facts, h), h)))


def ends_of(node: str, facts: LinkFacts, interface: str | None = None) -> list[End]:
    """The node's usable candidates: RDMA-backed, present, up, per IPv4 address."""
    return [End(node, n.name, a.address, a.prefix, port_hcas(facts, n), n.mtu)
            for n in facts.candidates
            if n.exists and n.up and n.ipv4 and (interface is None or n.name == interface)
            for a in n.ipv4]


def candidates_line(found: dict[str, LinkFacts]) -> str:
    """Every node's candidates in one line (for a refusal)."""
    parts = []
    for node, facts in found.items():
        shown = [f"{n.name} {'up' if n.up else 'down'} "
                 f"{','.join(f'{a.address}/{a.prefix}' for a in n.ipv4) or 'no IPv4'}"
                 for n in facts.candidates if n.exists]
        parts.append(f"{node}: {'; '.join(shown) or 'no RDMA-backed interface'}")
    return " | ".join(parts)


def pick_link(found: dict[str, LinkFacts], interface: str | None = None) -> list[Link]:
    """Every subnet in which each node has exactly one usable candidate (nodes in order).
    ``LinkRefused`` when a node has two candidates in one subnet, or none is shared."""
    per_node = {node: ends_of(node, facts, interface) for node, facts in found.items()}
    first = next(iter(per_node))
    links = []
    for subnet in dict.fromkeys(e.subnet for e in per_node[first]):
        ends = []
        for node, mine in per_node.items():
            here = [e for e in mine if e.subnet == subnet]
            if len(here) > 1:
                raise LinkRefused(f"{node} has {len(here)} RDMA-backed interfaces in {subnet} "
                                  f"({', '.join(e.interface for e in here)}): which one is the "
                                  "link is ambiguous")
            ends += here
        if len(ends) == len(per_node):
            links.append(Link(subnet, ends))
    if not links:
        which = f" named {interface}" if interface else ""
        raise LinkRefused(f"no subnet that every node reaches on an RDMA-backed interface{which} "
                          f"that is up with an IPv4 address: {candidates_line(found)}")
    return links


def link_warnings(facts: LinkFacts, end: End) -> list[str]:
    """What is off with a node's end of the chosen link (each one line)."""
    out = []
    if end.mtu is not None and end.mtu < JUMBO:
        out.append(f"{end.interface} has MTU {end.mtu}, below {JUMBO} (jumbo frames on both ends)")
    port_netdevs = {nd for h in end.hcas if (x := facts.hca(h)) for nd in x.netdevs}
    for n in facts.candidates:
        if n.exists and n.up and not n.ipv4:
            twin = " (a twin of the link's port)" if n.name in port_netdevs else ""
            out.append(f"{n.name} is up without an IPv4 address{twin}")
    states = {h: _port_state(facts, h) for h in end.hcas}
    active = [h for h, s in states.items() if s == "ACTIVE"]
    for h, s in states.items():
        if s != "ACTIVE" and active:
            out.append(f"{h} is {s or 'missing'} while its twin {active[0]} is ACTIVE "
                       "(one twin carries about half the bandwidth)")
    if active and not any(end.address in _roce_v2(facts, h) for h in active):
        out.append(f"no RoCE v2 GID holds {end.address} on {', '.join(active)}")
    net = ipaddress.ip_network(end.subnet)
    for n in facts.netdevs:
        if n.name != end.interface and any(ipaddress.ip_address(a) in net for a in n.addresses):
            out.append(f"{n.name} is in the link's subnet {end.subnet} too")
    return out


def _port_state(facts: LinkFacts, hca: str) -> str | None:
    h = facts.hca(hca)
    return h.ports[0].state if h is not None and h.ports else None


def _roce_v2(facts: LinkFacts, hca: str) -> dict[str, int]:
    h = facts.hca(hca)
    return h.ports[0].roce_v2 if h is not None and h.ports else {}


# --- names -----------------------------------------------------------------------------------


def node_name(alias: str) -> str:
    """The node's name in the profile, from its ssh alias: the alias itself when it is a safe
    name, else its host part in lower case with dots as '-' (``me@Spark-A.local`` ->
    ``spark-a-local``). ``ValueError`` when even that is not a safe name."""
    checks.ssh_alias(alias)
    if checks.NAME_RE.fullmatch(alias):
        return alias
    name = alias.rpartition("@")[2].lower().replace(".", "-")
    if not checks.NAME_RE.fullmatch(name):
        raise ValueError(f"{alias!r}: no safe node name can be made of it (use an ssh alias of "
                         "lower-case letters, digits and '-')")
    return name
