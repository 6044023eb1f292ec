"""bench.run on the lab's deployment reads the engine's own /metrics (issue 31): the lab's seed
profile serves SGLang with the recipe's --enable-metrics across the two nodes, and the bench sets
the engine's TTFT, ITL and end-to-end means beside its own, writing the HTML report beside the
JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkdeploy import deployment

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
PROFILE = "configs/lab.yaml"


def inv(state_dir: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "INVOKE_SPARKDEPLOY_PROFILE": PROFILE,
           "INVOKE_SPARKDEPLOY_STATE_DIR": str(state_dir)}
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def served(lab, tmp_path_factory):
    state = tmp_path_factory.mktemp("bench-metrics-state")
    r = inv(state, "deploy.all")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    url = r.stdout.strip().splitlines()[-2].split(" ", 1)[1]
    return state, url


def test_bench_reads_sglangs_metrics_on_the_lab(served, tmp_path):
    state, url = served
    dep = deployment.load(ROOT / PROFILE, state)
    assert "--enable-metrics" in dep.profile.engines[0].args  # the recipe's
    out = tmp_path / "run.json"
    r = inv(state, "bench.run", "--url", url, "--concurrency", "1,2", "--requests", "4",
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
