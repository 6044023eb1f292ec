"""vLLM's own multi-node mode (``kind: vllm``, no Ray): the exact containers for 1 to 4 nodes,
and the profile doors between it and vLLM on Ray (``kind: vllm-ray``)."""

from __future__ import annotations

import pytest
import yaml

from sparkdeploy.engines import NodeFacts, launch
from sparkdeploy.engines.base import run_args
from sparkdeploy.profile.config import ProfileError, load_profile
from tests.unit.profiles import seed_data
from tests.unit.test_engines import MODEL, REPO_ID, common, envs, link

IMAGE = "hellohal2064/vllm-qwen3.5-gb10"
ARGS = ["--gpu-memory-utilization", "0.85", "--max-model-len", "32768", "--trust-remote-code"]
ADDRS = ["192.168.100.10", "192.168.100.11", "192.168.100.12", "192.168.100.13"]
IFACES = ["enp1s0f0np0", "enp1s0f0np0", "enp1s0f1np1", "enp1s0f1np1"]
HCAS = ["rocep1s0f0,roceP2p1s0f0", "rocep1s0f0,roceP2p1s0f0", "rocep1s0f1,roceP2p1s0f1",
        "rocep1s0f1,roceP2p1s0f1"]
GIDS = [3, 5, 7, None]
FACTS = {f"spark{i + 1}": NodeFacts(gid_index=g, rdma_devices=i < 2) for i, g in enumerate(GIDS)}


def profile(tmp_path, nodes: int, tp: int, pp: int, edit=None):
    data = seed_data()
    d = data["sparkdeploy"]
    for i in range(2, nodes):
        d["nodes"].append({"name": f"spark{i + 1}", "role": "worker", "ssh": f"spark{i + 1}",
                           "link": {"interface": IFACES[i], "address": ADDRS[i],
                                    "hcas": HCAS[i].split(",")}})
    d["engines"] = [{"name": "vllm", "kind": "vllm", "image": IMAGE, "port": 8000,
                     "dist_port": 29501, "tensor_parallel": tp, "pipeline_parallel": pp,
                     "args": ARGS}]
    if edit:
        edit(d)
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(data))
    return load_profile(p)


def serve(nodes, rank, tp, pp, port="29501"):
    return ["vllm", "serve", MODEL, "--served-model-name", REPO_ID, "--host", "0.0.0.0",
            "--port", "8000", "--tensor-parallel-size", str(tp), "--pipeline-parallel-size",
            str(pp), "--distributed-executor-backend", "mp", "--nnodes", str(nodes),
            "--node-rank", str(rank), "--master-addr", "192.168.100.10", "--master-port", port,
            *(["--headless"] if rank else []), *ARGS]


@pytest.mark.parametrize("nodes,tp,pp", [(2, 2, 1), (3, 1, 3), (4, 2, 2)])
def test_one_container_per_node_head_serves_workers_headless(tmp_path, nodes, tp, pp):
    p = profile(tmp_path, nodes, tp, pp)
    lau = launch(p, p.engines[0], FACTS)
    roles = ["head"] + (["worker"] if nodes == 2 else [f"worker{i}" for i in range(1, nodes)])
    assert [(s.wait, [c.name for c in s.containers]) for s in lau.stages] == [
        ("dist-port", ["sparkdeploy-vllm-head"]),
        ("ranks-joined", [f"sparkdeploy-vllm-{r}" for r in roles[1:]])]
    assert lau.stages[1].joined == r"rank \d+ in world size \d+ is assigned as DP rank"
    assert (lau.head, lau.port, lau.wait_port, lau.served_model) == ("spark1", 8000, 29501, REPO_ID)
    for rank, c in enumerate(lau.containers):
        assert c.node == f"spark{rank + 1}"
        assert run_args(c) == [
            *common(f"sparkdeploy-vllm-{roles[rank]}", roles[rank], rank, p, p.engines[0],
                    rdma=rank < 2),
            *envs([*link(IFACES[rank], GIDS[rank], "192.168.100.10", HCAS[rank]),
                   ("VLLM_HOST_IP", ADDRS[rank])]),
            IMAGE, *serve(nodes, rank, tp, pp)]
        assert c.ports == ((8000, 29501) if rank == 0 else ())
        # no Ray anywhere: no Ray container, no Ray variable, no Ray executor
        assert not [k for k in c.environment if k.startswith("RAY")]
        assert "ray" not in c.argv and c.volumes == () and c.pid_from is None


