"""Lab part 2, item 3: the community images on spark1 (real engine files, stand-in engines)."""

from __future__ import annotations

import json
import subprocess

import pytest

from sparkdeploy.core.outcomes import Status
from sparkdeploy.core.packaged import helper
from sparkdeploy.lab import images, layout
from sparkdeploy.lab.dockerd import docker

pytestmark = pytest.mark.lab

PROBE = helper("probe_image.py")
TAGS = {
    "lmsysorg/sglang:spark": "lmsysorg/sglang:spark",
    "scitrera/dgx-spark-sglang:0.5.10rc0": "scitrera/dgx-spark-sglang:0.5.10rc0",
    "hellohal2064/vllm-qwen3.5-gb10": "hellohal2064/vllm-qwen3.5-gb10:latest",
}
MODEL_CONFIG = {
    "model_type": "qwen3_5_moe",
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "text_config": {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 48},
}
SGLANG_FILES = ["sglang/srt/models/qwen3_5.py", "sglang/srt/models/qwen3_5_mtp.py"]
VLLM_FILES = ["vllm/model_executor/models/qwen3_5.py", "vllm/model_executor/models/qwen3_5_mtp.py"]


@pytest.fixture(scope="module")
def head_images(lab):
    """What lab.up leaves on the head; building here is a no-op when lab.up already did it."""
    head = lab.nodes[0]
    results = images.build_community_images(f"unix://{layout.docker_socket(head)}",
                                            layout.BASE_IMAGE, node=head)
    bad = [r.why for r in results if r.failed]
    assert not bad, bad
    return head, results


def tags_on(lab, node: str) -> set[str]:
    out = lab.ssh(node, ["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"]).stdout
    return set(out.split())


def probe(node: str, image: str, *args: str) -> dict:
    """Run helpers/probe_image.py under the image's python3 (no network, the model's config
    written inside the container)."""
    shell = ("mkdir -p /tmp/model && printf '%s' \"$CFG\" > /tmp/model/config.json && "
             "exec python3 - \"$@\"")
    cp = subprocess.run(
        docker(node, "run", "-i", "--rm", "--network", "none", "-e",
               f"CFG={json.dumps(MODEL_CONFIG)}", image, "sh", "-c", shell, "probe", *args),
        input=PROBE.read_text(), capture_output=True, text=True, timeout=180)
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


def test_head_holds_the_three_images_and_the_worker_none(lab, head_images):
    head, _ = head_images
    assert set(TAGS.values()) <= tags_on(lab, head)
    for worker in lab.nodes[1:]:
        assert not set(TAGS.values()) & tags_on(lab, worker)


def test_each_image_is_labelled_a_lab_standin_with_its_recipe(lab, head_images):
    head, results = head_images
    for r in results:
        out = lab.ssh(head, ["docker", "image", "inspect", "--format", "{{json .Config.Labels}}",
                             r.details["image"]]).stdout
        labels = json.loads(out)
        assert labels[layout.STANDIN_LABEL] == "true"
        assert labels[images.RECIPE_LABEL] == r.details["recipe"]


def test_building_again_is_ok_without_a_build(head_images):
    head, first = head_images
    again = images.build_community_images(f"unix://{layout.docker_socket(head)}",
                                          layout.BASE_IMAGE, node=head)
    assert [r.status for r in again] == [Status.OK] * len(images.COMMUNITY_IMAGES)
    assert [r.details["recipe"] for r in again] == [r.details["recipe"] for r in first]


def test_probe_reads_the_seed_versions_files_and_config_error(head_images):
    head, _ = head_images
    files = [f"--model-file=sglang={f}" for f in SGLANG_FILES]
    files += [f"--model-file=vllm={f}" for f in VLLM_FILES]
    args = ["--model-dir", "/tmp/model", *files, "--require-config", "sglang"]

    old = probe(head, "lmsysorg/sglang:spark", *args)
    assert old["packages"]["sglang"] == "0.5.4"
    assert old["packages"]["transformers"] == "4.57.1"
    assert old["packages"]["torch"] is None and old["packages"]["vllm"] is None
    assert old["engines"]["sglang"]["model_files"] == {f: False for f in SGLANG_FILES}
    assert old["config"]["ok"] is False
    assert "does not recognize this architecture" in old["config"]["error"]

    rc0 = probe(head, "scitrera/dgx-spark-sglang:0.5.10rc0", *args)
    assert rc0["packages"]["sglang"] == "0.5.10rc0"
    assert rc0["packages"]["transformers"] == "4.57.1"
    assert rc0["engines"]["sglang"]["model_files"] == {f: True for f in SGLANG_FILES}
    assert rc0["config"]["ok"] is False and rc0["engines"]["sglang"]["ok"] is False

    vl = probe(head, "hellohal2064/vllm-qwen3.5-gb10", *args)
    assert vl["packages"]["vllm"].startswith("0.17.")
    assert vl["packages"]["ray"].startswith("2.")
    assert vl["packages"]["transformers"] == "4.57.1"
    assert vl["packages"]["torch"] is None and vl["packages"]["sglang"] is None
    assert vl["engines"]["vllm"]["model_files"] == {f: True for f in VLLM_FILES}
    assert vl["engines"]["vllm"]["ok"] is True  # vLLM ships its own config classes


def run_in(node: str, image: str, script: str, timeout: float = 120) -> str:
    cp = subprocess.run(docker(node, "run", "--rm", "--network", "none", image, "sh", "-c", script),
                        capture_output=True, text=True, timeout=timeout)
    assert cp.returncode == 0, f"{cp.stdout}\n{cp.stderr}"
    return cp.stdout


MODELS = ('python3 -c "import json, urllib.request; '
          "print(json.load(urllib.request.urlopen('http://127.0.0.1:{port}/v1/models'))"
          "['data'][0]['owned_by'])\"")
