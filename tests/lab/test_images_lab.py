"""image.probe / image.build / image.ship against the lab's engines and community images."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sparkdeploy.core.outcomes import Status
from sparkdeploy.lab import layout
from sparkdeploy.node.deployment import load
from sparkdeploy.node.nodeops import docker, inspect_image
from sparkdeploy.run import plan as plans
from sparkdeploy.steps import images, ship

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "configs" / "lab.yaml"
SGLANG_OLD = "lmsysorg/sglang:spark"
SGLANG = "scitrera/dgx-spark-sglang:0.5.10rc0"
VLLM = "hellohal2064/vllm-qwen3.5-gb10"
DERIVED = "sparkdeploy/sglang-qwen3.5:latest"


@pytest.fixture(scope="module")
def state(lab, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("state")


def inv(state: Path, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    env = {**os.environ, "INVOKE_SPARKDEPLOY_PROFILE": str(PROFILE),
           "INVOKE_SPARKDEPLOY_STATE_DIR": str(state)}
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def dep(state):
    return load(PROFILE, state)


def forget(dep, node: str, *refs: str) -> None:
    """The node loses ``refs`` and every layer no other tag holds (the lab base image too)."""
    h = dep.host(node)
    h.run(docker(h, "image", "rm", "-f", *refs))
    h.run(docker(h, "image", "prune", "-a", "-f"))


@pytest.fixture(scope="module", autouse=True)
def worker_as_lab_up_left_it(dep):
    """After these tests spark2 holds what lab.up gave it: the lab base image, no community image."""
    yield
    forget(dep, "spark2", DERIVED, SGLANG, VLLM)
    [base] = ship.ship(dep, "spark2", layout.BASE_IMAGE)
    assert not base.failed, base.why


def test_probe_rejects_old_sglang_needs_layer_for_scitrera_accepts_vllm(state):
    r = inv(state, "image.probe")
    assert r.returncode == 0, r.stdout + r.stderr
    envelope = json.loads(next((state / "decisions").glob("*-lab/image-probe.json")).read_text())
    assert envelope["step"] == "image.probe" and envelope["profile"].endswith("-lab")
    rec = envelope["data"]
    verdicts = {c["image"]: c for c in rec["candidates"]}
    assert verdicts[SGLANG_OLD]["verdict"] == "rejected"
    assert "sglang lacks sglang/srt/models/qwen3_5.py" in verdicts[SGLANG_OLD]["why"]
    assert verdicts[SGLANG]["verdict"] == "needs-layer"
    assert verdicts[SGLANG]["engine_version"] == "0.5.10rc0"
    assert verdicts[SGLANG]["transformers"] == "4.57.1"
    assert "transformers 4.57.1 cannot parse model_type qwen3_5_moe" in verdicts[SGLANG]["why"]
    assert verdicts[VLLM]["verdict"] == "viable"
    assert rec["chosen"]["image"] == SGLANG and rec["chosen"]["needs_layer"] is True
    assert rec["engines"]["vllm-ray"]["serve_image"] == VLLM
    md = next((state / "decisions").glob("*-lab/image-probe.md")).read_text()
    assert f"- `{SGLANG_OLD}` (sglang): rejected:" in md
    # the table is printed too
    assert "needs-layer" in r.stdout and "rejected" in r.stdout


def test_build_makes_a_derivative_whose_config_parses_and_rebuild_is_ok(state, dep):
    # a real build, with its log: docker's layer cache (an earlier build's) unused
    first = inv(state, "image.build", "--no-cache")
    assert first.returncode == 0, first.stdout + first.stderr
    head = dep.host("spark1")
    info = inspect_image(head, DERIVED)
    labels = info["Config"]["Labels"]
    tf = labels["org.sparkdeploy.transformers.version"]
    # transformers>=5 resolved together with what sglang 0.5.10rc0 declares (==5.3.0), not
    # the newest 5.x on the index: pip installs it without a dependency conflict
    assert tf == "5.3.0"
    assert labels["org.sparkdeploy.transformers.requirement"] == "transformers>=5"
    assert labels["org.sparkdeploy.engine.requires"] == "sglang 0.5.10rc0: transformers==5.3.0"
    assert "transformers-5.3.0" in first.stdout  # the build log is streamed
    # pip may list what the lab's --no-deps engine lacks, but nothing about transformers
    conflicts = [ln for ln in first.stdout.splitlines()
                 if "transformers" in ln and ("incompatible" in ln or " requires " in ln)]
    assert conflicts == []
    assert labels["org.opencontainers.image.base.name"] == SGLANG
    assert labels["org.sparkdeploy.base.id"] == inspect_image(head, SGLANG)["Id"]
    # the probe in the derivative: transformers parses the config, sglang is ok
    r = head.run(docker(head, "run", "--rm", "--network", "none", "--entrypoint", "cat", DERIVED,
                        "/usr/share/sparkdeploy/probe.json"), change=False)
    report = json.loads(r.stdout)
    assert report["config"]["ok"] is True and report["packages"]["transformers"] == tf
    second = inv(state, "image.build")
    assert second.returncode == 0
    assert re.search(r"^\S+ ok +image\.build +spark1 +.* already built", second.stdout, re.M), \
        second.stdout


def test_ship_full_then_delta_then_nothing(dep):
    forget(dep, "spark2", DERIVED, SGLANG)
    [full] = ship.ship(dep, "spark2", SGLANG)
    assert full.status is Status.CHANGED, full.why
    assert full.details["mode"] == "full"
    [delta] = ship.ship(dep, "spark2", DERIVED)
    assert delta.status is Status.CHANGED, delta.why
    assert delta.details["mode"] == "partial"
    assert delta.details["layers_skipped"] == len(inspect_image(dep.host("spark1"), SGLANG)["RootFS"]["Layers"])
    assert delta.details["via"] == "store", delta.why  # read from spark1's layer store
    assert delta.details["bytes_out"] < inspect_image(dep.host("spark1"), DERIVED)["Size"] / 2
    src, got = inspect_image(dep.host("spark1"), DERIVED), inspect_image(dep.host("spark2"), DERIVED)
    assert got["Id"] == src["Id"] and got["RootFS"]["Layers"] == src["RootFS"]["Layers"]
    [again] = ship.ship(dep, "spark2", DERIVED)
    assert again.status is Status.OK


def _peer_load_pid(sock: str) -> int | None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"load" in cmd and f"unix://{sock}".encode() in cmd and cmd[0].endswith(b"docker"):
            return int(pid)
    return None


def test_a_load_killed_on_the_peer_hands_over_to_the_next_way(dep):
    forget(dep, "spark2", VLLM)
    sock = dep.profile.node("spark2").docker_socket
    out: list = []
    t = threading.Thread(target=lambda: out.extend(ship.ship(dep, "spark2", VLLM)))
    t.start()
    deadline = time.monotonic() + 120
    pid = None
    while pid is None and time.monotonic() < deadline and t.is_alive():
        pid = _peer_load_pid(sock)
        time.sleep(0.05)
    assert pid, "never saw docker load on the peer"
    time.sleep(0.3)
    os.kill(pid, 9)  # the peer's load dies midway (our own process, by PID)
    t.join(600)
    # the cut archive tagged nothing; the ship went on the next way (the whole docker save),
    # which completed, and says why
    [res] = out
    assert res.status is Status.CHANGED and res.details["via"] == "full", res.why
    assert "the peer refused the layer store's archive" in res.why
    assert inspect_image(dep.host("spark2"), VLLM)["Id"] == inspect_image(dep.host("spark1"), VLLM)["Id"]
    [rerun] = ship.ship(dep, "spark2", VLLM)
    assert rerun.status is Status.OK, rerun.why


# --- pinned images and the NCCL an image loads (issue 30) -----------------------------------------

WHEEL_NCCL = "nvidia-nccl-cu13"


def test_probe_reports_the_nccl_and_the_digest_of_each_lab_image(state, dep):
    """The community images carry the nvidia-nccl-cu13 wheel's libnccl.so.2 and libnccl2's
    (lab.images): the probe says torch would load the wheel's, with both versions, and records
    each candidate's digest (built here: no registry, so its image ID)."""
    r = inv(state, "image.probe", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"NCCL: loads the {WHEEL_NCCL} wheel's 2.28.9 (also libnccl2 2.28.9)" in r.stdout
    rec = json.loads(next((state / "decisions").glob("*-lab/image-probe.json")).read_text())["data"]
    head = dep.host("spark1")
    for cand in rec["candidates"]:
        nccl = cand["nccl"]
        assert (nccl["loads"], nccl["version"]) == ("wheel", "2.28.9"), cand["image"]
        assert nccl["path"].endswith("/site-packages/nvidia/nccl/lib/libnccl.so.2")
        assert nccl["system"]["path"].endswith("-linux-gnu/libnccl.so.2")
        assert cand["digest"] == cand["image_id"] == inspect_image(head, cand["image"])["Id"]
    assert rec["chosen"]["digest"] == inspect_image(head, SGLANG)["Id"]


def test_a_moved_tag_refuses_deploy_all_and_serve_up_before_anything_stops(state, dep):
    """spark1's lmsysorg/sglang:spark is retagged to another image after the probe: deploy.all
    (dry) and serve.up refuse with the one line, exit 1, and no container was touched."""
    head = dep.host("spark1")
    was = inspect_image(head, SGLANG_OLD)["Id"]
    other = inspect_image(head, VLLM)["Id"]
    decided = {c["image"]: c for c in json.loads(next((state / "decisions").glob(
        "*-lab/image-probe.json")).read_text())["data"]["candidates"]}
    assert decided[SGLANG_OLD]["digest"] == was  # the probe above decided on this one
    before = head.run(docker(head, "ps", "-a", "-q", "--no-trunc"), change=False).stdout
    line = (f"{SGLANG_OLD} was {was} when decided, is {other} now; run image.probe to accept it")
    try:
        assert head.run(docker(head, "tag", VLLM, SGLANG_OLD)).ok
        dry = inv(state, "--dry", "deploy.all", timeout=300)
        assert (dry.returncode, dry.stderr.strip()) == (1, line), dry.stdout + dry.stderr
        up = inv(state, "serve.up", timeout=300)
        assert up.returncode == 1, up.stdout + up.stderr
        assert line in up.stdout, up.stdout
        assert head.run(docker(head, "ps", "-a", "-q", "--no-trunc"), change=False).stdout == before
    finally:
        head.run(docker(head, "tag", was, SGLANG_OLD))
    assert plans.refusal(dep) is None  # the tag names the decided image again


def test_the_layer_with_the_system_nccl_makes_torch_load_libnccl2(tmp_path, lab):
    """images.layer.nccl: system: the wheel's libnccl.so.2 becomes a link to libnccl2's (the
    lab image has it: nothing to install), the build's own probe confirms it, and a probe of
    the built image says the system's library loads."""
    tag = "sparkdeploy/sglang-qwen3.5:nccl-system"
    prof = tmp_path / "nccl-system.yaml"
    prof.write_text(f"extends: {PROFILE}\nsparkdeploy:\n  images:\n    layer:\n"
                    f"      nccl: system\n      tag: {tag}\n")
    dep = load(prof, tmp_path / "state")
    head = dep.host("spark1")
    try:
        [res] = images.build(dep)
        assert res.status is Status.CHANGED and "+ the system NCCL in " in res.why, res.why
        labels = inspect_image(head, tag)["Config"]["Labels"]
        assert labels["org.sparkdeploy.nccl"] == "system"
        assert labels["org.sparkdeploy.base.digest"] == inspect_image(head, SGLANG)["Id"]
        report = json.loads(head.run(docker(head, "run", "--rm", "--network", "none",
                                            "--entrypoint", "cat", tag,
                                            "/usr/share/sparkdeploy/probe.json"),
                                     change=False).stdout)
        assert (report["nccl"]["loads"], report["nccl"]["version"]) == ("system", "2.28.9")
        assert report["nccl"]["wheel"]["version"] == "2.28.9"  # still installed, both reported
    finally:
        head.run(docker(head, "image", "rm", "-f", tag))
