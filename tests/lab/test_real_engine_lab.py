"""The real engine on the lab pair: vLLM 0.32.0 built for the CPU (``lab.up --real-engine``)
serving the real ``lab-tiny`` model (``sparkdeploy.lab.tiny``) across both nodes, native
multi-node TP=2 over gloo on the fast link, brought up by the real ``inv deploy.all --recipe
lab-tiny``.

What only a real engine can show: the two-node greedy text equals what a single vLLM process
gives on the same files; the startup milestones come from vLLM's own log lines; the bench passes
the recipe's gate and reads the engine's real ``/metrics``; the engine's own failure (a KV cache
beyond memory) is diagnosed from its own lines; ``serve.down`` leaves no headless rank behind
(the headless rank does not end when its head does: FACTS 2026-12). The module leaves the pair
as the other lab tests expect it (nothing of ours serving, the head's units back)."""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from sparkdeploy.helpers import status_page
from sparkdeploy.lab import images, lifecycle, tiny
from tests import chromium
from tests.lab.test_serve_lab import ours

pytestmark = [pytest.mark.lab, pytest.mark.real_engine]

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "configs" / "lab.yaml"
IMAGE = images.REAL_VLLM.tag
MODEL_DIR = "/srv/models/tiny-qwen3"
PROMPT = "The lab's two nodes"
TOKENS = 24


def inv_env(state: Path, profile: Path = LAB) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "INVOKE_SPARKDEPLOY_PROFILE": str(profile),
           "INVOKE_SPARKDEPLOY_STATE_DIR": str(state)}
    env.pop("SPARKDEPLOY_API_KEY", None)
    return env


