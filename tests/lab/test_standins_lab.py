"""The lab behaves like two Sparks for the serving steps: `docker run --gpus all` works, the RoCE
devices and their GID tables are readable on the nodes and in GPU containers, and SGLang's ranks
meet over the fast link: they serve when each advertises its fast-link address (SGLANG_HOST_IP),
and hang like the real thing when one does not, or when `lab.fault sglang-hang` is set."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import requests

from sparkdeploy.lab import faults
from sparkdeploy.node.deployment import load
from sparkdeploy.steps import ship

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[2]
SGLANG = "scitrera/dgx-spark-sglang:0.5.10rc0"
VLLM = "hellohal2064/vllm-qwen3.5-gb10"
BASE = "sparkdeploy-lab/base:bookworm"
MODEL = "/srv/models/sd-test-standins"
PORT, DIST = 30123, 20123
NAME = "sd-test-sglang"
LAST = "CustomAllreduce is disabled because this process group spans across nodes."
HCAS = "rocep1s0f0,roceP2p1s0f0"


def test_gpus_all_is_accepted_and_the_container_sees_nvidia_smi_and_roce(lab):
    for node, v2 in zip(lab.nodes[:2], ("3", "5"), strict=True):
        cp = lab.ssh(node, ["docker", "run", "--rm", "--gpus", "all", BASE, "sh", "-c",
                            "nvidia-smi -L; cat /sys/class/infiniband/rocep1s0f0/ports/1/gid_attrs/types/"
                            + v2 + " /sys/class/infiniband/rocep1s0f0/ports/1/gids/" + v2])
        lines = cp.stdout.strip().splitlines()
        assert lines[0].startswith("GPU 0: NVIDIA GB10 (UUID: GPU-"), cp.stdout
        ip = lab.addr(node).split(".")
        assert lines[1:] == ["RoCE v2", f"0000:0000:0000:0000:0000:ffff:{int(ip[0]) << 8 | int(ip[1]):04x}:"
                                        f"{int(ip[2]) << 8 | int(ip[3]):04x}"]
    # a device the node lacks: refused like the real runtime, the container never starts
    bad = lab.ssh(lab.nodes[0], ["docker", "run", "--rm", "--gpus", "device=3", BASE, "true"], check=False)
    assert bad.returncode != 0 and "unknown device" in bad.stderr
    # no GPU asked: no stand-in mounts
    plain = lab.ssh(lab.nodes[0], ["docker", "run", "--rm", BASE, "sh", "-c",
                                   "ls /sys/class/infiniband 2>&1; command -v nvidia-smi || echo none"], check=False)
    assert "No such file" in plain.stdout and plain.stdout.strip().endswith("none")


def test_gid_tables_on_the_nodes_put_roce_v2_ipv4_at_3_and_5(lab):
    script = ("for i in 0 1 2 3 4 5; do printf '%s %s\\n' \"$(cat types/$i)\" \"$(cat gids/$i)\"; done")
    for node, want in zip(lab.nodes[:2], (3, 5), strict=True):
        for hca in HCAS.split(","):
            out = lab.ssh(node, f"cd /sys/class/infiniband/{hca}/ports/1/gid_attrs/.. && "
                                f"cat state && {script.replace('types/', 'gid_attrs/types/')}").stdout
            rows = out.strip().splitlines()
            assert rows[0] == "4: ACTIVE"
            v2_ipv4 = [i for i, r in enumerate(rows[1:]) if r.startswith("RoCE v2 0000:0000:0000:0000:0000:ffff:")]
            assert v2_ipv4 == [want], out


@pytest.fixture(scope="module")
def sglang(lab, tmp_path_factory):
    """The SGLang image on both nodes and a small model directory on each."""
    dep = load(REPO / "configs" / "lab.yaml", tmp_path_factory.mktemp("state"))
    worker = lab.nodes[1]
    had = lab.ssh(worker, ["docker", "image", "inspect", SGLANG], check=False).returncode == 0
    if not had:
        [r] = ship.ship(dep, worker, SGLANG)
        assert not r.failed, r.why
    for node in lab.nodes[:2]:
        lab.ssh(node, f"mkdir -p {MODEL} && echo '{{}}' > {MODEL}/config.json && "
                      f"head -c 3000000 /dev/zero > {MODEL}/model-00001-of-00002.safetensors && "
                      f"head -c 3000000 /dev/zero > {MODEL}/model-00002-of-00002.safetensors")
    yield lab
    for node in lab.nodes[:2]:
        lab.ssh(node, ["docker", "rm", "-f", NAME], check=False)
        lab.ssh(node, ["rm", "-rf", MODEL], check=False)
    if not had:
        lab.ssh(worker, ["docker", "image", "rm", SGLANG], check=False)
    faults.set_fault("none")


def start(lab, advertise: bool):
    head_ip = lab.addr(lab.nodes[0])
    for rank, node in enumerate(lab.nodes[:2]):
        lab.ssh(node, ["docker", "rm", "-f", NAME], check=False)
        env = {"NCCL_SOCKET_IFNAME": "enp1s0f0np0", "GLOO_SOCKET_IFNAME": "enp1s0f0np0",
               "NCCL_IB_HCA": HCAS, "NCCL_IB_DISABLE": "0", "MASTER_ADDR": head_ip}
        if advertise:
            env["SGLANG_HOST_IP"] = lab.addr(node)
        flags = [f"--env={k}={v}" for k, v in env.items()]
        lab.ssh(node, ["docker", "run", "-d", "--name", NAME, "--network=host", "--ipc=host", "--gpus=all",
                       f"--volume={MODEL}:/model:ro", *flags, SGLANG,
                       "python3", "-m", "sglang.launch_server", "--model-path", "/model",
                       "--served-model-name", "Qwen/Qwen3.5-122B-A10B-FP8", "--tp-size", "2", "--nnodes", "2",
                       "--node-rank", str(rank), "--dist-init-addr", f"{head_ip}:{DIST}",
                       "--host", "0.0.0.0", "--port", str(PORT), "--trust-remote-code"])


def logs(lab, node) -> str:
    cp = lab.ssh(node, ["docker", "logs", NAME], check=False)
    return cp.stdout + cp.stderr


def wait_for_line(lab, text, seconds=60):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = [logs(lab, n) for n in lab.nodes[:2]]
        if all(text in g for g in got):
            return got
        time.sleep(1)
    pytest.fail(f"{text!r} not in every node's log:\n" + "\n---\n".join(g[-1500:] for g in got))


def assert_hangs_like_the_real_thing(lab):
    wait_for_line(lab, LAST)
    time.sleep(3)
    before = [logs(lab, n) for n in lab.nodes[:2]]
    time.sleep(5)
    after = [logs(lab, n) for n in lab.nodes[:2]]
    assert before == after  # silence: no periodic lines
    for text in after:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        assert lines[-1].endswith(LAST)
        assert "NET/IB : Using [0]rocep1s0f0:1/RoCE [1]roceP2p1s0f0:1/RoCE [RO]; OOB enp1s0f0np0:" in text
        assert "Init torch distributed ends" not in text
    for node in lab.nodes[:2]:
        running = lab.ssh(node, ["docker", "inspect", "-f", "{{.State.Running}}", NAME]).stdout.strip()
        assert running == "true"


def test_sglang_refuses_a_flag_its_version_lacks_as_its_parser_does(sglang):
    lab = sglang
    cp = lab.ssh(lab.nodes[0], ["docker", "run", "--rm", "--network=host", f"--volume={MODEL}:/model:ro",
                                SGLANG, "python3", "-m", "sglang.launch_server", "--model-path",
                                "/model", "--mem-fraction-statik", "0.8"], check=False)
    assert cp.returncode == 2, cp.stdout + cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert lines[0].startswith("usage: sglang serve ")
    assert lines[-1] == "sglang serve: error: unrecognized arguments: --mem-fraction-statik 0.8"


def test_vllm_refuses_a_flag_its_version_lacks_as_its_parser_does(sglang):
    """The lab's vLLM image (vLLM 0.17.1's parser, from its manifest): exit 2, argparse's line."""
    lab = sglang
    cp = lab.ssh(lab.nodes[0], ["docker", "run", "--rm", "--network=host", f"--volume={MODEL}:/model:ro",
                                VLLM, "vllm", "serve", "/model", "--gpu-memory-utilisation", "0.8"],
                 check=False)
    assert cp.returncode == 2, cp.stdout + cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert lines[0].startswith("usage: vllm serve ")
    assert lines[-1] == "vllm serve: error: unrecognized arguments: --gpu-memory-utilisation 0.8"


