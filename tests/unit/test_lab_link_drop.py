"""The lab's ``link-drop`` fault, by the commands it runs: the bridge port towards the node
disabled with ``ip`` in the lab's fast namespace (nothing on the host, no iptables), and ``heal``
setting it forwarding again only when it is not (the lab leaves the link as it found it)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from sparkdeploy.lab import layout, link_faults


class Node:
    """spark2's namespaces as ``ip`` shows them: its link up at MTU 9000 with its address, the
    bridge port towards it in ``state``."""

    def __init__(self, state: str):
        self.state = state
        self.ran: list[list[str]] = []

    def run(self, argv, check=True, **kw):
        argv = list(argv)
        self.ran.append(argv)
        out = ""
        if argv[-2:] == ["dev", layout.fast_peer_veth("spark2")] and "-d" in argv:
            out = json.dumps([{"ifname": layout.fast_peer_veth("spark2"), "linkinfo": {
                "info_kind": "veth", "info_slave_kind": "bridge",
                "info_slave_data": {"state": self.state}}}])
        elif argv[-3:] == ["show", "dev", layout.FAST_IF]:
            out = json.dumps([{"mtu": layout.FAST_MTU, "flags": ["UP"], "addr_info": [
                {"local": link_faults.fast_addr("spark2")}]}])
        elif "bridge_slave" in argv:
            self.state = "disabled" if argv[-1] == "0" else "forwarding"
        elif argv[-1] == "labextra0":
            return subprocess.CompletedProcess(argv, 1, "", "Device does not exist")
        return subprocess.CompletedProcess(argv, 0, out, "")


def test_link_drop_disables_the_bridge_port_and_heal_makes_it_forward_again(monkeypatch, tmp_path):
    node = Node("forwarding")
    monkeypatch.setattr(link_faults, "run", node.run)
    monkeypatch.setattr(layout, "netns_path", lambda n: tmp_path)  # the node's namespace exists
    monkeypatch.setattr(link_faults, "twin_state_file", lambda n, hca=None: tmp_path / "absent")
    [r] = link_faults.inject("link-drop", "spark2")
    assert not r.failed, r.why
    port = layout.fast_peer_veth("spark2")
    assert node.ran == [["ip", "-n", "lab-fast", "link", "set", "dev", port, "type", "bridge_slave", "state", "0"]]
    assert link_faults.port_state("spark2") == "disabled"
    node.ran.clear()
    assert f"{port} forwarding" in link_faults.heal("spark2")
    assert ["ip", "-n", "lab-fast", "link", "set", "dev", port, "type", "bridge_slave", "state", "3"] in node.ran
    assert not [a for a in node.ran if "iptables" in a[0]]
    node.ran.clear()
    assert link_faults.heal("spark2") == []  # nothing left to undo: nothing set
    assert not [a for a in node.ran if "bridge_slave" in a]


def test_link_drop_is_listed_with_the_link_faults():
    assert "link-drop" in link_faults.LINK_FAULTS
    assert Path(link_faults.__file__).read_text().count("iptables") == 0
