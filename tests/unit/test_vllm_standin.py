"""The vLLM stand-in in vLLM's own multi-node mode (``--nnodes``, workers ``--headless``, no Ray):
real ranks (local processes on loopback) meeting in the head's store on --master-addr:
--master-port, the head reaching each worker's queue at the address it advertises, every token
through every rank; a worker advertising another address never reached, the head waiting."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from sparkdeploy.lab.standins import engine_server as es
from sparkdeploy.lab.standins import roce
from tests.unit.test_sglang_standin import HCAS, _free_port, _health, _stream_tokens


def _rank(rank, nodes, dist, port, model, env, tmp_path, tp=1, pp=None):
    pp = pp or nodes // tp
    argv = ["serve", str(model), "--served-model-name", "Qwen/Q", "--host", "127.0.0.1", "--port",
            str(port), "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
            "--distributed-executor-backend", "mp", "--nnodes", str(nodes), "--node-rank", str(rank),
            "--master-addr", "127.0.0.1", "--master-port", str(dist), "--ttft-ms", "5", "--gap-ms", "1",
            *(["--headless"] if rank else [])]
    full = {**{k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "VLLM_", "RAY_"))},
            "SPARKDEPLOY_STANDIN_SYSFS_IB": str(tmp_path / "infiniband"),
            "SPARKDEPLOY_STANDIN_LAB_DIR": str(tmp_path / "lab"),
            "NCCL_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", **env}
    code = f"from sparkdeploy.lab.standins.engine_server import vllm_main; raise SystemExit(vllm_main({argv!r}))"
    log = open(tmp_path / f"rank{rank}.log", "w")
    return subprocess.Popen([sys.executable, "-c", code], env=full, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture
def ranks(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 4096)
    roce.write_tree(tmp_path, HCAS, "lo", roce.gid_table("127.0.0.1", "fe80::1"))
    (tmp_path / "lab").mkdir()
    procs = []

    def start(*envs, tp=1):
        """The head, then (once its master port answers, as serve.up waits) the workers."""
        dist, port = _free_port(), _free_port()
        procs.append(_rank(0, len(envs), dist, port, model, envs[0], tmp_path, tp=tp))
        _master_port_open(dist)
        procs.extend(_rank(r, len(envs), dist, port, model, env, tmp_path, tp=tp)
                     for r, env in enumerate(envs) if r)
        return port

    start.procs = procs
    yield start, tmp_path
    for p in procs:
        p.kill()
        p.wait()


def _master_port_open(port: int) -> None:
    deadline = time.monotonic() + 20
    while True:  # serve.up's wait for the head's master port: connect, close
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def log_of(tmp, r) -> str:
    return (tmp / f"rank{r}.log").read_text()


LINK = {"VLLM_HOST_IP": "127.0.0.1"}


def test_two_nodes_meet_on_the_master_port_and_the_head_serves(ranks):
    start, tmp = ranks
    port = start(LINK, LINK, tp=2)
    assert _health(port) == 200, log_of(tmp, 0) + log_of(tmp, 1)
    assert _stream_tokens(port, 5, 10) == 5
    head, worker = log_of(tmp, 0), log_of(tmp, 1)
    assert "DP group leader: node_rank=0, node_rank_within_dp=0, master_addr=127.0.0.1, " \
           "mq_connect_ip=127.0.0.1 (local), world_size=2, local_world_size=1" in head
    assert "headless multiproc executor, with head node address 127.0.0.1:" in worker
    assert "rank 0 in world size 2 is assigned as DP rank 0, PP rank 0, TP rank 0" in head
    assert "rank 1 in world size 2 is assigned as DP rank 0, PP rank 0, TP rank 1" in worker
    assert "Init COMPLETE" in head and "Init COMPLETE" in worker
    assert "Starting vLLM API server on http://127.0.0.1:" in head
    assert "API server" not in worker and "Uvicorn" not in worker  # headless: no API
    assert "ray" not in (head + worker).lower()


def test_four_nodes_pipeline_ranks_each_join_and_every_token_needs_them(ranks):
    start, tmp = ranks
    port = start(LINK, LINK, LINK, LINK, tp=2)  # TP=2 x PP=2
    assert _health(port, 30) == 200, log_of(tmp, 0)
    assert "rank 3 in world size 4 is assigned as DP rank 0, PP rank 1, TP rank 1" in log_of(tmp, 3)
    assert _stream_tokens(port, 4, 10) == 4
    os.kill(start.procs[2].pid, signal.SIGSTOP)  # one rank of four stops: no token is made
    try:
        assert _health(port, 2) == 200
        assert _stream_tokens(port, 4, 1.5) == 0
    finally:
        os.kill(start.procs[2].pid, signal.SIGCONT)
    assert _stream_tokens(port, 4, 10) == 4


def _waits_after_loading(tmp, procs, port):
    """Both sides wait after the weights, silently: no API, no line after 'Model loading took'."""
    def last(r: int) -> str:
        lines = log_of(tmp, r).strip().splitlines()
        return lines[-1].split("] ", 1)[-1] if lines else ""

    deadline = time.monotonic() + 30
    while not all(last(r).startswith("Model loading took") for r in (0, 1)):
        assert time.monotonic() < deadline, log_of(tmp, 0) + log_of(tmp, 1)
        time.sleep(0.1)
    assert _health(port, 1) is None  # the head goes on only once it has every worker's queue
    assert [p.poll() for p in procs] == [None, None]
    assert all(last(r).startswith("Model loading took") for r in (0, 1))
    assert "is assigned as DP rank" in log_of(tmp, 1)  # the rank met the store: the queue it lacks


def test_a_worker_advertising_hostname_i_is_never_reached_and_the_head_waits(ranks):
    start, tmp = ranks
    port = start(LINK, {"VLLM_HOST_IP": "127.0.1.1"})
    _waits_after_loading(tmp, start.procs, port)


def test_the_lab_fault_makes_the_worker_advertise_hostname_i(ranks):
    start, tmp = ranks
    (tmp / "lab" / "faults.json").write_text(json.dumps({"faults": ["vllm-wrong-address"]}))
    port = start(LINK, LINK)
    _waits_after_loading(tmp, start.procs, port)
    assert es.advertised_ip(LINK, True, {"vllm-wrong-address"}) == "127.0.1.1"
    assert es.advertised_ip(LINK, False, {"vllm-wrong-address"}) == "127.0.0.1"  # the head's own
    assert es.advertised_ip(LINK, True, set()) == "127.0.0.1"


def test_an_address_the_worker_does_not_have_fails_its_bind(ranks):
    start, tmp = ranks
    start(LINK, {"VLLM_HOST_IP": "10.255.7.7"})
    assert start.procs[1].wait(timeout=30) == 1
    assert "zmq.error.ZMQError: Cannot assign requested address (addr='tcp://10.255.7.7:0')" in log_of(tmp, 1)
    # the head's exchange of the queues' handles loses the rank: it fails too
    assert start.procs[0].wait(timeout=30) == 1
    assert "DistNetworkError: rank 1 closed its connection" in log_of(tmp, 0)


def test_the_head_alone_times_out_waiting_for_its_workers(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    p = _rank(0, 2, _free_port(), _free_port(), model, {"SPARKDEPLOY_STANDIN_DIST_TIMEOUT_S": "1"}, tmp_path)
    assert p.wait(timeout=20) == 1
    text = log_of(tmp_path, 0)
    assert "DistStoreError: Timed out after 2 seconds waiting for clients. 1/2 clients joined." in text
    assert "distributed_init_method=tcp://127.0.0.1:" in text


def test_a_worker_whose_head_does_not_answer_retries_like_c10d(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    p = _rank(1, 2, _free_port(), _free_port(), model, {"SPARKDEPLOY_STANDIN_DIST_TIMEOUT_S": "1"}, tmp_path)
    assert p.wait(timeout=20) == 1
    text = log_of(tmp_path, 1)
    assert "[c10d] The client socket has failed to connect to [127.0.0.1]:" in text
    assert "DistNetworkError: The client socket has timed out after 1000ms" in text


def test_a_probe_of_the_master_port_does_not_disturb_the_store(ranks):
    start, tmp = ranks
    dist, port = _free_port(), _free_port()
    head = _rank(0, 2, dist, port, tmp / "model", LINK, tmp)
    start.procs.append(head)
    _master_port_open(dist)
    socket.create_connection(("127.0.0.1", dist), timeout=1).close()  # and once more
    start.procs.append(_rank(1, 2, dist, port, tmp / "model", LINK, tmp))
    assert _health(port, 30) == 200, log_of(tmp, 0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
        assert json.loads(r.read())["data"][0]["id"] == "Qwen/Q"


# --- what the diagnosis makes of these logs --------------------------------------------------


def _logs(tmp, n=2) -> dict[str, list[str]]:
    return {f"spark{r + 1}-sparkdeploy-vllm-{'head' if r == 0 else 'worker'}.log":
            log_of(tmp, r).splitlines() for r in range(n)}


def test_the_unreached_worker_is_diagnosed_as_a_worker_that_never_joined(ranks):
    from sparkdeploy.engines import diagnose as dx

    start, tmp = ranks
    port = start(LINK, {"VLLM_HOST_IP": "127.0.1.1"})
    _waits_after_loading(tmp, start.procs, port)
    logs = _logs(tmp)
    d = dx.classify(logs)
    assert d.cls == "worker-never-joined", d
    head = "spark1-sparkdeploy-vllm-head.log"
    texts = [e.text for e in d.evidence if e.label == head]
    assert "DP group leader: node_rank=0" in texts[0] and "Model loading took" in texts[-1]
    assert "waits for a worker's message queue" in d.summary and "VLLM_HOST_IP" in d.summary


def test_a_head_alone_at_its_store_is_a_worker_that_never_joined(tmp_path):
    from sparkdeploy.engines import diagnose as dx

    model = tmp_path / "m"
    model.mkdir()
    p = _rank(0, 2, _free_port(), _free_port(), model, {"SPARKDEPLOY_STANDIN_DIST_TIMEOUT_S": "1"}, tmp_path)
    assert p.wait(timeout=20) == 1
    d = dx.classify({"head": log_of(tmp_path, 0).splitlines()})
    assert d.cls == "worker-never-joined" and "store on --master-addr:--master-port timed out" in d.summary
    assert "1/2 clients joined" in d.evidence[-1].text
    # still waiting (the store's timeout not reached): the head's log stops at its init line
    waiting = [ln for ln in log_of(tmp_path, 0).splitlines() if "DistStoreError" not in ln]
    d = dx.classify({"head": waiting})
    assert d.cls == "worker-never-joined" and "waits for a worker at its store" in d.summary
    assert "distributed_init_method=tcp://127.0.0.1:" in d.evidence[-1].text


def test_a_served_pair_and_a_single_node_leader_are_not_that(ranks):
    from sparkdeploy.engines import diagnose as dx

    start, tmp = ranks
    port = start(LINK, LINK)
    assert _health(port) == 200
    assert dx.classify(_logs(tmp)).cls == "unknown"
    one = ["(EngineCore_DP0 pid=7) INFO 12-04 05:01:03 [multiproc_executor.py:131] DP group leader: "
           "node_rank=0, node_rank_within_dp=0, master_addr=127.0.0.1, mq_connect_ip=10.0.0.1 (local), "
           "world_size=2, local_world_size=2",
           "(Worker pid=9) INFO 12-04 05:02:03 [gpu_model_runner.py:2370] Model loading took 60.1 GiB memory "
           "and 70.2 seconds"]
    assert dx.classify({"one-node": one}).cls != "worker-never-joined"  # both ranks on the node
