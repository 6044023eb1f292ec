"""The exact containers both engines start, for the seed's profile and a three-node profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sparkdeploy.core.fingerprint import digest, key_digests
from sparkdeploy.core.labels import engine_fingerprint
from sparkdeploy.engines import NodeFacts, launch
from sparkdeploy.engines.base import EngineError, apply_overrides, merge_args, run_args
from sparkdeploy.profile.config import load_profile
from tests.unit.profiles import SEED, seed_data

REPO = Path(__file__).resolve().parents[2]
MODEL = "/srv/models/Qwen3.5-122B-A10B-FP8"
REPO_ID = "Qwen/Qwen3.5-122B-A10B-FP8"
FACTS = {"spark1": NodeFacts(gid_index=3, rdma_devices=True),
         "spark2": NodeFacts(gid_index=5, rdma_devices=True),
         "spark3": NodeFacts(gid_index=7, rdma_devices=False)}


def _seed():
    return load_profile(SEED)


def _profile(tmp_path, edit) -> object:
    data = seed_data()
    edit(data["sparkdeploy"])
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(data))
    return load_profile(p)


def _three(tmp_path):
    def edit(d):
        d["nodes"].append({"name": "spark3", "role": "worker", "ssh": "spark3",
                           "link": {"interface": "enp1s0f1np1", "address": "192.168.100.12",
                                    "hcas": ["rocep1s0f1", "roceP2p1s0f1"]}})
        for e in d["engines"]:
            e["tensor_parallel"] = 3
    return _profile(tmp_path, edit)


def link(iface, own_gid, master, hcas="rocep1s0f0,roceP2p1s0f0"):
    env = [("NCCL_SOCKET_IFNAME", iface), ("GLOO_SOCKET_IFNAME", iface),
           ("TP_SOCKET_IFNAME", iface), ("UCX_NET_DEVICES", iface),
           ("NCCL_IB_HCA", hcas), ("NCCL_IB_DISABLE", "0")]
    if own_gid is not None:
        env.append(("NCCL_IB_GID_INDEX", str(own_gid)))
    return [*env, ("MASTER_ADDR", master)]


def label_args(p, eng, role, rank):
    """The labels every engine container carries, in run_args' order (by key)."""
    fp = engine_fingerprint(p, eng)
    return [f"--label=org.sparkdeploy.deployment={p.name}",
            f"--label=org.sparkdeploy.engine={eng.name}",
            f"--label=org.sparkdeploy.engine.kind={eng.kind}",
            f"--label=org.sparkdeploy.fingerprint={digest(fp)}",
            "--label=org.sparkdeploy.fingerprint.keys="
            + json.dumps(key_digests(fp), separators=(",", ":")),
            f"--label=org.sparkdeploy.port={eng.port}",
            f"--label=org.sparkdeploy.rank={rank}",
            *([f"--label=org.sparkdeploy.recipe={p.recipe}"] if p.recipe else []),
            f"--label=org.sparkdeploy.role={role}"]


def common(name, role, rank, p, eng, rdma=True):
    return ["run", "--detach", f"--name={name}", *label_args(p, eng, role, rank),
            "--network=host", "--ipc=host", "--ulimit=memlock=-1", "--ulimit=stack=67108864",
            "--gpus=all", *(["--device=/dev/infiniband"] if rdma else []),
            f"--volume={MODEL}:{MODEL}:ro"]


SGLANG_ARGS = ["--trust-remote-code", "--mem-fraction-static", "0.85", "--context-length", "32768",
               "--enable-metrics"]
VLLM_ARGS = ["--distributed-executor-backend", "ray", "--gpu-memory-utilization", "0.85",
             "--max-model-len", "32768", "--trust-remote-code"]


def sglang_argv(rank, nnodes, tp, head="192.168.100.10"):
    return ["python3", "-m", "sglang.launch_server", "--model-path", MODEL, "--served-model-name",
            REPO_ID, "--tp-size", str(tp), "--nnodes", str(nnodes), "--node-rank", str(rank),
            "--dist-init-addr", f"{head}:20000", "--host", "0.0.0.0", "--port", "30000",
            *SGLANG_ARGS]


def envs(pairs):
    return [f"--env={k}={v}" for k, v in pairs]


