"""A DGX Spark's fast-link view for the unit tests: its sysfs laid out as the kernel lays it out
(``/sys/class/infiniband/<hca>`` a link into ``/sys/devices/pci.../<pci>/infiniband/<hca>``,
``device`` a link to the PCI function, ``device/net/<ifname>``), built from the recorded
``ibdev2netdev`` and PCI mapping of real Sparks (``data/spark/``), and the ``ip -j addr``
answer of its interfaces. ``link_node.py`` runs on it unchanged."""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from sparkdeploy.core.packaged import helper

DATA = Path(__file__).parent / "data" / "spark"
_spec = importlib.util.spec_from_file_location("link_node", helper("link_node.py"))
assert _spec and _spec.loader
link_node = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(link_node)


def recorded_ibdev2netdev(name: str = "ibdev2netdev-eugr.txt") -> list[tuple[str, str, str]]:
    """(hca, netdev, Up|Down) per line of a recorded ``ibdev2netdev``."""
    rows = []
    for line in (DATA / name).read_text().splitlines():
        hca, _, _, _, netdev, state = line.split()
        rows.append((hca, netdev, state.strip("()")))
    return rows


def recorded_pci() -> dict[str, tuple[str, str]]:
    """netdev -> (PCI function, phys_port_name), as recorded on a real Spark."""
    out = {}
    for line in (DATA / "pci-twins.txt").read_text().splitlines():
        cols = line.split()
        out[cols[0]] = (cols[2].removeprefix("pci="), cols[1].removeprefix("port="))
    return out


def mapped(addr: str) -> str:
    v6 = ipaddress.IPv6Address(f"::ffff:{addr}") if "." in addr else ipaddress.IPv6Address(addr)
    h = v6.exploded.replace(":", "")
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


@dataclass
class Iface:
    up: bool = True
    mtu: int = 9000
    ipv4: list[str] = field(default_factory=list)
    """``a.b.c.d/p``."""
    link_local: str = "fe80::1"


@dataclass
class SparkView:
    """One Spark: its interfaces (by name) and the state of each RoCE port (by HCA)."""

    ifaces: dict[str, Iface]
    hca_state: dict[str, str]
    """hca -> ``4: ACTIVE`` / ``1: DOWN``."""
    netdev_of: dict[str, str]
    extra: dict[str, Iface] = field(default_factory=dict)
    """Interfaces without an HCA (the LAN, Wi-Fi)."""

    def write_sysfs(self, root: Path) -> Path:
        pci = recorded_pci()
        for hca, netdev in self.netdev_of.items():
            fn, port_name = pci[netdev]
            dom = fn.split(":")[0]
            dev = root / "devices" / f"pci{dom}:00" / f"{dom}:00:00.0" / fn
            (dev / "net" / netdev).mkdir(parents=True, exist_ok=True)
            (dev / "net" / netdev / "phys_port_name").write_text(port_name + "\n")
            ib = dev / "infiniband" / hca
            port = ib / "ports" / "1"
            for sub in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
                (port / sub).mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(dev, ib), ib / "device")
            (port / "state").write_text(self.hca_state[hca] + "\n")
            up = "ACTIVE" in self.hca_state[hca]
            (port / "phys_state").write_text(("5: LinkUp" if up else "3: Disabled") + "\n")
            (port / "link_layer").write_text("Ethernet\n")
            (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
            iface = self.ifaces[netdev]
            table = []
            for addr in [iface.link_local, *(a.split("/")[0] for a in iface.ipv4)]:
                table += [(mapped(addr), "IB/RoCE v1"), (mapped(addr), "RoCE v2")]
            for i in range(8):
                gid, kind = table[i] if i < len(table) else ("0000:" * 7 + "0000", "")
                (port / "gids" / str(i)).write_text(gid + "\n")
                (port / "gid_attrs" / "types" / str(i)).write_text(kind + "\n" if kind else "")
                (port / "gid_attrs" / "ndevs" / str(i)).write_text(netdev + "\n" if kind else "")
            cls = root / "class" / "infiniband"
            cls.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(ib, cls), cls / hca)
        return root

    def ip_addr_json(self) -> str:
        """What ``ip -j addr show`` answers on this node."""
        out = [{"ifindex": 1, "ifname": "lo", "flags": ["LOOPBACK", "UP", "LOWER_UP"],
                "mtu": 65536, "operstate": "UNKNOWN",
                "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]}]
        for i, (name, f) in enumerate({**self.extra, **self.ifaces}.items(), start=2):
            flags = ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"] if f.up else ["BROADCAST", "MULTICAST"]
            info = [{"family": "inet", "local": a.split("/")[0], "prefixlen": int(a.split("/")[1])}
                    for a in f.ipv4]
            info.append({"family": "inet6", "local": f.link_local, "prefixlen": 64, "scope": "link"})
            out.append({"ifindex": i, "ifname": name, "flags": flags, "mtu": f.mtu,
                        "operstate": "UP" if f.up else "DOWN", "addr_info": info})
        return json.dumps(out)


def spark(recorded: str = "ibdev2netdev-eugr.txt", addrs: dict[str, list[str]] | None = None,
          mtu: int = 9000) -> SparkView:
    """A Spark as a recorded ``ibdev2netdev`` shows it: the Up ports up and ACTIVE, the
    others down; ``addrs`` per interface (default: the first Up interface 192.168.177.11/24,
    as in the thread)."""
    rows = recorded_ibdev2netdev(recorded)
    first_up = next(n for _, n, s in rows if s == "Up")
    addrs = addrs if addrs is not None else {first_up: ["192.168.177.11/24"]}
    ifaces = {n: Iface(up=s == "Up", mtu=mtu, ipv4=list(addrs.get(n, [])),
                       link_local=f"fe80::{i + 1:x}") for i, (_, n, s) in enumerate(rows)}
    return SparkView(ifaces=ifaces,
                     hca_state={h: "4: ACTIVE" if s == "Up" else "1: DOWN" for h, _, s in rows},
                     netdev_of={h: n for h, n, _ in rows},
                     extra={"enP7s7": Iface(mtu=1500, ipv4=["192.168.1.40/24"]),
                            "wlP9s9": Iface(mtu=1500, ipv4=["192.168.1.41/24"])})


def facts_on(view: SparkView, root: Path, monkeypatch, ibdev2netdev: str | None = None) -> dict:
    """``link_node.py facts`` on ``view`` (its sysfs under ``root``; ``ip`` and, when given,
    ``ibdev2netdev`` answer as the node's would)."""
    view.write_sysfs(root)

    def run(argv, timeout=10):
        if argv == ["ip", "-j", "addr", "show"]:
            return view.ip_addr_json()
        if argv == ["ibdev2netdev"] and ibdev2netdev is not None:
            return (DATA / ibdev2netdev).read_text()
        raise AssertionError(f"unexpected {argv}")

    monkeypatch.setattr(link_node, "run", run)
    monkeypatch.setattr(link_node.shutil, "which",
                        lambda name: "/usr/bin/ibdev2netdev" if ibdev2netdev and name == "ibdev2netdev" else None)
    return link_node.facts(str(root))
