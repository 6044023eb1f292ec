"""Link faults: what the link doctor (``link.check``) must see, made on one lab node through the
real tools (``ip``, ``tc`` in the node's network namespace) or the RoCE stand-in's sysfs files,
by ``inv lab.fault NAME --nodes X``; ``inv lab.fault none`` undoes every one of them on every
node (each undo looks first and says what it restored).

They act at once and are not kept in the faults record: the node's state is the record, so an
undo finds what is off whoever made it (a fault injected by hand too). ``lab.up`` remakes a
fast link that lost its address, MTU or state, and rewrites the stand-in's sysfs.
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.lab import layout
from sparkdeploy.lab.proc import LabError, run

LINK_FAULTS: dict[str, str] = {
    "mtu-mismatch": f"the node's {layout.FAST_IF} at MTU 1500 (the others keep {layout.FAST_MTU})",
    "address-missing": f"the node's fast-link address removed from {layout.FAST_IF}",
    "twin-down": f"the RoCE twin {layout.FAST_HCAS[-1]}'s port 1 DOWN in the stand-in's sysfs",
    "link-throttled": (f"tc tbf at 200mbit on the node's {layout.FAST_IF} and on the bridge port "
                       "towards it (both directions)"),
    "second-interface": "a second interface labextra0 (a veth pair inside the node) with an "
                        f"address in the link's subnet {layout.FAST_NET}",
    "interface-down": f"the node's {layout.FAST_IF} set down",
    "link-drop": ("the switch's port towards the node down (ip -n lab-fast link set ... down): the "
                  "node's interface keeps its address and stays up, nothing crosses (the port's "
                  "bridge state 0 let the all-reduce through, and this kernel has no netem)"),
}
EXTRA = "labextra0"
"""A veth pair inside the node (``labextra0``, ``labextra1``): this kernel may lack ``dummy``."""
PORT_DISABLED, PORT_FORWARDING = 0, 3
"""A bridge port's states as ``ip link set ... type bridge_slave state N`` takes them."""
SLOW = ["tbf", "rate", "200mbit", "burst", "256kb", "latency", "50ms"]

ACTIVE, DOWN = "4: ACTIVE", "1: DOWN"


def fast_addr(node: str) -> str:
    return str(ipaddress.ip_network(layout.FAST_NET)[layout.node_index(node)])


def prefix() -> int:
    return ipaddress.ip_network(layout.FAST_NET).prefixlen


def _in(ns: str, *argv: str, check: bool = True) -> str:
    return run(["ip", "netns", "exec", ns, *argv], check=check).stdout or ""


def _link(ns: str, name: str) -> dict | None:
    out = run(["ip", "-n", ns, "-j", "addr", "show", "dev", name], check=False)
    try:
        got = json.loads(out.stdout or "[]") if out.returncode == 0 else []
    except ValueError:
        return None
    return got[0] if isinstance(got, list) and got and isinstance(got[0], dict) else None


def port_state(node: str) -> str | None:
    """The state of the bridge port towards ``node`` (``forwarding``, ``disabled``; None: no
    such port), as ``ip -d -j link`` says it."""
    out = run(["ip", "-n", layout.FAST_NETNS, "-d", "-j", "link", "show", "dev",
               layout.fast_peer_veth(node)], check=False)
    try:
        got = json.loads(out.stdout or "[]") if out.returncode == 0 else []
    except ValueError:
        return None
    info = got[0].get("linkinfo", {}) if isinstance(got, list) and got and isinstance(got[0], dict) else {}
    state = info.get("info_slave_data", {}).get("state") if isinstance(info, dict) else None
    return str(state) if state is not None else None


def twin_state_file(node: str, hca: str | None = None) -> Path:
    """The port state the RoCE stand-in shows for ``hca`` (the overlay's upper layer, which
    the node sees as ``/sys/class/infiniband/<hca>/ports/1/state``)."""
    root = layout.node_dir(node) / layout.PRIVATE_MOUNTS[layout.STANDIN_DIR]
    return root / "sysfs" / "infiniband" / (hca or layout.FAST_HCAS[-1]) / "ports" / "1" / "state"


def _write_in_place(path: Path, text: str) -> None:
    """Rewrite the file's content in its own inode: the node's overlay keeps showing that inode
    (a new file renamed over it would leave the overlay with the old one)."""
    with open(path, "r+") as f:
        f.seek(0)
        f.write(text)
        f.truncate()


