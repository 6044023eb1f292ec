"""deploy.all on the lab, end to end, through the real `inv` (tests run in file order): a full
deployment, a re-run that changes nothing, a run interrupted during the sync and resumed, and
the rollback that gives the head back its original units.

The deployment's state lives on the nodes: a second clone (clone B: its own, empty state dir)
sees the deployment the first serves (serve.status), names it as the GPU's holder at once
(services.stop) and finds it serving what the profile says (deploy.all: ok, nothing restarted);
the controller killed (SIGKILL) mid-serve.up leaves containers that clone B's serve.up removes
before it serves; serve.down from either clone leaves no engine container on any node; the
rollback from clone B, which never stopped the head's units, gives them back by the head's own
record."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from sparkdeploy.lab import hub
from sparkdeploy.node import deployment
from sparkdeploy.node.nodeops import docker

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
PROFILE = "configs/lab.yaml"
NODES = ("spark1", "spark2")
GLM_UNITS = ["vllm-cluster.service", "vllm-proxy.service", "vllm-embeddings.service",
             "vllm-reranker.service"]


@pytest.fixture(scope="module")
def state_dir(lab, tmp_path_factory):
    return tmp_path_factory.mktemp("deploy-state")


@pytest.fixture(scope="module")
def clone_b(lab, tmp_path_factory):
    """A second controller: a state dir of its own, empty to begin with."""
    return tmp_path_factory.mktemp("clone-b")


def inv_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "invoke", *args]


def inv_env(state_dir: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"),
           "INVOKE_SPARKDEPLOY_PROFILE": PROFILE, "INVOKE_SPARKDEPLOY_STATE_DIR": str(state_dir)}
    env.pop("SPARKDEPLOY_API_KEY", None)
    return env


def inv(state_dir: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(inv_argv(*args), cwd=ROOT, env=inv_env(state_dir), capture_output=True,
                          text=True, timeout=timeout)


def timed(state_dir: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    cp = inv(state_dir, *args)
    return cp, time.monotonic() - t0


def started(lab, node: str) -> dict[str, tuple[str, str]]:
    """{name: (container ID, StartedAt)} of every sparkdeploy engine container on the node."""
    cp = lab.ssh(node, ["sh", "-c", "for c in $(docker ps -aq --no-trunc --filter "
                        "label=org.sparkdeploy.engine); do docker inspect --format "
                        "'{{.Name}} {{.Id}} {{.State.StartedAt}}' \"$c\"; done"])
    out = {}
    for line in cp.stdout.splitlines():
        name, cid, since = line.split()
        out[name.lstrip("/")] = (cid, since)
    return out


def everywhere(lab) -> dict[str, dict[str, tuple[str, str]]]:
    return {n: started(lab, n) for n in NODES}


def dep_for(state_dir: Path):
    return deployment.load(ROOT / PROFILE, state_dir)


def remove_weights(dep, *nodes: str) -> None:
    for n in nodes:
        r = dep.host(n).run(["rm", "-rf", "--", dep.profile.model.path])
        assert r.ok, r.stderr


def containers(dep, node: str) -> list[str]:
    h = dep.host(node)
    r = h.run(docker(h, "ps", "-a", "--format", "{{.Names}}"), change=False)
    assert r.ok, r.stderr
    return [c for c in r.stdout.split() if c.startswith("sparkdeploy")]


def step_lines(out: str, state: str) -> list[str]:
    return [ln for ln in out.splitlines() if f" step {state} " in f" {ln.split(' ', 1)[-1]}"]


def test_deploy_all_serves_and_records(lab, state_dir):
    dep = dep_for(state_dir)
    remove_weights(dep, *[n.name for n in dep.profile.nodes])
    r = inv(state_dir, "deploy.all")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-2:]
    assert last[0].startswith("endpoint: http://") and last[1].startswith("record: ")
    url, record = last[0].split(" ", 1)[1], Path(last[1].split(" ", 1)[1])
    models = requests.get(url.rstrip("/") + "/v1/models", timeout=10).json()
    assert dep.profile.model.repo in [m["id"] for m in models["data"]]
    md = record.read_text()
    data = json.loads(record.with_suffix(".json").read_text())["data"]
    assert data["image"]["tag"] and data["image"]["id"].startswith("sha256:")
    assert f"`{data['image']['tag']}` = `{data['image']['id']}`" in md
    assert data["engine"]["chosen"] and "## Engine" in md
    assert data["endpoint"] == url
    assert data["bench"]["levels"] and data["bench"]["levels"][0]["concurrency"] == 1
    level = data["bench"]["levels"][0]
    assert level["completed"] == level["requests"] > 0 and level["decode_tok_s_median"] > 0
    assert "## Bench (smoke)" in md and "decode_tok_s_median" in md
    assert {s["state"] for s in data["steps"].values()} <= {"done", "skipped"}


def test_second_run_changes_nothing(lab, state_dir):
    r = inv(state_dir, "deploy.all")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    changed = [ln for ln in r.stdout.splitlines() if ln.split(" ", 1)[-1].startswith("changed ")]
    assert changed == []
    assert any("bench.run: nothing changed in this run" in ln for ln in step_lines(r.stdout, "skipped"))
    took = [ln for ln in r.stdout.splitlines() if ln.startswith("took: ")]
    print(took)


def test_a_second_clone_sees_names_and_adopts_the_deployment(lab, clone_b):
    b = clone_b
    before = everywhere(lab)
    assert all(before.values()), before
    # serve.status: engine, endpoint, since when
    st, took = timed(b, "serve.status")
    assert st.returncode == 0, st.stdout[-3000:] + st.stderr
    print(f"clone B serve.status: {took:.1f}s")
    line = next(ln for ln in st.stdout.splitlines() if "endpoint: http://" in ln)
    assert " healthy (" in line and " since 20" in line, line
    engine = line.split(" healthy (", 1)[1].split(" since ", 1)[0]
    assert engine in ("sglang", "vllm", "vllm-ray"), line
    head = next(n for n in before["spark1"] if n.endswith("-head"))
    assert f"{head} running since 20" in st.stdout
    # serve.list: what serves where, from the nodes alone
    ls, took = timed(b, "serve.list", "--json")
    print(f"clone B serve.list: {took:.1f}s")
    assert ls.returncode == 0, ls.stdout[-3000:] + ls.stderr[-3000:]
    url = line.split("endpoint: ", 1)[1].split()[0]
    assert json.loads(ls.stdout) == [{
        "recipe": "qwen3.5-122b-a10b-fp8", "repo": dep_for(b).profile.model.repo,
        "nodes": list(NODES), "url": url, "loaded": True, "engine": engine,
        "deployment": "qwen3.5-122b-a10b-fp8-lab", "on_demand": False}]
    # services.stop: our own engine named at once, not waited on
    stop, took = timed(b, "services.stop")
    print(f"clone B services.stop: {took:.1f}s")
    assert stop.returncode == 0, stop.stdout[-3000:] + stop.stderr
    assert "the GPU is held by this deployment's own engine: " in stop.stdout, stop.stdout[-3000:]
    assert f"{head} (deployment qwen3.5-122b-a10b-fp8-lab, engine {engine}, since 20" in stop.stdout
    assert took < 15, f"services.stop took {took:.1f}s"
    # deploy.all: ok, nothing restarted
    dep, took = timed(b, "deploy.all")
    print(f"clone B deploy.all: {took:.1f}s")
    assert dep.returncode == 0, dep.stdout[-4000:] + dep.stderr[-2000:]
    assert f"{engine} serves as the profile says, since 20" in dep.stdout
    assert dep.stdout.strip().splitlines()[-2].startswith("endpoint: http://")
    assert everywhere(lab) == before  # the same containers, started when they were
    assert took < 30, f"deploy.all took {took:.1f}s"  # its smoke bench and the fabric check: 21 s


def test_bench_reads_the_engines_own_metrics_beside_its_own(lab, state_dir, tmp_path):
    """bench.run on the deployment the tests above left serving (SGLang across both nodes, with
    the recipe's --enable-metrics) sets the engine's /metrics means beside the client's and
    writes the HTML report beside the JSON."""
    from sparkdeploy.node.endpoint import url as endpoint_url

    dep = dep_for(state_dir)
    assert "--enable-metrics" in dep.profile.engines[0].args  # the recipe's
    url = endpoint_url(dep)
    out = tmp_path / "run.json"
    r = inv(state_dir, "bench.run", "--url", url, "--concurrency", "1,2", "--requests", "4",
            "--output-tokens", "16", "--warmup", "1", "--json", str(out))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["engine_metrics"]["skipped"] is None
    for run in doc["runs"]:
        s, eng = run["summary"], run["summary"]["engine"]
        assert eng["engine"] == "sglang" and eng["ttft_count"] == 4
        assert eng["families"]["ttft_ms"] == "sglang:time_to_first_token_seconds"
        # the head's stand-in measured the same requests the client did, over the lab network
        assert eng["ttft_ms"] == pytest.approx(s["ttft_ms"]["mean"], rel=0.10)
        assert eng["itl_ms"] == pytest.approx(s["itl_ms"]["mean"], rel=0.10)
        assert 0 < eng["kv_cache_peak_pct"] <= 100 and eng["preemptions"] == 0
    assert "engine (sglang) /metrics: TTFT mean" in r.stdout
    html = out.with_suffix(".html").read_text()
    assert "engine /metrics (sglang) vs client" in html and "data:image/png;base64," in html


def test_depth_sweep_with_the_heads_tokenizer(lab, state_dir, tmp_path):
    """bench.depth on the deployment left serving, without --url or --tokenizer: the profile's
    endpoint, the head's model directory's tokenizer.json (read over SSH); the engine stand-in
    counts prompts with the same tokenizer, its prefill rate grows and decode slows with depth."""
    out = tmp_path / "depth.json"
    r = inv(state_dir, "bench.depth", "--depths", "0,1024,4096", "--runs", "2",
            "--output-tokens", "8", "--json", str(out))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    rows = doc["depths"]
    assert [d["depth"] for d in rows] == [0, 1024, 4096]
    assert doc["config"]["tokenizer"].endswith("bench/tokenizer/tokenizer.json")
    assert all(d["prompt_tokens"] > d["depth"] for d in rows)
    assert rows[0]["pp_tok_s"] < rows[1]["pp_tok_s"] < rows[2]["pp_tok_s"]
    assert rows[0]["tg_tok_s"] > rows[2]["tg_tok_s"]
    assert "pp @ d4096" in r.stdout and "tg8 @ d4096" in r.stdout


def test_garbage_fails_the_coherence_gate_while_health_is_green(lab, state_dir, tmp_path):
    """`inv lab.fault garbage`: the serving engine answers nonsense at once while /health is 200;
    bench.run and bench.depth exit 1 on the gate's line, write no JSON; `lab.fault none` and the
    gate passes again."""
    from sparkdeploy.node.endpoint import url as endpoint_url

    url = endpoint_url(dep_for(state_dir)).rstrip("/")
    out = tmp_path / "garbage.json"
    r = inv(state_dir, "lab.fault", "garbage")
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        assert requests.get(url + "/health", timeout=10).status_code == 200
        for task in (["bench.run", "--requests", "2", "--warmup", "0"],
                     ["bench.depth", "--depths", "0", "--runs", "1"]):
            r = inv(state_dir, *task, "--json", str(out))
            assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-2000:]
            gate = [ln for ln in r.stdout.splitlines() if "coherence gate:" in ln]
            assert len(gate) == 1 and ("'What is 17 + 25? Answer with the number only.' came "
                                       "back '!!!!") in gate[0], r.stdout
            assert not out.exists()
    finally:
        r = inv(state_dir, "lab.fault", "none")
        assert r.returncode == 0, r.stdout + r.stderr
    r = inv(state_dir, "bench.run", "--requests", "2", "--warmup", "0", "--json", str(out))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert json.loads(out.read_text())["gate"][0]["answer"].strip() == "42"


VERIFIED = """import json, sys
seen = {}
try:
    for line in open(sys.argv[1] + "/.sparkdeploy/verified.jsonl"):
        try:
            rec = json.loads(line)
            seen[rec["path"]] = rec.get("size", 0)
        except (ValueError, KeyError, TypeError):
            pass
except FileNotFoundError:
    pass
print(json.dumps(seen))"""


def verified(lab, dep, node: str) -> dict[str, int]:
    """{file: size} the node's weights record says are complete and verified."""
    cp = lab.ssh(node, ["python3", "-c", VERIFIED, dep.profile.model.path])
    return json.loads(cp.stdout)


def test_killed_during_sync_resumes_without_resending(lab, state_dir):
    dep = dep_for(state_dir)
    remove_weights(dep, *[n.name for n in dep.profile.nodes])
    url = dep.profile.model.endpoint
    before = hub.set_knobs(url).get("bandwidth_bps")
    hub.set_knobs(url, bandwidth_bps=8_000_000)  # ~40 s for the lab repo: time to interrupt
    try:
        p = subprocess.Popen(inv_argv("deploy.all"), cwd=ROOT, env=inv_env(state_dir),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        seen = []
        deadline = time.monotonic() + 300
        for line in p.stdout:
            seen.append(line)
            if " model.sync " in line and "[spark2]" in line and " of " in line:
                break  # the sync has moved a file to the worker
            assert time.monotonic() < deadline, "".join(seen[-20:])
        os.killpg(p.pid, signal.SIGINT)  # Ctrl-C
        p.communicate(timeout=120)
        assert p.returncode != 0
    finally:
        hub.set_knobs(url, bandwidth_bps=before)
    head_had, worker_had = verified(lab, dep, "spark1"), verified(lab, dep, "spark2")
    assert worker_had, "".join(seen[-20:])
    hub.set_knobs(url, reset_stats=True)
    r = inv(state_dir, "deploy.all")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    head_has, worker_has = verified(lab, dep, "spark1"), verified(lab, dep, "spark2")
    assert head_has == worker_has and set(head_had) <= set(head_has)
    fetched = sum(q.get("bytes") or 0 for q in hub.get_stats(url)["requests"])
    missing = sum(size for f, size in head_has.items() if f not in head_had)
    assert fetched <= missing + 1_000_000  # what the head had complete was not fetched again
    state = json.loads((state_dir / f"runs/deploy-{dep.profile.name}.json").read_text())
    why = state["data"]["steps"]["model.sync"]["why"]
    sent = int(why.split(" sent ", 1)[1].split()[0]) if " sent " in why else 0
    assert sent <= len(worker_has) - len(worker_had), why  # nor sent again to the worker


def test_a_controller_killed_mid_start_leaves_nothing_after_the_next_run(lab, state_dir, clone_b):
    a, b = state_dir, clone_b
    cp = inv(a, "serve.down")
    assert cp.returncode == 0 and everywhere(lab) == {n: {} for n in NODES}, cp.stdout[-2000:]
    p = subprocess.Popen(inv_argv("serve.up"), cwd=ROOT, env=inv_env(a),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 300
        while not started(lab, "spark1"):  # the head's container started: kill the controller
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
    up, took = timed(b, "serve.up")
    print(f"clone B serve.up after the kill: {took:.1f}s")
    assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-2000:]
    assert "removed this deployment's old containers" in up.stdout, up.stdout[-3000:]
    now = everywhere(lab)
    for node, old in left.items():
        assert not {cid for cid, _ in old.values()} & {cid for cid, _ in now[node].values()}
    assert all(now.values()), now
    # serve.down from the clone that did not start them: nothing on any node
    down = inv(a, "serve.down")
    assert down.returncode == 0, down.stdout[-2000:]
    assert everywhere(lab) == {n: {} for n in NODES}


def test_a_keyed_endpoint_passes_the_bench_smoke_and_the_key_stays_out_of_argv_and_files(
        lab, state_dir):
    """SPARKDEPLOY_API_KEY set: the engine serves behind the key, deploy.all's readiness and its
    bench smoke send it (the smoke completes every request), and the key is in no process's
    argv on a node, no container's command or labels, nothing deploy.all printed and no file
    under the state dir (its journal, records and bench JSON)."""
    key = "sk-lab-" + os.urandom(12).hex()
    env = {**inv_env(state_dir), "SPARKDEPLOY_API_KEY": key}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(inv_argv(*args), cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=900)

    assert run("serve.down").returncode == 0
    try:
        r = run("deploy.all", "--bench")
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        last = r.stdout.strip().splitlines()[-2:]
        url, record = last[0].split(" ", 1)[1], Path(last[1].split(" ", 1)[1])
        assert requests.get(url.rstrip("/") + "/v1/models", timeout=10).status_code == 401
        level = json.loads(record.with_suffix(".json").read_text())["data"]["bench"]["levels"][0]
        assert level["completed"] == level["requests"] > 0, level
        assert key not in r.stdout + r.stderr
        leaked = [str(f) for f in state_dir.rglob("*") if f.is_file()
                  and key.encode() in f.read_bytes()]
        assert leaked == []
        dep = dep_for(state_dir)
        for n in dep.profile.nodes:
            args = lab.ssh(n.name, ["ps", "-eo", "args"]).stdout
            assert key not in args, n.name
            cmds = lab.ssh(n.name, ["sh", "-c", "docker ps -q --filter label=org.sparkdeploy."
                                    "engine | xargs -r docker inspect --format "
                                    "'{{json .Path}} {{json .Args}} {{json .Config.Labels}}'"])
            assert cmds.stdout.strip() and key not in cmds.stdout, n.name
    finally:
        assert run("serve.down").returncode == 0


STALL = 45.0  # as in the serve tests: a loaded 2-core CI machine lists a Ray cluster in >20 s


def test_a_hang_ends_on_vllm_with_the_diagnosis_in_the_record(lab, state_dir, tmp_path):
    """`inv lab.fault sglang-hang`, then deploy.all: SGLang hangs in init, is found silent
    within the stall time, diagnosed, its logs kept, and serve.up falls back to vLLM on Ray
    across both nodes; the record names both decisions and the evidence. A profile on top of
    the lab's shortens the stall so the test does not wait 300 s."""
    import yaml

    from sparkdeploy.core.records import ServeDecision

    prof = tmp_path / "lab-hang.yaml"
    prof.write_text(yaml.safe_dump({"extends": str(ROOT / PROFILE), "sparkdeploy": {
        "serve": {"stall_s": STALL, "poll_s": 1, "ready_timeout_s": 300}}}))
    env = {**inv_env(state_dir), "INVOKE_SPARKDEPLOY_PROFILE": str(prof)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(inv_argv(*args), cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=1200)

    assert run("serve.down").returncode == 0
    assert run("lab.fault", "sglang-hang").returncode == 0
    try:
        r = run("deploy.all")
    finally:
        assert run("lab.fault", "none").returncode == 0
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    out = r.stdout
    assert "sglang hang: no log output and no readiness step" in out
    assert "class: nccl-init-hang" in out and "falling back to vllm-ray" in out
    last = out.strip().splitlines()[-2:]
    assert last[0].startswith("endpoint: http://") and last[1].startswith("record: ")
    record = Path(last[1].split(" ", 1)[1])
    data = json.loads(record.with_suffix(".json").read_text())["data"]
    engine = data["engine"]
    assert engine["chosen"] == "vllm-ray"
    # vLLM's ranks (the Ray workers' lines in the API server's log) marked the distributed init;
    # the hung SGLang never reached it
    assert {"containers_running", "dist_init", "port_open", "first_token"} <= set(engine["startup"])
    [tried] = engine["tried"]
    assert (tried["engine"], tried["class"]) == ("sglang", "nccl-init-hang")
    assert tried["evidence"]
    md = record.read_text()
    assert "serving with **vllm-ray**" in md and "diagnosis `nccl-init-hang`" in md
    assert "evidence: `" in md
    assert data["image"]["tag"] and data["image"]["id"].startswith("sha256:")
    dep = deployment.load(prof, state_dir)
    decision = dep.records.read(ServeDecision)
    [hung] = decision.tried
    assert "dist_init" not in (hung.startup or {}) and "port_open" not in (hung.startup or {})
    # detected within the stall time + 10 %, the fallback started soon after
    assert STALL <= hung.silent_s <= STALL * 1.1
    print(f"\nserve.hang_to_fallback_seconds: {hung.fallback_after_s}")
    assert hung.fallback_after_s <= STALL * 1.1 + 15
    assert sorted(p.name for p in Path(hung.logs).iterdir()) == [
        "spark1-sparkdeploy-sglang-head.log", "spark2-sparkdeploy-sglang-worker.log"]
    assert sorted(containers(dep, "spark1")) == ["sparkdeploy-vllm-ray-api",
                                                 "sparkdeploy-vllm-ray-head"]
    assert containers(dep, "spark2") == ["sparkdeploy-vllm-ray-worker"]
    st = run("serve.status")
    assert "Ray: " in st.stdout and "10.77.1.1 (1 GPU)" in st.stdout
    assert "10.77.1.2 (1 GPU)" in st.stdout
    url = last[0].split(" ", 1)[1]
    models = requests.get(url.rstrip("/") + "/v1/models", timeout=10).json()
    assert dep.profile.model.repo in [m["id"] for m in models["data"]]
    body = {"model": dep.profile.model.repo, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8, "stream": True}
    with requests.post(url.rstrip("/") + "/v1/chat/completions", json=body, stream=True,
                       timeout=60) as chat:
        assert chat.status_code == 200
        assert any(ln.startswith("data: {") for ln in chat.iter_lines(decode_unicode=True))


def test_rollback_gives_the_head_its_units_back(lab, state_dir, clone_b):
    # from the clone that never stopped the head's units: the node's record says which
    r = inv(clone_b, "deploy.rollback")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert everywhere(lab) == {n: {} for n in NODES}
    dep = dep_for(state_dir)
    for unit in GLM_UNITS:
        cp = lab.ssh("spark1", ["systemctl", "is-active", unit], check=False)
        assert cp.stdout.strip() == "active", (unit, cp.stdout, cp.stderr)
    for n in dep.profile.nodes:
        assert containers(dep, n.name) == [], n.name


def test_rollback_purge_removes_the_weights_and_our_images(lab, state_dir):
    """After the rollback, --purge --yes removes the weights from both nodes, the images
    sparkdeploy built, and the images it shipped to the worker. lab.up then loads the lab's
    images again for the tests that follow."""
    from sparkdeploy.lab import layout, lifecycle

    dep = dep_for(state_dir)
    path = dep.profile.model.path
    refused = inv(state_dir, "deploy.rollback", "--purge")  # not a terminal, no --yes
    assert refused.returncode != 0 and "--yes" in (refused.stdout + refused.stderr)
    for n in dep.profile.nodes:
        assert lab.ssh(n.name, ["test", "-d", path], check=False).returncode == 0, n.name
    r = inv(state_dir, "deploy.rollback", "--purge", "--yes")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    try:
        for n in dep.profile.nodes:
            assert lab.ssh(n.name, ["test", "-e", path], check=False).returncode == 1, n.name
            built = lab.ssh(n.name, ["docker", "image", "ls", "-q", "--filter",
                                     "label=org.sparkdeploy.base.id"]).stdout.split()
            assert built == [], n.name
            assert containers(dep, n.name) == [], n.name
        images = lab.ssh("spark2", ["docker", "image", "ls", "--format",
                                    "{{.Repository}}"]).stdout.split()
        for e in dep.profile.engines:
            assert e.image.split(":")[0] not in images, e.image
        for unit in GLM_UNITS:
            cp = lab.ssh("spark1", ["systemctl", "is-active", unit], check=False)
            assert cp.stdout.strip() == "active", unit
        again = inv(state_dir, "deploy.rollback", "--purge", "--yes")
        assert again.returncode == 0 and step_lines(again.stdout, "failed") == []
    finally:
        bad = [x for x in lifecycle.up(nodes=2, flavor=layout.DEFAULT_DOCKERD) if x.failed]
        assert not bad, [x.why for x in bad]


def test_deploy_all_of_a_recipe_serves_its_model_from_only_the_files_the_engine_loads(
        lab, tmp_path):
    """`deploy.all --recipe gpt-oss-120b` on the pair: the recipe's model, image and engine
    (vLLM's own multi-node mode, TP=2 from the calculator) over the lab's cluster; each node
    holds the files the engine loads and none of the repository's other copies; then
    `deploy.rollback --recipe ... --purge --yes` leaves the pair as it was."""
    from sparkdeploy.lab import layout, lifecycle

    state = tmp_path / "state"
    r = inv(state, "deploy.all", "--recipe", "gpt-oss-120b", timeout=1200)
    try:
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        last = r.stdout.strip().splitlines()[-2:]
        url = last[0].split(" ", 1)[1]
        models = requests.get(url.rstrip("/") + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["openai/gpt-oss-120b"]
        data = json.loads(Path(last[1].split(" ", 1)[1]).with_suffix(".json").read_text())["data"]
        assert data["engine"]["chosen"] == "vllm"
        for node in ("spark1", "spark2"):
            files = lab.ssh(node, ["find", "/srv/models/gpt-oss-120b", "-type", "f",
                                   "-not", "-path", "*/.sparkdeploy/*"]).stdout.split()
            names = sorted(f.removeprefix("/srv/models/gpt-oss-120b/") for f in files)
            assert "model-00000-of-00014.safetensors" in names, names
            assert not [n for n in names if n.startswith(("original/", "metal/"))], names
    finally:
        down = inv(state, "deploy.rollback", "--recipe", "gpt-oss-120b", "--purge", "--yes")
        assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-2000:]
        bad = [x for x in lifecycle.up(nodes=2, flavor=layout.DEFAULT_DOCKERD) if x.failed]
        assert not bad, [x.why for x in bad]
    for node in ("spark1", "spark2"):
        assert lab.ssh(node, ["test", "-e", "/srv/models/gpt-oss-120b"], check=False).returncode == 1
