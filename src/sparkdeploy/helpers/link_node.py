"""sparkdeploy's node-side helper for the fast link (standard library only).

Subcommands (each prints one JSON object on stdout):

  facts
      What this node offers as a fast link, read the way an owner reads it:
      - every network interface ``ip -j addr`` lists (this network namespace): its operstate,
        whether it is up, its MTU, its IPv4 addresses with their prefix length;
      - the RDMA devices (HCAs) under ``/sys/class/infiniband``: for each, the PCI function
        behind it (``device``), its net devices (``device/net/<ifname>``: what ``ibdev2netdev``
        reads), and per port its state (``ports/<p>/state``, ``phys_state``, ``link_layer``,
        ``rate``) and GID table (``ports/<p>/gids/<i>`` with ``gid_attrs/types/<i>`` and
        ``gid_attrs/ndevs/<i>``, as ``show_gids`` reads them), with the RoCE v2 GID index of
        each IPv4 address;
      - which HCAs are twins of one physical port: on a DGX Spark each ConnectX-7 port is
        driven through two PCIe x4 links, so it shows as two PCI functions that differ only in
        their PCI domain (``0000:01:00.0`` and ``0002:01:00.0``: ``rocep1s0f0`` and
        ``roceP2p1s0f0``, ``enp1s0f0np0`` and ``enP2p1s0f0np0``);
      - ``ibdev2netdev``'s own lines, where that tool is installed.

The answer's shape (``version`` 1):

  {"version": 1,
   "netdevs": [{"name", "exists", "operstate", "up", "mtu", "ipv4": [{"address", "prefix"}],
                "hcas": [HCA names behind it]}],
   "hcas": [{"name", "pci", "netdevs": [names], "twin": KEY,
             "ports": [{"port", "state", "phys_state", "link_layer", "rate",
                        "gids": [{"index", "gid", "type", "ndev", "ipv4"}],
                        "roce_v2": {IPV4: INDEX}}]}],
   "twins": [{"key", "hcas": [names], "netdevs": [names]}],
   "ibdev2netdev": null | [{"hca", "port", "netdev", "state"}]}
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shutil
import sys

try:  # in the package (the controller, the tests)
    from . import protocol
except ImportError:  # a script: protocol.py beside it (a checkout) or a directory up (staged on a node)
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [_here, os.path.dirname(_here)]
    import protocol  # type: ignore[import-not-found, no-redef]

SYS = "/sys"
VERSION = 1
_PCI = re.compile(r"^([0-9a-fA-F]{4,}):([0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])$")
_NAME_DOMAIN = re.compile(r"^(roce|en|ib)P\d+(p\d+s\d+f\d+.*)$")
_IBDEV2NETDEV = re.compile(r"^(\S+) port (\d+) ==> (\S+) \((\w+)\)\s*$")


def listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def run(argv: list[str], timeout: float = 10) -> str | None:
    """stdout of ``argv``, or None when it cannot run or fails."""
    code, out, _ = protocol.run(argv, timeout)
    return out if code == 0 else None


# --- interfaces ------------------------------------------------------------------------------


def interfaces() -> list[dict]:
    """Every interface of this network namespace, from ``ip -j addr`` (``/sys/class/net``
    shows the namespace that mounted ``/sys``, which is not always the caller's)."""
    out = run(["ip", "-j", "addr", "show"])
    try:
        listed = json.loads(out) if out else []
    except ValueError:
        listed = []
    found = []
    for info in listed if isinstance(listed, list) else []:
        if not isinstance(info, dict) or not info.get("ifname"):
            continue
        oper = str(info.get("operstate", "UNKNOWN")).lower()
        flags = info.get("flags") or []
        up = oper == "up" or (oper == "unknown" and "UP" in flags and "LOWER_UP" in flags)
        v4 = [{"address": a.get("local"), "prefix": a.get("prefixlen")}
              for a in info.get("addr_info") or []
              if isinstance(a, dict) and a.get("family") == "inet" and a.get("local")]
        found.append({"name": info["ifname"], "exists": True, "operstate": oper, "up": up,
                      "mtu": info.get("mtu"), "ipv4": v4, "hcas": []})
    return found


# --- RDMA devices ----------------------------------------------------------------------------


def pci_of(hca_dir: str) -> str | None:
    """The PCI function behind an HCA (``0000:01:00.0``): where its ``device`` link points."""
    name = os.path.basename(os.path.realpath(os.path.join(hca_dir, "device")))
    return name if _PCI.match(name) else None


def twin_key(hca: str, pci: str | None) -> str:
    """What the twins of one port share: the PCI function without its domain (``01:00.0``);
    without a PCI address, the HCA's name without its domain part (``roceP2p1s0f0`` ->
    ``rocep1s0f0``)."""
    m = _PCI.match(pci or "")
    if m:
        return m.group(2)
    n = _NAME_DOMAIN.match(hca)
    return f"{n.group(1)}{n.group(2)}" if n else hca


def mapped_ipv4(gid: str) -> str | None:
    try:
        v4 = ipaddress.IPv6Address(gid).ipv4_mapped
    except ValueError:
        return None
    return str(v4) if v4 else None


def gid_table(port_dir: str) -> list[dict]:
    """The port's GID entries that are in use (a zero GID is an empty slot), by index."""
    out = []
    names = sorted((n for n in listdir(os.path.join(port_dir, "gids")) if n.isdigit()), key=int)
    for n in names:
        gid = protocol.read(os.path.join(port_dir, "gids", n))
        if not gid:
            continue
        try:
            if ipaddress.IPv6Address(gid) == ipaddress.IPv6Address(0):
                continue
        except ValueError:
            continue
        kind = protocol.read(os.path.join(port_dir, "gid_attrs", "types", n))
        ndev = protocol.read(os.path.join(port_dir, "gid_attrs", "ndevs", n))
        out.append({"index": int(n), "gid": gid, "type": kind or None, "ndev": ndev or None,
                    "ipv4": mapped_ipv4(gid)})
    return out


def _state(text: str | None) -> str | None:
    """``4: ACTIVE`` -> ``ACTIVE``."""
    return text.split(":", 1)[-1].strip() if text else None


def port_facts(port_dir: str, port: int) -> dict:
    gids = gid_table(port_dir)
    v2: dict[str, int] = {}
    for g in gids:
        if g["ipv4"] and g["type"] == "RoCE v2":
            v2.setdefault(g["ipv4"], g["index"])
    return {"port": port, "state": _state(protocol.read(os.path.join(port_dir, "state"))),
            "phys_state": _state(protocol.read(os.path.join(port_dir, "phys_state"))),
            "link_layer": protocol.read(os.path.join(port_dir, "link_layer")),
            "rate": protocol.read(os.path.join(port_dir, "rate")), "gids": gids, "roce_v2": v2}


def hcas(sys_root: str = SYS) -> list[dict]:
    ib = os.path.join(sys_root, "class", "infiniband")
    out = []
    for name in listdir(ib):
        d = os.path.join(ib, name)
        if not os.path.isdir(d):
            continue
        pci = pci_of(d)
        ports = [port_facts(os.path.join(d, "ports", p), int(p))
                 for p in sorted((p for p in listdir(os.path.join(d, "ports")) if p.isdigit()), key=int)]
        out.append({"name": name, "pci": pci, "netdevs": listdir(os.path.join(d, "device", "net")),
                    "twin": twin_key(name, pci), "ports": ports})
    return out


def twins(devs: list[dict]) -> list[dict]:
    """HCAs (and their net devices) grouped by the physical port they drive."""
    groups: dict[str, dict] = {}
    for h in devs:
        g = groups.setdefault(h["twin"], {"key": h["twin"], "hcas": [], "netdevs": []})
        g["hcas"].append(h["name"])
        g["netdevs"] += [n for n in h["netdevs"] if n not in g["netdevs"]]
    return list(groups.values())


def ibdev2netdev() -> list[dict] | None:
    """``ibdev2netdev``'s lines (``rocep1s0f0 port 1 ==> enp1s0f0np0 (Up)``), when installed."""
    if not shutil.which("ibdev2netdev"):
        return None
    out = run(["ibdev2netdev"])
    if out is None:
        return None
    rows = []
    for line in out.splitlines():
        m = _IBDEV2NETDEV.match(line.strip())
        if m:
            rows.append({"hca": m.group(1), "port": int(m.group(2)), "netdev": m.group(3),
                         "state": m.group(4)})
    return rows


def facts(sys_root: str = SYS) -> dict:
    nets = interfaces()
    devs = hcas(sys_root)
    by_name = {n["name"]: n for n in nets}
    for h in devs:
        for nd in h["netdevs"]:
            entry = by_name.get(nd)
            if entry is None:  # behind an HCA, but not in this network namespace
                entry = {"name": nd, "exists": False, "operstate": None, "up": False,
                         "mtu": None, "ipv4": [], "hcas": []}
                by_name[nd] = entry
                nets.append(entry)
            entry["hcas"].append(h["name"])
    return {"version": VERSION, "netdevs": nets, "hcas": devs, "twins": twins(devs),
            "ibdev2netdev": ibdev2netdev()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="link_node.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("facts")
    p.parse_args(argv)
    protocol.answer(facts())
    return 0


if __name__ == "__main__":
    sys.exit(main())