def inject(name: str, node: str) -> list[Result]:
    """One of LINK_FAULTS on ``node`` now (a tool that refuses: one failed line)."""
    if not layout.netns_path(node).exists():
        return [Result("lab.fault", Status.FAILED, f"{node}: no such lab node (lab.up first)")]
    try:
        _inject(name, node)
    except LabError as e:
        return [Result("lab.fault", Status.FAILED, f"{name} on {node}: {e}", node)]
    return [Result("lab.fault", Status.CHANGED, f"{name} on {node}: {LINK_FAULTS[name]}", node)]


def _inject(name: str, node: str) -> None:
    ns, iface = layout.netns_name(node), layout.FAST_IF
    if name == "mtu-mismatch":
        run(["ip", "-n", ns, "link", "set", iface, "mtu", "1500"])
    elif name == "address-missing":
        run(["ip", "-n", ns, "addr", "del", f"{fast_addr(node)}/{prefix()}", "dev", iface])
    elif name == "twin-down":
        _write_in_place(twin_state_file(node), DOWN + "\n")
    elif name == "link-throttled":
        _in(ns, "tc", "qdisc", "replace", "dev", iface, "root", *SLOW)
        _in(layout.FAST_NETNS, "tc", "qdisc", "replace", "dev", layout.fast_peer_veth(node), "root",
            *SLOW)
    elif name == "second-interface":
        other = str(ipaddress.ip_network(layout.FAST_NET)[200 + layout.node_index(node)])
        run(["ip", "-n", ns, "link", "add", EXTRA, "type", "veth", "peer", "name", "labextra1"])
        run(["ip", "-n", ns, "addr", "add", f"{other}/{prefix()}", "dev", EXTRA])
        run(["ip", "-n", ns, "link", "set", "labextra1", "up"])
        run(["ip", "-n", ns, "link", "set", EXTRA, "up"])
    elif name == "link-drop":
        run(["ip", "-n", layout.FAST_NETNS, "link", "set", "dev", layout.fast_peer_veth(node), "down"])
    elif name == "interface-down":
        # keep its IPv6 addresses (the stand-in's GID table has them) for when it comes back
        _in(ns, "sysctl", "-qw", f"net.ipv6.conf.{iface}.keep_addr_on_down=1")
        run(["ip", "-n", ns, "link", "set", iface, "down"])


def heal(node: str) -> list[str]:
    """Undo every link fault on ``node``: what was off, each said."""
    ns, iface = layout.netns_name(node), layout.FAST_IF
    if not layout.netns_path(node).exists():
        return []
    did = []
    link = _link(ns, iface)
    if link is not None:
        if link.get("mtu") != layout.FAST_MTU:
            run(["ip", "-n", ns, "link", "set", iface, "mtu", str(layout.FAST_MTU)])
            did.append(f"MTU {layout.FAST_MTU}")
        if not any(a.get("local") == fast_addr(node) for a in link.get("addr_info", [])):
            run(["ip", "-n", ns, "addr", "add", f"{fast_addr(node)}/{prefix()}", "dev", iface])
            did.append(f"address {fast_addr(node)}")
        if "UP" not in link.get("flags", []):
            run(["ip", "-n", ns, "link", "set", iface, "up"])
            did.append(f"{iface} up")
    for where, dev in ((ns, iface), (layout.FAST_NETNS, layout.fast_peer_veth(node))):
        if "tbf" in _in(where, "tc", "qdisc", "show", "dev", dev, check=False):
            _in(where, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            did.append(f"no tbf on {dev}")
    port = _link(layout.FAST_NETNS, layout.fast_peer_veth(node))
    if port is not None and "UP" not in port.get("flags", []):
        run(["ip", "-n", layout.FAST_NETNS, "link", "set", "dev", layout.fast_peer_veth(node), "up"])
        did.append(f"{layout.fast_peer_veth(node)} up")
    if port_state(node) not in (None, "forwarding"):
        run(["ip", "-n", layout.FAST_NETNS, "link", "set", "dev", layout.fast_peer_veth(node),
             "type", "bridge_slave", "state", str(PORT_FORWARDING)])
        did.append(f"{layout.fast_peer_veth(node)} forwarding")
    if _link(ns, EXTRA) is not None:
        run(["ip", "-n", ns, "link", "del", EXTRA])  # and its peer
        did.append(f"{EXTRA} removed")
    state = twin_state_file(node)
    if state.exists() and state.read_text().strip() != ACTIVE:
        _write_in_place(state, ACTIVE + "\n")
        did.append(f"{layout.FAST_HCAS[-1]} ACTIVE")
    return did
