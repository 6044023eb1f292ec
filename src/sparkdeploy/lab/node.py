"""A node's namespaces, private mounts and network links (idempotent; each says if it changed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from sparkdeploy.lab import layout
from sparkdeploy.lab.layout import AddressPlan
from sparkdeploy.lab.proc import LabError, run

# --- mounts ------------------------------------------------------------------------------


def _mount_points(mountinfo: str) -> dict[str, str]:
    """mount point -> root (the path inside its source filesystem), last mount wins."""
    out = {}
    for line in mountinfo.splitlines():
        f = line.split()
        if len(f) > 4:
            out[_unescape(f[4])] = _unescape(f[3])
    return out


def _unescape(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace(
        "\\134", "\\")


def root_mounts() -> dict[str, str]:
    return _mount_points(Path("/proc/self/mountinfo").read_text())


def is_ns_mounted(path: Path) -> bool:
    return os.path.realpath(path) in root_mounts()


def ensure_mntns(node: str, created: list[str]) -> bool:
    """A persistent mount namespace bound to ``ns/<node>.mnt``; True if made now."""
    f = layout.mntns_path(node)
    if f.exists() and is_ns_mounted(f):
        return False
    f.parent.mkdir(parents=True, exist_ok=True)
    f.touch()
    run(["unshare", f"--mount={f}", "--propagation", "private", "true"])
    return True


def ensure_private_mounts(node: str, created: list[str]) -> list[str]:
    """Bind each node-private backing dir over its path inside the node; return those made."""
    f = layout.mntns_path(node)
    have = _mount_points(run(["nsenter", f"--mount={f}", "cat", "/proc/self/mountinfo"]).stdout)
    made: list[str] = []
    for target, name in layout.PRIVATE_MOUNTS.items():
        src = layout.node_dir(node) / name
        src.mkdir(parents=True, exist_ok=True)
        if name == "ssh":
            os.chmod(src, 0o700)
        if target == layout.ROOT_HOME:
            os.chmod(src, 0o700)
            # the mount point of the .ssh bind inside the node's own /root
            (src / Path(layout.ROOT_SSH_DIR).name).mkdir(mode=0o700, exist_ok=True)
        tp = Path(target)
        if not tp.exists():
            tp.mkdir(parents=True)
            created.append(target)
        # mountinfo's root is the path inside the source filesystem: a suffix of ``src``
        root = have.get(target, "/")
        shadowed = any(target.startswith(m.rstrip("/") + "/") for m in made)
        if (root != "/" and str(src).endswith(root) and root.endswith(f"/{node}/{name}")
                and not shadowed):
            continue
        run(["nsenter", f"--mount={f}", "mount", "--bind", str(src), target])
        made.append(target)
    return made


SHM = "/dev/shm"


def shm_source(node: str) -> str:
    return f"lab-shm-{node}"


def _mount_source(mountinfo: str, target: str) -> str | None:
    """The source of the last mount on ``target`` (the field after the ``-`` separator)."""
    source = None
    for line in mountinfo.splitlines():
        f = line.split()
        if len(f) > 4 and _unescape(f[4]) == target and "-" in f:
            rest = f[f.index("-") + 1:]
            source = rest[1] if len(rest) > 1 else None
    return source


def ensure_private_shm(node: str) -> bool:
    """A tmpfs of the node's own on /dev/shm (True if mounted now). The nodes share the
    machine's kernel: without it, every node's engines (``--ipc=host``) see one /dev/shm, and
    vLLM's check whether two ranks share a machine (a shared-memory segment one writes and the
    others open) says the lab's two nodes are one, where two Sparks are two."""
    f = layout.mntns_path(node)
    have = run(["nsenter", f"--mount={f}", "cat", "/proc/self/mountinfo"]).stdout
    if _mount_source(have, SHM) == shm_source(node):
        return False
    run(["nsenter", f"--mount={f}", "mount", "-t", "tmpfs", "-o", "mode=1777,nosuid,nodev",
         shm_source(node), SHM])
    return True


# --- network -----------------------------------------------------------------------------


def _links(netns: str | None = None) -> dict[str, dict]:
    argv = ["ip", "-j"] + (["-n", netns] if netns else []) + ["addr", "show"]
    cp = run(argv, check=False)
    if cp.returncode != 0:
        return {}
    return {i["ifname"]: i for i in json.loads(cp.stdout or "[]")}


