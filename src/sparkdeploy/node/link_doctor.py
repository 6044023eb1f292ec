"""The link doctor's decisions (``link.check``): what is wrong with the fast link, from the
profile and what each node shows (``sparkdeploy.node.link.LinkFacts``), one ``Problem`` each.

Pure: no node is asked here. Each problem names the node, the interface (or HCA) and both
values: what the node has and what the link needs.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from sparkdeploy.core.outside import OutsideError, parsed
from sparkdeploy.engines import EngineError, launch
from sparkdeploy.node.link import LinkFacts, Netdev
from sparkdeploy.profile.config import Node, Profile

OWN_ADDRESS = ("SGLANG_HOST_IP", "VLLM_HOST_IP")
"""Variables in which an engine advertises the node's own address to its peers."""
HEAD_ADDRESS = ("MASTER_ADDR",)
IFNAMES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "UCX_NET_DEVICES")
OWN_FLAGS = ("--node-ip-address",)
"""Flags whose value is the node's own address (Ray's node IP)."""
HEAD_FLAGS = ("--master-addr", "--dist-init-addr")
"""Flags whose value is the head's address (``--dist-init-addr`` with its port)."""


@dataclass(frozen=True)
class Problem:
    node: str
    interface: str
    what: str

    @property
    def line(self) -> str:
        return f"{self.interface}: {self.what}"


# --- one node --------------------------------------------------------------------------------


def link_network(node: Node, nd: Netdev | None) -> ipaddress.IPv4Network | None:
    """The link's subnet: the profile's address with the prefix the interface gives it."""
    for a in nd.ipv4 if nd else []:
        if a.address == node.link.address:
            return ipaddress.IPv4Interface(f"{a.address}/{a.prefix}").network
    return None


def interface_problems(node: Node, facts: LinkFacts, min_mtu: int) -> list[Problem]:
    """The link's interface: present, up, holding the profile's address, jumbo MTU."""
    iface, addr = node.link.interface, node.link.address
    nd = facts.netdev(iface)
    if nd is None or not nd.exists:
        have = ", ".join(n.name for n in facts.netdevs if n.exists and n.name != "lo") or "none"
        return [Problem(node.name, iface, f"does not exist on {node.name} (interfaces: {have})")]
    out = []
    if not nd.up:
        out.append(Problem(node.name, iface, f"is {nd.operstate or 'down'}, must be up"))
    if addr not in nd.addresses:
        has = ", ".join(f"{a.address}/{a.prefix}" for a in nd.ipv4) or "none"
        out.append(Problem(node.name, iface, f"lacks the profile's address {addr} (has: {has})"))
    if nd.mtu is None or nd.mtu < min_mtu:
        out.append(Problem(node.name, iface, f"MTU {nd.mtu}, must be jumbo (>= {min_mtu})"))
    return out


def twin_netdevs(node: Node, facts: LinkFacts) -> set[str]:
    """The net devices of the link's port: behind the profile's HCAs and their twins (a Spark
    drives one port through two PCI functions, each with its own net device)."""
    out = set()
    for name in node.link.hcas:
        for twin in facts.twins_of(name):
            hca = facts.hca(twin)
            out |= set(hca.netdevs if hca else [])
    return out


def subnet_problems(node: Node, facts: LinkFacts) -> list[Problem]:
    """No other interface with an address in (or overlapping) the link's subnet: the kernel
    would route part of the link's traffic through it. The twins of the link's port may (they
    are the same cable)."""
    net = link_network(node, facts.netdev(node.link.interface))
    if net is None:
        return []
    twins = twin_netdevs(node, facts)
    out = []
    for nd in facts.netdevs:
        if nd.name == node.link.interface or nd.name in twins:
            continue
        for a in nd.ipv4:
            other = ipaddress.IPv4Interface(f"{a.address}/{a.prefix}").network
            if other.overlaps(net):
                out.append(Problem(node.name, nd.name,
                                   f"holds {a.address}/{a.prefix}, in the link's subnet {net} "
                                   f"(only {node.link.interface} may)"))
    return out


