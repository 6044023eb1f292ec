"""Lab part 1: the simulated nodes have their own network, files, SSH and dockerd."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from sparkdeploy.core.outcomes import Status
from sparkdeploy.lab import layout, lifecycle
from sparkdeploy.profile.config import load_profile

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[2]
GLM_UNITS = ["vllm-cluster.service", "vllm-proxy.service", "vllm-embeddings.service",
             "vllm-reranker.service"]


def test_controller_reaches_every_node_on_its_management_address(lab):
    for node in lab.nodes:
        out = lab.ssh(node, 'echo "$SSH_CONNECTION"').stdout.split()
        assert out[0] == lab.state["controller"]
        assert out[2] == lab.addr(node, "mgmt")


def test_head_reaches_worker_over_the_fast_link_with_its_own_key(lab):
    head, worker = lab.nodes[0], lab.nodes[1]
    # the head's own ssh client, config and key (its private /root/.ssh), host key checked
    out = lab.ssh(head, ["ssh", "-o", "BatchMode=yes", worker, 'echo "$SSH_CONNECTION"'])
    client, _, server, port = out.stdout.split()
    assert (client, server, port) == (lab.addr(head), lab.addr(worker), "22")


def test_fast_link_is_named_like_a_spark_with_jumbo_frames(lab):
    profile = load_profile(REPO / "configs" / "lab.yaml")
    for n in profile.nodes:
        link = json.loads(lab.ssh(n.name, ["ip", "-j", "addr", "show", n.link.interface]).stdout)
        assert link[0]["mtu"] == 9000
        assert n.link.address in [a["local"] for a in link[0]["addr_info"]]
        assert n.link.address == lab.addr(n.name)


def test_nodes_default_route_leads_nowhere(lab):
    # a Spark has a default route (LAN or Wi-Fi) and the engines take its source address; the
    # lab's goes via the management /24's last address, which no one holds: nothing leaves
    mgmt = ipaddress.ip_network(lab.state["mgmt_net"])
    gateway = str(mgmt[-2])
    held = {lab.state["controller"]} | {lab.state["node"][n]["mgmt_addr"] for n in lab.nodes}
    assert gateway not in held
    for node in lab.nodes:
        routes = json.loads(lab.ssh(node, ["ip", "-j", "route"]).stdout)
        default = [r for r in routes if r["dst"] == "default"]
        assert [(r["gateway"], r["dev"]) for r in default] == [(gateway, layout.MGMT_IF)]
        # an address outside the lab is unreachable: the next hop never answers ARP
        probe = lab.ssh(node, ["python3", "-c",
                               "import socket; socket.create_connection(('192.0.2.1', 80), 5)"],
                        check=False)
        assert probe.returncode != 0
        assert "Errno" in probe.stderr or "timed out" in probe.stderr


def test_each_dockerd_runs_the_base_image_with_its_own_model_dir(lab):
    for node in lab.nodes:
        marker = f"{node}-{uuid.uuid4().hex}"
        lab.ssh(node, f"echo {marker} > {layout.MODEL_DIR}/.lab-marker")
        out = lab.ssh(node, ["docker", "run", "--rm", "--network", "host", "-v",
                             f"{layout.MODEL_DIR}:/models", layout.BASE_IMAGE,
                             "cat", "/models/.lab-marker"])
        assert out.stdout.strip() == marker
        labels = lab.ssh(node, ["docker", "image", "inspect", "--format",
                                "{{json .Config.Labels}}", layout.BASE_IMAGE]).stdout
        assert json.loads(labels)[layout.STANDIN_LABEL] == "true"


def test_a_file_in_the_heads_model_dir_is_absent_on_the_worker(lab):
    name = f"only-on-head-{uuid.uuid4().hex}"
    lab.ssh(lab.nodes[0], f"touch {layout.MODEL_DIR}/{name}")
    assert lab.ssh(lab.nodes[0], ["test", "-e", f"{layout.MODEL_DIR}/{name}"],
                   check=False).returncode == 0
    assert lab.ssh(lab.nodes[1], ["test", "-e", f"{layout.MODEL_DIR}/{name}"],
                   check=False).returncode == 1
    assert not (Path(layout.MODEL_DIR) / name).exists()  # nor on the controller


def test_each_node_talks_to_its_own_dockerd(lab):
    ids = set()
    for node in lab.nodes:
        info = json.loads(lab.ssh(node, ["docker", "info", "--format", "{{json .}}"]).stdout)
        assert info["ServerVersion"].startswith("26.")
        ids.add(info["ID"])
        assert lab.ssh(node, 'echo "$DOCKER_HOST"').stdout.strip() == \
            f"unix://{layout.docker_socket(node)}"
    assert len(ids) == len(lab.nodes)


def test_nvidia_smi_stand_in_answers_like_a_gb10(lab):
    out = lab.ssh(lab.nodes[0], ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    assert out.stdout.strip() == "NVIDIA GB10"


def test_the_glm_units_run_on_the_head_and_hold_its_gpu(lab):
    out = lab.ssh(lab.nodes[0], ["systemctl", "is-active", *GLM_UNITS])
    assert out.stdout.split() == ["active"] * 4
    apps = lab.ssh(lab.nodes[0], ["nvidia-smi", "--query-compute-apps=pid,process_name",
                                  "--format=csv,noheader"]).stdout
    assert apps.strip() != ""
    assert lab.ssh(lab.nodes[1], ["systemctl", "list-units", "vllm-*"],
                   check=False).stdout.count("vllm-") == 0


def test_lab_up_again_changes_nothing(lab):
    results = lifecycle.up(nodes=len(lab.nodes), flavor=lab.state["dockerd"])
    assert [(r.step, r.node, r.why) for r in results if r.status is not Status.OK] == []


def test_status_shows_every_node_its_daemons_and_images(lab):
    results = lifecycle.status()
    assert not [r for r in results if r.failed]
    for node in lab.nodes:
        steps = {r.step: r for r in results if r.node == node}
        assert {"node", "sshd", "dockerd", "images"} <= set(steps)
        assert any(i.startswith(layout.BASE_IMAGE) for i in steps["images"].details["images"])


def _inv(*args: str, state_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "INVOKE_SPARKDEPLOY_PROFILE": "configs/lab.yaml",
           "INVOKE_SPARKDEPLOY_STATE_DIR": str(state_dir)}
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_services_stop_frees_the_heads_gpu_and_restore_brings_the_units_back(lab, tmp_path):
    head = lab.nodes[0]
    gpu = ["nvidia-smi", "--query-compute-apps=pid,process_name", "--format=csv,noheader"]
    assert lab.ssh(head, gpu).stdout.strip() != ""  # busy: the GLM cluster holds it
    stop = _inv("services.stop", state_dir=tmp_path)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    try:
        assert lab.ssh(head, gpu).stdout.strip() == ""
        out = lab.ssh(head, ["systemctl", "is-active", *GLM_UNITS], check=False)
        assert out.stdout.split() == ["inactive"] * 4
    finally:
        restore = _inv("services.restore", state_dir=tmp_path)
    assert restore.returncode == 0, restore.stdout + restore.stderr
    assert lab.ssh(head, ["systemctl", "is-active", *GLM_UNITS]).stdout.split() == ["active"] * 4
    assert lab.ssh(head, gpu).stdout.strip() != ""


def test_lab_up_restarts_daemons_that_died(lab):
    from sparkdeploy.lab import proc
    from sparkdeploy.lab import state as lab_state

    node = lab.nodes[-1]
    procs = lab_state.load()["nodes"][node]["procs"]
    assert proc.stop(procs["sshd"]) and proc.stop(procs["dockerd"])
    assert lab.ssh(node, "true", check=False).returncode == 255
    results = lifecycle.up(nodes=len(lab.nodes), flavor=lab.state["dockerd"])
    redone = {(r.step, r.node) for r in results if r.status is Status.CHANGED}
    assert {("sshd", node), ("dockerd", node)} <= redone
    assert not [r for r in results if r.failed]
    assert lab.ssh(node, ["docker", "image", "inspect", layout.BASE_IMAGE]).returncode == 0
