"""link.check, the link doctor, on a pair of Sparks as real ones show their fast link: each node's
sysfs laid out from recorded ``ibdev2netdev`` and PCI mappings (``link_fakes``), ``ip -j addr``,
``ping`` as iputils prints it (``data/link/``), ``iperf3 -J`` or the stream helper. Each check
fails alone, naming the node, the interface and both values; a clean pair passes."""

from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path

import pytest

from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.steps import link as link_step
from tests.unit.fakes import FakeContext, deployment
from tests.unit.link_fakes import SparkView, facts_on, spark
from tests.unit.profiles import SEED, seed_data, write_profile

DATA = Path(__file__).parent / "data" / "link"
ADDR = {"spark1": "192.168.100.10", "spark2": "192.168.100.11"}
TWIN = {"spark1": "192.168.100.20", "spark2": "192.168.100.21"}


def iperf_json(bps: float) -> str:
    """``iperf3 -J``'s answer, trimmed to what a client prints at the end (iperf 3.12)."""
    secs = 2.000123
    return json.dumps({"start": {"version": "iperf 3.12"}, "intervals": [], "end": {
        "sum_sent": {"start": 0, "end": secs, "seconds": secs, "bytes": int(bps * secs / 8),
                     "bits_per_second": bps * 1.001, "retransmits": 0, "sender": True},
        "sum_received": {"start": 0, "end": secs, "seconds": secs, "bytes": int(bps * secs / 8),
                         "bits_per_second": bps, "sender": True}}}, indent="\t")


REFUSED = json.dumps({"start": {}, "intervals": [], "end": {},
                      "error": "unable to connect to server: Connection refused"})


def healthy_view(node: str) -> SparkView:
    """A Spark with both QSFP ports Up (the Leadtek recording): the link's port carries the
    node's address, its twin's net device one of its own."""
    return spark("ibdev2netdev-leadtek.txt", addrs={
        "enp1s0f0np0": [f"{ADDR[node]}/24"], "enP2p1s0f0np0": [f"{TWIN[node]}/24"]})


class Pair(FakeContext):
    """Two Sparks answering link.check's commands as real ones would."""

    def __init__(self, tmp_path: Path, monkeypatch, views: dict[str, SparkView] | None = None,
                 dry: bool = False):
        super().__init__(dry)
        self._set("facts", {})
        self._set("ping", {"spark1": ("ping-ok.txt", 0)})
        self._set("iperf3", {"spark1": None, "spark2": None})
        self._set("iperf_answers", [])
        self._set("streamed", (8_000_000_000, 2.0))
        self._set("serve_error", None)
        root = Path(tempfile.mkdtemp(dir=tmp_path))  # a test may lay out several pairs
        for node, view in (views or {n: healthy_view(n) for n in ADDR}).items():
            self.facts[node] = facts_on(view, root / node, monkeypatch)

    def answer(self, alias, argv, stdin, command, kw):
        if argv[:2] == ["sh", "-c"] and "base64 -d" in argv[2]:
            return self.result(command, 0, f"/tmp/sparkdeploy-stage-0/{argv[4]}/{argv[5]}\n")
        if argv[:2] == ["sh", "-c"] and "sha256sum" in argv[2]:
            inner = argv[argv.index("python3"):]
            return self.helper(alias, Path(inner[1]).name, inner[2:], command)
        if argv[0] == "ping":
            name, code = self.ping.get(alias, ("ping-ok.txt", 0))
            text = (DATA / name).read_text()
            return self.result(command, code, "" if code == 2 else text, text if code == 2 else "")
        if argv[0] == "timeout" and argv[2] == "iperf3":
            return self.result(command, 0, "")
        if argv[0] == "iperf3":
            out = self.iperf_answers.pop(0) if self.iperf_answers else iperf_json(40e9)
            return self.result(command, 0 if '"error"' not in out else 1, out)
        raise AssertionError(f"unexpected {alias}: {shlex.join(argv)}")

    def helper(self, alias, script, args, command):
        if script == "link_node.py":
            return self.result(command, 0, json.dumps(self.facts[alias]) + "\n")
        assert script == "link_stream.py", script
        if args == ["tools"]:
            return self.result(command, 0, json.dumps({"iperf3": self.iperf3[alias]}) + "\n")
        if args[0] == "serve":
            if self.serve_error:
                return self.result(command, 1, "", f"error: {self.serve_error}\n")
            n, secs = self.streamed
            return self.result(command, 0, json.dumps({"bytes": n, "seconds": secs}) + "\n")
        return self.result(command, 0, json.dumps({"bytes": self.streamed[0], "seconds": 2.01}) + "\n")

    def ran(self, first: str) -> list[tuple[str, list[str]]]:
        return [(a, v) for a, v in self.calls if v and v[0] == first]

    def helper_calls(self, script: str) -> list[tuple[str, list[str]]]:
        out = []
        for a, v in self.calls:
            if v[:2] == ["sh", "-c"] and "sha256sum" in v[2] and "python3" in v:
                inner = v[v.index("python3"):]
                if inner[1].endswith(script):
                    out.append((a, inner[2:]))
        return out


