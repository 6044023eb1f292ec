"""The link doctor's decisions (``sparkdeploy.node.link_doctor``) one by one, on a Spark's facts as
``link_node.py`` reads them from a recorded real Spark's sysfs (``link_fakes``), changed where a
case needs it; and the readers of the tools' answers."""

from __future__ import annotations

import json

import pytest

from sparkdeploy.node import link_doctor as doc
from sparkdeploy.node.link import LinkFacts
from sparkdeploy.profile.config import load_profile
from tests.unit.link_fakes import facts_on, spark
from tests.unit.profiles import SEED, seed_data, write_profile

PROFILE = load_profile(SEED)
HEAD, WORKER = PROFILE.nodes


def raw(tmp_path, monkeypatch, addr="192.168.100.11", twin="192.168.100.21", **kw) -> dict:
    view = spark("ibdev2netdev-leadtek.txt", addrs={
        "enp1s0f0np0": [f"{addr}/24"], "enP2p1s0f0np0": [f"{twin}/24"]}, **kw)
    return facts_on(view, tmp_path, monkeypatch)


def lines(problems) -> list[tuple[str, str]]:
    return [(p.node, p.line) for p in problems]


def test_a_healthy_worker_has_no_problem_and_one_gid_index(tmp_path, monkeypatch):
    f = LinkFacts.model_validate(raw(tmp_path, monkeypatch))
    assert doc.node_problems(WORKER, f) == []
    assert doc.gid_indexes(WORKER, f) == {"rocep1s0f0": 3, "roceP2p1s0f0": 3}
    assert str(doc.link_network(WORKER, f.netdev("enp1s0f0np0"))) == "192.168.100.0/24"
    assert doc.link_network(WORKER, None) is None
    assert doc.twin_netdevs(WORKER, f) == {"enp1s0f0np0", "enP2p1s0f0np0"}
    assert doc.usable(WORKER, f) and not doc.usable(WORKER, None)


def test_an_interface_that_is_not_there(tmp_path, monkeypatch):
    data = raw(tmp_path, monkeypatch)
    data["netdevs"] = [n for n in data["netdevs"] if n["name"] != "enp1s0f0np0"]
    f = LinkFacts.model_validate(data)
    assert lines(doc.interface_problems(WORKER, f, 9000)) == [
        ("spark2", "enp1s0f0np0: does not exist on spark2 (interfaces: enP7s7, wlP9s9, "
                   "enp1s0f1np1, enP2p1s0f0np0, enP2p1s0f1np1)")]
    gone = raw(tmp_path / "b", monkeypatch)
    for n in gone["netdevs"]:
        if n["name"] == "enp1s0f0np0":
            n.update(exists=False, up=False, mtu=None, ipv4=[])
    assert lines(doc.interface_problems(WORKER, LinkFacts.model_validate(gone), 9000))[0][1] \
        .startswith("enp1s0f0np0: does not exist on spark2 (interfaces: enP7s7, wlP9s9, enp1s0f1np1,")
    empty = LinkFacts.model_validate({"version": 1, "netdevs": [
        {"name": "lo", "up": True, "mtu": 65536}]})
    assert lines(doc.interface_problems(WORKER, empty, 9000)) == [
        ("spark2", "enp1s0f0np0: does not exist on spark2 (interfaces: none)")]
    assert not doc.usable(WORKER, empty)


def test_a_down_interface_without_operstate_and_without_mtu(tmp_path, monkeypatch):
    data = raw(tmp_path, monkeypatch)
    for n in data["netdevs"]:
        if n["name"] == "enp1s0f0np0":
            n.update(up=False, operstate=None, mtu=None)
    assert lines(doc.interface_problems(WORKER, LinkFacts.model_validate(data), 9000)) == [
        ("spark2", "enp1s0f0np0: is down, must be up"),
        ("spark2", "enp1s0f0np0: MTU None, must be jumbo (>= 9000)")]
    for n in data["netdevs"]:
        if n["name"] == "enp1s0f0np0":
            n.update(operstate="lowerlayerdown", mtu=9000,
                     ipv4=[{"address": "10.0.0.1", "prefix": 30}, {"address": "10.0.0.9", "prefix": 30}])
    assert lines(doc.interface_problems(WORKER, LinkFacts.model_validate(data), 9000)) == [
        ("spark2", "enp1s0f0np0: is lowerlayerdown, must be up"),
        ("spark2", "enp1s0f0np0: lacks the profile's address 192.168.100.11 (has: 10.0.0.1/30, "
                   "10.0.0.9/30)")]
    # the MTU at the bound passes, one under fails
    assert doc.interface_problems(WORKER, LinkFacts.model_validate(data), 9001)[-1].what == \
        "MTU 9000, must be jumbo (>= 9001)"


