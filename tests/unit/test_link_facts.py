"""``link_node.py facts`` on a Spark's sysfs as real Sparks show it (data/spark/), and the
controller's typed reading of it."""

from __future__ import annotations

import json

import pytest

from sparkdeploy.node.link import LinkFacts, read_facts
from sparkdeploy.node.nodeops import HelperFailed
from tests.unit.fakes import FakeContext, deployment
from tests.unit.link_fakes import facts_on, spark
from tests.unit.profiles import SEED


def test_one_cable_in_the_outer_port_as_ibdev2netdev_shows_it(tmp_path, monkeypatch):
    got = LinkFacts.model_validate(facts_on(spark(), tmp_path, monkeypatch,
                                            ibdev2netdev="ibdev2netdev-eugr.txt"))
    assert sorted(n.name for n in got.candidates) == [
        "enP2p1s0f0np0", "enP2p1s0f1np1", "enp1s0f0np0", "enp1s0f1np1"]
    link = got.netdev("enp1s0f1np1")
    assert (link.up, link.mtu, link.addresses, link.hcas) == (True, 9000, ["192.168.177.11"], ["rocep1s0f1"])
    assert link.ipv4[0].prefix == 24
    twin = got.netdev("enP2p1s0f1np1")
    assert (twin.up, twin.addresses, twin.hcas) == (True, [], ["roceP2p1s0f1"])
    assert not got.netdev("enp1s0f0np0").up
    # the twins of one port: the PCI functions that differ only in their domain
    assert sorted(got.twins_of("rocep1s0f1")) == ["roceP2p1s0f1", "rocep1s0f1"]
    assert sorted(got.twins_of("roceP2p1s0f0")) == ["roceP2p1s0f0", "rocep1s0f0"]
    hca = got.hca("rocep1s0f1")
    assert (hca.pci, hca.netdevs, hca.twin) == ("0000:01:00.1", ["enp1s0f1np1"], "01:00.1")
    port = hca.ports[0]
    assert (port.port, port.state, port.phys_state, port.link_layer) == (1, "ACTIVE", "LinkUp", "Ethernet")
    # the kernel's order: link-local v1, v2, then the IPv4 address v1, v2 (index 3)
    assert [(g.index, g.type, g.ipv4) for g in port.gids] == [
        (0, "IB/RoCE v1", None), (1, "RoCE v2", None),
        (2, "IB/RoCE v1", "192.168.177.11"), (3, "RoCE v2", "192.168.177.11")]
    assert port.roce_v2 == {"192.168.177.11": 3}
    assert got.hca("roceP2p1s0f1").ports[0].roce_v2 == {}  # its net device has no IPv4
    assert got.hca("rocep1s0f0").ports[0].state == "DOWN"
    assert [(r.hca, r.netdev, r.state) for r in got.ibdev2netdev] == [
        ("rocep1s0f0", "enp1s0f0np0", "Down"), ("rocep1s0f1", "enp1s0f1np1", "Up"),
        ("roceP2p1s0f0", "enP2p1s0f0np0", "Down"), ("roceP2p1s0f1", "enP2p1s0f1np1", "Up")]
    lan = got.netdev("enP7s7")
    assert lan.hcas == [] and lan.addresses == ["192.168.1.40"]


def test_both_ports_cabled_each_twin_with_its_own_address(tmp_path, monkeypatch):
    view = spark("ibdev2netdev-leadtek.txt",
                 addrs={"enp1s0f0np0": ["10.0.0.1/30"], "enP2p1s0f0np0": ["10.0.0.5/30"]})
    got = LinkFacts.model_validate(facts_on(view, tmp_path, monkeypatch))
    assert got.ibdev2netdev is None  # not installed
    assert got.hca("rocep1s0f0").ports[0].roce_v2 == {"10.0.0.1": 3}
    assert got.hca("roceP2p1s0f0").ports[0].roce_v2 == {"10.0.0.5": 3}
    assert {t.key: sorted(t.netdevs) for t in got.twins} == {
        "01:00.0": ["enP2p1s0f0np0", "enp1s0f0np0"], "01:00.1": ["enP2p1s0f1np1", "enp1s0f1np1"]}


def test_no_rdma_devices_and_no_ip_is_an_empty_answer(tmp_path, monkeypatch):
    from tests.unit.link_fakes import link_node

    monkeypatch.setattr(link_node, "run", lambda argv, timeout=10: None)
    got = LinkFacts.model_validate(link_node.facts(str(tmp_path)))
    assert (got.netdevs, got.hcas, got.twins, got.ibdev2netdev) == ([], [], [], None)


def test_an_hca_whose_net_device_is_in_no_namespace_here_is_listed_absent(tmp_path, monkeypatch):
    view = spark()
    del view.ifaces["enP2p1s0f1np1"]
    view.ifaces["enP2p1s0f1np1"] = type(view.ifaces["enp1s0f1np1"])()  # for its GID table only
    view.write_sysfs(tmp_path)
    from tests.unit.link_fakes import link_node

    del view.ifaces["enP2p1s0f1np1"]
    monkeypatch.setattr(link_node, "run", lambda argv, timeout=10: view.ip_addr_json())
    got = LinkFacts.model_validate(link_node.facts(str(tmp_path)))
    gone = got.netdev("enP2p1s0f1np1")
    assert (gone.exists, gone.up, gone.hcas) == (False, False, ["roceP2p1s0f1"])


class _Node(FakeContext):
    def __init__(self, stdout: str, code: int = 0, stderr: str = ""):
        super().__init__()
        self._set("reply", (code, stdout, stderr))

    def answer(self, alias, argv, stdin, command, kw):
        if argv[:2] == ["sh", "-c"] and "base64 -d" in argv[2]:
            return self.result(command, 0, f"/tmp/sparkdeploy-stage-0/{argv[4]}/{argv[5]}\n")
        code, out, err = self.reply
        return self.result(command, code, out, err)


def test_read_facts_runs_the_staged_helper_and_types_its_answer(tmp_path, monkeypatch):
    answer = facts_on(spark(), tmp_path / "sys", monkeypatch)
    ctx = _Node(json.dumps(answer) + "\n")
    dep = deployment(SEED, tmp_path / "state", ctx)
    got = read_facts(dep.host("spark2"))
    assert got.netdev("enp1s0f1np1").addresses == ["192.168.177.11"]
    alias, argv = ctx.calls[-1]
    assert alias == "spark2"
    staged = argv[-2]
    assert staged.endswith("/link_node.py") and argv[-3:] == ["python3", staged, "facts"]
    assert argv[:2] == ["sh", "-c"] and "sha256sum -c" in argv[2]


@pytest.mark.parametrize("stdout,code,why", [
    ("", 1, "spark1: link_node.py facts: ip: not found"),
    ('{"netdevs": []}\n', 0, "spark1: link_node.py facts"),
])
def test_an_answer_that_does_not_fit_is_one_line(tmp_path, stdout, code, why):
    ctx = _Node(stdout, code, "error: ip: not found\n" if code else "")
    dep = deployment(SEED, tmp_path / "state", ctx)
    with pytest.raises(HelperFailed) as e:
        read_facts(dep.host("spark1"))
    assert str(e.value).startswith(why) and "\n" not in str(e.value)