def run(tmp_path, ctx, profile=None):
    dep = deployment(profile or SEED, tmp_path / "state", ctx)
    results = link_step.check(dep)
    return results, [(r.status.value, r.node, r.why) for r in results]


def failures(lines):
    return [(n, w) for s, n, w in lines if s == "failed"]


def test_a_healthy_pair_passes_with_the_exact_commands(tmp_path, monkeypatch):
    ctx = Pair(tmp_path, monkeypatch)
    results, lines = run(tmp_path, ctx)
    assert failures(lines) == []
    assert lines == [
        ("ok", "spark1", "enp1s0f0np0 up, 192.168.100.10/24, MTU 9000; rocep1s0f0, roceP2p1s0f0 "
                         "ACTIVE, RoCE v2 GID index 3"),
        ("ok", "spark2", "enp1s0f0np0 up, 192.168.100.11/24, MTU 9000; rocep1s0f0, roceP2p1s0f0 "
                         "ACTIVE, RoCE v2 GID index 3"),
        ("ok", "spark2", "spark1 -> spark2: 32.00 Gb/s (stream, 2 s), expected >= 25")]
    # the head pings the worker with one unfragmented packet of the MTU's size on the link
    assert ctx.ran("ping") == [("spark1", ["ping", "-M", "do", "-s", "8972", "-c", "1", "-W", "2",
                                           "-I", "enp1s0f0np0", "192.168.100.11"])]
    # neither has iperf3: the stream, received on the worker's link address, sent from the head's
    streams = [c for c in ctx.helper_calls("link_stream.py") if c[1][0] != "tools"]
    assert sorted(streams) == [
        ("spark1", ["send", "--to", "192.168.100.11", "--port", "5201", "--seconds", "2",
                    "--bind", "192.168.100.10"]),
        ("spark2", ["serve", "--bind", "192.168.100.11", "--port", "5201", "--wait", "15"])]


def test_the_bandwidth_is_judged_against_link_expect_gbps(tmp_path, monkeypatch):
    ctx = Pair(tmp_path, monkeypatch)
    ctx._set("streamed", (1_000_000_000, 2.0))  # 4 Gb/s received on the worker
    _, lines = run(tmp_path, ctx)
    assert failures(lines) == [("spark2", "enp1s0f0np0: spark1 -> spark2: 4.00 Gb/s measured "
                                          "(stream), the profile expects >= 25 Gb/s "
                                          "(link.expect_gbps)")]
    ctx = Pair(tmp_path, monkeypatch)
    ctx._set("streamed", (7_000_000_000, 2.0))  # 28 Gb/s
    _, lines = run(tmp_path, ctx)
    assert failures(lines) == []
    assert lines[-1] == ("ok", "spark2", "spark1 -> spark2: 28.00 Gb/s (stream, 2 s), expected >= 25")