def test_sglang_seed_profile_exact_argv_and_env():
    p = _seed()
    lau = launch(p, p.engines[0], FACTS)
    assert [(s.wait, [c.name for c in s.containers]) for s in lau.stages] == [
        ("dist-port", ["sparkdeploy-sglang-head"]), (None, ["sparkdeploy-sglang-worker"])]
    head, worker = lau.containers
    assert (head.node, head.ports, worker.node, worker.ports) == ("spark1", (30000, 20000), "spark2", ())
    assert run_args(head) == [
        *common("sparkdeploy-sglang-head", "head", 0, p, p.engines[0]),
        *envs([*link("enp1s0f0np0", 3, "192.168.100.10"), ("SGLANG_HOST_IP", "192.168.100.10")]),
        "sparkdeploy/sglang-qwen3.5:latest", *sglang_argv(0, 2, 2)]
    assert run_args(worker) == [
        *common("sparkdeploy-sglang-worker", "worker", 1, p, p.engines[0]),
        *envs([*link("enp1s0f0np0", 5, "192.168.100.10"), ("SGLANG_HOST_IP", "192.168.100.11")]),
        "sparkdeploy/sglang-qwen3.5:latest", *sglang_argv(1, 2, 2)]
    assert lau.wait_port == 20000 and lau.port == 30000 and lau.served_model == REPO_ID


def ray_worker(addr, head="192.168.100.10"):
    return ["ray", "start", "--address", f"{head}:6379", "--node-ip-address", addr, "--num-gpus",
            "1", "--disable-usage-stats", "--block"]


def vllm_serve(tp):
    # the profile's args set --distributed-executor-backend themselves: theirs wins, once
    return ["vllm", "serve", MODEL, "--served-model-name", REPO_ID, "--host", "0.0.0.0", "--port",
            "8000", "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", "1", *VLLM_ARGS]


def test_vllm_ray_seed_profile_exact_argv_and_env():
    p = _seed()
    lau = launch(p, p.engines[1], FACTS)
    assert [(s.wait, [c.name for c in s.containers]) for s in lau.stages] == [
        (None, ["sparkdeploy-vllm-ray-head"]), ("ray-nodes", ["sparkdeploy-vllm-ray-worker"]),
        (None, ["sparkdeploy-vllm-ray-api"])]
    head, worker, api = lau.containers
    ray = [("RAY_memory_monitor_refresh_ms", "0")]
    assert run_args(head) == [
        *common("sparkdeploy-vllm-ray-head", "head", 0, p, p.engines[1]), "--volume=/tmp/ray",
        *envs([*link("enp1s0f0np0", 3, "192.168.100.10"), ("VLLM_HOST_IP", "192.168.100.10"), *ray]),
        "hellohal2064/vllm-qwen3.5-gb10", "ray", "start", "--head", "--port", "6379",
        "--node-ip-address", "192.168.100.10", "--num-gpus", "1", "--disable-usage-stats", "--block"]
    assert run_args(worker) == [
        *common("sparkdeploy-vllm-ray-worker", "worker", 1, p, p.engines[1]),
        *envs([*link("enp1s0f0np0", 5, "192.168.100.10"), ("VLLM_HOST_IP", "192.168.100.11"), *ray]),
        "hellohal2064/vllm-qwen3.5-gb10", *ray_worker("192.168.100.11")]
    assert run_args(api) == [
        *common("sparkdeploy-vllm-ray-api", "api", 0, p, p.engines[1]),
        "--volumes-from=sparkdeploy-vllm-ray-head", "--pid=container:sparkdeploy-vllm-ray-head",
        *envs([*link("enp1s0f0np0", 3, "192.168.100.10"), ("VLLM_HOST_IP", "192.168.100.10"), *ray,
               ("RAY_ADDRESS", "192.168.100.10:6379")]),
        "hellohal2064/vllm-qwen3.5-gb10", *vllm_serve(2)]
    assert (head.ports, worker.ports, api.ports) == ((6379,), (), (8000,))


def test_three_nodes_sglang_ranks_and_own_addresses(tmp_path):
    p = _three(tmp_path)
    lau = launch(p, p.engines[0], FACTS)
    names = [c.name for c in lau.containers]
    assert names == ["sparkdeploy-sglang-head", "sparkdeploy-sglang-worker1",
                     "sparkdeploy-sglang-worker2"]
    w2 = lau.containers[2]
    assert run_args(w2) == [
        *common("sparkdeploy-sglang-worker2", "worker2", 2, p, p.engines[0], rdma=False),
        *envs([*link("enp1s0f1np1", 7, "192.168.100.10", "rocep1s0f1,roceP2p1s0f1"),
               ("SGLANG_HOST_IP", "192.168.100.12")]),
        "sparkdeploy/sglang-qwen3.5:latest", *sglang_argv(2, 3, 3)]
    assert [c.argv[c.argv.index("--node-rank") + 1] for c in lau.containers] == ["0", "1", "2"]
    assert [s.wait for s in lau.stages] == ["dist-port", None]
    assert [c.name for c in lau.stages[1].containers] == names[1:]


