"""bench on the lab (issue 31), through the real `inv`: the depth sweep against the lab's
engine with the head's own tokenizer (read from the model directory over SSH), and the coherence
gate refusing an engine that answers garbage (`inv lab.fault garbage`) while its /health is 200."""

from __future__ import annotations

import json

import pytest
import requests

from tests.lab.test_deploy_lab import inv

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def serving(lab, tmp_path_factory):
    """A state dir whose deployment serves (deploy.all: a no-op when the lab already serves)."""
    state_dir = tmp_path_factory.mktemp("bench-state")
    r = inv(state_dir, "deploy.all")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    url = r.stdout.strip().splitlines()[-2].split(" ", 1)[1]
    return state_dir, url.rstrip("/")


def failed(stdout: str) -> list[str]:
    return [ln.split(" - ", 1)[-1].strip() for ln in stdout.splitlines() if " failed " in ln]


def test_depth_sweep_with_the_heads_tokenizer(serving):
    state_dir, _url = serving
    out = state_dir / "depth.json"
    r = inv(state_dir, "bench.depth", "--depths", "0,1024,4096", "--runs", "2",
            "--output-tokens", "8", "--json", str(out))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    rows = doc["depths"]
    assert [d["depth"] for d in rows] == [0, 1024, 4096]
    # the head's tokenizer.json was read and kept; the engine counted with the same tokenizer
    assert doc["config"]["tokenizer"].endswith("bench/tokenizer/tokenizer.json")
    assert all(d["prompt_tokens"] > d["depth"] for d in rows)
    # the stand-in's shape: prefill rate grows toward its set rate, decode slows with depth
    assert rows[0]["pp_tok_s"] < rows[1]["pp_tok_s"] < rows[2]["pp_tok_s"]
    assert rows[0]["tg_tok_s"] > rows[2]["tg_tok_s"]
    assert "pp @ d4096" in r.stdout and "tg8 @ d4096" in r.stdout


def test_garbage_fails_the_gate_while_health_is_green(lab, serving):
    state_dir, url = serving
    out = state_dir / "garbage.json"
    r = inv(state_dir, "lab.fault", "garbage")
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        assert requests.get(url + "/health", timeout=10).status_code == 200
        for task in (["bench.run", "--requests", "2", "--warmup", "0"],
                     ["bench.depth", "--depths", "0", "--runs", "1"]):
            r = inv(state_dir, *task, "--json", str(out))
            assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-2000:]
            assert failed(r.stdout)[0].startswith(
                "coherence gate: 'What is 17 + 25? Answer with the number only.' came back "
                "'!!!!"), r.stdout
            assert not out.exists()
    finally:
        r = inv(state_dir, "lab.fault", "none")
        assert r.returncode == 0, r.stdout + r.stderr
    r = inv(state_dir, "bench.run", "--requests", "2", "--warmup", "0", "--json", str(out))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert json.loads(out.read_text())["gate"][0]["answer"].strip() == "42"
