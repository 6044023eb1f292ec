"""Where the lab keeps things, node names, interface names and address plans."""

from __future__ import annotations

import ipaddress
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

LAB_DIR = Path("/var/lib/sparkdeploy/lab")
CACHE_DIR = Path("/var/cache/sparkdeploy")
STATE_FILE = LAB_DIR / "state.json"
LOCK_FILE = Path("/var/lib/sparkdeploy/lab.lock")
NS_DIR = LAB_DIR / "ns"
NODES_DIR = LAB_DIR / "nodes"
KEYS_DIR = LAB_DIR / "keys"
CONTROLLER_KEY = KEYS_DIR / "id_ed25519"
SSH_CONFIG = LAB_DIR / "ssh_config"
KNOWN_HOSTS = LAB_DIR / "known_hosts"
ENV_FILE = LAB_DIR / "env"
PROFILE_OVERLAY = LAB_DIR / "profile.yaml"
"""The profile overlay lab.up writes for the addresses it chose (``configs/lab.yaml`` extends it)."""

# Paths inside a node that get a private bind mount (node path -> backing dir name).
MODEL_DIR = "/srv/models"
UNIT_DIR = "/etc/systemd/system"
STANDIN_DIR = "/opt/sparkdeploy-lab"
"""The stand-ins' home on a node: ``bin/`` (first on PATH) and the stand-ins' own state."""
NODE_STATE_DIR = "/var/lib/sparkdeploy-node"
ROOT_HOME = "/root"
"""root's home on a node is its own: a Spark's root has no pyenv or cargo of this machine's, so
``python3`` on a node is the distribution's (PEP 668) and a node's caches stay on the node."""
ROOT_SSH_DIR = "/root/.ssh"
CONTAINERD_RUN_DIR = "/run/containerd"
"""The containerd flavour's containerd listens in it, where Docker's and Debian's docker.service
tell dockerd to find it (``--containerd=/run/containerd/containerd.sock``)."""
CONTAINERD_ROOT = "/var/lib/containerd"
"""... and keeps its content and snapshots in it, as a node's system containerd does."""
PRIVATE_MOUNTS: dict[str, str] = {  # parents before children: /root before /root/.ssh
    MODEL_DIR: "models",
    UNIT_DIR: "systemd-system",
    STANDIN_DIR: "standins",
    NODE_STATE_DIR: "node-state",
    ROOT_HOME: "home",
    ROOT_SSH_DIR: "ssh",
    CONTAINERD_RUN_DIR: "containerd-run",
    CONTAINERD_ROOT: "containerd-root",
}

NODE_PATH = f"{STANDIN_DIR}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

MGMT_BRIDGE = "labmgmt0"
MGMT_BRIDGE_MAC = "02:5d:1a:b0:00:01"
MGMT_IF = "eth0"
"""The management interface's name inside a node."""
FAST_IF = "enp1s0f0np0"
"""The fast link's name inside a node (the Sparks' ConnectX-7 naming)."""
FAST_HCAS = ["rocep1s0f0", "roceP2p1s0f0"]
FAST_MTU = 9000
FAST_NETNS = "lab-fast"
FAST_BRIDGE = "labfast0"

# Address plans: the first is what configs/lab.yaml names; the rest are fallbacks used only
# when the first clashes with one of the machine's own routes.
MGMT_CANDIDATES = ["10.77.0.0/24", "172.31.77.0/24", "192.168.177.0/24", "10.177.0.0/24"]
FAST_NET = "10.77.1.0/24"
"""The fast link lives only inside node namespaces; its addresses are in configs/lab.yaml."""

DOCKERDS = ("docker26", "classic20", "containerd")
"""The flavors of a node's Docker daemon (``lab.up --dockerd``)."""
DEFAULT_DOCKERD = "docker26"


def node_dockerds(spec: str, n: int) -> list[str]:
    """Each node's Docker daemon flavour from ``--dockerd``: one flavour for every node, or one
    per node (``containerd,docker26``: spark1 on the containerd image store, spark2 classic).
    Raises ValueError with the one line to show."""
    parts = str(spec).split(",")
    if any(p not in DOCKERDS for p in parts) or len(parts) not in (1, n):
        raise ValueError(f"--dockerd: must be one of {', '.join(DOCKERDS)}, or one per node "
                         f"({n}) separated by commas, not {spec!r}")
    return parts * n if len(parts) == 1 else parts
BASE_IMAGE = "sparkdeploy-lab/base:bookworm"
STANDIN_LABEL = "org.sparkdeploy.lab.standin"


def node_names(n: int) -> list[str]:
    return [f"spark{i}" for i in range(1, n + 1)]