def test_iperf3_when_both_nodes_have_it(tmp_path, monkeypatch):
    ctx = Pair(tmp_path, monkeypatch)
    ctx._set("iperf3", {"spark1": "/usr/bin/iperf3", "spark2": "/usr/bin/iperf3"})
    ctx._set("iperf_answers", [REFUSED, iperf_json(94.1e9)])  # the server not listening yet
    _, lines = run(tmp_path, ctx)
    assert lines[-1] == ("ok", "spark2", "spark1 -> spark2: 94.10 Gb/s (iperf3, 2 s), expected >= 25")
    client = ["iperf3", "-c", "192.168.100.11", "-B", "192.168.100.10", "-p", "5201", "-t", "2", "-J"]
    assert ctx.ran("iperf3") == [("spark1", client), ("spark1", client)]
    assert ctx.ran("timeout") == [("spark2", ["timeout", "17", "iperf3", "-s", "-1", "-B",
                                              "192.168.100.11", "-p", "5201"])]
    # only one node with iperf3: the stream
    ctx = Pair(tmp_path, monkeypatch)
    ctx._set("iperf3", {"spark1": "/usr/bin/iperf3", "spark2": None})
    _, lines = run(tmp_path, ctx)
    assert ctx.ran("iperf3") == [] and "(stream, 2 s)" in lines[-1][2]


def test_iperf3_that_never_connects_is_one_line(tmp_path, monkeypatch):
    ctx = Pair(tmp_path, monkeypatch)
    ctx._set("iperf3", {"spark1": "/usr/bin/iperf3", "spark2": "/usr/bin/iperf3"})
    ctx._set("iperf_answers", [REFUSED] * 5)
    _, lines = run(tmp_path, ctx)
    assert failures(lines) == [("spark2", "enp1s0f0np0: spark1 -> spark2: bandwidth not measured "
                                          "(iperf3): iperf3: unable to connect to server: "
                                          "Connection refused")]


def test_a_receiver_that_cannot_listen_is_one_line(tmp_path, monkeypatch):
    ctx = Pair(tmp_path, monkeypatch)
    ctx._set("serve_error", "serve 192.168.100.11:5201: Address already in use")
    _, lines = run(tmp_path, ctx)
    assert failures(lines) == [("spark2", "enp1s0f0np0: spark1 -> spark2: bandwidth not measured "
                                          "(stream): spark2: link_stream.py serve: serve "
                                          "192.168.100.11:5201: Address already in use")]


def worker(mutate) -> dict[str, SparkView]:
    views = {n: healthy_view(n) for n in ADDR}
    mutate(views["spark2"])
    return views


def _mtu(v, m=1500):
    v.ifaces["enp1s0f0np0"].mtu = m


def _down(v):
    v.ifaces["enp1s0f0np0"].up = False


def _no_address(v):
    v.ifaces["enp1s0f0np0"].ipv4 = []


def _other_address(v):
    v.ifaces["enp1s0f0np0"].ipv4 = ["192.168.100.99/24"]


def _second_interface(v):
    v.extra["enP7s7"].ipv4 = ["192.168.100.50/24"]


def _wide_lan(v):
    v.extra["wlP9s9"].ipv4 = ["192.168.0.7/16"]


def _twin_down(v):
    v.hca_state["roceP2p1s0f0"] = "1: DOWN"


def _twin_unaddressed(v):
    v.ifaces["enP2p1s0f0np0"].ipv4 = []


CASES = [
    ("mtu", _mtu, [
        "enp1s0f0np0: MTU 1500, must be jumbo (>= 9000)",
        "enp1s0f0np0: MTU 1500, but spark1's enp1s0f0np0 has MTU 9000 (both ends must be equal)"]),
    ("down", _down, ["enp1s0f0np0: is down, must be up"]),
    ("no address", _no_address, [
        "enp1s0f0np0: lacks the profile's address 192.168.100.11 (has: none)",
        "rocep1s0f0 (enp1s0f0np0): no RoCE v2 GID for 192.168.100.11 (RoCE v2 IPv4 GIDs: none)"]),
    ("another address", _other_address, [
        "enp1s0f0np0: lacks the profile's address 192.168.100.11 (has: 192.168.100.99/24)",
        "rocep1s0f0 (enp1s0f0np0): no RoCE v2 GID for 192.168.100.11 (RoCE v2 IPv4 GIDs: "
        "192.168.100.99 at 3)"]),
    ("second interface", _second_interface, [
        "enP7s7: holds 192.168.100.50/24, in the link's subnet 192.168.100.0/24 (only "
        "enp1s0f0np0 may)"]),
    ("overlapping LAN", _wide_lan, [
        "wlP9s9: holds 192.168.0.7/16, in the link's subnet 192.168.100.0/24 (only enp1s0f0np0 "
        "may)"]),
    ("twin down", _twin_down, [
        "roceP2p1s0f0 (enP2p1s0f0np0): port 1 is DOWN, must be ACTIVE"]),
    ("twin without address", _twin_unaddressed, [
        "roceP2p1s0f0 (enP2p1s0f0np0): no RoCE v2 GID for an IPv4 address of enP2p1s0f0np0 "
        "(addresses: none; RoCE v2 IPv4 GIDs: none)"]),
]