def test_subnet_checks_every_other_interface_and_every_address(tmp_path, monkeypatch):
    f = LinkFacts.model_validate(raw(tmp_path, monkeypatch, twin="10.9.9.9"))
    data = f.model_dump()
    for n in data["netdevs"]:
        if n["name"] == "enP7s7":  # the LAN: first an address elsewhere, then one in the subnet
            n["ipv4"] = [{"address": "192.168.1.40", "prefix": 24},
                         {"address": "192.168.100.77", "prefix": 24}]
        if n["name"] == "wlP9s9":
            n["ipv4"] = [{"address": "192.168.100.78", "prefix": 25}]
        if n["name"] == "enp1s0f1np1":  # the other port, listed after the link's interface
            n["ipv4"] = [{"address": "192.168.100.79", "prefix": 24}]
    assert lines(doc.subnet_problems(WORKER, LinkFacts.model_validate(data))) == [
        ("spark2", "enP7s7: holds 192.168.100.77/24, in the link's subnet 192.168.100.0/24 "
                   "(only enp1s0f0np0 may)"),
        ("spark2", "wlP9s9: holds 192.168.100.78/25, in the link's subnet 192.168.100.0/24 "
                   "(only enp1s0f0np0 may)"),
        ("spark2", "enp1s0f1np1: holds 192.168.100.79/24, in the link's subnet 192.168.100.0/24 "
                   "(only enp1s0f0np0 may)")]


def _hca(data: dict, name: str) -> dict:
    return next(h for h in data["hcas"] if h["name"] == name)


def test_hca_absent_portless_unknown_state_and_differing_gid_index(tmp_path, monkeypatch):
    data = raw(tmp_path, monkeypatch)
    data["hcas"] = [h for h in data["hcas"] if h["name"] != "rocep1s0f0"]
    _hca(data, "roceP2p1s0f0")["ports"][0]["state"] = "DOWN"
    absent = [("spark2", "rocep1s0f0: HCA absent (RDMA devices: roceP2p1s0f0, roceP2p1s0f1, "
                         "rocep1s0f1)"),
              ("spark2", "roceP2p1s0f0 (enP2p1s0f0np0): port 1 is DOWN, must be ACTIVE")]
    assert lines(doc.hca_problems(WORKER, LinkFacts.model_validate(data))) == absent
    assert lines(doc.node_problems(WORKER, LinkFacts.model_validate(data)))[-2:] == absent
    data["hcas"] = []
    assert lines(doc.hca_problems(WORKER, LinkFacts.model_validate(data)))[0] == (
        "spark2", "rocep1s0f0: HCA absent (RDMA devices: none)")
    data = raw(tmp_path / "b", monkeypatch)
    _hca(data, "rocep1s0f0")["ports"] = []
    _hca(data, "roceP2p1s0f0")["ports"][0]["state"] = None
    assert lines(doc.hca_problems(WORKER, LinkFacts.model_validate(data))) == [
        ("spark2", "rocep1s0f0 (enp1s0f0np0): HCA has no port"),
        ("spark2", "roceP2p1s0f0 (enP2p1s0f0np0): port 1 is unknown, must be ACTIVE")]
    assert doc.gid_indexes(WORKER, LinkFacts.model_validate(data)) == {"roceP2p1s0f0": 3}
    data = raw(tmp_path / "c", monkeypatch)
    _hca(data, "roceP2p1s0f0")["ports"][0]["roce_v2"] = {"192.168.100.21": 5, "10.1.1.1": 2}
    _hca(data, "roceP2p1s0f0")["netdevs"] = []
    f = LinkFacts.model_validate(data)
    assert lines(doc.hca_problems(WORKER, f)) == [
        ("spark2", "roceP2p1s0f0 (no netdev): no RoCE v2 GID for an IPv4 address of its netdev "
                   "(addresses: none; RoCE v2 IPv4 GIDs: 10.1.1.1 at 2, 192.168.100.21 at 5)")]
    _hca(data, "roceP2p1s0f0")["netdevs"] = ["enP7s7", "wlP9s9"]  # two, neither with a GID
    assert lines(doc.hca_problems(WORKER, LinkFacts.model_validate(data))) == [
        ("spark2", "roceP2p1s0f0 (enP7s7, wlP9s9): no RoCE v2 GID for an IPv4 address of enP7s7, "
                   "wlP9s9 (addresses: 192.168.1.40, 192.168.1.41; RoCE v2 IPv4 GIDs: 10.1.1.1 at "
                   "2, 192.168.100.21 at 5)")]
    _hca(data, "roceP2p1s0f0")["netdevs"] = ["enP2p1s0f0np0"]
    assert lines(doc.hca_problems(WORKER, LinkFacts.model_validate(data))) == [
        ("spark2", "rocep1s0f0, roceP2p1s0f0: RoCE v2 GID index differs (rocep1s0f0 3, "
                   "roceP2p1s0f0 5); NCCL_IB_GID_INDEX is one number for all of them")]
    # the twin's own net device holds two addresses: the GID of one of them is enough
    for n in data["netdevs"]:
        if n["name"] == "enP2p1s0f0np0":
            n["ipv4"] = [{"address": "192.168.100.30", "prefix": 24},
                         {"address": "192.168.100.21", "prefix": 24}]
    _hca(data, "roceP2p1s0f0")["ports"][0]["roce_v2"] = {"192.168.100.21": 3, "10.1.1.1": 2}
    assert doc.hca_problems(WORKER, LinkFacts.model_validate(data)) == []


