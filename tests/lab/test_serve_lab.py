"""serve.* on the lab: SGLang across both nodes (ranks meeting over the fast link), the forced
hang diagnosed and replaced by vLLM on a real two-node Ray cluster, the suspected cause
(no SGLANG_HOST_IP) reproduced, the bad cases refused before anything starts, and the
persisted units (ordered start, restart together, removal).

Each test leaves the lab as it found it: no engine container, no unit of ours, no fault, the
head's GLM units back (services.restore), spark2 without the images serve.up shipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from sparkdeploy.core.records import ServeDecision
from sparkdeploy.node.deployment import load
from sparkdeploy.steps.registry import run_one
from tests.unit.profiles import seed_data

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "configs" / "lab.yaml"
MODEL = "Qwen/Qwen3.5-122B-A10B-FP8"
DERIVED = "sparkdeploy/sglang-qwen3.5:latest"
VLLM = "hellohal2064/vllm-qwen3.5-gb10"
STALL = 45.0  # a loaded 2-core CI machine lists a Ray cluster in >20 s
SERVE = {"stall_s": STALL, "poll_s": 1, "ready_timeout_s": 300}


def profile(tmp: Path, name: str, **body) -> Path:
    """A profile extending the lab's, with serve timings for tests and ``body`` on top."""
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump({"extends": str(LAB), "sparkdeploy": {"serve": SERVE, **body}}))
    return p


def inv(state: Path, prof: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "INVOKE_SPARKDEPLOY_PROFILE": str(prof),
           "INVOKE_SPARKDEPLOY_STATE_DIR": str(state)}
    env.pop("SPARKDEPLOY_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def ours(lab, node: str) -> list[str]:
    cp = lab.ssh(node, ["docker", "ps", "-a", "--filter", "label=org.sparkdeploy.engine",
                        "--format", "{{.Names}}"])
    return sorted(cp.stdout.split())


def fault(state: Path, prof: Path, what: str) -> None:
    cp = inv(state, prof, "lab.fault", what, timeout=120)
    assert cp.returncode == 0, cp.stdout + cp.stderr


def stream(url: str) -> str:
    http = requests.Session()
    http.trust_env = False  # lab addresses only
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "stream": True}
    text = []
    with http.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:]).get("choices") or []:
                    d = ch.get("delta") or {}
                    text.append(d.get("content") or d.get("reasoning_content") or "")
    return "".join(text)


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    """The chain up to serving: head GPU freed, the SGLang layer built, weights verified on
    both nodes. Afterwards: everything of ours gone, GLM units back, spark2's images as
    lab.up left them."""
    tmp = tmp_path_factory.mktemp("serve")
    state = tmp / "state"
    prof = profile(tmp, "lab-serve")
    dep = load(prof, state)
    had = set(lab.ssh("spark2", ["docker", "image", "ls", "--format",
                                 "{{.Repository}}:{{.Tag}}"]).stdout.split())
    for name, opts in [("services.stop", {}), ("image.build", {}), ("model.download", {}),
                       ("model.sync", {"to": "spark2"}), ("model.verify", {})]:
        bad = [r for r in run_one(dep, name, **opts) if r.failed]
        assert not bad, f"{name}: {bad[0].why}"
    yield lab, tmp, state, prof, dep
    fault(state, prof, "none")
    inv(state, prof, "serve.unpersist")
    inv(state, prof, "serve.down")
    now = set(lab.ssh("spark2", ["docker", "image", "ls", "--format",
                                 "{{.Repository}}:{{.Tag}}"]).stdout.split())
    extra = sorted(now - had)
    if extra:
        lab.ssh("spark2", ["docker", "image", "rm", "-f", *extra], check=False)
    assert inv(state, prof, "services.restore").returncode == 0


@pytest.fixture
def clean(env):
    lab, tmp, state, prof, dep = env
    yield env
    fault(state, prof, "none")
    inv(state, prof, "serve.down")
    for node in ("spark1", "spark2"):
        assert ours(lab, node) == [], f"{node} still has engine containers"