def test_three_nodes_vllm_ray_one_worker_per_node(tmp_path):
    p = _three(tmp_path)
    lau = launch(p, p.engines[1], FACTS)
    assert [c.name for c in lau.containers] == [
        "sparkdeploy-vllm-ray-head", "sparkdeploy-vllm-ray-worker1", "sparkdeploy-vllm-ray-worker2",
        "sparkdeploy-vllm-ray-api"]
    w1, w2 = lau.stages[1].containers
    assert (w1.node, w2.node) == ("spark2", "spark3")
    assert list(w2.argv) == ray_worker("192.168.100.12")
    assert w2.environment["VLLM_HOST_IP"] == "192.168.100.12"
    assert w2.environment["NCCL_SOCKET_IFNAME"] == "enp1s0f1np1"
    assert w2.environment["NCCL_IB_GID_INDEX"] == "7"
    assert list(lau.containers[-1].argv) == vllm_serve(3)


def test_profile_env_overrides_and_null_removes(tmp_path):
    def edit(d):
        d["engines"][0]["env"] = {"SGLANG_HOST_IP": None, "NCCL_IB_GID_INDEX": "5",
                                  "NCCL_DEBUG": "INFO"}
    p = _profile(tmp_path, edit)
    head = launch(p, p.engines[0], FACTS).containers[0]
    env = head.environment
    assert "SGLANG_HOST_IP" not in env
    assert env["NCCL_IB_GID_INDEX"] == "5" and env["NCCL_DEBUG"] == "INFO"
    assert not any(a.startswith("--env=SGLANG_HOST_IP") for a in run_args(head))


def test_no_hcas_disables_ib_and_unknown_gid_is_left_out(tmp_path):
    def edit(d):
        d["nodes"][1]["link"]["hcas"] = []
    p = _profile(tmp_path, edit)
    lau = launch(p, p.engines[0], {"spark1": NodeFacts(gid_index=None)})
    head, worker = lau.containers
    assert "NCCL_IB_GID_INDEX" not in head.environment
    assert head.environment["NCCL_IB_DISABLE"] == "0"
    assert worker.environment["NCCL_IB_DISABLE"] == "1" and "NCCL_IB_HCA" not in worker.environment


def test_api_key_only_through_the_env_file(tmp_path):
    p = _seed()
    lau = launch(p, p.engines[1], FACTS, api_key=True)
    api = lau.containers[-1]
    assert api.secret_env == ("VLLM_API_KEY",)
    args = run_args(api, env_file="/dev/stdin")
    assert "--env-file=/dev/stdin" in args
    assert not any("API_KEY" in a for a in args) and "--api-key" not in args
    assert all(c.secret_env == () for c in lau.containers[:-1])
    sg = launch(p, p.engines[0], FACTS, api_key=True).containers
    assert sg[0].secret_env == ("SPARKDEPLOY_API_KEY",) and sg[1].secret_env == ()
    assert sg[0].argv[:2] == ("python3", "-c") and sg[1].argv[:3] == (
        "python3", "-m", "sglang.launch_server")
    assert "--api-key" not in sg[0].argv + sg[1].argv


def test_sglangs_key_reaches_its_argv_parser_and_no_command_line(tmp_path):
    """The head's launcher run as the image runs it: SGLang's module sees ``--api-key KEY``
    last in sys.argv, while the process's command line (what ps and docker top show) and the
    environment its children inherit hold no key."""
    import subprocess
    import sys

    p = _seed()
    head = launch(p, p.engines[0], FACTS, api_key=True).containers[0]
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "launch_server.py").write_text(
        "import json, os, sys\n"
        "cmdline = open('/proc/self/cmdline', 'rb').read().decode()\n"
        "print(json.dumps([sys.argv[1:], cmdline, os.environ.get('SPARKDEPLOY_API_KEY')]))\n")
    key = "k3y-" + "9e" * 10
    out = subprocess.run([sys.executable, *head.argv[1:]], cwd=tmp_path, capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "SPARKDEPLOY_API_KEY": key},
                         check=True).stdout
    seen, cmdline, env_left = json.loads(out)
    assert seen == [*head.argv[3:], "--api-key", key]
    assert key not in cmdline and env_left is None