@pytest.mark.parametrize("case,mutate,want", CASES, ids=[c[0] for c in CASES])
def test_each_problem_is_one_line_naming_node_interface_and_both_values(
        tmp_path, monkeypatch, case, mutate, want):
    ctx = Pair(tmp_path, monkeypatch, worker(mutate))
    if case == "mtu":
        ctx.ping["spark1"] = ("ping-lost.txt", 1)
    _, lines = run(tmp_path, ctx)
    got = failures(lines)
    node_lines = [w for n, w in got if n == "spark2" and not w.startswith("enp1s0f0np0: spark1")]
    assert node_lines == want
    assert all(n == "spark2" for n, _ in got), got
    assert ("ok", "spark1", lines[0][2]) == lines[0]  # the head is fine


def test_an_end_without_its_address_is_not_pinged_nor_measured(tmp_path, monkeypatch):
    ctx = Pair(tmp_path, monkeypatch, worker(_down))
    _, lines = run(tmp_path, ctx)
    assert lines[-1] == ("skipped", "spark2", "spark1 -> spark2 not tested: the link of spark2 "
                                              "is not up with the profile's address (above)")
    assert ctx.ran("ping") == [] and ctx.helper_calls("link_stream.py") == []


@pytest.mark.parametrize("recorded,code,why", [
    ("ping-lost.txt", 1, "1 packets transmitted, 0 received, 100% packet loss, time 0ms"),
    ("ping-local-mtu.txt", 1, "ping: local error: message too long, mtu=1500"),
    ("ping-down.txt", 2, "ping: connect: Network is unreachable"),
])
def test_a_ping_that_does_not_pass_is_one_line_and_nothing_is_measured(
        tmp_path, monkeypatch, recorded, code, why):
    ctx = Pair(tmp_path, monkeypatch)
    ctx.ping["spark1"] = (recorded, code)
    _, lines = run(tmp_path, ctx)
    assert failures(lines) == [("spark2", "enp1s0f0np0: spark1 cannot reach spark2 at "
                                          "192.168.100.11 with a 9000-byte unfragmented packet "
                                          f"(ping -M do -s 8972): {why}")]
    assert ctx.helper_calls("link_stream.py") == []


def engine_env(tmp_path, **env):
    data = seed_data()
    data["sparkdeploy"]["engines"][0]["env"] = env
    return write_profile(tmp_path, data)


@pytest.mark.parametrize("env,want", [
    ({"SGLANG_HOST_IP": "10.0.0.5"}, [
        ("spark1", "enp1s0f0np0: sglang (sparkdeploy-sglang-head) advertises SGLANG_HOST_IP="
                   "10.0.0.5, not spark1's fast-link address 192.168.100.10"),
        ("spark2", "enp1s0f0np0: sglang (sparkdeploy-sglang-worker) advertises SGLANG_HOST_IP="
                   "10.0.0.5, not spark2's fast-link address 192.168.100.11")]),
    ({"MASTER_ADDR": "192.168.1.40"}, [
        ("spark1", "enp1s0f0np0: sglang (sparkdeploy-sglang-head) has MASTER_ADDR=192.168.1.40, "
                   "not the head's fast-link address 192.168.100.10"),
        ("spark2", "enp1s0f0np0: sglang (sparkdeploy-sglang-worker) has MASTER_ADDR=192.168.1.40, "
                   "not the head's fast-link address 192.168.100.10")]),
    ({"NCCL_SOCKET_IFNAME": "wlP9s9", "GLOO_SOCKET_IFNAME": "enp1s0f0np0"}, [
        ("spark1", "enp1s0f0np0: sglang (sparkdeploy-sglang-head) has NCCL_SOCKET_IFNAME=wlP9s9, "
                   "not the fast link's interface enp1s0f0np0"),
        ("spark2", "enp1s0f0np0: sglang (sparkdeploy-sglang-worker) has NCCL_SOCKET_IFNAME="
                   "wlP9s9, not the fast link's interface enp1s0f0np0")]),
    ({"NCCL_SOCKET_IFNAME": "enp1s0f0", "SGLANG_HOST_IP": None}, []),  # a prefix; removed: none
])
def test_the_address_each_engine_advertises_after_the_profiles_env(tmp_path, monkeypatch, env, want):
    ctx = Pair(tmp_path, monkeypatch)
    _, lines = run(tmp_path, ctx, engine_env(tmp_path, **env))
    assert failures(lines) == want