def test_the_lower_end_of_each_pair_is_named(tmp_path, monkeypatch):
    data = seed_data()
    third = json.loads(json.dumps(data["sparkdeploy"]["nodes"][1]))
    third.update(name="spark3", ssh="spark3", link={**third["link"], "address": "192.168.100.12"})
    data["sparkdeploy"]["nodes"].append(third)
    for e in data["sparkdeploy"]["engines"]:
        e["tensor_parallel"] = 3
    prof = load_profile(write_profile(tmp_path, data))

    def at(mtu, sub):
        d = raw(tmp_path / sub, monkeypatch, mtu=mtu)
        return LinkFacts.model_validate(d)
    facts = {"spark1": at(9000, "a"), "spark2": at(1500, "b"), "spark3": at(9000, "c")}
    assert lines(doc.pair_problems(prof, facts)) == [
        ("spark2", "enp1s0f0np0: MTU 1500, but spark1's enp1s0f0np0 has MTU 9000 (both ends must "
                   "be equal)"),
        ("spark2", "enp1s0f0np0: MTU 1500, but spark3's enp1s0f0np0 has MTU 9000 (both ends must "
                   "be equal)")]
    facts = {"spark1": at(9000, "d"), "spark2": None, "spark3": at(8000, "e")}
    assert lines(doc.pair_problems(prof, facts)) == [
        ("spark3", "enp1s0f0np0: MTU 8000, but spark1's enp1s0f0np0 has MTU 9000 (both ends must "
                   "be equal)")]


@pytest.mark.parametrize("argv,flag,want", [
    (("--master-addr", "1.2.3.4"), "--master-addr", "1.2.3.4"),
    (("--master-addr=1.2.3.4",), "--master-addr", "1.2.3.4"),
    (("--master-addr=a=b",), "--master-addr", "a=b"),
    (("x", "--master-addr"), "--master-addr", None),
    (("--master-address", "1.2.3.4"), "--master-addr", None),
])
def test_flag_values(argv, flag, want):
    assert doc._flag_value(argv, flag) == want


@pytest.mark.parametrize("value,want", [("10.0.0.1:20000", "10.0.0.1"), ("10.0.0.1", "10.0.0.1"),
                                        ("fd00::1", "fd00::1")])
def test_host_part(value, want):
    assert doc._host_part(value) == want


@pytest.mark.parametrize("var,value,ok", [
    ("NCCL_SOCKET_IFNAME", "enp1s0f0np0", True), ("NCCL_SOCKET_IFNAME", "enp1s0", True),
    ("NCCL_SOCKET_IFNAME", "eth0,enp1s0f0", True), ("NCCL_SOCKET_IFNAME", "^lo", False),
    ("NCCL_SOCKET_IFNAME", "=enp1s0f0np0", True), ("NCCL_SOCKET_IFNAME", "wlP9s9", False),
    ("NCCL_SOCKET_IFNAME", "^enp1s0f0np0", False),
    ("UCX_NET_DEVICES", "enp1s0f0np0:1", True), ("UCX_NET_DEVICES", "mlx5_0:1", False),
    ("GLOO_SOCKET_IFNAME", "enp1s0f0np0", True), ("GLOO_SOCKET_IFNAME", "enp1s0", False),
    ("TP_SOCKET_IFNAME", "", False),
])
def test_socket_interface_values(var, value, ok):
    assert doc._ifname_ok(var, value, "enp1s0f0np0") is ok