def inv(state: Path, *args: str, timeout: float = 1500, profile: Path = LAB,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT,
                          env={**inv_env(state, profile), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def http() -> requests.Session:
    s = requests.Session()
    s.trust_env = False  # lab addresses only
    return s


def greedy(url: str, timeout: float = 120, model: str = tiny.REPO_ID) -> str:
    r = http().post(url.rstrip("/") + "/v1/completions", timeout=timeout, json={
        "model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
        "ignore_eos": True})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


SINGLE = f"""
import json
from vllm import LLM, SamplingParams
llm = LLM({MODEL_DIR!r}, dtype="bfloat16", max_model_len=2048, enforce_eager=True)
out = llm.generate([{PROMPT!r}], SamplingParams(temperature=0, max_tokens={TOKENS}, ignore_eos=True))
print("TEXT " + json.dumps(out[0].outputs[0].text))
"""


WATCH = {"watch_s": 5, "canary_s": 30, "restart_backoff_s": 0}
"""The watchdog's test timings (a node helper's, read when the units are written): a check every
5 s; the canary's deadline is the default 30 s, which a real model's answer keeps on two cores
busy starting another vLLM beside it (serve.add's test: with 5 s, the pair was restarted for a
slow answer)."""


METRICS = ROOT / "configs" / "lab-metrics.yaml"
"""The lab's profile with Prometheus and the exporters (the real image has prometheus_client)."""


def watched(where: Path) -> Path:
    """The lab's profile with the metrics on and the watchdog's test timings on top."""
    p = where / "watched.yaml"
    p.write_text(yaml.safe_dump({"extends": str(METRICS), "sparkdeploy": {"serve": WATCH}}))
    return p


@pytest.fixture(scope="module")
def served(lab, tmp_path_factory):
    """lab-tiny served by the real vLLM across the pair, through `inv deploy.all --recipe`."""
    bad = [r for r in lifecycle.up(nodes=2, real_engine=True) if r.failed]
    assert not bad, [f"{r.step}: {r.why}" for r in bad]
    state = tmp_path_factory.mktemp("real") / "state"
    r = inv(state, "deploy.all", "--recipe", tiny.RECIPE, profile=watched(state.parent))
    try:
        assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
        last = r.stdout.strip().splitlines()[-2:]
        url = last[0].split(" ", 1)[1]
        record = json.loads(Path(last[1].split(" ", 1)[1]).with_suffix(".json").read_text())
        yield lab, state, url, record, r.stdout
    finally:
        for m in reversed(tiny.MODELS):
            down = inv(state, "deploy.rollback", "--recipe", m.recipe, "--purge", "--yes",
                       profile=watched(state.parent))
            assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-2000:]


def test_two_nodes_give_exactly_the_text_of_one_vllm_process_on_the_same_files(served):
    lab, state, url, record, out = served
    models = http().get(url.rstrip("/") + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [tiny.REPO_ID]
    two = greedy(url)
    assert two and two == greedy(url)  # greedy: the same text every time
    # one process, no tensor parallelism, on the head's copy of the same files
    cp = lab.ssh("spark1", ["docker", "run", "--rm", "--network", "none", "--shm-size", "1g", "-e",
                            "VLLM_CPU_KVCACHE_SPACE=1", "-v", f"{MODEL_DIR}:{MODEL_DIR}:ro", IMAGE,
                            "python3", "-c", SINGLE], timeout=600)
    [line] = [ln for ln in cp.stdout.splitlines() if ln.startswith("TEXT ")]
    assert json.loads(line[5:]) == two


def test_the_ranks_are_one_per_node_and_the_worker_is_headless_over_the_fast_link(served):
    lab, state, url, record, out = served
    h = lab.ssh("spark1", ["docker", "logs", "sparkdeploy-vllm-head"])
    head = h.stdout + h.stderr
    worker = lab.ssh("spark2", ["docker", "logs", "sparkdeploy-vllm-worker"])
    worker_log = worker.stdout + worker.stderr
    assert "rank 1 in world size 2 is assigned as DP rank 0, PP rank 0, PCP rank 0, TP rank 1" in worker_log
    assert "10.77.1.1:29501" in worker_log
    assert "backend=gloo" in head + worker_log
    assert record["data"]["engine"]["chosen"] == "vllm"


def test_startup_milestones_come_from_the_engines_own_log(served):
    lab, state, url, record, out = served
    marks = record["data"]["engine"]["startup"]
    assert set(marks) >= {"containers_running", "dist_init", "port_open", "health", "first_token"}
    assert 0 < marks["dist_init"] <= marks["port_open"] <= marks["health"] <= marks["first_token"]
    # dist_init is vLLM's own line, each rank's place in the groups (engines/vllm.py RANK_JOINED)
    head = lab.ssh("spark1", ["docker", "logs", "sparkdeploy-vllm-head"])
    assert "rank 0 in world size 2 is assigned as DP rank 0" in head.stdout + head.stderr


def test_the_fabric_test_ran_in_the_real_image_over_gloo(served):
    lab, state, url, record, out = served
    assert "link.fabric" in out and "over 2 ranks (gloo)" in out, out[-3000:]


def test_bench_with_the_recipes_gate_and_the_engines_real_metrics(served, tmp_path):
    lab, state, url, record, out = served
    doc_path = tmp_path / "bench.json"
    r = inv(state, "bench.run", "--json", str(doc_path), "--requests", "4", "--concurrency", "1",
            "--warmup", "0", "--input-tokens", "256", "--output-tokens", "32", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    doc = json.loads(doc_path.read_text())
    # the gate: the answers lab-tiny's recipe recorded for its weights (random weights cannot add)
    recorded = [(a["prompt"], a["answer"]) for a in tiny_gate()]
    assert [(a["prompt"], a["answer"]) for a in doc["gate"]] == recorded
    assert doc["engine_metrics"]["skipped"] is None
    summary = doc["runs"][0]["summary"]
    assert summary["completed"] == 4 and summary["failed"] == 0
    engine = summary["engine"]
    assert engine["families"]["ttft_ms"] == "vllm:time_to_first_token_seconds"
    assert engine["ttft_count"] == 4 and engine["itl_count"] > 0


SECRET = "hf_labSecretNeverOnANode0123456789"
"""A token in the controller's environment while metrics.up runs: on no node, page or series."""
EXPORTER_PORT = 9408


def prom(url: str, query: str) -> list[dict]:
    """What Prometheus answers for ``query`` now (its instant vector)."""
    r = http().get(f"{url}/api/v1/query", params={"query": query}, timeout=10)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def until(what: str, probe, deadline: float = 30):
    end = time.monotonic() + deadline
    while True:
        got = probe()
        if got:
            return got
        assert time.monotonic() < end, f"{what}: not within {deadline:g} s"
        time.sleep(1)


def test_prometheus_on_the_head_scrapes_the_real_engine_and_every_node(served, tmp_path):
    """deploy.all started Prometheus (Debian's, on spark1) and the exporter on both nodes (in
    the real vLLM image); the engine's own counter grows after a bench, the bench's figures
    reach the exporter, every panel of the shipped dashboard has a series, and no secret of the
    controller reaches a node, a scrape or Prometheus' configuration."""
    lab, state, url, record, out = served
    prof = watched(state.parent)
    murl = url.rsplit(":", 1)[0] + ":9090"
    assert f"metrics: {murl}\nendpoint: {url}\n" in out, out[-3000:]
    # a re-run restarts nothing, with a token in the controller's environment
    r = inv(state, "metrics.up", profile=prof, env={"HF_TOKEN": SECRET})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert f"metrics: {murl} (3 targets up), as it was" in r.stdout, r.stdout[-3000:]
    rec = json.loads((state / "decisions" / lab_name(state) / "metrics.json").read_text())["data"]
    assert rec["units"] == {"spark1": ["sparkdeploy-exporter.service", "sparkdeploy-prometheus.service",
                                       "sparkdeploy-status.service"],
                            "spark2": ["sparkdeploy-exporter.service"]}
    assert rec["ports"] == {"spark1": [EXPORTER_PORT, 9090, 9480], "spark2": [EXPORTER_PORT]}

    def total() -> float:
        [series] = prom(murl, "vllm:generation_tokens_total")
        assert series["metric"]["job"] == "engine"
        return float(series["value"][1])

    before = total()
    doc = tmp_path / "bench.json"
    r = inv(state, "bench.run", "--json", str(doc), "--requests", "4", "--concurrency", "1",
            "--warmup", "0", "--input-tokens", "64", "--output-tokens", "16", profile=prof, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "the figures are in the metrics (sparkdeploy_bench_*)" in r.stdout
    # 4 answers of 16 tokens each, seen by the next scrape
    until("the generated tokens counted", lambda: total() >= before + 64)
    tok_s = json.loads(doc.read_text())["runs"][0]["summary"]["output_tok_s"]
    # the deploy's smoke put its own figure there first: this bench's replaces it
    until("this bench's figure", lambda: [
        s for s in prom(murl, "sparkdeploy_bench_output_tokens_per_second")
        if float(s["value"][1]) == pytest.approx(tok_s)])
    # the recording rules see the bench; each panel's query has a series here
    until("a generation rate", lambda: [s for s in prom(murl, "sparkdeploy:generation_tokens:rate1m")
                                        if float(s["value"][1]) > 0])
    dash = json.loads((ROOT / "src/sparkdeploy/data/metrics/dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 12
    empty = [e for e in exprs if not prom(murl, e)]
    assert empty == [], empty
    mem = {s["metric"]["node"]: float(s["value"][1])
           for s in prom(murl, "sparkdeploy_node_memory_available_bytes")}
    assert set(mem) == {"spark1", "spark2"} and all(v > 2**30 for v in mem.values()), mem
    info = prom(murl, "sparkdeploy_deployment_info")
    assert {(s["metric"]["node"], s["metric"]["recipe"], s["metric"]["engine"]) for s in info} == {
        ("spark1", tiny.RECIPE, "vllm"), ("spark2", tiny.RECIPE, "vllm")}
    [verdict] = prom(murl, "sparkdeploy_fabric_verdict")
    assert verdict["metric"]["verdict"] == "ok"
    # no secret: not in any scrape, Prometheus' configuration, or the files on the nodes
    config = http().get(f"{murl}/api/v1/status/config", timeout=10).json()["data"]["yaml"]
    texts = [config, *(http().get(f"http://{addr}:{EXPORTER_PORT}/metrics", timeout=10).text
                       for addr in node_addresses(lab))]
    texts += [lab.ssh(n, ["sh", "-c", "cat /var/lib/sparkdeploy-node/metrics/*.* "
                          "/etc/systemd/system/sparkdeploy-*.service"]).stdout for n in RANKS]
    assert all(SECRET not in t for t in texts)
    assert all("sparkdeploy_node_memory_total_bytes" in t for t in texts[1:3])


def test_the_status_page_shows_what_prometheus_answers_in_chromium(served, tmp_path):
    """The status page on the head, rendered by Debian's Chromium: no console message, every
    figure it shows is what Prometheus answers for the same query at the page's instant, the
    deployment and both nodes named, and nothing of the controller's secret."""
    lab, state, url, record, out = served
    base = url.rsplit(":", 1)[0]
    surl, murl = f"{base}:9480", f"{base}:9090"
    assert f"status: {surl}\n" in out, out[-3000:]
    dom, console = chromium.render(surl, tmp_path)
    assert console == []
    at = re.search(r'<body data-time="([0-9.]+)"', dom).group(1)
    cells = re.findall(r'<td class="figure" data-query="([^"]*)" data-value="([^"]*)" '
                       r'data-how="(\w+)">([^<]*)</td>', dom)
    assert len(cells) >= 12, dom[-3000:]
    for q, value, how, text in cells:
        r = http().get(f"{murl}/api/v1/query", params={"query": html.unescape(q), "time": at}, timeout=10)
        [series] = r.json()["data"]["result"]
        assert series["value"][1] == value, q
        assert text == status_page.show(float(value), how), q
    assert "<th>recipe</th><td>lab-tiny</td>" in dom
    assert "<th>spark1</th><td>head</td><td>0</td>" in dom and "<th>spark2</th><td>worker</td><td>1</td>" in dom
    assert SECRET not in dom


def lab_name(state: Path) -> str:
    """The deployment's records' folder under the state dir (the profile's name)."""
    [d] = [p.name for p in (state / "decisions").iterdir() if p.is_dir()]
    return d


def node_addresses(lab) -> list[str]:
    """Each node's management address (where the controller reaches it)."""
    return [lab.ssh(n, ["sh", "-c", "ip -4 -o addr show dev eth0 | awk '{print $4}'"]).stdout
            .strip().split("/")[0] for n in RANKS]


def test_bench_depth_counts_with_the_models_own_tokenizer_as_the_engine_does(served, tmp_path):
    """bench.depth with the head's copy of the recipe's model's tokenizer: every measured
    request's prompt, as the real engine counted it, is the tokenizer's count plus the chat
    template's (bench.depth refuses the run otherwise)."""
    lab, state, url, record, out = served
    doc_path = tmp_path / "depth.json"
    r = inv(state, "bench.depth", "--recipe", tiny.RECIPE, "--depths", "0,512", "--runs", "2",
            "--output-tokens", "16", "--json", str(doc_path), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    doc = json.loads(doc_path.read_text())
    assert doc["config"]["tokenizer"].endswith("tokenizer.json")
    rows = doc["depths"]
    assert [d["depth"] for d in rows] == [0, 512], rows
    assert all("error" not in d and d["pp_tok_s"] > 0 and d["tg_tok_s"] > 0 for d in rows), rows
    # the context grew by the depth asked for, as the engine counted it: 512 tokens, the blank
    # line after them and the run's name growing from d0 to d512 (516 measured); bench.depth
    # itself refused any request the engine counted otherwise than the tokenizer
    assert 512 < rows[1]["prompt_tokens"] - rows[0]["prompt_tokens"] <= 512 + 8, rows


def test_serve_swap_to_a_second_real_model_passes_its_own_gate(served):
    """serve.swap from lab-tiny to lab-tiny-b (the same architecture, other weights) on the real
    engine: b's recipe gate judges the new engine (its recorded greedy answers), the endpoint
    then serves b alone and answers with b's own text."""
    lab, state, url, record, out = served
    before = greedy(url)
    r = inv(state, "serve.swap", "--recipe", tiny.SECOND.recipe, profile=watched(state.parent))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "swap.prepare" in r.stdout and "swap.cut-over" in r.stdout
    last = r.stdout.strip().splitlines()[-3:]
    assert last[1] == f"endpoint: {url}", last
    rec = json.loads(Path(last[2].split(" ", 1)[1]).with_suffix(".json").read_text())["data"]
    assert (rec["from_model"], rec["to_model"], rec["outcome"]) == (
        tiny.REPO_ID, tiny.SECOND.repo_id, "swapped"), rec
    models = http().get(url.rstrip("/") + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [tiny.SECOND.repo_id]
    after = greedy(url, model=tiny.SECOND.repo_id)
    assert after and after != before
    SWAPPED.update(model=tiny.SECOND.repo_id, recipe=tiny.SECOND.recipe)
    # the metrics followed: the exporters name the new recipe, the head's swap record its phase
    murl = url.rsplit(":", 1)[0] + ":9090"
    until("the new recipe in the metrics", lambda: {
        s["metric"]["recipe"] for s in prom(murl, "sparkdeploy_deployment_info")} == {tiny.SECOND.recipe})
    [phase] = prom(murl, "sparkdeploy_swap_phase")
    assert (phase["metric"]["phase"], phase["metric"]["from_model"], phase["metric"]["to_model"]) == (
        "done", tiny.REPO_ID, tiny.SECOND.repo_id)


SWAPPED = {"model": tiny.REPO_ID, "recipe": tiny.RECIPE}
"""The model the pair serves after the swap test (the tests after it ask for that one)."""


def test_a_frozen_real_worker_is_found_and_the_pair_restarted_as_a_whole(served):
    """serve.persist's watchdog on the real engine: the units adopt what serves (no rank
    restarted), then every process of the headless rank's container is stopped (``lab.fault
    rank-wedged``: vLLM's own workers frozen mid-serve); the watchdog names it, restarts both
    nodes' containers, records it with each node's logs and when it served again (serve.status
    shows it), and the real model answers again with its greedy text."""
    lab, state, url, record, out = served
    prof = watched(state.parent)
    model = SWAPPED["model"]
    before = greedy(url, model=model)
    # without --recipe, the profile's own model: refused, what serves untouched (the nodes'
    # containers say which recipe serves)
    r = inv(state, "serve.persist", profile=prof)
    assert r.returncode == 1, r.stdout[-3000:]
    assert f"(its containers say recipe {SWAPPED['recipe']})" in r.stdout, r.stdout[-3000:]
    assert greedy(url, model=model) == before
    lab.ssh("spark1", ["rm", "-f", "--", RESTARTS])  # this test's restarts only
    up = {n: started_at(lab, n, c) for n, c in RANKS.items()}
    r = inv(state, "serve.persist", "--recipe", SWAPPED["recipe"], profile=prof)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    # the units adopted what serves: no rank restarted, nothing left to adopt
    assert r.stdout.count("it adopted sparkdeploy-vllm-") == 2, r.stdout[-3000:]
    assert {n: started_at(lab, n, c) for n, c in RANKS.items()} == up
    for n in RANKS:
        assert lab.ssh(n, ["test", "-e", ADOPT], check=False).returncode == 1
    head0 = up["spark1"]
    t0 = time.monotonic()
    r = inv(state, "lab.fault", "rank-wedged", profile=prof, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    end = t0 + 480
    while True:
        try:
            again = greedy(url, timeout=5, model=model)
            if started_at(lab, "spark1", "sparkdeploy-vllm-head") != head0:
                break
        except requests.RequestException:
            pass
        assert time.monotonic() < end, "the real engine did not answer again within 480 s"
        time.sleep(2)
    took = time.monotonic() - t0
    print(f"\nreal engine: frozen worker -> answering again: {took:.1f} s")
    assert again == before
    # the record on the head: why, each node's saved logs, when it served again (the head
    # writes it once its canary passes); serve.status shows it
    end = time.monotonic() + 30
    while True:
        [rec] = json.loads(lab.ssh("spark1", ["cat", RESTARTS]).stdout)["restarts"]
        if rec["served_again_after_s"] is not None or time.monotonic() > end:
            break
        time.sleep(1)
    assert rec["kind"] == "rank" and rec["outcome"] == "restarted", rec
    assert rec["why"].startswith("spark2: sparkdeploy-vllm-worker stopped (state T: pid "), rec
    assert 0 < rec["served_again_after_s"] < took, rec
    for node, name in RANKS.items():
        assert lab.ssh(node, ["ls", rec["logs"][node]]).stdout.split() == [f"{name}.log"], node
    r = inv(state, "serve.status", profile=prof)
    assert f"vllm: restart 1 at {rec['at']} by {UNIT}: {rec['why']}" in r.stdout, r.stdout[-3000:]
    assert f"served again after {rec['served_again_after_s']:g}s" in r.stdout
    # and in the metrics: the head's exporter reads the same record
    murl = url.rsplit(":", 1)[0] + ":9090"
    [restarts] = until("the restart in the metrics",
                       lambda: prom(murl, "sparkdeploy_watchdog_restarts_total"))
    assert (restarts["metric"]["reason"], restarts["value"][1]) == (rec.get("class") or "unknown", "1")
    assert f"metrics: {murl} (Prometheus on spark1)" in r.stdout


GATEWAY_PORT = 8888


def placing(where: Path) -> Path:
    """The watched profile with the fit's reserve at what the lab's CPU engine holds (its
    processes' RSS, ~2.5 GiB, beside VLLM_CPU_KVCACHE_SPACE=1): three models fit the lab's memory."""
    p = where / "placing.yaml"
    p.write_text(yaml.safe_dump({"extends": str(watched(where)), "sparkdeploy": {"fit": {"reserve_gib": 3}}}))
    return p


def changed_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if re.match(r"^\S+ changed ", ln)]


def test_three_real_models_on_the_pair_answer_through_one_endpoint(served, tmp_path):
    """serve.add: lab-tiny on one node and lab-tiny-c on the other, beside lab-tiny-b across both
    (the swap's), each placed where it fits and brought up by the real engine without touching
    what serves; the gateway on the head routes each by its name, streams, refuses an unknown one
    naming those there; a model that fits nowhere is refused with the numbers and nothing stops;
    a fresh controller lists the set, and a re-run changes nothing."""
    lab, state, url, record, out = served
    prof = placing(state.parent)
    base_model = SWAPPED["model"]
    # the two real models the pair does not serve (after the swap: lab-tiny and lab-tiny-c)
    placed = [m for m in tiny.MODELS if m.repo_id != base_model]
    before = greedy(url, model=base_model)
    up = {n: started_at(lab, n, c) for n, c in RANKS.items()}
    endpoint = None
    for m, node, given in zip(placed, ("spark1", "spark2"), (["--nodes", "spark1"], []), strict=True):
        # the first on the nodes given; the second where it fits: the node holding no placed model
        r = inv(state, "serve.add", "--recipe", m.recipe, *given, profile=prof)
        assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
        assert f"{m.recipe} ({m.repo_id}) fits on {node}: TP=1 x PP=1" in r.stdout, r.stdout[-3000:]
        endpoint = r.stdout.strip().splitlines()[-1]
        assert endpoint == f"endpoint: http://{url.split('//')[1].rsplit(':', 1)[0]}:{GATEWAY_PORT}"
        # what served before was not touched
        assert {n: started_at(lab, n, c) for n, c in RANKS.items()} == up
        assert greedy(url, model=base_model) == before
        # the pair's model is persisted (the watchdog test): the placed one is too, its own unit
        unit = f"sparkdeploy-{m.recipe}-vllm.service"
        assert f"{unit} written, enabled and started; it adopted" in r.stdout, r.stdout[-3000:]
        assert lab.ssh(node, ["systemctl", "is-active", unit]).stdout.strip() == "active"
    gateway = endpoint.split(" ", 1)[1]
    models = http().get(gateway + "/v1/models", timeout=10).json()
    assert sorted(m["id"] for m in models["data"]) == sorted(
        [base_model, *(m.repo_id for m in placed)])
    # each model answers through the gateway with the text its own engine gives (serve.list
    # names each engine's own address)
    r = inv(state, "serve.list", "--json", profile=prof)
    assert r.returncode == 0, r.stderr[-3000:]
    own = {e["repo"]: e["url"] for e in json.loads(r.stdout)}
    for m in placed:
        assert greedy(gateway, model=m.repo_id) == greedy(own[m.repo_id], model=m.repo_id) != ""
    assert greedy(gateway, model=base_model) == before
    # streamed through, chunk by chunk
    with http().post(gateway + "/v1/chat/completions", stream=True, timeout=60, json={
            "model": placed[1].repo_id, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8, "stream": True}) as resp:
        assert resp.status_code == 200
        events = [ln for ln in resp.iter_lines() if ln.startswith(b"data: ")]
    assert len(events) >= 3 and events[-1] == b"data: [DONE]"
    bad = http().post(gateway + "/v1/completions", timeout=10, json={"model": "nope", "prompt": "x"})
    assert bad.status_code == 404 and all(m.repo_id in bad.json()["message"] for m in placed)
    # per model figures at the gateway
    figures = http().get(gateway + "/metrics", timeout=10).text
    assert f'sparkdeploy_gateway_requests_total{{model="{placed[0].repo_id}"}}' in figures
    # a model that fits nowhere: refused with the numbers, nothing stops
    r = inv(state, "serve.add", "--recipe", "qwen3.5-122b-a10b-fp8", profile=prof)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "recipe qwen3.5-122b-a10b-fp8 does not fit beside what the cluster serves: on spark" in r.stdout
    assert re.search(r"spark1: \d+\.\d GiB usable of \d+\.\d GiB \(\d+\.\d GiB available now, "
                     + re.escape(placed[0].recipe) + r" holds \d+\.\d GiB \(0\.\d+ of it\)\)",
                     r.stdout), r.stdout[-3000:]
    assert {n: started_at(lab, n, c) for n, c in RANKS.items()} == up
    assert sorted(m["id"] for m in http().get(gateway + "/v1/models", timeout=10).json()["data"]) == \
        sorted([base_model, *(m.repo_id for m in placed)])
    # a fresh controller (its own empty state dir) sees the set, and a re-run changes nothing
    fresh = tmp_path / "fresh"
    r = inv(fresh, "serve.list", "--json", profile=prof)
    assert r.returncode == 0, r.stderr[-3000:]
    listed = {e["repo"]: e for e in json.loads(r.stdout)}
    assert set(listed) == {base_model, *(m.repo_id for m in placed)}
    assert [listed[m.repo_id]["nodes"] for m in placed] == [["spark1"], ["spark2"]]
    assert all(e["loaded"] for e in listed.values()), listed
    placed_up = {m.recipe: started_at(lab, n, f"sparkdeploy-{m.recipe}-vllm-head")
                 for m, n in zip(placed, ("spark1", "spark2"), strict=True)}
    for m in placed:
        r = inv(fresh, "serve.add", "--recipe", m.recipe, profile=prof)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        assert changed_lines(r.stdout) == [], r.stdout[-4000:]
        assert r.stdout.strip().splitlines()[-1] == endpoint
    assert placed_up == {m.recipe: started_at(lab, n, f"sparkdeploy-{m.recipe}-vllm-head")
                         for m, n in zip(placed, ("spark1", "spark2"), strict=True)}
    # its own watchdog: the placed model's engine killed, its unit brings it back alone
    victim, node = f"sparkdeploy-{placed[1].recipe}-vllm-head", "spark2"
    # this test's restarts only: the node keeps a unit's restart record, and its budget, across
    # deployments of the same name
    lab.ssh(node, ["rm", "-f", "--", f"/var/lib/sparkdeploy-node/serve/{placed[1].recipe}-vllm.restarts.json"])
    lab.ssh(node, ["docker", "kill", victim])
    end = time.monotonic() + 240
    while True:
        try:
            if greedy(gateway, timeout=5, model=placed[1].repo_id) and \
                    started_at(lab, node, victim) not in ("", placed_up[placed[1].recipe]):
                break
        except requests.RequestException:
            pass
        assert time.monotonic() < end, f"{victim} did not serve again within 240 s"
        time.sleep(2)
    assert {n: started_at(lab, n, c) for n, c in RANKS.items()} == up
    assert started_at(lab, "spark1", f"sparkdeploy-{placed[0].recipe}-vllm-head") == \
        placed_up[placed[0].recipe]


def on_demand(where: Path) -> Path:
    """The placing profile with room for one model on demand at a time on the head (each takes
    about 3 GiB), and a request's wait shorter than the CPU engine's load (about 30 s)."""
    p = where / "on-demand.yaml"
    p.write_text(yaml.safe_dump({"extends": str(placing(where)), "sparkdeploy": {
        "gateway": {"on_demand_gib": 4, "wait_s": 5}}}))
    return p


def gateway_record(lab) -> list[dict]:
    r = lab.ssh("spark1", ["cat", "/var/lib/sparkdeploy-node/gateway/loads.json"], check=False)
    return json.loads(r.stdout) if r.returncode == 0 else []


def unit_state(lab, verb: str, unit: str) -> str:
    return lab.ssh("spark1", ["systemctl", verb, unit], check=False).stdout.strip()


def served_after_503s(gateway: str, model: str, deadline_s: float = 240) -> tuple[str, list[str]]:
    """The greedy text once the model answers through the gateway; the Retry-After of each 503
    before it."""
    retries: list[str] = []
    end = time.monotonic() + deadline_s
    while True:
        r = http().post(gateway + "/v1/completions", timeout=120, json={
            "model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True})
        if r.status_code == 200:
            return r.json()["choices"][0]["text"], retries
        assert r.status_code == 503, (r.status_code, r.text[:500])
        retries.append(r.headers.get("Retry-After", ""))
        assert time.monotonic() < end, f"{model} not loaded within {deadline_s} s: {r.text[:300]}"


def test_models_on_demand_load_on_their_first_request_and_evict_the_least_recent(served, tmp_path):
    """serve.add --on-demand: lab-tiny and lab-tiny-c registered on the head (units written, not
    started), listed by the gateway; the first request for one loads it through its unit (503
    with Retry-After while the real engine starts), the first request for the other evicts it
    (room for one: gateway.on_demand_gib); the record, serve.status, serve.list and the
    gateway's /metrics say so; a fresh controller sees the set and a re-run changes nothing."""
    lab, state, url, record, out = served
    prof = on_demand(state.parent)
    base_model = SWAPPED["model"]
    models = [m for m in tiny.MODELS if m.repo_id != base_model]
    up = {n: started_at(lab, n, c) for n, c in RANKS.items()}
    for m in models:  # placed always loaded by the test before: out, then back on demand
        r = inv(state, "serve.remove", "--recipe", m.recipe, profile=prof)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    units = {m.recipe: f"sparkdeploy-{m.recipe}-vllm.service" for m in models}
    for m in models:
        r = inv(state, "serve.add", "--recipe", m.recipe, "--on-demand", profile=prof)
        assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
        assert f"{m.recipe} ({m.repo_id}) fits on spark1, on demand" in r.stdout, r.stdout[-3000:]
        assert f"{units[m.recipe]} written, not started: on demand" in r.stdout, r.stdout[-3000:]
        gateway = r.stdout.strip().splitlines()[-1].split(" ", 1)[1]
    for m in models:  # registered, not loaded, not at boot
        assert unit_state(lab, "is-active", units[m.recipe]) == "inactive"
        assert unit_state(lab, "is-enabled", units[m.recipe]) == "disabled"
        assert started_at(lab, "spark1", f"sparkdeploy-{m.recipe}-vllm-head") == ""
    listed = http().get(gateway + "/v1/models", timeout=10)
    assert sorted(x["id"] for x in listed.json()["data"]) == sorted([base_model, *(m.repo_id for m in models)])
    assert "X-Sparkdeploy-Unreachable" not in listed.headers
    r = inv(state, "serve.list", "--json", profile=prof)
    entries = {e["repo"]: e for e in json.loads(r.stdout)}
    assert [(entries[m.repo_id]["loaded"], entries[m.repo_id]["on_demand"]) for m in models] == [(False, True)] * 2
    # the first request loads the first: 503s with Retry-After while the engine starts (wait_s 5)
    first, retries = served_after_503s(gateway, models[0].repo_id)
    assert retries and all(x.isdigit() and int(x) >= 1 for x in retries), retries
    assert unit_state(lab, "is-active", units[models[0].recipe]) == "active"
    assert first == greedy(gateway, model=models[0].repo_id) != ""
    # the second's first request evicts the first (room for one), then loads
    second, _ = served_after_503s(gateway, models[1].repo_id)
    assert second != ""
    assert unit_state(lab, "is-active", units[models[0].recipe]) == "inactive"
    assert started_at(lab, "spark1", f"sparkdeploy-{models[0].recipe}-vllm-head") == ""
    events = [(e["event"], e["model"]) for e in gateway_record(lab)]
    assert events == [("load", models[0].repo_id), ("evict", models[0].repo_id), ("load", models[1].repo_id)]
    assert gateway_record(lab)[1]["for"] == models[1].repo_id
    # serve.status, serve.list and the gateway's figures say the same
    r = inv(state, "serve.status", profile=prof)
    assert re.search(rf"{re.escape(models[1].repo_id)} on demand \({units[models[1].recipe]}\): loaded; "
                     r"1 load\(s\), 0 eviction\(s\); last load at \S+ in [\d.]+ s", r.stdout), r.stdout[-3000:]
    assert f"{models[0].repo_id} on demand ({units[models[0].recipe]}): not loaded; 1 load(s), 1 eviction(s)" \
        in r.stdout, r.stdout[-3000:]
    figures = http().get(gateway + "/metrics", timeout=10).text
    for name, model, value in (("loaded", models[1], 1), ("loaded", models[0], 0),
                               ("evictions_total", models[0], 1), ("loads_total", models[1], 1)):
        assert re.search(rf'^sparkdeploy_gateway_{name}{{model="{re.escape(model.repo_id)}"}} {value}$',
                         figures, re.M), (name, model.repo_id, figures[-3000:])
    # a fresh controller sees the set, and a re-run changes nothing (the loaded one stays loaded)
    fresh = tmp_path / "fresh"
    r = inv(fresh, "serve.list", "--json", profile=prof)
    entries = {e["repo"]: e for e in json.loads(r.stdout)}
    assert [(entries[m.repo_id]["loaded"], entries[m.repo_id]["on_demand"]) for m in models] == [
        (False, True), (True, True)]
    loaded_at = started_at(lab, "spark1", f"sparkdeploy-{models[1].recipe}-vllm-head")
    for m in models:
        r = inv(fresh, "serve.add", "--recipe", m.recipe, "--on-demand", profile=prof)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        assert changed_lines(r.stdout) == [], r.stdout[-4000:]
    assert started_at(lab, "spark1", f"sparkdeploy-{models[1].recipe}-vllm-head") == loaded_at
    # always loaded is not on demand: refused, one line, nothing changed
    r = inv(fresh, "serve.add", "--recipe", models[0].recipe, profile=prof)
    assert r.returncode == 1 and f"{models[0].recipe} is placed on demand already" in r.stdout
    assert {n: started_at(lab, n, c) for n, c in RANKS.items()} == up


def test_serve_down_leaves_no_headless_rank(served):
    """After the watchdog's restart too: serve.down ends both ranks (the headless one does not
    end with its head: FACTS 2026-12) and the models placed beside them with the gateway, and
    serve.unpersist leaves no unit."""
    lab, state, url, record, out = served
    r = inv(state, "serve.down", profile=watched(state.parent))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    for node in ("spark1", "spark2"):
        assert ours(lab, node) == []
        procs = lab.ssh(node, ["ps", "-eo", "args"]).stdout
        assert "VLLM::" not in procs and "--headless" not in procs, procs
    r = inv(state, "serve.unpersist", profile=watched(state.parent))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    for node in ("spark1", "spark2"):
        assert lab.ssh(node, ["test", "-e", f"/etc/systemd/system/{UNIT}"], check=False).returncode == 1
        # the metrics went with the engine: no unit, no container, no port
        units = lab.ssh(node, ["sh", "-c", "ls /etc/systemd/system/ | grep -c '^sparkdeploy-' || true"])
        assert units.stdout.strip() == "0", units.stdout
        assert "sparkdeploy-exporter" not in lab.ssh(node, ["docker", "ps", "-a"]).stdout
        held = lab.ssh(node, ["ss", "-Hltn"]).stdout
        # and the models serve.add placed with their gateway: nothing on its port either
        assert not [p for p in (EXPORTER_PORT, 9090, 9480, GATEWAY_PORT) if f":{p} " in held], held


RESTARTS = "/var/lib/sparkdeploy-node/serve/vllm.restarts.json"
ADOPT = "/var/lib/sparkdeploy-node/serve/vllm.adopt"
RANKS = {"spark1": "sparkdeploy-vllm-head", "spark2": "sparkdeploy-vllm-worker"}
UNIT = "sparkdeploy-vllm.service"


def started_at(lab, node: str, name: str) -> str:
    return lab.ssh(node, ["docker", "inspect", "--format", "{{.State.StartedAt}}", name],
                   check=False).stdout.strip()


def tiny_gate() -> list[dict]:
    import yaml

    from sparkdeploy.lab import internet

    body = yaml.safe_load((internet.RECIPES / "lab-tiny.yaml").read_text())
    return body["sparkdeploy"]["about"]["gate"]["answers"]


def test_a_kv_cache_beyond_memory_fails_the_real_engine_diagnosed_and_nothing_left(served, tmp_path):
    """The real engine's own failure (not a stand-in's): VLLM_CPU_KVCACHE_SPACE beyond the
    node's memory; serve.up ends at once with vLLM's line, classed out-of-memory, and no rank
    of it left running (the headless one included)."""
    import yaml

    body = yaml.safe_load((ROOT / "src/sparkdeploy/lab/recipes/lab-tiny.yaml").read_text())
    [engine] = body["sparkdeploy"]["engines"]
    engine["env"] = {**engine["env"], "VLLM_CPU_KVCACHE_SPACE": "64"}
    prof = tmp_path / "kv.yaml"
    prof.write_text(yaml.safe_dump({"extends": str(LAB), "sparkdeploy": {
        "recipe": tiny.RECIPE, "engines": [engine]}}))
    lab, state, url, record, out = served
    r = inv(state, "serve.up", profile=prof, timeout=900)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "class: out-of-memory" in r.stdout, r.stdout[-4000:]
    assert "less than requested memory for kv (64.0 GiB)" in r.stdout
    for node in ("spark1", "spark2"):
        assert ours(lab, node) == []



def test_a_worker_that_cannot_reach_its_master_is_ended_by_the_readiness_deadline_and_named(served, tmp_path):
    """The headless rank cannot reach its master (``lab.fault link-drop``: the switch's port
    towards spark2 down); vLLM's c10d store keeps retrying for 30 minutes (FACTS 2026-12). With
    the link down before serve.up, its link check refuses at once; down once the ranks'
    containers run (past every check, before vLLM's rendezvous), serve.up's readiness deadline
    ends the bring-up and the diagnosis names the link from vLLM's own lines (``[c10d] The client
    socket has failed to connect ... No route to host``); no rank is left behind."""
    from sparkdeploy.lab import faults

    lab, state, url, record, out = served
    prof = tmp_path / "stall.yaml"
    prof.write_text(yaml.safe_dump({"extends": str(LAB), "sparkdeploy": {
        "recipe": tiny.RECIPE, "serve": {"stall_s": STALL, "poll_s": 1, "ready_timeout_s": READY}}}))
    down = inv(state, "serve.down", profile=prof)  # a bring-up from nothing, whatever ran before
    assert down.returncode == 0, down.stdout[-3000:]
    try:
        [f] = faults.set_fault("link-drop", node="spark2")
        assert not f.failed, f.why
        r = inv(state, "serve.up", profile=prof, timeout=300)
        assert r.returncode == 1 and "enp1s0f0np0: is down, must be up" in r.stdout, r.stdout[-3000:]
        assert "serve.up" not in r.stdout.split("recap:")[0], r.stdout[-3000:]
    finally:
        [undo] = faults.set_fault("none")
        assert not undo.failed, undo.why
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "serve.up"], cwd=ROOT,
                            env=inv_env(state, prof), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        end = t0 + 300
        while "sparkdeploy-vllm-worker" not in lab.ssh(
                "spark2", ["docker", "ps", "--format", "{{.Names}}"]).stdout:
            assert proc.poll() is None and time.monotonic() < end, "the worker never started"
            time.sleep(1)
        [f] = faults.set_fault("link-drop", node="spark2")
        assert not f.failed, f.why
        stdout, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        [undo] = faults.set_fault("none")
        assert not undo.failed, undo.why
    took = time.monotonic() - t0
    print(f"\nreal engine: master unreachable -> ended and named in {took:.1f} s")
    assert proc.returncode == 1, stdout[-3000:]
    # c10d's retries (`failed to connect ... No route to host`) name the link; before the first
    # of them, only the store's wait shows: an init hang
    assert "class: link-misconfigured" in stdout or "class: nccl-init-hang" in stdout, stdout[-4000:]
    assert took < READY + 240, took
    for node in ("spark1", "spark2"):
        assert ours(lab, node) == []


STALL = 90.0
"""No output for this long is a hang (vLLM's import on a loaded 2-core lab prints nothing for up
to about 40 s)."""
READY = 100.0
"""The readiness deadline of that test: what ends the bring-up whose worker cannot reach its
master (a healthy TP=2 bring-up of lab-tiny takes about 90 s here; this one never ends by
itself, so any deadline past vLLM's first rendezvous attempt, about 40 s in, shows it)."""
