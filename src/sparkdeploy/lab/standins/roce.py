"""The RoCE devices of a Spark's ConnectX-7 port, as sysfs shows them (lab only).

A Spark exposes each fast-link port as two RoCE devices ("twins", e.g. ``rocep1s0f0`` and
``roceP2p1s0f0``), each under ``/sys/class/infiniband/<hca>/``::

    ports/1/state                 "4: ACTIVE"
    ports/1/phys_state            "5: LinkUp"
    ports/1/link_layer            "Ethernet"
    ports/1/gids/<i>              the GID (IPv6 form; IPv4 addresses mapped as ::ffff:a.b.c.d)
    ports/1/gid_attrs/types/<i>   "IB/RoCE v1" or "RoCE v2"
    ports/1/gid_attrs/ndevs/<i>   the net device
    device/net/<ifname>/          the port's net device (what ``ibdev2netdev`` reads)

The GID table lists, per address of the net device, a RoCE v1 entry then a RoCE v2 entry:
the link-local IPv6 address first, then each global IPv6 address, then the IPv4 address. So
the IPv4 RoCE v2 entry (what NCCL needs) is at index 3 on a port with no global IPv6 address,
and at 5 on a port with one (an owner reported needing ``NCCL_IB_GID_INDEX=5``).

``write_tree`` makes that tree under a directory; the lab overlays it on ``/sys/class`` in a
node's mount namespace (and in its GPU containers). Run on the controller (by
``nodeinstall.py``), never on a node.
"""

from __future__ import annotations

import ipaddress
import shutil
from pathlib import Path

from sparkdeploy.core.files import write_if_changed

ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


def gid_text(addr: str) -> str:
    """sysfs's form of a GID: eight groups of four hex digits."""
    ip = ipaddress.ip_address(addr)
    v6 = ipaddress.IPv6Address(f"::ffff:{ip}") if ip.version == 4 else ip
    h = v6.exploded.replace(":", "")
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def gid_table(ipv4: str, link_local: str, global_v6: list[str] | tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """[(gid, type)] in the kernel's order: per address a RoCE v1 then a RoCE v2 entry."""
    out = []
    for addr in [link_local, *global_v6, ipv4]:
        out.append((gid_text(addr), "IB/RoCE v1"))
        out.append((gid_text(addr), "RoCE v2"))
    return out


def roce_v2_ipv4_index(table: list[tuple[str, str]], ipv4: str) -> int | None:
    want = gid_text(ipv4)
    return next((i for i, (g, t) in enumerate(table) if g == want and t == "RoCE v2"), None)


def write_tree(root: Path, hcas: list[str], netdev: str, table: list[tuple[str, str]],
               slots: int = 16) -> None:
    """``root/infiniband/<hca>/...`` for each HCA (the whole tree rewritten in place)."""
    ib = Path(root) / "infiniband"
    ib.mkdir(parents=True, exist_ok=True)
    for stale in ib.iterdir():
        if stale.name not in hcas:
            shutil.rmtree(stale, ignore_errors=True)
    for hca in hcas:
        port = ib / hca / "ports" / "1"
        for sub in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
            (port / sub).mkdir(parents=True, exist_ok=True)
        (ib / hca / "device" / "net" / netdev).mkdir(parents=True, exist_ok=True)
        for other in (ib / hca / "device" / "net").iterdir():
            if other.name != netdev:
                shutil.rmtree(other, ignore_errors=True)
        _write(ib / hca / "node_type", "1: CA")
        _write(port / "state", "4: ACTIVE")
        _write(port / "phys_state", "5: LinkUp")
        _write(port / "link_layer", "Ethernet")
        _write(port / "rate", "200 Gb/sec (4X HDR)")
        for i in range(slots):
            gid, typ = table[i] if i < len(table) else (ZERO_GID, "")
            _write(port / "gids" / str(i), gid)
            _write(port / "gid_attrs" / "types" / str(i), typ)
            _write(port / "gid_attrs" / "ndevs" / str(i), netdev if i < len(table) else "")


def _write(path: Path, text: str) -> None:
    write_if_changed(path, text + "\n")