def _gid_problem(node: Node, facts: LinkFacts, netdevs: list[str],
                 roce_v2: dict[str, int]) -> tuple[int | None, str | None]:
    """(the RoCE v2 GID index the HCA gives the link, or None and why): the node's address
    behind the link's interface; a twin behind its own net device, one of that one's."""
    if node.link.interface in netdevs:
        want = [node.link.address]
    else:
        want = [a for n in netdevs if (nd := facts.netdev(n)) for a in nd.addresses]
    found = [roce_v2[a] for a in want if a in roce_v2]
    if found:
        return found[0], None
    v2 = ", ".join(f"{a} at {i}" for a, i in sorted(roce_v2.items())) or "none"
    if node.link.interface in netdevs:
        return None, f"no RoCE v2 GID for {node.link.address} (RoCE v2 IPv4 GIDs: {v2})"
    return None, (f"no RoCE v2 GID for an IPv4 address of {', '.join(netdevs) or 'its netdev'} "
                  f"(addresses: {', '.join(want) or 'none'}; RoCE v2 IPv4 GIDs: {v2})")


def hca_problems(node: Node, facts: LinkFacts) -> list[Problem]:
    """Every HCA the profile lists: present, port ACTIVE, a RoCE v2 GID for the node's address
    (a twin behind its own net device: for that one's address), the same GID index on all of
    them (``NCCL_IB_GID_INDEX`` is one number)."""
    out = []
    index: dict[str, int] = {}
    for name in node.link.hcas:
        hca = facts.hca(name)
        if hca is None:
            have = ", ".join(h.name for h in facts.hcas) or "none"
            out.append(Problem(node.name, name, f"HCA absent (RDMA devices: {have})"))
            continue
        where = f"{name} ({', '.join(hca.netdevs) or 'no netdev'})"
        port = hca.ports[0] if hca.ports else None
        if port is None:
            out.append(Problem(node.name, where, "HCA has no port"))
            continue
        if port.state != "ACTIVE":
            out.append(Problem(node.name, where,
                               f"port {port.port} is {port.state or 'unknown'}, must be ACTIVE"))
        found, why = _gid_problem(node, facts, hca.netdevs, port.roce_v2)
        if found is not None:
            index[name] = found
        else:
            out.append(Problem(node.name, where, str(why)))
    if len(set(index.values())) > 1:
        shown = ", ".join(f"{h} {i}" for h, i in index.items())
        out.append(Problem(node.name, ", ".join(index),
                           f"RoCE v2 GID index differs ({shown}); "
                           "NCCL_IB_GID_INDEX is one number for all of them"))
    return out


def gid_indexes(node: Node, facts: LinkFacts) -> dict[str, int]:
    """{HCA: the RoCE v2 GID index it gives the link} for the profile's HCAs that have one."""
    out = {}
    for name in node.link.hcas:
        hca = facts.hca(name)
        if hca and hca.ports:
            found, _ = _gid_problem(node, facts, hca.netdevs, hca.ports[0].roce_v2)
            if found is not None:
                out[name] = found
    return out


def node_problems(node: Node, facts: LinkFacts, min_mtu: int = 9000) -> list[Problem]:
    return (interface_problems(node, facts, min_mtu) + subnet_problems(node, facts)
            + hca_problems(node, facts))


def usable(node: Node, facts: LinkFacts | None) -> bool:
    """The node's end can be tested: its interface up with the profile's address."""
    nd = facts.netdev(node.link.interface) if facts else None
    return bool(nd and nd.exists and nd.up and node.link.address in nd.addresses)


# --- every pair ------------------------------------------------------------------------------


def mtu_of(node: Node, facts: LinkFacts | None) -> int | None:
    nd = facts.netdev(node.link.interface) if facts else None
    return nd.mtu if nd and nd.exists else None


def pair_problems(profile: Profile, facts: dict[str, LinkFacts | None]) -> list[Problem]:
    """Both ends of every pair at one MTU; the problem is the lower end's (it limits the link)."""
    out = []
    nodes = profile.nodes
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            ma, mb = mtu_of(a, facts.get(a.name)), mtu_of(b, facts.get(b.name))
            if ma is None or mb is None or ma == mb:
                continue
            low, high, lm, hm = (a, b, ma, mb) if ma < mb else (b, a, mb, ma)
            out.append(Problem(low.name, low.link.interface,
                               f"MTU {lm}, but {high.name}'s {high.link.interface} has MTU {hm} "
                               "(both ends must be equal)"))
    return out


# --- what the engines advertise ----------------------------------------------------------------


