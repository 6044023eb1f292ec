"""link.fabric: the all-reduce's ranks launched as the engine is (the exact ``docker run`` per node
for a profile), nccl-tests' arithmetic (algbw, busbw), the verdicts, the deadline on a fake clock
(a hang ended, named, every rank removed), the JSON shape ``inv link.fabric --json`` prints, and
the perftest's figure."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from sparkdeploy.core.records import FabricRecord
from sparkdeploy.ops import fabric as fab
from sparkdeploy.profile.config import load_profile
from sparkdeploy.steps import link_fabric
from tests.unit.fakes import FakeClock, FakeContext, deployment
from tests.unit.profiles import seed_data, write_profile

HEAD_ADDR = "192.168.100.10"
SOCK = "unix:///var/run/docker.sock"
GIB = 1 << 30


def profile(tmp_path: Path, **link) -> Path:
    data = seed_data()
    data["sparkdeploy"]["link"] = {"expect_gbps": 25, **link}
    return write_profile(tmp_path, data)


def report(rank: int, sizes: list[tuple[int, int, float]], sent: dict | None = None,
           world: int = 2) -> str:
    return json.dumps({"rank": rank, "world": world, "backend": "nccl", "torch": "2.9.0",
                       "joined_s": 1.2, "stopped": None,
                       "sizes": [{"bytes": b, "iters": i, "seconds": s} for b, i, s in sizes],
                       "sent": sent if sent is not None else {"netdev": {"enp1s0f0np0": 0, "lo": 0},
                                                              "rdma": {"rocep1s0f0/1": 10 ** 12}}})


FAST = [(fab.MIB * 4 ** k, 5, fab.MIB * 4 ** k / 12e9) for k in range(6)]  # 12 GB/s busbw at n=2
SLOW = [(fab.MIB * 4 ** k, 2, fab.MIB * 4 ** k / 0.5e9) for k in range(6)]  # 0.5 GB/s


class Ranks(FakeContext):
    """Two Sparks whose engine containers run the rank: ``behaviour`` per node, ``ok`` (ends at
    once with ``answers[node]``), ``hang`` (never ends), ``fail`` (exits 1 with an error)."""

    def __init__(self, clock: FakeClock, behaviour: dict[str, str], answers: dict[str, str],
                 rdma: bool = True):
        super().__init__()
        self._set("clock", clock)
        self._set("behaviour", behaviour)
        self._set("answers", answers)
        self._set("rdma", rdma)
        self._set("running", {})
        self._set("runs", {})
        self._set("removed", [])

    def answer(self, alias, argv, stdin, command, kw):
        if argv[:3] == ["sudo", "-n", "--"]:
            argv = argv[3:]
        if argv == ["true"]:
            return self.result(command)
        if argv[:2] == ["sh", "-c"] and "base64 -d" in argv[2]:
            return self.result(command, 0, f"/tmp/sparkdeploy-stage-0/{argv[4]}/{argv[5]}\n")
        if argv[:2] == ["sh", "-c"] and argv[2].endswith('exec "$@"'):
            argv = argv[4:]
        if argv[0] == "python3" and argv[2] == "facts":
            return self.result(command, 0, json.dumps({
                "iface": {"exists": True, "up": True}, "gid": {"index": 3},
                "rdma_devices": self.rdma}) + "\n")
        if argv[:2] == ["sh", "-c"] and "command -v" in argv[2]:
            return self.result(command, 1)  # no perftest
        assert argv[:3] == ["docker", "-H", SOCK], argv
        return self.docker(alias, argv[3:], command)

    def docker(self, node, a, command):
        if a[:2] == ["image", "inspect"]:
            return self.result(command, 0, json.dumps({"Id": "sha256:" + "a" * 64}))
        if a[:2] == ["rm", "--force"]:
            self.removed.append((node, a[2]))
            self.running.pop((node, a[2]), None)
            return self.result(command, 0 if (node, a[2]) in self.runs else 1)
        if a[0] == "run":
            name = next(x.split("=", 1)[1] for x in a if x.startswith("--name="))
            self.runs[(node, name)] = a
            self.running[(node, name)] = self.clock()
            return self.result(command, 0, "c0ffee\n")
        if a[0] == "inspect":
            key = (node, a[-1])
            if key not in self.running:
                return self.result(command, 1, "", f"Error: No such object: {a[-1]}")
            how = self.behaviour[node]
            state = {"ok": "exited 0", "fail": "exited 1", "hang": "running 0", "notorch": "exited 3"}[how]
            return self.result(command, 0, state + "\n")
        if a[0] == "logs":
            how = self.behaviour[node]
            if how == "hang":
                return self.result(command, 0, "", "" if node == "spark1" else (
                    "[W1207 01:04:59.143600558 TCPStore.cpp:340] [c10d] TCP client failed to connect/validate "
                    "to host 192.168.100.10:29511 - retrying (try=20, timeout=600000ms, delay=364ms)\n"
                    "Exception raised from run at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/socket.cpp:820\n"
                    "frame #36: _start + 0x21 (0x56027c43b081 in /usr/bin/python3)\n"))
            if how == "fail":
                return self.result(command, 0, "", "error: RuntimeError: NCCL error: unhandled system error\n")
            if how == "notorch":
                return self.result(command, 0, "", "error: this image's python3 cannot import "
                                                    "torch.distributed: No module named 'torch'\n")
            return self.result(command, 0, "progress size=1048576 iters=5\n" + self.answers[node] + "\n")
        raise AssertionError(f"unexpected docker {shlex.join(a)}")


def run(tmp_path: Path, behaviour: dict[str, str], answers: dict[str, str] | None = None, **link):
    clock = FakeClock()
    ctx = Ranks(clock, behaviour, answers or {"spark1": report(0, FAST), "spark2": report(1, FAST)})
    dep = deployment(profile(tmp_path, **link), tmp_path / "state", ctx, clock=clock)
    results = link_fabric.fabric(dep, engine="vllm")
    return dep, ctx, clock, results


# --- the containers: the engine's, running the rank ----------------------------------------


def test_each_rank_runs_in_the_engines_container_spec_rank_0_on_the_head(tmp_path):
    dep, ctx, _, results = run(tmp_path, {"spark1": "ok", "spark2": "ok"})
    staged = "/tmp/sparkdeploy-stage-0/{}/fabric_allreduce.py"
    head, worker = ctx.runs[("spark1", "sparkdeploy-vllm-fabric-rank0")], ctx.runs[
        ("spark2", "sparkdeploy-vllm-fabric-rank1")]
    vol = next(x for x in head if x.startswith("--volume="))
    digest = vol.split("/")[3]
    label = [f"--label=org.sparkdeploy.deployment={dep.profile.name}", "--label=org.sparkdeploy.role=fabric",
             "--label=org.sparkdeploy.started=2026-11-30T00:53:20Z",
             "--label=org.sparkdeploy.started.by=link.fabric"]
    common = ["--network=host", "--ipc=host", "--ulimit=memlock=-1", "--ulimit=stack=67108864",
              "--gpus=all", "--device=/dev/infiniband",
              f"--volume={staged.format(digest)}:/sparkdeploy/fabric_allreduce.py:ro"]
    env = ["--env=NCCL_SOCKET_IFNAME=enp1s0f0np0", "--env=GLOO_SOCKET_IFNAME=enp1s0f0np0",
           "--env=TP_SOCKET_IFNAME=enp1s0f0np0", "--env=UCX_NET_DEVICES=enp1s0f0np0",
           "--env=NCCL_IB_HCA=rocep1s0f0,roceP2p1s0f0", "--env=NCCL_IB_DISABLE=0",
           "--env=NCCL_IB_GID_INDEX=3", f"--env=MASTER_ADDR={HEAD_ADDR}"]
    sizes = ",".join(str(fab.MIB * 4 ** k) for k in range(6))

    def rank(r: int) -> list[str]:
        return ["--entrypoint=python3", "hellohal2064/vllm-qwen3.5-gb10",
                "/sparkdeploy/fabric_allreduce.py", "--rank", str(r), "--world", "2",
                "--master-addr", HEAD_ADDR, "--master-port", "29511", "--backend", "auto",
                "--sizes", sizes, "--budget", "60"]

    assert head == ["run", "--detach", "--name=sparkdeploy-vllm-fabric-rank0", *label, *common, *env,
                    f"--env=VLLM_HOST_IP={HEAD_ADDR}", *rank(0)]
    assert worker == ["run", "--detach", "--name=sparkdeploy-vllm-fabric-rank1", *label, *common, *env,
                      "--env=VLLM_HOST_IP=192.168.100.11", *rank(1)]
    # the staged program is checked against its sha256 before docker mounts it
    started = [c for c in ctx.calls if "run" in c[1] and "--detach" in c[1]]
    assert [c[0] for c in started] == ["spark1", "spark2"]  # rank 0 first: it listens
    assert all(c[1][:2] == ["sh", "-c"] and "sha256sum -c" in c[1][2] for c in started)
    # every rank removed when it ended (and before, in case one was left)
    assert ctx.removed.count(("spark1", "sparkdeploy-vllm-fabric-rank0")) == 2
    assert ctx.removed.count(("spark2", "sparkdeploy-vllm-fabric-rank1")) == 2
    assert ctx.running == {}
    assert [r.status.value for r in results] == ["skipped", "ok"]
    assert results[0].why == ("perftest (ib_write_bw) not run: not installed on both spark1 and spark2 "
                              "(the perftest package)")


def test_the_lab_max_bytes_caps_the_sizes_and_a_node_without_rdma_skips_the_perftest(tmp_path):
    clock = FakeClock()
    ctx = Ranks(clock, {"spark1": "ok", "spark2": "ok"},
                {"spark1": report(0, FAST[:5]), "spark2": report(1, FAST[:5])}, rdma=False)
    dep = deployment(profile(tmp_path, fabric_max_bytes=256 * fab.MIB), tmp_path / "state", ctx,
                     clock=clock)
    results = link_fabric.fabric(dep, engine="vllm")
    head = ctx.runs[("spark1", "sparkdeploy-vllm-fabric-rank0")]
    assert head[head.index("--sizes") + 1] == ",".join(str(fab.MIB * 4 ** k) for k in range(5))
    assert "--device=/dev/infiniband" not in head
    assert results[0].status.value == "skipped"
    assert results[0].why.startswith("perftest (ib_write_bw) not run: spark1, spark2 has no RDMA device")


# --- the figures ---------------------------------------------------------------------------


@pytest.mark.parametrize("n,factor", [(2, 1.0), (3, 4 / 3), (4, 1.5), (8, 1.75)])
def test_busbw_is_algbw_times_2_n_minus_1_over_n_as_nccl_tests(n, factor):
    got = fab.figures([fab.RankSize(bytes=GIB, iters=5, seconds=0.5)], n)
    assert got[0].algbw_gbs == round(GIB / 0.5 / 1e9, 4) == 2.1475
    assert got[0].busbw_gbs == round(GIB / 0.5 / 1e9 * factor, 4)
    assert fab.bus_factor(n) == pytest.approx(factor)


def test_sizes_go_from_1_mib_to_1_gib_times_4():
    assert fab.SIZES == (1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30)
    assert fab.sizes_for(None) == fab.SIZES
    assert fab.sizes_for(300 << 20) == fab.SIZES[:5]


def test_expected_gbs_is_the_profiles_gbps_over_8(tmp_path):
    assert fab.expected_gbs(load_profile(profile(tmp_path, expect_gbps=25))) == 3.125


# --- the verdicts --------------------------------------------------------------------------


def reports(head: str, worker: str) -> dict[str, fab.RankReport]:
    return {"spark1": fab.RankReport.model_validate_json(head),
            "spark2": fab.RankReport.model_validate_json(worker)}


def test_a_link_that_carries_what_is_expected_is_ok(tmp_path):
    prof = load_profile(profile(tmp_path))
    got = fab.judge(prof, reports(report(0, FAST), report(1, FAST)))
    assert got.verdict == "ok"
    assert got.why == "best busbw 12.000 GB/s at 1 MiB over 2 ranks (nccl), at least the 3.125 GB/s expected"


def test_a_slow_link_is_degraded_against_the_expected_figure(tmp_path):
    prof = load_profile(profile(tmp_path))
    got = fab.judge(prof, reports(report(0, SLOW), report(1, SLOW)))
    assert got.verdict == "degraded"
    assert got.why.endswith("under the 3.125 GB/s expected (link.expect_gbps 25 Gb/s)")
    assert [s.busbw_gbs for s in got.sizes] == [0.5] * 6


def test_without_an_expectation_the_figures_are_shown_not_judged(tmp_path):
    data = seed_data()
    data["sparkdeploy"]["link"] = {}
    prof = load_profile(write_profile(tmp_path, data))
    got = fab.judge(prof, reports(report(0, SLOW), report(1, SLOW)))
    assert (got.verdict, got.expected_gbs) == ("ok", None)
    assert "nothing expected (link.expect_gbps unset)" in got.why


def test_bytes_sent_over_another_interface_are_a_wrong_interface(tmp_path):
    prof = load_profile(profile(tmp_path))
    need = int(fab.must_send([fab.RankSize(bytes=b, iters=i, seconds=s) for b, i, s in FAST], 2))
    wrong = {"netdev": {"enp1s0f0np0": 1000, "enP7s7": need + 10, "lo": 5}, "rdma": {"rocep1s0f0/1": 0}}
    got = fab.judge(prof, reports(report(0, FAST, wrong), report(1, FAST)))
    assert got.verdict == "wrong-interface"
    assert got.why.startswith(f"spark1: the all-reduce sent {(need + 10) / 1e6:.0f} MB over enP7s7, "
                              "0 MB over the link's enp1s0f0np0")


def test_bytes_on_the_links_rdma_ports_count_for_the_link(tmp_path):
    prof = load_profile(profile(tmp_path))
    need = int(fab.must_send([fab.RankSize(bytes=b, iters=i, seconds=s) for b, i, s in FAST], 2))
    rdma = {"netdev": {"enp1s0f0np0": 0, "enP7s7": need}, "rdma": {"rocep1s0f0/1": need, "mlx5_9/1": 0}}
    assert fab.judge(prof, reports(report(0, FAST, rdma), report(1, FAST))).verdict == "ok"


# --- the deadline, and the record ----------------------------------------------------------


def test_a_rank_that_never_ends_is_a_hang_ended_by_the_deadline_and_removed(tmp_path):
    dep, ctx, clock, results = run(tmp_path, {"spark1": "hang", "spark2": "hang"}, fabric_timeout_s=90)
    assert 90 <= clock() <= 90 + link_fabric.POLL_S + 1
    assert ctx.running == {}  # both removed
    got = results[-1]
    assert got.failed
    assert got.why == ("hang: the all-reduce did not end within 90 s: rank(s) on spark1, spark2 still running, "
                       "ended and removed (last: spark2: [W1207 01:04:59.143600558 TCPStore.cpp:340] [c10d] TCP "
                       "client failed to connect/validate to host 192.168.100.10:29511 - retrying (try=20, "
                       "timeout=600000ms, delay=364ms))")
    fabric = got.details["fabric"]
    assert fabric == {"verdict": "hang", "expected_gbs": 3.125, "sizes": [], "why": fabric["why"]}
    assert dep.records.read(FabricRecord).verdict == "hang"


def test_a_rank_that_fails_ends_the_test_at_once_with_its_error(tmp_path):
    _, ctx, clock, results = run(tmp_path, {"spark1": "ok", "spark2": "fail"})
    assert clock() < 5
    assert results[-1].why == "failed: spark2: the rank failed: RuntimeError: NCCL error: unhandled system error"
    assert ctx.running == {}


def test_an_image_without_torch_is_skipped_not_failed(tmp_path):
    # the lab's engine stand-ins hold no torch: deploy.all goes on to serve.up
    dep, ctx, _, results = run(tmp_path, {"spark1": "notorch", "spark2": "notorch"})
    assert results[-1].status.value == "skipped"
    assert results[-1].why == ("skipped: spark1: not run in hellohal2064/vllm-qwen3.5-gb10: this image's "
                               "python3 cannot import torch.distributed: No module named 'torch'")
    assert ctx.running == {}


def test_the_json_is_the_issues_shape_and_the_record_keeps_it(tmp_path):
    dep, _, _, results = run(tmp_path, {"spark1": "ok", "spark2": "ok"})
    fabric = results[-1].details["fabric"]
    assert list(fabric) == ["verdict", "expected_gbs", "sizes", "why"]
    assert fabric["verdict"] == "ok" and fabric["expected_gbs"] == 3.125
    assert fabric["sizes"][0] == {"bytes": 1 << 20, "algbw_gbs": 12.0, "busbw_gbs": 12.0}
    rec = dep.records.read(FabricRecord)
    assert (rec.engine, rec.backend, rec.nodes) == ("vllm", "nccl", ["spark1", "spark2"])
    assert rec.model_dump(include={"verdict", "expected_gbs", "sizes", "why"}) == fabric


# --- the perftest --------------------------------------------------------------------------

IB_WRITE_BW = """
---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF		Device         : rocep1s0f0
 Number of qps   : 1		Transport type : IB
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
 65536      1066000          0.00               111.70 		     0.213047
