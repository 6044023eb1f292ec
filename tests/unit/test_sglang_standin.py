"""The SGLang stand-in across nodes: the advertised address, NCCL's choices, the verdict, and
two real ranks rendezvousing over --dist-init-addr (local processes on loopback)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from sparkdeploy.lab.standins import engine_server as es
from sparkdeploy.lab.standins import roce

IFACES = [("lo", "127.0.0.1"), ("eth0", "10.77.0.11"), ("enp1s0f0np0", "10.77.1.1")]
HCAS = ["rocep1s0f0", "roceP2p1s0f0"]


def test_advertised_address_order_of_sglang():
    remote = lambda: "10.77.0.11"  # noqa: E731
    assert es.sglang_host_ip({"SGLANG_HOST_IP": "10.77.1.1", "HOST_IP": "x"}, IFACES, remote) == "10.77.1.1"
    assert es.sglang_host_ip({"HOST_IP": "10.77.1.9"}, IFACES, remote) == "10.77.1.9"
    assert es.sglang_host_ip({"SGLANG_LOCAL_IP_NIC": "enp1s0f0np0"}, IFACES, remote) == "10.77.1.1"
    assert es.sglang_host_ip({}, IFACES, remote) == "10.77.0.11"  # the default route's source
    assert es.sglang_host_ip({}, IFACES, lambda: None) == "0.0.0.0"


@pytest.mark.parametrize(("spec", "want"), [
    (None, ["eth0", "enp1s0f0np0", "enp1s0f1np1"]),
    ("enp1s0f0np0", ["enp1s0f0np0"]),
    ("enp", ["enp1s0f0np0", "enp1s0f1np1"]),
    ("=enp", []),
    ("^eth", ["enp1s0f0np0", "enp1s0f1np1"]),
    ("rocep1s0f0:1,enp1s0f1np1", ["enp1s0f1np1"]),
])
def test_nccl_select(spec, want):
    assert es.nccl_select(spec, ["eth0", "enp1s0f0np0", "enp1s0f1np1"]) == want


def hca_tree(tmp_path, ipv4="10.77.1.1", global_v6=()):
    table = roce.gid_table(ipv4, "fe80::1", list(global_v6))
    roce.write_tree(tmp_path, HCAS, "enp1s0f0np0", table)
    return es.read_hcas(str(tmp_path / "infiniband"))


def test_read_hcas_sees_the_roce_twins_and_gid_types(tmp_path):
    hcas = hca_tree(tmp_path, global_v6=["fd00::1"])
    assert sorted(hcas) == sorted(HCAS)
    h = hcas["rocep1s0f0"]
    assert h["state"] == "4: ACTIVE" and h["netdev"] == "enp1s0f0np0"
    assert h["types"][5] == "RoCE v2" and h["gids"][5] == es.v4_mapped_gid("10.77.1.1")
    assert h["types"][3] == "RoCE v2" and h["gids"][3] != es.v4_mapped_gid("10.77.1.1")


def test_nccl_plan_ib_on_the_fast_link(tmp_path):
    hcas = hca_tree(tmp_path)
    env = {"NCCL_SOCKET_IFNAME": "enp1s0f0np0", "NCCL_IB_HCA": ",".join(HCAS), "NCCL_IB_GID_INDEX": "3"}
    plan = es.nccl_plan(env, IFACES, hcas, "10.77.1.1")
    assert (plan.net, plan.hcas, plan.socket_if, plan.problem) == ("IB", HCAS, "enp1s0f0np0", "")


def test_nccl_plan_gid_index_assumed_3_is_caught_where_v2_is_at_5(tmp_path):
    hcas = hca_tree(tmp_path, global_v6=["fd00::1"])
    env = {"NCCL_SOCKET_IFNAME": "enp1s0f0np0", "NCCL_IB_GID_INDEX": "3"}
    assert es.nccl_plan(env, IFACES, hcas, "10.77.1.1").problem == "gid"
    assert es.nccl_plan({**env, "NCCL_IB_GID_INDEX": "5"}, IFACES, hcas, "10.77.1.1").problem == ""
    assert es.nccl_plan({**env, "NCCL_IB_GID_INDEX": ""}, IFACES, hcas, "10.77.1.1").problem == ""


def test_nccl_plan_misconfigured_links(tmp_path):
    hcas = hca_tree(tmp_path)
    no_if = es.nccl_plan({"NCCL_SOCKET_IFNAME": "enp9s9"}, IFACES, hcas, "10.77.1.1")
    assert no_if.problem == "no-socket-if"
    # HCAs the node lacks, sockets left to NCCL's own choice (the management interface)
    other = es.nccl_plan({"NCCL_IB_HCA": "mlx5_0"}, IFACES, hcas, "10.77.1.1")
    assert (other.net, other.socket_if, other.problem) == ("Socket", "eth0", "other-network")
    # no IB, but sockets on the fast link: slow, works
    fast = es.nccl_plan({"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "enp1s0f0np0"}, IFACES,
                        hcas, "10.77.1.1")
    assert (fast.net, fast.problem) == ("Socket", "")


def test_verdict_hangs_when_a_rank_advertises_another_address():
    good = [{"rank": 0, "advertised": "10.77.1.1", "link": "10.77.1.1"},
            {"rank": 1, "advertised": "10.77.1.2", "link": "10.77.1.2"}]
    assert es.sglang_verdict(good, set())[0] == "ends"
    assert es.sglang_verdict(good, {"sglang-hang"}) == ("hang", "lab fault sglang-hang")
    bad = [good[0], {**good[1], "advertised": "10.77.0.12"}]
    outcome, why = es.sglang_verdict(bad, set())
    assert outcome == "hang" and "rank 1 advertises 10.77.0.12" in why


def test_lab_faults_file(tmp_path):
    assert es.lab_faults(str(tmp_path)) == set()
    (tmp_path / "faults.json").write_text(json.dumps({"faults": ["sglang-hang"]}))
    assert es.lab_faults(str(tmp_path)) == {"sglang-hang"}


# --- two real ranks ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, dist, port, model, env, tmp_path):
    argv = ["--model-path", str(model), "--served-model-name", "Qwen/Q", "--tp", "2", "--nnodes", "2",
            "--node-rank", str(rank), "--dist-init-addr", f"127.0.0.1:{dist}", "--host", "127.0.0.1",
            "--port", str(port), "--ttft-ms", "5", "--gap-ms", "1", "--watchdog-timeout", "1"]
    full = {**{k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "SGLANG_", "HOST_IP"))},
            "SPARKDEPLOY_STANDIN_SYSFS_IB": str(tmp_path / "infiniband"),
            "SPARKDEPLOY_STANDIN_LAB_DIR": str(tmp_path / "lab"),
            "NCCL_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", **env}
    code = f"from sparkdeploy.lab.standins.engine_server import sglang_main; raise SystemExit(sglang_main({argv!r}))"
    log = open(tmp_path / f"rank{rank}.log", "w")
    return subprocess.Popen([sys.executable, "-c", code], env=full, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture
def pair(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 4096)
    roce.write_tree(tmp_path, HCAS, "lo", roce.gid_table("127.0.0.1", "fe80::1"))
    (tmp_path / "lab").mkdir()
    procs = []

    def start(env0, env1):
        dist, port = _free_port(), _free_port()
        procs.extend([_rank(0, dist, port, model, env0, tmp_path), _rank(1, dist, port, model, env1, tmp_path)])
        return port

    start.procs = procs
    yield start, tmp_path
    for p in procs:
        p.kill()
        p.wait()


def _health(port, deadline_s=20.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                return r.status
        except OSError:
            time.sleep(0.1)
    return None


def test_two_ranks_advertising_the_link_address_serve_and_stream(pair):
    start, tmp = pair
    port = start({"SGLANG_HOST_IP": "127.0.0.1"}, {"SGLANG_HOST_IP": "127.0.0.1"})
    assert _health(port) == 200, (tmp / "rank0.log").read_text()
    body = json.dumps({"model": "Qwen/Q", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 4, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        events = [ln for ln in r.read().decode().split("\n\n") if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 1 + 4 + 1
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
        assert json.loads(r.read())["data"][0]["id"] == "Qwen/Q"
    log0 = (tmp / "rank0.log").read_text()
    assert "NET/IB : Using [0]rocep1s0f0:1/RoCE [1]roceP2p1s0f0:1/RoCE [RO]; OOB lo:127.0.0.1<0>" in log0
    assert "Init torch distributed ends." in log0 and "Load weight end." in log0
    assert "Init torch distributed ends." in (tmp / "rank1.log").read_text()


def _hangs_silently(tmp, procs):
    # a hung rank says nothing more until SGLang's watchdog kills it (--watchdog-timeout 1);
    # a rank that went on would print its init's end and serve, never be killed
    assert [p.wait(timeout=60) for p in procs] == [-signal.SIGKILL] * 2
    after = [(tmp / f"rank{r}.log").read_text() for r in (0, 1)]
    for text in after:
        last = text.strip().splitlines()[-1]
        assert last.endswith("CustomAllreduce is disabled because this process group spans across nodes."), text
        assert "Init torch distributed ends" not in text
        assert "NET/IB : Using [0]rocep1s0f0:1/RoCE" in text


def test_a_rank_advertising_another_address_hangs_after_custom_allreduce(pair):
    start, tmp = pair
    port = start({"SGLANG_HOST_IP": "127.0.0.1"}, {"SGLANG_HOST_IP": "10.255.7.7"})
    _hangs_silently(tmp, start.procs)
    assert _health(port, 0.5) is None


def test_the_lab_fault_forces_the_hang(pair):
    start, tmp = pair
    (tmp / "lab" / "faults.json").write_text(json.dumps({"faults": ["sglang-hang"]}))
    start({"SGLANG_HOST_IP": "127.0.0.1"}, {"SGLANG_HOST_IP": "127.0.0.1"})
    _hangs_silently(tmp, start.procs)


def test_rank0_alone_times_out_waiting_for_clients(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    p = _rank(0, _free_port(), _free_port(), model, {"SPARKDEPLOY_STANDIN_DIST_TIMEOUT_S": "1"}, tmp_path)
    assert p.wait(timeout=20) == 1
    assert "Timed out after 2 seconds waiting for clients. 1/2 clients joined." in (tmp_path / "rank0.log").read_text()


def test_missing_model_dir_fails_before_distributed_init(tmp_path):
    p = _rank(1, _free_port(), _free_port(), tmp_path / "nope", {}, tmp_path)
    assert p.wait(timeout=20) == 1
    text = (tmp_path / "rank1.log").read_text()
    assert "Incorrect path_or_model_id" in text and "Init torch distributed begin" not in text


def test_module_is_standard_library_only():
    src = Path(es.__file__).read_text()
    assert "import sparkdeploy" not in src and "from sparkdeploy" not in src


def test_a_port_probe_on_the_init_port_does_not_disturb_the_rendezvous(pair, tmp_path):
    _start, tmp = pair
    dist, port = _free_port(), _free_port()
    env = {"SGLANG_HOST_IP": "127.0.0.1"}
    procs = [_rank(0, dist, port, tmp / "model", env, tmp)]
    try:
        deadline = time.monotonic() + 20
        while True:  # serve.up's wait for the head's init port: connect, close
            try:
                socket.create_connection(("127.0.0.1", dist), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        silent = socket.create_connection(("127.0.0.1", dist), timeout=1)  # and one that says nothing
        procs.append(_rank(1, dist, port, tmp / "model", env, tmp))
        assert _health(port, 30) == 200, (tmp / "rank0.log").read_text()
        silent.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _stream_tokens(port: int, n: int, timeout: float) -> int:
    """How many token chunks a streamed chat answer delivers before ``timeout`` (no byte)."""
    body = json.dumps({"model": "Qwen/Q", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": n, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    got = 0
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for line in r:
                if line.startswith(b"data: {") and (b'"content":"' in line and b'"role"' not in line
                                                    or b'"reasoning_content"' in line):
                    got += 1
    except OSError:  # the read timed out: the stream stalled
        pass
    return got


def test_every_token_needs_the_worker_rank_a_stopped_one_stalls_the_stream(pair):
    # tensor parallel: the head cannot make a token without every rank; /health still says 200
    start, tmp = pair
    port = start({"SGLANG_HOST_IP": "127.0.0.1"}, {"SGLANG_HOST_IP": "127.0.0.1"})
    assert _health(port) == 200, (tmp / "rank0.log").read_text()
    assert _stream_tokens(port, 6, 10) == 6
    worker = start.procs[1]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        assert _health(port, 2) == 200
        assert _stream_tokens(port, 6, 1.5) == 0
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    assert _stream_tokens(port, 6, 10) == 6


def test_decode_steps_share_a_round_and_wait_for_one_begun_after_the_call():
    import threading

    rounds: list[int] = []
    gate = threading.Event()

    def exchange(k: int) -> None:
        rounds.append(k)
        gate.wait(5)

    steps = es.DecodeSteps(exchange)
    done = []
    ts = [threading.Thread(target=lambda: (steps.step(), done.append(1))) for _ in range(8)]
    for t in ts:
        t.start()
    deadline = time.monotonic() + 5
    while not rounds and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done == []  # round 1 has not ended: nobody has its token
    gate.set()
    for t in ts:
        t.join(5)
    assert len(done) == 8
    assert len(rounds) <= 2  # the eight waiters shared the rounds (a call during round 1 waits for round 2)


@pytest.mark.parametrize(("tp", "pp", "nnodes", "per_node"), [
    # one GPU a node: each node one (pp_rank, tp_rank), every rank of the tp x pp grid once
    (2, 1, 2, [[(0, 0)], [(0, 1)]]),
    (1, 3, 3, [[(0, 0)], [(1, 0)], [(2, 0)]]),
    (2, 2, 4, [[(0, 0)], [(0, 1)], [(1, 0)], [(1, 1)]]),
    (4, 1, 4, [[(0, 0)], [(0, 1)], [(0, 2)], [(0, 3)]]),
    # more ranks than nodes: a node holds several
    (2, 2, 2, [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]),
    (4, 1, 2, [[(0, 0), (0, 1)], [(0, 2), (0, 3)]]),
])
def test_sglang_ranks_per_node(tp, pp, nnodes, per_node):
    assert [es.sglang_ranks(tp, pp, nnodes, r) for r in range(nnodes)] == per_node


def test_sglang_refuses_more_ranks_than_the_nodes_gpus(capsys, monkeypatch):
    monkeypatch.setenv(es.ENV + "GPUS", "1")
    rc = es.sglang_main(["--model-path", "/nonexistent", "--tp", "2", "--pp-size", "2",
                         "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "127.0.0.1:1"])
    assert rc == 1
    assert ("RuntimeError: CUDA error: invalid device ordinal (tp_size=2 x pp_size=2 over 2 "
            "node(s) puts 2 ranks on this node; it has 1 GPU(s))") in capsys.readouterr().err


def test_the_lab_fault_oom_at_load_fails_every_rank_as_a_cuda_oom(pair):
    from sparkdeploy.engines.diagnose import classify

    start, tmp = pair
    (tmp / "lab" / "faults.json").write_text(json.dumps({"faults": ["oom-at-load"]}))
    start({"SGLANG_HOST_IP": "127.0.0.1"}, {"SGLANG_HOST_IP": "127.0.0.1"})
    assert [p.wait(timeout=60) for p in start.procs] == [1, 1]
    logs = {f"rank{r}": (tmp / f"rank{r}.log").read_text().splitlines() for r in (0, 1)}
    for lines in logs.values():
        text = "\n".join(lines)
        assert "Load weight begin." in text and "Load weight end." not in text
        assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in text
    assert classify(logs).cls == "out-of-memory"