def test_single_node_vllm_needs_no_ray(tmp_path):
    def edit(d):
        d["nodes"] = d["nodes"][:1]
        d["services"]["stop"] = {}
        for e in d["engines"]:
            e["tensor_parallel"] = 1
            e["args"] = []
    p = _profile(tmp_path, edit)
    [only] = launch(p, p.engines[1], FACTS).containers
    assert list(only.argv) == ["vllm", "serve", MODEL, "--served-model-name", REPO_ID, "--host",
                               "0.0.0.0", "--port", "8000", "--tensor-parallel-size", "1",
                               "--pipeline-parallel-size", "1", "--distributed-executor-backend", "mp"]
    [sg] = launch(p, p.engines[0], FACTS).containers
    assert "--nnodes" not in sg.argv and "--dist-init-addr" not in sg.argv


def test_bad_image_is_one_line(tmp_path):
    # the profile refuses such an image at load; the engine module still refuses one given to it
    p = _profile(tmp_path, lambda d: None)
    engine = p.engines[0].model_copy(update={"image": "--privileged"})
    with pytest.raises(EngineError, match=r"^engines.sglang.image: '--privileged' is not an image"):
        launch(p, engine, FACTS)


@pytest.mark.parametrize("ours,theirs,want", [
    (["--port", "1", "--x"], ["--port", "2"], ["--x", "--port", "2"]),
    (["--port", "1"], ["--port=2"], ["--port=2"]),
    (["--tp", "2", "--port", "1"], [], ["--tp", "2", "--port", "1"]),
])
def test_merge_args_profile_wins(ours, theirs, want):
    assert merge_args(ours, theirs, {"--port", "--tp"}) == want


def test_apply_overrides():
    assert apply_overrides({"A": "1", "B": "2"}, {"A": None, "C": "3", "B": "x"}) == {"B": "x", "C": "3"}


def test_profile_refuses_bad_env_name_and_engine_name(tmp_path):
    from sparkdeploy.profile.config import ProfileError

    def bad_env(d):
        d["engines"][0]["env"] = {"BAD-NAME": "1"}
    with pytest.raises(ProfileError, match=r"engines\[0\]\.env: 'BAD-NAME' is not an environment"):
        _profile(tmp_path, bad_env)

    def bad_name(d):
        d["engines"][0]["name"] = "--rm"
    with pytest.raises(ProfileError, match=r"engines\[0\]\.name: '--rm' is not a safe name"):
        _profile(tmp_path, bad_name)


@pytest.mark.parametrize("name,secret", [
    ("HF_TOKEN", True), ("HUGGING_FACE_HUB_TOKEN", True), ("OPENAI_API_KEY", True),
    ("S3_ACCESS_KEY", True), ("KEY", True), ("AWS_SECRET_ACCESS_KEY", True),
    ("DB_PASSWORD", True), ("GOOGLE_APPLICATION_CREDENTIALS", True), ("hf_token", True),
    ("NCCL_DEBUG", False), ("NCCL_IB_GID_INDEX", False), ("MASTER_ADDR", False),
    ("KEYBOARD_LAYOUT", False), ("MONKEY_PATCH", False), ("RAY_ADDRESS", False),
    ("SGLANG_MAX_TOKENS", False), ("TOKENIZERS_PARALLELISM", False),
])
def test_which_engine_env_names_are_secrets(name, secret):
    from sparkdeploy.core.redaction import is_secret_name

    assert is_secret_name(name) is secret


# --- 2, 3 and 4 nodes, tensor x pipeline parallel ---------------------------------------------

ADDR = {1: "192.168.100.10", 2: "192.168.100.11", 3: "192.168.100.12", 4: "192.168.100.13"}
GID = {1: 3, 2: 5, 3: 7, 4: 9}


def _n_nodes(tmp_path, n: int, tp: int, pp: int):
    def edit(d):
        for i in range(3, n + 1):
            d["nodes"].append({"name": f"spark{i}", "role": "worker", "ssh": f"spark{i}",
                               "link": {"interface": "enp1s0f0np0", "address": ADDR[i],
                                        "hcas": ["rocep1s0f0", "roceP2p1s0f0"]}})
        for e in d["engines"]:
            e["tensor_parallel"], e["pipeline_parallel"] = tp, pp
    return _profile(tmp_path, edit)


N_FACTS = {f"spark{i}": NodeFacts(gid_index=GID[i], rdma_devices=True) for i in ADDR}
SHAPES = [(2, 2, 1), (2, 1, 2), (3, 3, 1), (3, 1, 3), (4, 4, 1), (4, 2, 2), (4, 1, 4)]


