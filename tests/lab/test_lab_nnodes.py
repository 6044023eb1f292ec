"""The lab with four nodes: each its own fast-link address and RoCE twins on one switch; the
pair's nodes untouched while spark3 and spark4 come and go, and nothing of them left after."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from sparkdeploy.core.wait import WaitTimeout, wait_for
from sparkdeploy.lab import layout, lifecycle, node, proc
from tests.lab.conftest import lab_with

pytestmark = pytest.mark.lab

EXTRA = ["spark3", "spark4"]


def _left(recs: list[dict]) -> list[str]:
    """Those of the recorded processes ``recs`` still in /proc (alive, or dead and not reaped
    yet), each with its state, parent and name; [] once every one has left. A PID held by a
    newer process (another start time) counts as left: PIDs wrap at 32768 here. Waits up to 30
    s for PID 1 to reap a daemon an earlier process started."""
    def still() -> list[str]:
        out = []
        for r in recs:
            if proc.start_time(r["pid"]) != r["start"]:
                continue
            try:
                stat = Path(f"/proc/{r['pid']}/stat").read_text()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
            out.append(f"{r['pid']} {comm} state {state} parent {ppid}")
        return out
    try:
        wait_for(lambda: not still(), deadline=30, interval=0.1)
    except WaitTimeout:
        pass
    return still()


def _pair_view(nodes: list[str]) -> dict:
    """What must not change on the pair's nodes: their daemons' PIDs and their fast link."""
    st = lifecycle.lab_facts()["node"]
    out = {}
    for x in nodes:
        link = json.loads(subprocess.run(
            ["ip", "-j", "-n", layout.netns_name(x), "link", "show", layout.FAST_IF],
            capture_output=True, text=True, check=True).stdout)[0]
        out[x] = ({k: v["pid"] for k, v in st[x]["procs"].items()}, link["ifindex"],
                  link["address"])
    return out


@pytest.fixture(scope="module")
def lab4(lab):
    lifecycle.up(nodes=len(lab.nodes), flavor=layout.DEFAULT_DOCKERD)  # the pair, settled
    before = _pair_view(lab.nodes)
    with lab_with(lab, 4) as big:
        big.state["pair_before"] = before
        yield big


def test_four_nodes_each_their_own_fast_address_and_twins_on_one_switch(lab4):
    assert lab4.nodes == ["spark1", "spark2", "spark3", "spark4"]
    ports = json.loads(subprocess.run(["ip", "-j", "-n", layout.FAST_NETNS, "link", "show"],
                                      capture_output=True, text=True, check=True).stdout)
    assert sorted(p["ifname"] for p in ports if p.get("master") == layout.FAST_BRIDGE) == [
        "lab1f", "lab2f", "lab3f", "lab4f"]
    for i, x in enumerate(lab4.nodes, start=1):
        link = json.loads(lab4.ssh(x, ["ip", "-j", "-4", "addr", "show", layout.FAST_IF]).stdout)
        assert [(a["local"], a["prefixlen"]) for a in link[0]["addr_info"]] == [(f"10.77.1.{i}", 24)]
        assert link[0]["mtu"] == layout.FAST_MTU
        assert lab4.ssh(x, ["ls", "/sys/class/infiniband"]).stdout.split() == sorted(
            layout.FAST_HCAS)
        netdevs = lab4.ssh(x, ["cat", *[f"/sys/class/infiniband/{h}/ports/1/gid_attrs/ndevs/0"
                                        for h in layout.FAST_HCAS]]).stdout.split()
        assert netdevs == [layout.FAST_IF] * 2


def test_every_node_reaches_every_other_over_the_fast_link_with_its_own_key(lab4):
    for x in lab4.nodes:
        others = [o for o in lab4.nodes if o != x]
        # the node's own ssh client, config and key; one line per peer: client, server
        script = "; ".join(f"ssh -o BatchMode=yes {o} 'echo $SSH_CONNECTION'" for o in others)
        seen = [line.split() for line in lab4.ssh(x, script).stdout.splitlines()]
        assert [(s[0], s[2]) for s in seen] == [(lab4.addr(x), lab4.addr(o)) for o in others]


def test_adding_nodes_left_the_pair_alone(lab4):
    assert _pair_view(["spark1", "spark2"]) == lab4.state["pair_before"]


def test_back_to_two_nodes_leaves_nothing_of_spark3_and_spark4(lab4, lab):
    recs = [p for x in EXTRA for p in lab4.state["node"][x]["procs"].values()]
    results = lifecycle.up(nodes=2, flavor=layout.DEFAULT_DOCKERD)
    assert not [r for r in results if r.failed]
    assert [(r.node, r.why) for r in results if r.step == "node" and r.node in EXTRA] == [
        (x, "removed (beyond --nodes)") for x in EXTRA]
    assert lifecycle.lab_facts()["nodes"] == ["spark1", "spark2"]
    assert _left(recs) == []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [x for x in EXTRA if layout.netns_name(x) in netns]
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert "lab3m" not in links and "lab4m" not in links
    ports = subprocess.run(["ip", "-br", "-n", layout.FAST_NETNS, "link"], capture_output=True,
                           text=True).stdout.split("\n")
    assert sorted(p.split()[0].split("@")[0] for p in ports if p.strip()) == [
        "lab1f", "lab2f", "labfast0", "lo"]
    mounts = Path("/proc/self/mountinfo").read_text()
    assert not [x for x in EXTRA if f"/nodes/{x}/" in mounts or f"/ns/{x}.mnt" in mounts]
    assert not [x for x in EXTRA if layout.node_dir(x).exists() or layout.mntns_path(x).exists()]
    for x in EXTRA:  # and no process in what were their namespaces: none of them is there
        assert node.netns_exists(layout.netns_name(x)) is False
    ssh_config = layout.SSH_CONFIG.read_text()
    assert "spark3" not in ssh_config and "spark4" not in ssh_config
    assert "spark3" not in layout.KNOWN_HOSTS.read_text()
    # the pair as it was: same daemons, same links, and they reach each other
    assert _pair_view(["spark1", "spark2"]) == lab4.state["pair_before"]
    lab.ssh("spark1", ["ssh", "-o", "BatchMode=yes", "spark2", "true"])
    assert "spark3" not in lab.ssh("spark1", ["cat", "/root/.ssh/config"]).stdout


def _addresses() -> dict[str, tuple[str, str, str]]:
    """Each node's management and fast-link address and its fast interface's MAC."""
    facts = lifecycle.lab_facts()
    out = {}
    for x in facts["nodes"]:
        link = json.loads(subprocess.run(
            ["ip", "-j", "-n", layout.netns_name(x), "link", "show", layout.FAST_IF],
            capture_output=True, text=True, check=True).stdout)[0]
        out[x] = (facts["node"][x]["mgmt_addr"], facts["node"][x]["fast_addr"], link["address"])
    return out


@pytest.mark.lab_last
def test_lab_down_from_four_nodes_leaves_nothing_and_the_pair_comes_back_as_it_was(lab):
    """Runs after every other lab test (it takes the lab down): lab.down from four nodes leaves
    no process, namespace, link, mount or file of any of them; lab.up brings the same pair back
    (names, addresses, MACs) and its nodes reach each other."""
    pair = _addresses()
    results = lifecycle.up(nodes=4, flavor=layout.DEFAULT_DOCKERD)
    assert not [r for r in results if r.failed]
    st = lifecycle.lab_facts()
    nodes = st["nodes"]
    assert nodes == ["spark1", "spark2", "spark3", "spark4"]
    recs = [p for x in nodes for p in st["node"][x]["procs"].values()]
    down = lifecycle.down()
    assert not [r for r in down if r.failed], down
    assert _left(recs) == []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in [*map(layout.netns_name, nodes), layout.FAST_NETNS] if n in netns]
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert not [ln for ln in links.splitlines()
                if ln.split()[0].split("@")[0] in {layout.MGMT_BRIDGE, "lab1m", "lab2m", "lab3m",
                                                   "lab4m"}]
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(layout.LAB_DIR) + "/" not in mounts
    assert not layout.LAB_DIR.exists()
    back = lifecycle.up(nodes=2, flavor=layout.DEFAULT_DOCKERD)
    assert not [r for r in back if r.failed], back
    assert {x: a[:2] for x, a in _addresses().items()} == {x: a[:2] for x, a in pair.items()}
    assert {x: a[2] for x, a in _addresses().items()} == {x: layout.fast_mac(x) for x in pair}
    cp = subprocess.run(lab.ssh_argv("spark1", ["ssh", "-o", "BatchMode=yes", "spark2", "true"]),
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
