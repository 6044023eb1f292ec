"""Lab part 2: a real two-node Ray cluster across spark1 and spark2 (containers with host
networking, one declared GPU each, over the fast link), and the vLLM stand-in with tensor
parallel 2 on it serving a streamed chat completion to the controller."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import requests

from sparkdeploy.node.deployment import load
from sparkdeploy.steps import ship

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[2]
VLLM = "hellohal2064/vllm-qwen3.5-gb10"
PORT = 8123


@pytest.fixture(scope="module")
def cluster(lab, tmp_path_factory):
    dep = load(REPO / "configs" / "lab.yaml", tmp_path_factory.mktemp("state"))
    [shipped] = ship.ship(dep, "spark2", VLLM)
    assert not shipped.failed, shipped.why
    head, worker = lab.nodes[0], lab.nodes[1]
    head_ip, worker_ip = lab.addr(head), lab.addr(worker)
    env = ["-e", "RAY_USAGE_STATS_ENABLED=0", "-e", "RAY_memory_monitor_refresh_ms=0"]
    run = ["docker", "run", "-d", "--network", "host", "--ipc", "host", "--shm-size", "1g", "--gpus", "all", *env]
    names = {head: "sd-test-ray-head", worker: "sd-test-ray-worker"}
    for node, name in names.items():
        lab.ssh(node, ["docker", "rm", "-f", name], check=False)
    lab.ssh(head, [*run, "--name", names[head], VLLM, "ray", "start", "--head", "--port", "6379",
                   "--node-ip-address", head_ip, "--num-gpus", "1", "--block"])
    lab.ssh(worker, [*run, "--name", names[worker], VLLM, "ray", "start", "--address",
                     f"{head_ip}:6379", "--node-ip-address", worker_ip, "--num-gpus", "1", "--block"])
    yield lab, head, names
    for node, name in names.items():
        lab.ssh(node, ["docker", "rm", "-f", name], check=False)
    lab.ssh(worker, ["docker", "image", "rm", VLLM], check=False)  # spark2 as lab.up left it


RESOURCES = ("import json, ray; ray.init(address='auto', logging_level='ERROR'); "
             "print(json.dumps({'gpus': ray.cluster_resources().get('GPU', 0), "
             "'nodes': sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])}))")


def test_two_node_ray_cluster_and_vllm_tp2_streams_a_chat_completion(cluster):
    lab, head, names = cluster
    deadline = time.monotonic() + 120
    seen = None
    while time.monotonic() < deadline:
        cp = lab.ssh(head, ["docker", "exec", names[head], "python3", "-c", RESOURCES], check=False)
        if cp.returncode == 0:
            seen = json.loads(cp.stdout.strip().splitlines()[-1])
            if seen["gpus"] >= 2 and len(seen["nodes"]) == 2:
                break
        time.sleep(1)
    assert seen == {"gpus": 2.0, "nodes": sorted([lab.addr(n) for n in lab.nodes[:2]])}, seen

    # without VLLM_HOST_IP vLLM takes the default route's address (the management network's):
    # no Ray node has it, the placement group waits, as on a Spark
    lab.ssh(head, ["docker", "exec", "-d", names[head], "sh", "-c",
                   f"timeout 25 vllm serve /models/m --tensor-parallel-size 2 "
                   f"--distributed-executor-backend ray --host 0.0.0.0 --port {PORT + 1} "
                   f"> /tmp/vllm-noip.log 2>&1"])
    deadline = time.monotonic() + 60
    log = ""
    while time.monotonic() < deadline and "Waiting for creating a placement group" not in log:
        time.sleep(2)
        log = lab.ssh(head, ["docker", "exec", names[head], "cat", "/tmp/vllm-noip.log"], check=False).stdout
    assert (f"Waiting for creating a placement group of specs for 10 seconds. "
            f"specs=[{{'node:{lab.addr(head, 'mgmt')}': 0.001, 'GPU': 1.0}}, {{'GPU': 1.0}}]") in log, log

    lab.ssh(head, ["docker", "exec", "-d", "-e", f"VLLM_HOST_IP={lab.addr(head)}", names[head], "sh", "-c",
                   f"vllm serve /models/m --tensor-parallel-size 2 --distributed-executor-backend ray "
                   f"--host 0.0.0.0 --port {PORT} > /tmp/vllm.log 2>&1"])
    url = f"http://{lab.addr(head, 'mgmt')}:{PORT}"
    http = requests.Session()
    http.trust_env = False  # lab addresses only: never through a proxy
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if http.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    else:
        log = lab.ssh(head, ["docker", "exec", names[head], "cat", "/tmp/vllm.log"], check=False).stdout
        pytest.fail(f"vllm stand-in never served /health:\n{log[-2000:]}")
    body = {"model": "/models/m", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    with http.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        events = [ln[6:] for ln in r.iter_lines(decode_unicode=True) if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    text = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert any(d.get("content") or d.get("reasoning_content") for d in text)
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    # vLLM's GPU workers (one Ray actor per bundle) hold each node's GPU: nvidia-smi lists each
    # Ray container's main process (on the head, where `vllm serve` runs in the same container,
    # under the engine's name)
    for node in lab.nodes[:2]:
        pid = lab.ssh(node, ["docker", "inspect", "-f", "{{.State.Pid}}", names[node]]).stdout.strip()
        apps = lab.ssh(node, ["nvidia-smi", "--query-compute-apps=pid,process_name",
                              "--format=csv,noheader"]).stdout
        want = "VLLM::EngineCore" if node == head else "ray::RayWorkerWrapper"
        assert f"{pid}, {want}" in apps.splitlines(), (node, pid, apps)
