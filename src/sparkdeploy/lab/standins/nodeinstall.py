"""Install the stand-ins on a lab node (controller side; runs as root from ``lab.up``).

What a Spark has and the lab's nodes lack, made present without the steps knowing:

- executables on the node's PATH: ``nvidia-smi``, ``systemctl``, the NVIDIA container runtime
  (``nvidia-container-runtime-hook``, found on dockerd's PATH, is what makes
  ``docker run --gpus all`` work; ``nvidia-container-runtime`` is the ``nvidia`` runtime);
- RoCE devices: ``/sys/class/infiniband/<hca>/...`` for the fast link's two twins, an overlay
  on ``/sys/class`` in the node's mount namespace (the GPU containers get the same overlay from
  the runtime hook); the GID table follows the port's addresses, and the even-numbered nodes'
  ports carry a global IPv6 address too, which moves their RoCE v2 IPv4 entry from index 3
  to 5 (a step that assumes 3 is caught there);
- a default route on the management interface, as a Spark's LAN or Wi-Fi has, through an
  address nobody holds (nothing leaves the lab): the address that SGLang, vLLM and Ray pick
  by themselves is then the management address, not the fast link's;
- the container view (``/opt/sparkdeploy-lab/container``): the lab's faults.
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

from sparkdeploy.core.files import copy_if_changed
from sparkdeploy.lab import faults, layout
from sparkdeploy.lab.proc import run
from sparkdeploy.lab.standins import roce

SRC = Path(__file__).resolve().parent
CONTROLLER_ONLY = {"__init__.py", "nodeinstall.py", "roce.py"}
SYSFS = "sysfs"
"""Under the node's stand-ins dir: ``sysfs/infiniband/...``, the overlay's upper layer."""


def install(root: Path, node: str) -> list[str]:
    did: list[str] = []
    did += copy_files(Path(root))
    if faults.sync_node(node):
        did.append("faults view")
    (faults.view_dir(node) / "gpu").mkdir(parents=True, exist_ok=True)  # a mount point
    if layout.netns_path(node).exists() and layout.mntns_path(node).exists():
        did += node_network(node)
        did += roce_devices(Path(root), node)
    return did


def copy_files(root: Path) -> list[str]:
    did = []
    (root / "bin").mkdir(parents=True, exist_ok=True)
    (root / "lib").mkdir(parents=True, exist_ok=True)
    for f in sorted(SRC.iterdir()):
        if not f.is_file() or f.name.startswith((".", "_")) or f.name in CONTROLLER_ONLY:
            continue
        if f.name == "runc":  # alone in its directory, first on dockerd's PATH
            (root / "runtime").mkdir(parents=True, exist_ok=True)
            if copy_if_changed(f, root / "runtime" / "runc", 0o755):
                did.append("runtime/runc")
        elif not f.suffix and copy_if_changed(f, root / "bin" / f.name, 0o755):
            did.append(f.name)
        elif f.suffix == ".py" and copy_if_changed(f, root / "lib" / f.name, 0o644):
            did.append(f"lib/{f.name}")
    return did


# --- addresses and routes ------------------------------------------------------------------


def _lab_state() -> dict:
    try:
        return json.loads(layout.STATE_FILE.read_text())
    except (OSError, ValueError):
        return {}


def global_v6(node: str) -> list[str]:
    """The extra global IPv6 address of the node's fast-link port: even-numbered nodes only."""
    return [f"fd00:77:1::{layout.node_index(node)}"] if layout.node_index(node) % 2 == 0 else []


def gateway(mgmt_net: str) -> str:
    """The default route's next hop: the management network's last host address, held by no
    one (lab.up gives the controller .1 and the nodes .11 up)."""
    return str(ipaddress.ip_network(mgmt_net)[-2])


def node_network(node: str) -> list[str]:
    did = []
    st = _lab_state()
    ns = layout.netns_name(node)
    mgmt = st.get("mgmt_net")
    if mgmt:
        gw = gateway(mgmt)
        have = run(["ip", "-n", ns, "-j", "route", "show", "default"], check=False).stdout or "[]"
        routes = json.loads(have)
        if not any(r.get("gateway") == gw and r.get("dev") == layout.MGMT_IF for r in routes):
            run(["ip", "-n", ns, "route", "replace", "default", "via", gw, "dev", layout.MGMT_IF])
            did.append(f"default route via {gw} dev {layout.MGMT_IF}")
    for addr in global_v6(node):
        cur = run(["ip", "-n", ns, "-j", "addr", "show", "dev", layout.FAST_IF], check=False).stdout or "[]"
        have = {a.get("local") for i in json.loads(cur) for a in i.get("addr_info", [])}
        if addr not in have:
            run(["ip", "-n", ns, "addr", "add", f"{addr}/64", "dev", layout.FAST_IF, "nodad"])
            did.append(f"{layout.FAST_IF} {addr}/64")
    return did


def _link_local(node: str) -> str:
    cur = run(["ip", "-n", layout.netns_name(node), "-j", "addr", "show", "dev", layout.FAST_IF],
              check=False).stdout or "[]"
    for i in json.loads(cur):
        for a in i.get("addr_info", []):
            if a.get("family") == "inet6" and a.get("scope") == "link":
                return a["local"]
    return "fe80::1"


# --- RoCE devices --------------------------------------------------------------------------


def gid_table_for(node: str, fast_ip: str) -> list[tuple[str, str]]:
    return roce.gid_table(fast_ip, _link_local(node), global_v6(node))


def roce_devices(root: Path, node: str) -> list[str]:
    st = _lab_state()
    fast_ip = (st.get("nodes", {}).get(node) or {}).get("fast_addr")
    if not fast_ip:
        return []
    upper = root / SYSFS
    before = _snapshot(upper)
    roce.write_tree(upper, layout.FAST_HCAS, layout.FAST_IF, gid_table_for(node, fast_ip))
    did = []
    if _snapshot(upper) != before:
        idx = roce.roce_v2_ipv4_index(gid_table_for(node, fast_ip), fast_ip)
        did.append(f"RoCE {'+'.join(layout.FAST_HCAS)} (RoCE v2 {fast_ip} at GID index {idx})")
    if not _overlay_mounted(node):
        mnt = layout.mntns_path(node)
        run(["nsenter", f"--mount={mnt}", "mount", "-t", "overlay", "sparkdeploy-roce", "-o",
             f"ro,lowerdir={upper}:/sys/class", "/sys/class"])
        did.append("/sys/class/infiniband")
    return did


def _overlay_mounted(node: str) -> bool:
    cp = run(["nsenter", f"--mount={layout.mntns_path(node)}", "cat", "/proc/self/mountinfo"], check=False)
    for line in cp.stdout.splitlines():
        f = line.split()
        if len(f) > 4 and f[4] == "/sys/class" and "sparkdeploy-roce" in line:
            return True
    return False


def _snapshot(d: Path) -> dict[str, str]:
    out = {}
    if d.is_dir():
        for p in d.rglob("*"):
            if p.is_file():
                out[str(p.relative_to(d))] = p.read_text()
    return out