def test_master_port_defaults_to_vllms_and_the_key_goes_to_the_head_only(tmp_path):
    def edit(d):
        d["engines"][0].pop("dist_port")
    p = profile(tmp_path, 2, 2, 1, edit)
    head, worker = launch(p, p.engines[0], FACTS, api_key=True).containers
    assert list(head.argv) == serve(2, 0, 2, 1, port="29501")
    assert head.secret_env == ("VLLM_API_KEY",) and worker.secret_env == ()
    assert "--api-key" not in head.argv


def test_profile_args_and_env_win(tmp_path):
    def edit(d):
        d["engines"][0]["args"] = ["--master-port=30000", "--enforce-eager"]
        d["engines"][0]["env"] = {"VLLM_HOST_IP": None, "NCCL_DEBUG": "INFO"}
    p = profile(tmp_path, 2, 2, 1, edit)
    head, worker = launch(p, p.engines[0], FACTS).containers
    assert list(worker.argv[-4:]) == ["192.168.100.10", "--headless", "--master-port=30000",
                                      "--enforce-eager"]
    assert "--master-port" not in worker.argv
    assert "VLLM_HOST_IP" not in worker.environment and worker.environment["NCCL_DEBUG"] == "INFO"


def test_one_node_is_plain_vllm_serve(tmp_path):
    def edit(d):
        d["nodes"] = d["nodes"][:1]
        d["services"]["stop"] = {}
    p = profile(tmp_path, 1, 1, 1, edit)
    [only] = launch(p, p.engines[0], FACTS).containers
    assert list(only.argv) == ["vllm", "serve", MODEL, "--served-model-name", REPO_ID, "--host",
                               "0.0.0.0", "--port", "8000", "--tensor-parallel-size", "1",
                               "--pipeline-parallel-size", "1", "--distributed-executor-backend",
                               "mp", *ARGS]


@pytest.mark.parametrize("args", [["--distributed-executor-backend", "ray"],
                                  ["--distributed-executor-backend=ray"]])
def test_kind_vllm_with_a_ray_backend_is_refused_in_one_line(tmp_path, args):
    def edit(d):
        d["engines"][0]["args"] = args
    with pytest.raises(ProfileError) as e:
        profile(tmp_path, 2, 2, 1, edit)
    assert str(e.value).endswith(
        "engines[0]: kind vllm is vLLM's own multi-node mode (no Ray); for "
        "--distributed-executor-backend ray write kind: vllm-ray")
    assert "\n" not in str(e.value)


def test_vllm_ray_keeps_its_ray_backend_and_both_kinds_run_the_vllm_software(tmp_path):
    def edit(d):
        d["engines"][0].update(kind="vllm-ray", args=["--distributed-executor-backend", "ray"])
    p = profile(tmp_path, 2, 2, 1, edit)
    assert p.engines[0].software == "vllm"
    assert [c.name for c in launch(p, p.engines[0], FACTS).containers] == [
        "sparkdeploy-vllm-head", "sparkdeploy-vllm-worker", "sparkdeploy-vllm-api"]
    assert profile(tmp_path, 2, 2, 1).engines[0].software == "vllm"


def test_an_unknown_kind_names_the_three(tmp_path):
    def edit(d):
        d["engines"][0]["kind"] = "ray"
    with pytest.raises(ProfileError, match=r"engines\[0\]\.kind: must be 'sglang', 'vllm' or "
                                           r"'vllm-ray'"):
        profile(tmp_path, 2, 2, 1, edit)