def test_sglang_with_sglang_host_ip_serves_and_streams(sglang):
    lab = sglang
    start(lab, advertise=True)
    wait_for_line(lab, "Init torch distributed ends", 90)
    url = f"http://{lab.addr(lab.nodes[0], 'mgmt')}:{PORT}"
    http = requests.Session()
    http.trust_env = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if http.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    else:
        pytest.fail(logs(lab, lab.nodes[0])[-2000:])
    models = http.get(f"{url}/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == ["Qwen/Qwen3.5-122B-A10B-FP8"]
    body = {"model": "Qwen/Qwen3.5-122B-A10B-FP8", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6, "stream": True}
    with http.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        events = [ln[6:] for ln in r.iter_lines(decode_unicode=True) if ln.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 1 + 6 + 1
    head_log = logs(lab, lab.nodes[0])
    assert "Load weight end." in head_log and "mem usage=0.01 GB." in head_log  # 6 MB read
    # the engine holds the GPU: nvidia-smi on each node lists the container's process
    for node in lab.nodes[:2]:
        apps = lab.ssh(node, ["nvidia-smi", "--query-compute-apps=pid,process_name", "--format=csv,noheader"]).stdout
        assert "python3" in apps, (node, apps)


def test_sglang_without_sglang_host_ip_hangs(sglang):
    start(sglang, advertise=False)
    assert_hangs_like_the_real_thing(sglang)
    head = logs(sglang, sglang.nodes[0])
    assert f"Bootstrap: Using enp1s0f0np0:{sglang.addr(sglang.nodes[0])}<0>" in head


def test_sglang_hangs_under_the_lab_fault_even_when_all_is_right(sglang):
    [r] = faults.set_fault("sglang-hang")
    assert not r.failed
    try:
        start(sglang, advertise=True)
        assert_hangs_like_the_real_thing(sglang)
    finally:
        faults.set_fault("none")
    for node in sglang.nodes[:2]:
        sglang.ssh(node, ["docker", "rm", "-f", NAME], check=False)
    assert json.loads((faults.view_dir(sglang.nodes[1]) / "faults.json").read_text()) == {"faults": []}