def test_ray_address_override_is_the_heads(tmp_path):
    data = seed_data()
    for e in data["sparkdeploy"]["engines"]:
        if e["kind"] == "vllm-ray":
            e["env"] = {"RAY_ADDRESS": "10.0.0.9:6379"}
    prof = load_profile(write_profile(tmp_path, data))
    assert lines(doc.advertised_problems(prof)) == [
        (n, f"enp1s0f0np0: vllm-ray (sparkdeploy-vllm-ray-{r}) has RAY_ADDRESS=10.0.0.9:6379, not "
            "the head's fast-link address 192.168.100.10")
        for n, r in [("spark1", "head"), ("spark2", "worker"), ("spark1", "api")]]


@pytest.mark.parametrize("stdout,stderr,want", [
    ("", "", "no answer"),
    ("PING x\n\n--- x ping statistics ---\n1 packets transmitted, 0 received, 100% packet loss\n",
     "", "1 packets transmitted, 0 received, 100% packet loss"),
    ("1 packets transmitted, 0 received, 100% packet loss\n", "ping: sendmsg: No buffer space available",
     "ping: sendmsg: No buffer space available"),
    ("odd\n", "", "odd"),
])
def test_ping_why(stdout, stderr, want):
    assert doc.ping_why(stdout, stderr) == want


@pytest.mark.parametrize("stdout,want", [
    ('{"end": {"sum_received": {"bits_per_second": 94100000000}}}', (94.1, "")),
    ('{"end": {"sum_received": {"bits_per_second": 0}}}', (0.0, "")),
    ("not json", (None, "iperf3 gave no JSON")),
    ("[1]", (None, "iperf3 gave no JSON object")),
    ('{"error": "unable to connect to server: Connection refused"}',
     (None, "iperf3: unable to connect to server: Connection refused")),
    ('{"end": {}}', (None, "iperf3's answer has no end.sum_received.bits_per_second")),
    ('{"end": {"sum_received": {"bits_per_second": -1}}}',
     (None, "iperf3's answer has no end.sum_received.bits_per_second")),
    ('{"end": {"sum_received": {"bits_per_second": "fast"}}}',
     (None, "iperf3's answer has no end.sum_received.bits_per_second")),
])
def test_iperf_answers(stdout, want):
    assert doc.iperf_gbps(stdout) == want


def test_stream_figures_and_the_bound():
    assert doc.stream_gbps(125_000_000, 1.0) == 1.0
    assert doc.stream_gbps(0, 2.0) is None and doc.stream_gbps(10, 0.0) is None
    assert doc.stream_gbps(1, 1.0) == 8e-9
    assert doc.bandwidth_problem(HEAD, WORKER, 25.0, 25.0, "iperf3") is None
    assert doc.bandwidth_problem(HEAD, WORKER, 3.0, None, "stream") is None
    p = doc.bandwidth_problem(HEAD, WORKER, 24.99, 25.0, "iperf3")
    assert (p.node, p.line) == ("spark2", "enp1s0f0np0: spark1 -> spark2: 24.99 Gb/s measured "
                                          "(iperf3), the profile expects >= 25 Gb/s (link.expect_gbps)")


def test_ping_argv():
    assert doc.ping_argv("enp1s0f0np0", 9000, "192.168.100.11") == [
        "ping", "-M", "do", "-s", "8972", "-c", "1", "-W", "2", "-I", "enp1s0f0np0", "192.168.100.11"]


def test_an_engine_the_builder_refuses_is_left_to_serve_up(monkeypatch):
    from sparkdeploy.engines import EngineError

    real = doc.launch

    def refusing(profile, engine, facts):
        if engine.kind == "sglang":
            raise EngineError("engines.sglang.image: no")
        return real(profile, engine, facts)
    data = PROFILE.model_dump()
    for e in data["engines"]:
        e["env"] = {"VLLM_HOST_IP": "127.0.1.1"} if e["kind"] == "vllm" else {}
    prof = type(PROFILE).model_validate(data, strict=False)
    monkeypatch.setattr(doc, "launch", refusing)
    got = lines(doc.advertised_problems(prof))
    assert [w.split(" (")[0] for _, w in got] == ["enp1s0f0np0: vllm", "enp1s0f0np0: vllm"]
