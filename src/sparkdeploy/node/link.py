"""The fast link as a node shows it: the typed answer of the node helper ``link_node.py facts``
(its interfaces, RoCE devices, GID tables and twins), read through ``nodeops.run_helper``.

The shape is the helper's ``version`` 1 (see ``helpers/link_node.py``); ``cluster.discover``
and ``link.check`` read it through these types.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from sparkdeploy.node.hosts import Host
from sparkdeploy.node.nodeops import run_helper

HELPER = "link_node.py"


class _Fact(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class Ipv4(_Fact):
    address: str
    prefix: int = Field(ge=0, le=32)


class Netdev(_Fact):
    name: str
    exists: bool = True
    operstate: str | None = None
    up: bool = False
    mtu: int | None = None
    ipv4: list[Ipv4] = []
    hcas: list[str] = []
    """The RDMA devices behind this interface (empty: not a fast-link candidate)."""

    @property
    def addresses(self) -> list[str]:
        return [a.address for a in self.ipv4]


class Gid(_Fact):
    index: int
    gid: str
    type: str | None = None
    """``RoCE v2`` or ``IB/RoCE v1``."""
    ndev: str | None = None
    ipv4: str | None = None


class Port(_Fact):
    port: int
    state: str | None = None
    """``ACTIVE``, ``DOWN``, ``INIT``, ... (from ``4: ACTIVE``)."""
    phys_state: str | None = None
    link_layer: str | None = None
    rate: str | None = None
    gids: list[Gid] = []
    roce_v2: dict[str, int] = {}
    """IPv4 address -> the lowest RoCE v2 GID index holding it."""


class Hca(_Fact):
    name: str
    pci: str | None = None
    netdevs: list[str] = []
    twin: str
    """What the twins of one physical port share (the PCI function without its domain)."""
    ports: list[Port] = []


class Twins(_Fact):
    key: str
    hcas: list[str]
    netdevs: list[str]


class Ibdev2netdev(_Fact):
    hca: str
    port: int
    netdev: str
    state: str


class LinkFacts(_Fact):
    """What ``link_node.py facts`` says of one node."""

    version: int = Field(ge=1)
    netdevs: list[Netdev] = []
    hcas: list[Hca] = []
    twins: list[Twins] = []
    ibdev2netdev: list[Ibdev2netdev] | None = None

    def netdev(self, name: str) -> Netdev | None:
        return next((n for n in self.netdevs if n.name == name), None)

    def hca(self, name: str) -> Hca | None:
        return next((h for h in self.hcas if h.name == name), None)

    @property
    def candidates(self) -> list[Netdev]:
        """The interfaces with an RDMA device behind them (the fast-link candidates)."""
        return [n for n in self.netdevs if n.hcas]

    def twins_of(self, hca: str) -> list[str]:
        """Every HCA that drives the same physical port as ``hca`` (itself included)."""
        return next((list(t.hcas) for t in self.twins if hca in t.hcas), [hca])


def read_facts(host: Host, timeout: float = 60) -> LinkFacts:
    """The node's link facts (raises ``HelperFailed`` with one line when they cannot be read,
    ``NodeUnreachable`` when the node does not answer)."""
    return run_helper(host, HELPER, ["facts"], result=LinkFacts,
                      where=f"{host.name}: {HELPER} facts", timeout=timeout)