WAIT = "for i in $(seq 100); do {check} 2>/dev/null && break; sleep 0.2; done"


def test_sglang_launch_server_runs_the_standin(head_images):
    head, _ = head_images
    for image in ("lmsysorg/sglang:spark", "scitrera/dgx-spark-sglang:0.5.10rc0"):
        check = MODELS.format(port=30000)
        out = run_in(head, image,
                     "python3 -m sglang.launch_server --model-path /models/m --host 127.0.0.1 "
                     "--port 30000 --tp 1 --trust-remote-code >/tmp/log 2>&1 & "
                     + WAIT.format(check=check) + "; " + check)
        assert out.strip().splitlines()[-1] == "sglang"


def test_sglang_two_ranks_hang_when_one_advertises_another_address(head_images):
    head, _ = head_images
    rank = ("NCCL_SOCKET_IFNAME=lo SGLANG_HOST_IP={ip} timeout 8 python3 -m sglang.launch_server "
            "--model-path /tmp/m --tp 2 --nnodes 2 --node-rank {r} --dist-init-addr 127.0.0.1:20000 "
            "--port 30000 >/tmp/r{r}.log 2>&1")
    out = run_in(head, "scitrera/dgx-spark-sglang:0.5.10rc0",
                 "mkdir -p /tmp/m && echo '{}' >/tmp/m/config.json; "
                 + rank.format(ip="127.0.0.1", r=0) + " & "
                 + rank.format(ip="10.9.9.9", r=1) + "; echo rc=$?; wait; tail -n 1 /tmp/r0.log")
    lines = out.strip().splitlines()
    assert "rc=124" in lines
    assert lines[-1].endswith("CustomAllreduce is disabled because this process group spans across nodes.")


def test_vllm_serve_runs_the_standin_and_checks_the_real_ray_cluster(head_images):
    head, _ = head_images
    check = MODELS.format(port=8000)
    out = run_in(head, "hellohal2064/vllm-qwen3.5-gb10",
                 "ray start --head --port 6379 --node-ip-address 127.0.0.1 --num-gpus 1 "
                 "--disable-usage-stats >/dev/null 2>&1 || exit 3; export VLLM_HOST_IP=127.0.0.1; "
                 "SPARKDEPLOY_STANDIN_PG_TIMEOUT_S=5 vllm serve /models/m --tensor-parallel-size 2 "
                 "--distributed-executor-backend ray --port 8000 2>&1; echo rc=$?; "
                 "vllm serve /models/m --tensor-parallel-size 1 --distributed-executor-backend ray "
                 "--port 8000 >/tmp/log 2>&1 & " + WAIT.format(check=check) + "; " + check,
                 timeout=180)
    lines = out.strip().splitlines()
    # two GPUs asked of a one-GPU cluster: Ray cannot place the group, vLLM waits and gives up
    assert "Tensor parallel size (2) exceeds available GPUs (1)" in out
    assert ("Waiting for creating a placement group of specs for 10 seconds. "
            "specs=[{'node:127.0.0.1': 0.001, 'GPU': 1.0}, {'GPU': 1.0}]") in out
    assert "Cannot provide a placement group of placement_group_specs=" in out
    assert "rc=1" in lines and lines[-1] == "vllm"


JUDGE = ('python3 -c "import sys; sys.path.insert(0, \'/opt/standin\'); import engine_server as e; '
         "print(e.unsupported_arch(sys.argv[1], \'/tmp/m\'))\" {engine}")
"""The stand-in's verdict on /tmp/m's architectures, from the image's own engine files."""


def _with_config(archs: list[str]) -> str:
    return ("mkdir -p /tmp/m && printf '%s' '" + json.dumps({"architectures": archs})
            + "' > /tmp/m/config.json; ")


def test_the_standins_refuse_an_architecture_the_images_engine_lacks_as_the_engine_does(head_images):
    head, _ = head_images
    # SGLang 0.5.4 predates Qwen3.5 (no qwen3_5.py): refused, naming what its files register
    out = run_in(head, "lmsysorg/sglang:spark",
                 _with_config(MODEL_CONFIG["architectures"])
                 + "python3 -m sglang.launch_server --model-path /tmp/m --port 30000 2>&1; echo rc=$?")
    lines = out.strip().splitlines()
    assert lines[-1] == "rc=1", out[-2000:]
    said = next(ln for ln in lines if ln.startswith("ValueError: Model architectures"))
    assert said.startswith("ValueError: Model architectures ['Qwen3_5MoeForConditionalGeneration'] "
                           "are not supported for now. Supported architectures: dict_keys([")
    assert "'Qwen3MoeForCausalLM'" in said and "'LlamaForCausalLM'" in said
    # the images the seed's rules choose register it: not refused there
    for image, engine in (("scitrera/dgx-spark-sglang:0.5.10rc0", "sglang"),
                          ("hellohal2064/vllm-qwen3.5-gb10", "vllm")):
        got = run_in(head, image, _with_config(MODEL_CONFIG["architectures"])
                     + JUDGE.format(engine=engine))
        assert got.strip().splitlines()[-1] == "None", (image, got[-2000:])
    # vLLM 0.17.1: an architecture it has no file for, refused in its pydantic wrapping, exit 1
    out = run_in(head, "hellohal2064/vllm-qwen3.5-gb10",
                 _with_config(["NoSuchModelForCausalLM"]) + "vllm serve /tmp/m 2>&1; echo rc=$?")
    lines = out.strip().splitlines()
    assert lines[-1] == "rc=1", out[-2000:]
    assert "  Value error, Model architectures ['NoSuchModelForCausalLM'] are not supported for now." \
        in "\n".join(lines), out[-2000:]