---------------------------------------------------------------------------------------
"""


def test_the_perftest_figure_is_its_average_column():
    assert link_fabric.perftest_gbps(IB_WRITE_BW) == 111.70
    assert link_fabric.perftest_gbps("Couldn't connect to 192.168.100.11:18515") is None


# --- the task ------------------------------------------------------------------------------


def test_json_prints_only_the_document_on_stdout_and_the_stream_on_stderr(tmp_path, capsys):
    from invoke import Config, Context

    from sparkdeploy.tasks import link as link_tasks

    c = Context(Config(overrides={"sparkdeploy": {"profile": str(profile(tmp_path)),
                                                  "state_dir": str(tmp_path / "state")},
                                  "run": {"dry": True}}))
    link_tasks.fabric(c, json=True, engine="vllm")
    out, err = capsys.readouterr()
    assert json.loads(out) == {
        "verdict": "skipped", "expected_gbs": 3.125, "sizes": [],
        "why": "would run an all-reduce of 1 to 1024 MiB in hellohal2064/vllm-qwen3.5-gb10 on spark1, spark2"}
    assert len(out.splitlines()) == 1
    assert "skipped  link.fabric" in err and "recap:" in err


# --- where the figures show: serve.status and the run record --------------------------------


def test_serve_status_and_the_run_record_show_the_last_fabric_test(tmp_path):
    from sparkdeploy.run import run_record
    from sparkdeploy.run.plan import StepRun
    from sparkdeploy.steps import serve as serve_steps
    from sparkdeploy.steps.registry import StepContext

    dep, _, _, _ = run(tmp_path, {"spark1": "ok", "spark2": "ok"})
    ctx = StepContext("serve.status", dep.events, dep)
    serve_steps._fabric(ctx)
    [line] = ctx.results
    assert re.fullmatch(r"link\.fabric \(\d{4}-\d\d-\d\dT[\d:]+Z\): ok: best busbw 12\.000 GB/s at 1 MiB over 2 "
                        r"ranks \(nccl\), at least the 3\.125 GB/s expected", line.why), line.why
    assert line.details["fabric"]["sizes"][0] == {"bytes": 1 << 20, "algbw_gbs": 12.0, "busbw_gbs": 12.0}
    got = run_record._fabric({"link.fabric": StepRun("link.fabric", state="done", reused=True)}, dep)
    assert got is not None
    assert (got["verdict"], got["reused"], got["sizes"][-1]["bytes"]) == ("ok", True, 1 << 30)
    md = "\n".join(run_record._fabric_markdown(got))
    assert md.startswith("- **ok**: best busbw") and f"(reused, from {got['time']})" in md
    assert "| 1073741824 | 12.0 | 12.0 |" in md
    assert run_record._fabric({}, dep) is None  # a plan without it


def test_deploy_all_tests_again_when_the_link_the_nodes_or_the_image_changed(tmp_path):
    from sparkdeploy.core.fingerprint import diff_keys
    from sparkdeploy.steps import registry

    fp = registry.get("link.fabric").fingerprint
    assert fp is not None and registry.get("link.fabric").reuse
    assert "link.fabric" in registry.get("serve.up").needs
    assert "link.fabric" not in registry.get("model.sync").needs  # the weights stream meanwhile
    ctx = Ranks(FakeClock(), {}, {})
    one = fp.local(deployment(profile(tmp_path), tmp_path / "s1", ctx))
    (tmp_path / "b").mkdir()
    two = fp.local(deployment(profile(tmp_path / "b", expect_gbps=50), tmp_path / "s2", ctx))
    assert diff_keys(one, two) == ["link.expect_gbps"]
    assert {"image", "serve_image", "nodes[1].link.address"} <= set(one)


# --- the verdict's edges (mutation testing: docs/notes/mutants.md) -------------------------


def _sent(netdev: dict, rdma: dict | None = None) -> dict:
    return {"netdev": netdev, "rdma": rdma or {}}


def test_must_send_is_every_timed_byte_times_the_bus_factor():
    sizes = [fab.RankSize(bytes=1000, iters=3, seconds=1.0), fab.RankSize(bytes=10, iters=2, seconds=1.0)]
    assert fab.must_send(sizes, 2) == 3020.0
    assert fab.must_send(sizes, 4) == 3020.0 * 1.5


def test_where_sent_counts_the_links_interface_and_its_hcas_and_names_the_busiest_other():
    rep = fab.RankReport.model_validate_json(report(0, FAST, _sent(
        {"enp1s0f0np0": 500, "lo": 9999, "a0": 300, "zz": 100},
        {"rocep1s0f0/1": 200, "mlx5_9/1": 50})))
    assert fab.where_sent(rep, "enp1s0f0np0", ["rocep1s0f0"]) == (700.0, "a0", 300.0)
    for sent in ({}, _sent({})):  # counters that say nothing
        rep = fab.RankReport.model_validate_json(report(0, FAST, sent))
        assert fab.where_sent(rep, "enp1s0f0np0", ["rocep1s0f0"]) == (0.0, "", 0.0)


def _wrong(tmp_path, head_sent: dict, sizes=FAST, worker: str | None = None) -> str | None:
    prof = load_profile(profile(tmp_path))
    return fab.wrong_interface(prof, reports(worker or report(1, FAST), report(0, sizes, head_sent)))


def test_the_wrong_interface_rule_at_its_bounds(tmp_path):
    need = fab.must_send([fab.RankSize(bytes=b, iters=i, seconds=s) for b, i, s in FAST], 2)
    half = fab.ON_LINK * need
    # the link's own interface counts for it, without any RDMA
    assert _wrong(tmp_path, _sent({"enp1s0f0np0": need, "enP7s7": need})) is None
    # on the link exactly half: not under it; another sent exactly half: enough to be the wrong one
    assert _wrong(tmp_path, _sent({"enp1s0f0np0": half, "enP7s7": need})) is None
    assert _wrong(tmp_path, _sent({"enp1s0f0np0": 0, "enP7s7": half})) is not None
    assert _wrong(tmp_path, _sent({"enp1s0f0np0": 0, "enP7s7": 1})) is None  # a trickle elsewhere
    # a one-byte all-reduce is still judged
    tiny = [(1, 1, 1e-6)]
    assert _wrong(tmp_path, _sent({"enP7s7": 1}), sizes=tiny,
                  worker=report(1, tiny, _sent({}))) is not None


def test_a_rank_that_timed_nothing_does_not_hide_a_wrong_interface_on_the_next(tmp_path):
    prof = load_profile(profile(tmp_path))
    got = fab.wrong_interface(prof, {
        "spark1": fab.RankReport.model_validate_json(report(0, [], _sent({}))),
        "spark2": fab.RankReport.model_validate_json(report(1, FAST, _sent({"enP7s7": 10 ** 12})))})
    need = fab.must_send([fab.RankSize(bytes=b, iters=i, seconds=s) for b, i, s in FAST], 2)
    assert got == (f"spark2: the all-reduce sent 1000000 MB over enP7s7, 0 MB over the link's "
                   f"enp1s0f0np0 (it must send {need / 1e6:.0f} MB): check NCCL_SOCKET_IFNAME, "
                   "GLOO_SOCKET_IFNAME")


def test_the_verdict_is_judged_on_the_heads_figures_and_keeps_the_expected_figure(tmp_path):
    prof = load_profile(profile(tmp_path))
    head, worker = report(0, SLOW), report(1, FAST)
    by = {"spark2": fab.RankReport.model_validate_json(worker), "spark1": fab.RankReport.model_validate_json(head)}
    got = fab.judge(prof, by)  # the head's, though the worker answered first
    assert (got.verdict, got.expected_gbs) == ("degraded", 3.125)
    only_worker = fab.judge(prof, {"spark2": fab.RankReport.model_validate_json(worker)})
    assert only_worker.verdict == "ok"  # no head report: the first rank's figures
    wrong = _sent({"enp1s0f0np0": 0, "enP7s7": 10 ** 12})
    assert fab.judge(prof, reports(report(0, FAST, wrong), report(1, FAST))).expected_gbs == 3.125


def test_a_busbw_exactly_the_expected_figure_is_ok(tmp_path):
    prof = load_profile(profile(tmp_path))
    exact = [(fab.MIB, 5, fab.MIB / 3.125e9)]  # busbw 3.125 GB/s at n=2: what 25 Gb/s expects
    got = fab.judge(prof, reports(report(0, exact), report(1, exact)))
    assert [s.busbw_gbs for s in got.sizes] == [3.125] and got.verdict == "ok"


def test_ranks_that_measured_no_size_fail_saying_why_they_stopped(tmp_path):
    prof = load_profile(profile(tmp_path))
    head = json.loads(report(0, []))
    head["stopped"] = "SIGTERM after 1 of 6 sizes"
    got = fab.judge(prof, reports(json.dumps(head), report(1, [])))
    assert got.model_dump() == fab.Fabric(verdict=fab.FAILED, expected_gbs=3.125, sizes=[],
                                          why="no size measured; SIGTERM after 1 of 6 sizes").model_dump()
    assert got.verdict == "failed" and got.sizes == [] and got.expected_gbs == 3.125