def test_ray_and_vllm_addresses_from_the_profiles_args(tmp_path, monkeypatch):
    data = seed_data()
    for e in data["sparkdeploy"]["engines"]:
        if e["kind"] == "vllm":
            e["args"] = [*e.get("args", []), "--master-addr", "192.168.1.40"]
        if e["kind"] == "vllm-ray":
            e["env"] = {"VLLM_HOST_IP": "127.0.1.1"}
    ctx = Pair(tmp_path, monkeypatch)
    _, lines = run(tmp_path, ctx, write_profile(tmp_path, data))
    got = failures(lines)
    assert ("spark2", "enp1s0f0np0: vllm-ray (sparkdeploy-vllm-ray-worker) advertises "
                      "VLLM_HOST_IP=127.0.1.1, not spark2's fast-link address 192.168.100.11") in got
    assert ("spark2", "enp1s0f0np0: vllm (sparkdeploy-vllm-worker) has --master-addr=192.168.1.40, "
                      "not the head's fast-link address 192.168.100.10") in got
    # Ray's node IP and RAY_ADDRESS come from the profile's addresses: nothing said of them
    assert not any("--node-ip-address" in w or "RAY_ADDRESS" in w for _, w in got)


def test_a_node_that_cannot_say_its_facts_is_one_line_and_the_pair_is_not_tested(tmp_path, monkeypatch):
    ctx = Pair(tmp_path, monkeypatch)
    ctx.facts["spark2"] = {"netdevs": []}  # no version: not the helper's answer
    _, lines = run(tmp_path, ctx)
    bad = failures(lines)
    assert len(bad) == 1 and bad[0][0] == "spark2" and bad[0][1].startswith("link_node.py facts")
    assert lines[-1][0] == "skipped" and ctx.ran("ping") == []


def test_dry_run_pings_but_does_not_measure(tmp_path, monkeypatch):
    ctx = Pair(tmp_path, monkeypatch, dry=True)
    dep = deployment(SEED, tmp_path / "state", ctx, dry=True)
    results = link_step.check(dep)
    assert results[-1].status is Status.SKIPPED
    assert results[-1].why == "would measure spark1 -> spark2 for 2 s"
    assert [c for c in ctx.helper_calls("link_stream.py")] == []


def test_the_deploy_plan_and_serve_up_need_it(tmp_path):
    from sparkdeploy.run import plan
    from sparkdeploy.steps import registry

    registry.load_all()
    assert "link.check" in registry.REGISTRY["model.download"].needs
    assert "link.check" in registry.REGISTRY["serve.up"].needs
    dep = deployment(SEED, tmp_path / "state", FakeContext())
    assert plan.plan(dep)[0].name == "link.check"


def test_task_runs_link_check_before_serve_up(tmp_path, monkeypatch):
    from invoke import Config, Context

    from sparkdeploy.tasks import _common
    from sparkdeploy.tasks import serve as serve_tasks

    ran = []

    def fake_run_one(dep, name, **options):
        ran.append(name)
        return [Result(name, Status.FAILED if name == "link.check" else Status.OK,
                       "MTU 1500" if name == "link.check" else "up")]

    monkeypatch.setattr(_common, "run_one", fake_run_one)
    c = Context(Config(overrides={"sparkdeploy": {"profile": str(SEED),
                                                  "state_dir": str(tmp_path / "s")}}))
    with pytest.raises(Exception) as e:
        serve_tasks.up(c)
    assert ran == ["link.check"] and getattr(e.value, "code", None) == 1
    ran.clear()
    serve_tasks.up(c, skip_link_check=True)
    assert ran == ["serve.up", "metrics.up"]  # the metrics once it serves
