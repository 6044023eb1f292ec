"""The lab's ``link-drop`` fault, by the commands it runs: every packet of the node's fast link
dropped both ways (``tc netem loss 100%`` on the node's interface and on the bridge's port towards
it, inside the lab's own namespaces: nothing on the host, no iptables), and ``heal`` removing
exactly that (the lab leaves the link as it found it)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from sparkdeploy.lab import layout, link_faults


class Node:
    """spark2's namespaces as ``ip`` and ``tc`` show them: its link up at MTU 9000 with its
    address, the bridge port forwarding, the qdiscs each ``tc`` call left."""

    def __init__(self):
        self.qdisc: dict[str, str] = {}
        self.ran: list[list[str]] = []

    def run(self, argv, check=True, **kw):
        argv = list(argv)
        self.ran.append(argv)
        out = ""
        if argv[-2:] == ["dev", layout.fast_peer_veth("spark2")] and "-d" in argv:
            out = json.dumps([{"ifname": layout.fast_peer_veth("spark2"), "linkinfo": {
                "info_kind": "veth", "info_slave_kind": "bridge",
                "info_slave_data": {"state": "forwarding"}}}])
        elif argv[-3:] == ["show", "dev", layout.FAST_IF] and "tc" not in argv:
            out = json.dumps([{"mtu": layout.FAST_MTU, "flags": ["UP"], "addr_info": [
                {"local": link_faults.fast_addr("spark2")}]}])
        elif "tc" in argv:
            ns, dev = argv[3], argv[argv.index("dev") + 1]
            if "replace" in argv:
                self.qdisc[f"{ns}/{dev}"] = " ".join(argv[argv.index("root") + 1:])
            elif "del" in argv:
                self.qdisc.pop(f"{ns}/{dev}", None)
            elif "show" in argv:
                q = self.qdisc.get(f"{ns}/{dev}")
                out = f"qdisc {q.split()[0]} 8001: root refcnt 2 {q}\n" if q else "qdisc noqueue 0: root\n"
        elif argv[-1] == "labextra0":
            return subprocess.CompletedProcess(argv, 1, "", "Device does not exist")
        return subprocess.CompletedProcess(argv, 0, out, "")


def test_link_drop_drops_every_packet_both_ways_and_heal_removes_exactly_that(monkeypatch, tmp_path):
    node = Node()
    monkeypatch.setattr(link_faults, "run", node.run)
    monkeypatch.setattr(layout, "netns_path", lambda n: tmp_path)  # the node's namespace exists
    monkeypatch.setattr(link_faults, "twin_state_file", lambda n, hca=None: tmp_path / "absent")
    [r] = link_faults.inject("link-drop", "spark2")
    assert not r.failed, r.why
    port, ns, iface = layout.fast_peer_veth("spark2"), layout.netns_name("spark2"), layout.FAST_IF
    assert node.ran == [
        ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", iface, "root", "netem", "loss", "100%"],
        ["ip", "netns", "exec", "lab-fast", "tc", "qdisc", "replace", "dev", port, "root", "netem", "loss",
         "100%"]]
    node.ran.clear()
    assert link_faults.heal("spark2") == [f"no netem on {iface}", f"no netem on {port}"]
    assert node.qdisc == {}
    assert not [a for a in node.ran if "iptables" in a[0] or "bridge_slave" in a]
    node.ran.clear()
    assert link_faults.heal("spark2") == []  # nothing left to undo: nothing set
    assert not [a for a in node.ran if "del" in a]


def test_link_drop_is_listed_with_the_link_faults():
    assert "link-drop" in link_faults.LINK_FAULTS
    assert Path(link_faults.__file__).read_text().count("iptables") == 0