def _has_addr(link: dict | None, addr: str, prefix: int) -> bool:
    if not link:
        return False
    return any(a.get("local") == addr and a.get("prefixlen") == prefix
               for a in link.get("addr_info", []))


def netns_exists(name: str) -> bool:
    p = Path("/var/run/netns") / name
    return p.exists() and is_ns_mounted(p)


def ensure_netns(name: str) -> bool:
    if netns_exists(name):
        return False
    p = Path("/var/run/netns") / name
    if p.exists():  # a stale file (e.g. after a reboot): replace it
        run(["ip", "netns", "del", name], check=False)
    run(["ip", "netns", "add", name])
    run(["ip", "-n", name, "link", "set", "lo", "up"])
    return True


def ensure_mgmt_bridge(plan: AddressPlan) -> bool:
    links = _links()
    br = links.get(layout.MGMT_BRIDGE)
    changed = False
    if br is None:
        # a fixed, locally administered MAC: a bridge otherwise takes its lowest port's MAC,
        # which changes as nodes come and go and leaves the nodes' ARP caches stale
        run(["ip", "link", "add", layout.MGMT_BRIDGE, "address", layout.MGMT_BRIDGE_MAC,
             "type", "bridge"])
        changed = True
    if not _has_addr(br, plan.controller, plan.prefix):
        for a in (br or {}).get("addr_info", []):
            if a.get("family") == "inet":
                run(["ip", "addr", "del", f"{a['local']}/{a['prefixlen']}", "dev",
                     layout.MGMT_BRIDGE])
        run(["ip", "addr", "add", f"{plan.controller}/{plan.prefix}", "dev", layout.MGMT_BRIDGE])
        changed = True
    if br is None or "UP" not in br.get("flags", []):
        run(["ip", "link", "set", layout.MGMT_BRIDGE, "up"])
        changed = True
    return changed


def ensure_mgmt_link(node: str, plan: AddressPlan) -> bool:
    ns = layout.netns_name(node)
    veth = layout.root_veth(node)
    inner = _links(ns).get(layout.MGMT_IF)
    outer = _links().get(veth)
    changed = False
    if inner is None or outer is None:
        if outer is not None:
            run(["ip", "link", "del", veth])
        if inner is not None:
            run(["ip", "-n", ns, "link", "del", layout.MGMT_IF])
        run(["ip", "link", "add", veth, "type", "veth", "peer", "name", layout.MGMT_IF,
             "netns", ns])
        inner = None
        changed = True
    if outer is None or outer.get("master") != layout.MGMT_BRIDGE or "UP" not in outer.get(
            "flags", []):
        run(["ip", "link", "set", veth, "master", layout.MGMT_BRIDGE, "up"])
        changed = True
    addr = plan.mgmt_addr(node)
    if changed:
        # a neighbour entry left FAILED while the node was away would delay the first contact
        run(["ip", "neigh", "flush", "to", addr, "dev", layout.MGMT_BRIDGE], check=False)
    if not _has_addr(inner, addr, plan.prefix):
        run(["ip", "-n", ns, "addr", "flush", "dev", layout.MGMT_IF])
        run(["ip", "-n", ns, "addr", "add", f"{addr}/{plan.prefix}", "dev", layout.MGMT_IF])
        changed = True
    if inner is None or "UP" not in inner.get("flags", []):
        run(["ip", "-n", ns, "link", "set", layout.MGMT_IF, "up"])
        changed = True
    return changed


def fast_topology(n: int) -> str:
    return "none" if n < 2 else "bridge"


def _fast_node_ok(node: str, plan: AddressPlan, ports: dict[str, dict]) -> bool:
    """The node's fast interface has its address, jumbo MTU and is up, and its peer end is a
    port of the fast bridge."""
    prefix = int(plan.fast_net.split("/")[1])
    link = _links(layout.netns_name(node)).get(layout.FAST_IF)
    if link is None or not _has_addr(link, plan.fast_addr(node), prefix):
        return False
    if link.get("mtu") != layout.FAST_MTU or "UP" not in link.get("flags", []):
        return False
    return ports.get(layout.fast_peer_veth(node), {}).get("master") == layout.FAST_BRIDGE