def test_sglang_serves_across_both_nodes_over_the_fast_link(clean):
    lab, tmp, state, prof, dep = clean
    fault(state, prof, "none")
    cp = inv(state, prof, "serve.up")
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr
    last = served(cp.stdout)
    assert last[:3] == ("ok", "serve.up", "-") and last[3].startswith("endpoint: "), last
    assert results(cp.stdout)[-1][:2] == ("skipped", "metrics.up")  # the lab's profile: off
    url = last[3].split(" ", 1)[1]
    assert url == f"http://{lab.addr('spark1', 'mgmt')}:30000"
    assert stream(url)
    assert ours(lab, "spark1") == ["sparkdeploy-sglang-head"]
    assert ours(lab, "spark2") == ["sparkdeploy-sglang-worker"]
    # the ranks met: rank 1 joined rank 0 over the head's fast-link address
    log = lab.ssh("spark2", ["docker", "logs", "sparkdeploy-sglang-worker"]).stdout + \
        lab.ssh("spark2", ["docker", "logs", "sparkdeploy-sglang-worker"]).stderr
    assert "dist_init_addr=10.77.1.1:20000" in log or "10.77.1.1:20000" in log
    assert "Init torch distributed ends" in log
    env_of = json.loads(lab.ssh("spark2", ["docker", "inspect", "--format", "{{json .Config.Env}}",
                                           "sparkdeploy-sglang-worker"]).stdout)
    assert "SGLANG_HOST_IP=10.77.1.2" in env_of and "NCCL_SOCKET_IFNAME=enp1s0f0np0" in env_of
    assert "NCCL_IB_HCA=rocep1s0f0,roceP2p1s0f0" in env_of
    st = inv(state, prof, "serve.status")
    assert st.returncode == 0 and f"endpoint: {url} healthy (sglang since " in st.stdout
    # the startup milestones, each from the engine's start, the distributed init read from
    # SGLang's own line; serve.status says them again
    startup = load(prof, state).records.read(ServeDecision).startup
    order = ["containers_running", "dist_init", "port_open", "health", "model_listed", "first_token"]
    assert set(startup) == set(order)
    assert [startup[k] for k in order] == sorted(startup[k] for k in order)
    assert "sglang: bring-up " in st.stdout and "dist init " in st.stdout


def test_without_sglang_host_ip_sglang_hangs_and_is_diagnosed(clean):
    lab, tmp, state, prof, dep = clean
    fault(state, prof, "none")
    [engine] = [e for e in seed_data()["sparkdeploy"]["engines"] if e["name"] == "sglang"]
    engine["env"] = {"SGLANG_HOST_IP": None}
    p = profile(tmp, "no-host-ip", engines=[engine])
    cp = inv(state, p, "serve.up")
    assert cp.returncode == 1, cp.stdout[-3000:]
    assert "sglang hang:" in cp.stdout and "class: nccl-init-hang" in cp.stdout
    gone = lab.ssh("spark1", ["docker", "inspect", "sparkdeploy-sglang-head"], check=False)
    assert gone.returncode != 0 and "No such object" in gone.stderr  # removed after the diagnosis
    rec = load(p, state).records.read(ServeDecision)
    assert rec.tried[0].diagnosis == "nccl-init-hang" and rec.chosen is None


def results(out: str) -> list[tuple[str, str, str, str]]:
    """(status, step, node, why) of each result line the plain renderer printed."""
    rows = []
    for ln in out.splitlines():
        parts = ln.split(None, 4)
        if len(parts) == 5 and parts[1] in ("ok", "changed", "skipped", "failed"):
            rows.append((parts[1], parts[2], parts[3], parts[4]))
    return rows


def served(out: str) -> tuple[str, str, str, str]:
    """serve.up's last result: ``endpoint: URL`` once it serves (the task runs metrics.up after
    it, which says its own lines)."""
    return [r for r in results(out) if r[1] == "serve.up"][-1]


def _one_line_refusal(lab, state, prof, node: str, want: str) -> None:
    cp = inv(state, prof, "serve.up", "--engine", "sglang")
    assert cp.returncode == 1, cp.stdout[-2000:]
    bad = [r for r in results(cp.stdout) if r[0] == "failed"]
    assert len(bad) == 1, cp.stdout[-2000:]
    assert bad[0][2] == node and bad[0][3].startswith(want), bad
    for n in ("spark1", "spark2"):
        assert ours(lab, n) == []


