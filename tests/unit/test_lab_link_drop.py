"""The lab's ``link-drop`` fault, by the commands it runs: the switch's port towards the node
down, with ``ip`` in the lab's fast namespace (nothing on the host, no iptables; the node's own
interface keeps its address), and ``heal`` bringing it up again only when it is down (the lab
leaves the link as it found it)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from sparkdeploy.lab import layout, link_faults


class Node:
    """spark2 as ``ip`` shows it: its link up at MTU 9000 with its address; the switch's port
    towards it up or down as the last ``ip link set`` left it."""

    def __init__(self):
        self.port_up = True
        self.ran: list[list[str]] = []

    def run(self, argv, check=True, **kw):
        argv = list(argv)
        self.ran.append(argv)
        port = layout.fast_peer_veth("spark2")
        out = ""
        if argv[-3:] == ["show", "dev", layout.FAST_IF]:
            out = json.dumps([{"mtu": layout.FAST_MTU, "flags": ["UP"], "addr_info": [
                {"local": link_faults.fast_addr("spark2")}]}])
        elif argv[-3:] == ["show", "dev", port] and "-d" not in argv:
            out = json.dumps([{"ifname": port, "flags": ["UP"] if self.port_up else ["BROADCAST"]}])
        elif argv[-2:] == ["dev", port] and "-d" in argv:
            out = json.dumps([{"ifname": port, "linkinfo": {"info_slave_data": {"state": "forwarding"}}}])
        elif argv[:6] == ["ip", "-n", "lab-fast", "link", "set", "dev"]:
            self.port_up = argv[-1] == "up"
        elif argv[-1] == "labextra0":
            return subprocess.CompletedProcess(argv, 1, "", "Device does not exist")
        return subprocess.CompletedProcess(argv, 0, out, "")


def test_link_drop_takes_the_switch_port_down_and_heal_brings_it_up(monkeypatch, tmp_path):
    node = Node()
    monkeypatch.setattr(link_faults, "run", node.run)
    monkeypatch.setattr(layout, "netns_path", lambda n: tmp_path)  # the node's namespace exists
    monkeypatch.setattr(link_faults, "twin_state_file", lambda n, hca=None: tmp_path / "absent")
    [r] = link_faults.inject("link-drop", "spark2")
    assert not r.failed, r.why
    port = layout.fast_peer_veth("spark2")
    assert node.ran == [["ip", "-n", "lab-fast", "link", "set", "dev", port, "down"]]
    node.ran.clear()
    assert f"{port} up" in link_faults.heal("spark2")
    assert ["ip", "-n", "lab-fast", "link", "set", "dev", port, "up"] in node.ran
    assert not [a for a in node.ran if "iptables" in a[0]]
    node.ran.clear()
    assert link_faults.heal("spark2") == []  # nothing left to undo: nothing set
    assert not [a for a in node.ran if a[-1] == "up"]


def test_link_drop_is_listed_with_the_link_faults():
    assert "link-drop" in link_faults.LINK_FAULTS
    assert Path(link_faults.__file__).read_text().count("iptables") == 0