def remove_fast(nodes: list[str]) -> None:
    for node in nodes:
        ns = layout.netns_name(node)
        if layout.FAST_IF in _links(ns):
            run(["ip", "-n", ns, "link", "del", layout.FAST_IF], check=False)
    if netns_exists(layout.FAST_NETNS):
        run(["ip", "netns", "del", layout.FAST_NETNS], check=False)


def _ensure_fast_bridge(mtu: str) -> bool:
    fns = layout.FAST_NETNS
    made = ensure_netns(fns)
    br = _links(fns).get(layout.FAST_BRIDGE)
    if br is None:
        run(["ip", "-n", fns, "link", "add", layout.FAST_BRIDGE, "mtu", mtu, "type", "bridge"])
        made = True
    if br is None or "UP" not in br.get("flags", []):
        run(["ip", "-n", fns, "link", "set", layout.FAST_BRIDGE, "up"])
        made = True
    return made


def ensure_fast(nodes: list[str], plan: AddressPlan) -> list[str]:
    """The fast link: a switch (a bridge in ``lab-fast``) with one port per node, whatever the
    node count, so that a node coming or going leaves the others' links alone. Returns the
    nodes whose link was (re)made (``lab-fast`` when the bridge itself was)."""
    if fast_topology(len(nodes)) == "none":
        remove_fast(nodes)
        return []
    mtu = str(layout.FAST_MTU)
    prefix = plan.fast_net.split("/")[1]
    fns = layout.FAST_NETNS
    made = [fns] if _ensure_fast_bridge(mtu) else []
    ports = _links(fns)
    for node in nodes:
        if _fast_node_ok(node, plan, ports):
            continue
        ns, peer = layout.netns_name(node), layout.fast_peer_veth(node)
        if layout.FAST_IF in _links(ns):  # half a link (or a pair from an older lab)
            run(["ip", "-n", ns, "link", "del", layout.FAST_IF], check=False)
        if peer in ports:
            run(["ip", "-n", fns, "link", "del", peer], check=False)
        run(["ip", "link", "add", layout.FAST_IF, "netns", ns, "mtu", mtu, "address",
             layout.fast_mac(node), "type", "veth", "peer", "name", peer, "netns", fns, "mtu", mtu])
        run(["ip", "-n", fns, "link", "set", peer, "master", layout.FAST_BRIDGE, "up"])
        run(["ip", "-n", ns, "addr", "add", f"{plan.fast_addr(node)}/{prefix}", "dev",
             layout.FAST_IF])
        run(["ip", "-n", ns, "link", "set", layout.FAST_IF, "up"])
        made.append(node)
    for node in (x for x in made if x in nodes):  # a peer's entry may name its old MAC
        for other in (x for x in nodes if x != node):
            run(["ip", "-n", layout.netns_name(other), "neigh", "flush", "to",
                 plan.fast_addr(node), "dev", layout.FAST_IF], check=False)
    return made


def node_addresses(node: str) -> dict[str, list[str]]:
    """ifname -> IPv4 addresses inside a node (for status)."""
    out = {}
    for name, link in _links(layout.netns_name(node)).items():
        if name == "lo":
            continue
        out[name] = [f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", [])
                     if a.get("family") == "inet"]
    return out


def remove_node_net(node: str) -> bool:
    changed = False
    veth = layout.root_veth(node)
    if veth in _links():
        run(["ip", "link", "del", veth], check=False)
        changed = True
    ns = layout.netns_name(node)
    if (Path("/var/run/netns") / ns).exists():
        run(["ip", "netns", "del", ns], check=False)
        changed = True
    return changed


def remove_mgmt_bridge() -> bool:
    if layout.MGMT_BRIDGE in _links():
        run(["ip", "link", "del", layout.MGMT_BRIDGE])
        return True
    return False


def unmount_ns(path: Path) -> bool:
    changed = False
    while path.exists() and is_ns_mounted(path):
        run(["umount", str(path)])
        changed = True
    if path.exists():
        path.unlink()
    return changed


def check_no_clash_with_root(plan: AddressPlan) -> None:
    """Refuse if a root-namespace interface other than the lab's holds a lab address."""
    for name, link in _links().items():
        if name == layout.MGMT_BRIDGE:
            continue
        for a in link.get("addr_info", []):
            if a.get("local") == plan.controller:
                raise LabError(f"{plan.controller} is already on {name}")