def netns_name(node: str) -> str:
    return f"lab-{node}"


def netns_path(node: str) -> Path:
    return Path("/var/run/netns") / netns_name(node)


def mntns_path(node: str) -> Path:
    return NS_DIR / f"{node}.mnt"


def node_dir(node: str) -> Path:
    return NODES_DIR / node


def docker_socket(node: str) -> str:
    return str(node_dir(node) / "run" / "docker.sock")


def node_index(node: str) -> int:
    return int(node.removeprefix("spark"))


def root_veth(node: str) -> str:
    """The root-namespace end of a node's management veth (<= 15 chars)."""
    return f"lab{node_index(node)}m"


def fast_peer_veth(node: str) -> str:
    """The bridge-side end of a node's fast veth (in the lab-fast namespace)."""
    return f"lab{node_index(node)}f"


def fast_mac(node: str) -> str:
    """The node's fast interface's MAC: fixed per node (locally administered), as a real NIC's
    is, so a node that comes back answers at the MAC its peers' neighbour tables still hold."""
    return f"02:5d:1a:f0:00:{node_index(node):02x}"


@dataclass(frozen=True)
class AddressPlan:
    mgmt_net: str
    fast_net: str

    @property
    def controller(self) -> str:
        return str(ipaddress.ip_network(self.mgmt_net)[1])

    def mgmt_addr(self, node: str) -> str:
        return str(ipaddress.ip_network(self.mgmt_net)[10 + node_index(node)])

    def fast_addr(self, node: str) -> str:
        return str(ipaddress.ip_network(self.fast_net)[node_index(node)])

    @property
    def prefix(self) -> int:
        return ipaddress.ip_network(self.mgmt_net).prefixlen


def machine_routes() -> list[dict]:
    out = subprocess.run(["ip", "-j", "route", "show", "table", "all"], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out or "[]")


def _clashes(net: str, routes: list[dict], own_devs: set[str]) -> list[str]:
    want = ipaddress.ip_network(net)
    hits = []
    for r in routes:
        dst = r.get("dst", "")
        if r.get("dev") in own_devs or dst in ("default", "") or ":" in dst:
            continue
        if r.get("type") in ("broadcast", "local") and r.get("dev") == "lo":
            continue
        try:
            have = ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False)
        except ValueError:
            continue
        if have.prefixlen == 0:
            continue
        if want.overlaps(have):
            hits.append(f"{dst} dev {r.get('dev', '?')}")
    return hits


def plan_addresses(routes: list[dict], recorded: str | None = None,
                   want: str | None = None) -> tuple[AddressPlan, str]:
    """Pick the management /24; say why in one line.

    ``want``: None keeps the ``recorded`` one (the lab is up) or picks the first candidate that
    does not clash; ``"fallback"`` picks the first candidate after the default that does not
    clash (as if the default clashed); a candidate CIDR picks that one. Routes on the lab's own
    bridge do not count as clashes. Raises ``ValueError`` when nothing fits, or when the
    fast-link range clashes.
    """
    own = {MGMT_BRIDGE}
    fast_hits = _clashes(FAST_NET, routes, own)
    if fast_hits:
        raise ValueError(f"the fast-link range {FAST_NET} (named in configs/lab.yaml) clashes "
                         f"with this machine's route {fast_hits[0]}")
    if want is None and recorded:
        return AddressPlan(recorded, FAST_NET), f"management network {recorded} (recorded)"
    if want not in (None, "fallback") and want not in MGMT_CANDIDATES:
        raise ValueError(f"--mgmt-net: must be 'fallback' or one of {', '.join(MGMT_CANDIDATES)}, "
                         f"not {want!r}")
    pool = MGMT_CANDIDATES[1:] if want == "fallback" else [want] if want else MGMT_CANDIDATES
    for net in pool:
        hits = _clashes(net, routes, own) + _clashes(net, [{"dst": FAST_NET}], set())
        if hits:
            if want not in (None, "fallback"):
                raise ValueError(f"--mgmt-net {net} clashes with this machine's route {hits[0]}")
            continue
        move = f" (moved from {recorded})" if recorded and recorded != net else ""
        if net == MGMT_CANDIDATES[0]:
            return AddressPlan(net, FAST_NET), f"management network {net} (default){move}"
        reason = ("asked for the fallback" if want == "fallback" else f"asked for {net}" if want
                  else f"the default {MGMT_CANDIDATES[0]} clashes with this machine's routes")
        return AddressPlan(net, FAST_NET), (
            f"management network {net}: {reason}; ssh aliases and the profile overlay hide the "
            f"difference{move}")
    raise ValueError("every candidate management network clashes with this machine's routes: "
                     + ", ".join(pool))
