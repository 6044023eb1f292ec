"""The deployment's state on the nodes, on the lab: one clone deploys; a second clone (its own,
empty state dir) sees it (serve.status), names it as the GPU's holder at once (services.stop)
and finds it serving what the profile says (deploy.all: ok, nothing restarted). The controller
killed (SIGKILL) mid-serve.up leaves containers that the next serve.up from the other clone
removes before it serves; serve.down from any clone leaves no engine container on any node.

Afterwards the lab is as the other tests expect it: nothing of ours serving, the head's GLM
units back (deploy.rollback from the second clone, by the head's own record of what
services.stop stopped)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
PROFILE = "configs/lab.yaml"
NODES = ("spark1", "spark2")


def inv_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "invoke", *args]


def inv_env(state: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"),
           "INVOKE_SPARKDEPLOY_PROFILE": PROFILE, "INVOKE_SPARKDEPLOY_STATE_DIR": str(state)}
    env.pop("SPARKDEPLOY_API_KEY", None)
    return env


def inv(state: Path, *args: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    cp = subprocess.run(inv_argv(*args), cwd=ROOT, env=inv_env(state), capture_output=True,
                        text=True, timeout=timeout)
    return cp, time.monotonic() - t0


def containers(lab, node: str) -> dict[str, tuple[str, str]]:
    """{name: (container ID, StartedAt)} of every sparkdeploy engine container on the node."""
    cp = lab.ssh(node, ["sh", "-c", "for c in $(docker ps -aq --no-trunc --filter "
                        "label=org.sparkdeploy.engine); do docker inspect --format "
                        "'{{.Name}} {{.Id}} {{.State.StartedAt}}' \"$c\"; done"])
    out = {}
    for line in cp.stdout.splitlines():
        name, cid, started = line.split()
        out[name.lstrip("/")] = (cid, started)
    return out


def everywhere(lab) -> dict[str, dict[str, tuple[str, str]]]:
    return {n: containers(lab, n) for n in NODES}


@pytest.fixture(scope="module")
def clones(lab, tmp_path_factory):
    """Clone A deploys (deploy.all); clone B is a second controller with an empty state dir."""
    a = tmp_path_factory.mktemp("clone-a")
    b = tmp_path_factory.mktemp("clone-b")
    cp, took = inv(a, "deploy.all")
    assert cp.returncode == 0, cp.stdout[-4000:] + cp.stderr[-2000:]
    print(f"\nclone A deploy.all: {took:.1f}s")
    yield lab, a, b
    # rolled back from the clone that never stopped the head's units: the node's record says
    cp, _ = inv(b, "deploy.rollback")
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-2000:]
    assert everywhere(lab) == {n: {} for n in NODES}
    st = lab.ssh("spark1", ["systemctl", "is-active", "vllm-cluster.service"], check=False)
    assert st.stdout.strip() == "active"


def test_a_second_clone_sees_names_and_adopts_the_deployment(clones):
    lab, a, b = clones
    before = everywhere(lab)
    assert all(before.values()), before
    # serve.status: engine, endpoint, since when
    st, took = inv(b, "serve.status")
    assert st.returncode == 0, st.stdout[-3000:] + st.stderr
    print(f"clone B serve.status: {took:.1f}s")
    line = next(ln for ln in st.stdout.splitlines() if "endpoint: http://" in ln)
    assert " healthy (" in line and " since 20" in line, line
    engine = line.split(" healthy (", 1)[1].split(" since ", 1)[0]
    assert engine in ("sglang", "vllm", "vllm-ray"), line
    head = next(n for n in before["spark1"] if n.endswith("-head"))
    assert f"{head} running since 20" in st.stdout
    # services.stop: our own engine named at once, not waited on
    stop, took = inv(b, "services.stop")
    print(f"clone B services.stop: {took:.1f}s")
    assert stop.returncode == 0, stop.stdout[-3000:] + stop.stderr
    assert "the GPU is held by this deployment's own engine: " in stop.stdout, stop.stdout[-3000:]
    assert f"{head} (deployment qwen3.5-122b-a10b-fp8-lab, engine {engine}, since 20" in stop.stdout
    assert took < 15, f"services.stop took {took:.1f}s"
    # deploy.all: ok, nothing restarted
    dep, took = inv(b, "deploy.all")
    print(f"clone B deploy.all: {took:.1f}s")
    assert dep.returncode == 0, dep.stdout[-4000:] + dep.stderr[-2000:]
    assert f"{engine} serves as the profile says, since 20" in dep.stdout
    assert dep.stdout.strip().splitlines()[-2].startswith("endpoint: http://")
    assert everywhere(lab) == before  # the same containers, started when they were
    assert took < 30, f"deploy.all took {took:.1f}s"  # its smoke bench and the fabric check: 21 s


def test_a_controller_killed_mid_start_leaves_nothing_after_the_next_run(clones):
    lab, a, b = clones
    cp, _ = inv(a, "serve.down")
    assert cp.returncode == 0 and everywhere(lab) == {n: {} for n in NODES}, cp.stdout[-2000:]
    p = subprocess.Popen(inv_argv("serve.up"), cwd=ROOT, env=inv_env(a),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 300
        while not containers(lab, "spark1"):  # the head's container started: kill the controller
            assert p.poll() is None and time.monotonic() < end, "serve.up never started the head"
            time.sleep(0.5)
    finally:
        os.kill(p.pid, signal.SIGKILL)  # the inv process only, by its PID
        p.wait(timeout=30)
    time.sleep(2)
    left = everywhere(lab)
    print(f"left by the killed controller: {left}")
    assert left["spark1"], left
    gpu = lab.ssh("spark1", ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                             "--format=csv,noheader"]).stdout
    print(f"spark1's GPU after the kill: {gpu.strip() or 'free'}")
    # the other clone's serve.up finds them by their labels, removes them, and serves
    up, took = inv(b, "serve.up")
    print(f"clone B serve.up after the kill: {took:.1f}s")
    assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-2000:]
    assert "removed this deployment's old containers" in up.stdout, up.stdout[-3000:]
    now = everywhere(lab)
    for node, old in left.items():
        assert not {cid for cid, _ in old.values()} & {cid for cid, _ in now[node].values()}
    assert all(now.values()), now
    # serve.down from the clone that did not start them: nothing on any node
    down, _ = inv(a, "serve.down")
    assert down.returncode == 0, down.stdout[-2000:]
    assert everywhere(lab) == {n: {} for n in NODES}