def _flag_value(argv: tuple[str, ...], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _host_part(value: str) -> str:
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _ifname_ok(var: str, value: str, iface: str) -> bool:
    """NCCL and UCX take a prefix (``enp1s0f0``) or a list; Gloo and TP an exact name."""
    names = [v for v in value.split(",") if v]
    if var in ("NCCL_SOCKET_IFNAME", "UCX_NET_DEVICES"):
        return any(iface.startswith(n.lstrip("=").split(":")[0]) for n in names)  # not ^X
    return value == iface


def advertised_problems(profile: Profile) -> list[Problem]:
    """Every engine's containers (after the profile's ``env`` and ``args``): the address each
    advertises is its node's fast-link address, the head's address the head's, the socket
    interfaces the link's."""
    head = profile.head
    out = []
    for eng in profile.engines:
        try:
            lau = launch(profile, eng, {})
        except EngineError:
            continue  # serve.up says why
        for c in lau.containers:
            node = profile.node(c.node)
            env = c.environment
            own = [(v, env[v]) for v in OWN_ADDRESS if v in env]
            own += [(f, v) for f in OWN_FLAGS if (v := _flag_value(c.argv, f)) is not None]
            heads = [(v, env[v]) for v in HEAD_ADDRESS if v in env]
            heads += [(f, v) for f in HEAD_FLAGS if (v := _flag_value(c.argv, f)) is not None]
            if "RAY_ADDRESS" in env:
                heads.append(("RAY_ADDRESS", env["RAY_ADDRESS"]))
            where = f"{eng.name} ({c.name})"
            for what, value in own:
                if _host_part(value) != node.link.address:
                    out.append(Problem(node.name, node.link.interface,
                                       f"{where} advertises {what}={value}, not {node.name}'s "
                                       f"fast-link address {node.link.address}"))
            for what, value in heads:
                if _host_part(value) != head.link.address:
                    out.append(Problem(node.name, node.link.interface,
                                       f"{where} has {what}={value}, not the head's fast-link "
                                       f"address {head.link.address}"))
            for var in IFNAMES:
                if var in env and not _ifname_ok(var, env[var], node.link.interface):
                    out.append(Problem(node.name, node.link.interface,
                                       f"{where} has {var}={env[var]}, not the fast link's "
                                       f"interface {node.link.interface}"))
    return out


# --- the head reaching a worker ------------------------------------------------------------------


def ping_argv(iface: str, mtu: int, addr: str) -> list[str]:
    """One packet of the MTU's size (20 bytes of IP and 8 of ICMP header), not to be fragmented."""
    return ["ping", "-M", "do", "-s", str(mtu - 28), "-c", "1", "-W", "2", "-I", iface, addr]


def ping_why(stdout: str, stderr: str) -> str:
    """The one line that says why a ping failed: its own error line (``ping: ...``), else the
    statistics' loss line."""
    lines = [ln.strip() for ln in (stderr + "\n" + stdout).splitlines() if ln.strip()]
    said = [ln for ln in lines if ln.startswith("ping:")]
    loss = [ln for ln in lines if "packet loss" in ln]
    return (said or loss or lines or ["no answer"])[0]


def iperf_gbps(stdout: str) -> tuple[float | None, str]:
    """(Gb/s received, '') from ``iperf3 -J``'s answer, or (None, why)."""
    try:
        data = parsed(stdout, "iperf3")
    except OutsideError:
        return None, "iperf3 gave no JSON"
    if not isinstance(data, dict):
        return None, "iperf3 gave no JSON object"
    if data.get("error"):
        return None, f"iperf3: {data['error']}"
    got = ((data.get("end") or {}).get("sum_received") or {}).get("bits_per_second")
    if not isinstance(got, int | float) or got < 0:
        return None, "iperf3's answer has no end.sum_received.bits_per_second"
    return got / 1e9, ""


def stream_gbps(received: int, seconds: float) -> float | None:
    return received * 8 / seconds / 1e9 if seconds > 0 and received > 0 else None


def bandwidth_problem(head: Node, worker: Node, gbps: float, expect: float | None,
                      tool: str) -> Problem | None:
    if expect is None or gbps >= expect:
        return None
    return Problem(worker.name, worker.link.interface,
                   f"{head.name} -> {worker.name}: {gbps:.2f} Gb/s measured ({tool}), the profile "
                   f"expects >= {expect:g} Gb/s (link.expect_gbps)")