def test_bad_cases_one_line_and_nothing_started(clean):
    lab, tmp, state, prof, dep = clean
    fault(state, prof, "none")
    # worker unreachable: its ssh alias answers nowhere
    seed = yaml.safe_load(LAB.read_text())["sparkdeploy"]["nodes"]
    nodes = [dict(n) for n in seed]
    nodes[1]["ssh"] = "spark2-gone.invalid"
    _one_line_refusal(lab, state, profile(tmp, "unreachable", nodes=nodes), "spark2",
                      "unreachable: ssh: Could not resolve hostname spark2-gone.invalid")
    # weights missing on the worker
    shard = lab.ssh("spark2", ["sh", "-c", "ls /srv/models/Qwen3.5-122B-A10B-FP8/*.safetensors"]
                    ).stdout.split()[0]
    lab.ssh("spark2", ["mv", shard, shard + ".away"])
    try:
        _one_line_refusal(lab, state, prof, "spark2", "weights missing in /srv/models/")
    finally:
        lab.ssh("spark2", ["mv", shard + ".away", shard])
    # the port already taken on the head
    pid = lab.ssh("spark1", ["sh", "-c", "python3 -c 'import socket,time; s=socket.socket(); "
                             "s.bind((\"0.0.0.0\", 30000)); s.listen(); time.sleep(120)' "
                             ">/dev/null 2>&1 & echo $!"]).stdout.strip()
    try:
        time.sleep(0.5)
        _one_line_refusal(lab, state, prof, "spark1", "port 30000 is already in use by pid")
    finally:
        lab.ssh("spark1", ["kill", pid], check=False)
    # the GPU busy: the head's GLM units back
    assert inv(state, prof, "services.restore").returncode == 0
    try:
        _one_line_refusal(lab, state, prof, "spark1", "GPU busy: pid")
    finally:
        assert inv(state, prof, "services.stop").returncode == 0


def _wait_stream(url: str, deadline: float) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        try:
            if stream(url):
                return
        except (requests.RequestException, AssertionError):
            pass
        time.sleep(1)
    pytest.fail(f"{url} did not serve within {deadline:.0f}s")


def _started_at(lab, node: str, name: str) -> str:
    return lab.ssh(node, ["docker", "inspect", "--format", "{{.State.StartedAt}}", name],
                   check=False).stdout.strip()


def test_persisted_units_start_in_order_restart_together_and_go(clean):
    lab, tmp, state, prof, dep = clean
    fault(state, prof, "none")
    cp = inv(state, prof, "serve.up")
    assert cp.returncode == 0, cp.stdout[-2000:]
    url = served(cp.stdout)[3].split(" ", 1)[1]
    up = {n: _started_at(lab, n, c) for n, c in (("spark1", "sparkdeploy-sglang-head"),
                                                   ("spark2", "sparkdeploy-sglang-worker"))}
    cp = inv(state, prof, "serve.persist")
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr
    # the units adopted what serve.up started: the same containers, not restarted
    assert {n: _started_at(lab, n, c) for n, c in (("spark1", "sparkdeploy-sglang-head"),
                                                   ("spark2", "sparkdeploy-sglang-worker"))} == up
    unit = "sparkdeploy-sglang.service"
    for node in ("spark1", "spark2"):
        text = lab.ssh(node, ["cat", f"/etc/systemd/system/{unit}"]).stdout
        assert "Restart=on-failure" in text and "ExecStop=" in text
        assert lab.ssh(node, ["systemctl", "is-enabled", unit]).stdout.strip() == "enabled"
    # serve.down takes it away; the units (as at boot: workers first) bring it back
    assert inv(state, prof, "serve.down").returncode == 0
    assert ours(lab, "spark1") == [] and ours(lab, "spark2") == []
    lab.ssh("spark2", ["systemctl", "start", unit])
    lab.ssh("spark1", ["systemctl", "start", unit])
    _wait_stream(url, 120)
    # one node's engine container dies: both come back, restarted together
    head_before = _started_at(lab, "spark1", "sparkdeploy-sglang-head")
    lab.ssh("spark2", ["docker", "kill", "sparkdeploy-sglang-worker"])
    end = time.monotonic() + 180
    while time.monotonic() < end:
        h = _started_at(lab, "spark1", "sparkdeploy-sglang-head")
        if h and h != head_before and _started_at(lab, "spark2", "sparkdeploy-sglang-worker"):
            break
        time.sleep(2)
    else:
        pytest.fail("the head's container was not restarted after the worker's died")
    _wait_stream(url, 120)
    # unpersist: units and containers gone, the head's own units still restorable
    cp = inv(state, prof, "serve.unpersist")
    assert cp.returncode == 0, cp.stdout[-2000:]
    for node in ("spark1", "spark2"):
        assert lab.ssh(node, ["test", "-e", f"/etc/systemd/system/{unit}"], check=False).returncode == 1
        assert ours(lab, node) == []
    assert inv(state, prof, "services.restore").returncode == 0
    st = lab.ssh("spark1", ["systemctl", "is-active", "vllm-cluster.service"], check=False)
    assert st.stdout.strip() == "active"
    assert inv(state, prof, "services.stop").returncode == 0