def _role(i: int, n: int) -> str:
    return "head" if i == 1 else "worker" if n == 2 else f"worker{i - 1}"


@pytest.mark.parametrize(("n", "tp", "pp"), SHAPES)
def test_sglang_n_nodes_exact_argv_and_env_of_every_rank(tmp_path, n, tp, pp):
    p = _n_nodes(tmp_path, n, tp, pp)
    lau = launch(p, p.engines[0], N_FACTS)
    want = []
    for i in range(1, n + 1):
        role = _role(i, n)
        want.append([
            *common(f"sparkdeploy-sglang-{role}", role, i - 1, p, p.engines[0]),
            *envs([*link("enp1s0f0np0", GID[i], ADDR[1]), ("SGLANG_HOST_IP", ADDR[i])]),
            "sparkdeploy/sglang-qwen3.5:latest", "python3", "-m", "sglang.launch_server",
            "--model-path", MODEL, "--served-model-name", REPO_ID, "--tp-size", str(tp),
            *(["--pp-size", str(pp)] if pp > 1 else []), "--nnodes", str(n), "--node-rank",
            str(i - 1), "--dist-init-addr", f"{ADDR[1]}:20000", "--host", "0.0.0.0", "--port",
            "30000", *SGLANG_ARGS])
    assert [run_args(c) for c in lau.containers] == want
    assert [c.node for c in lau.containers] == [f"spark{i}" for i in range(1, n + 1)]
    assert [(s.wait, len(s.containers)) for s in lau.stages] == [("dist-port", 1), (None, n - 1)]
    assert [c.ports for c in lau.containers] == [(30000, 20000)] + [()] * (n - 1)


@pytest.mark.parametrize(("n", "tp", "pp"), SHAPES)
def test_vllm_ray_n_nodes_exact_argv_and_env_of_every_container(tmp_path, n, tp, pp):
    p = _n_nodes(tmp_path, n, tp, pp)
    lau = launch(p, p.engines[1], N_FACTS)
    ray = [("RAY_memory_monitor_refresh_ms", "0")]
    image = "hellohal2064/vllm-qwen3.5-gb10"
    want = [[*common("sparkdeploy-vllm-ray-head", "head", 0, p, p.engines[1]), "--volume=/tmp/ray",
             *envs([*link("enp1s0f0np0", 3, ADDR[1]), ("VLLM_HOST_IP", ADDR[1]), *ray]),
             image, "ray", "start", "--head", "--port", "6379", "--node-ip-address", ADDR[1],
             "--num-gpus", "1", "--disable-usage-stats", "--block"]]
    for i in range(2, n + 1):
        role = _role(i, n)
        want.append([*common(f"sparkdeploy-vllm-ray-{role}", role, i - 1, p, p.engines[1]),
                     *envs([*link("enp1s0f0np0", GID[i], ADDR[1]), ("VLLM_HOST_IP", ADDR[i]),
                            *ray]),
                     image, *ray_worker(ADDR[i])])
    want.append([
        *common("sparkdeploy-vllm-ray-api", "api", 0, p, p.engines[1]),
        "--volumes-from=sparkdeploy-vllm-ray-head", "--pid=container:sparkdeploy-vllm-ray-head",
        *envs([*link("enp1s0f0np0", 3, ADDR[1]), ("VLLM_HOST_IP", ADDR[1]), *ray,
               ("RAY_ADDRESS", f"{ADDR[1]}:6379")]),
        image, "vllm", "serve", MODEL, "--served-model-name", REPO_ID, "--host", "0.0.0.0",
        "--port", "8000", "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
        *VLLM_ARGS])
    assert [run_args(c) for c in lau.containers] == want
    assert [(s.wait, len(s.containers)) for s in lau.stages] == [
        (None, 1), ("ray-nodes", n - 1), (None, 1)]


@pytest.mark.parametrize(("n", "tp", "pp"), [(3, 2, 1), (3, 2, 2), (4, 3, 1), (4, 1, 2)])
def test_n_nodes_product_other_than_the_gpus_is_refused(tmp_path, n, tp, pp):
    from sparkdeploy.profile.config import ProfileError

    with pytest.raises(ProfileError, match=rf"tensor_parallel x pipeline_parallel = {tp * pp}, "
                                           rf"but the nodes declare {n} GPUs"):
        _n_nodes(tmp_path, n, tp, pp)
