"""deploy.all on three and four lab nodes, through the real `inv`: `lab.up --nodes 3` with
configs/lab-3nodes.yaml (pipeline parallel 3), then `--nodes 4` with configs/lab-4nodes.yaml and
`deploy.all --recipe qwen3-235b-a22b-instruct-2507-fp8` (the 235B recipe, too big for two Sparks:
the model part from the recipe, the layout the fit calculator picks for four nodes, TP=4; the
lab hub serves the repository's real config.json and file layout). Each ends serving: the weights verified on every node
(its own records agree with the head's), the same image ID on every node, one engine rank per
node read from the labels `docker ps` shows there (ranks 0..N-1, the image ID each runs), the
pipeline's stages in the ranks' own logs, and the endpoint streams. Each takes its deployment
down (serve.down; the head's units back) and the module leaves the pair as it found it.

The tests run in file order (three nodes, then four: the lab grows by one node)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from sparkdeploy.core.labels import parse_ps, ps_args
from sparkdeploy.lab import layout, lifecycle
from sparkdeploy.node import deployment
from sparkdeploy.profile.config import read_recipe
from tests.lab.conftest import lab_with
from tests.lab.test_deploy_lab import VERIFIED
from tests.lab.test_serve_lab import stream

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
PROFILES = {3: "configs/lab-3nodes.yaml", 4: "configs/lab-4nodes.yaml"}
RECIPES = {4: "qwen3-235b-a22b-instruct-2507-fp8"}
"""The recipe ``deploy.all --recipe`` deploys on that many nodes (else the profile's model)."""
LAYOUTS = {3: (1, 3), 4: (4, 1)}
"""(TP, PP) of the engines: the profile's on three; the fit calculator's for the recipe on four
(64 attention heads and 4 KV heads divide by 4: tensor parallel first)."""
STAGES = {3: [(0, 0), (1, 0), (2, 0)], 4: [(0, 0), (0, 1), (0, 2), (0, 3)]}
"""(pipeline stage, tensor rank) of the node ranks, in order, as SGLang tags their log lines."""


@pytest.fixture(scope="module")
def grown(lab):
    """The lab with three nodes for this module (the four-node test adds the fourth), then the
    pair again, as the rest of the suite expects it."""
    with lab_with(lab, 3) as big:
        yield big


def inv(n: int, state: Path, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"),
           "INVOKE_SPARKDEPLOY_PROFILE": PROFILES[n], "INVOKE_SPARKDEPLOY_STATE_DIR": str(state)}
    env.pop("SPARKDEPLOY_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def engine_containers(lab, node: str, name: str) -> list:
    """The deployment's engine containers on ``node``, as their labels there say."""
    return parse_ps(lab.ssh(node, ["docker", *ps_args(name)]).stdout)


def verified(lab, node: str, path: str) -> dict[str, int]:
    return json.loads(lab.ssh(node, ["python3", "-c", VERIFIED, path]).stdout)


def image_ids(lab, nodes: list[str], ref: str) -> dict[str, str]:
    return {x: lab.ssh(x, ["docker", "image", "inspect", "--format", "{{.Id}}", ref],
                       check=False).stdout.strip() for x in nodes}


def check_serving(lab, n: int, state: Path, out: str) -> None:
    """What a finished deploy.all on ``n`` nodes must have left on them."""
    dep = deployment.load(ROOT / PROFILES[n], state, recipe=RECIPES.get(n))
    assert {(e.tensor_parallel, e.pipeline_parallel) for e in dep.profile.engines} == {LAYOUTS[n]}
    if n in RECIPES:
        assert dep.profile.model.repo == "Qwen/Qwen3-235B-A22B-Instruct-2507-FP8"
        tp, pp, why = read_recipe(RECIPES[n]).layout(n)
        assert (tp, pp) == LAYOUTS[n] and why.startswith("the fit calculator"), why
    nodes = [x.name for x in dep.profile.nodes]
    assert nodes == lifecycle.lab_facts()["nodes"] == layout.node_names(n)
    last = out.strip().splitlines()[-2:]
    assert last[0].startswith("endpoint: http://") and last[1].startswith("record: "), last
    url, record = last[0].split(" ", 1)[1], Path(last[1].split(" ", 1)[1])
    data = json.loads(record.with_suffix(".json").read_text())["data"]
    assert data["engine"]["chosen"] == "sglang" and not data["engine"].get("tried"), data["engine"]
    assert {s["state"] for s in data["steps"].values()} <= {"done", "skipped"}, data["steps"]
    assert data["steps"]["model.precheck"]["state"] == data["steps"]["model.fit"]["state"] == "done"
    # the weights: every node's own records hold every file the head's do, same sizes
    weights = {x: verified(lab, x, dep.profile.model.path) for x in nodes}
    assert weights[nodes[0]] and all(w == weights[nodes[0]] for w in weights.values())
    # the image: one ID everywhere, the one the record names and every rank runs
    ids = image_ids(lab, nodes, data["image"]["tag"])
    assert set(ids.values()) == {data["image"]["id"]}, ids
    ranks = {}
    for x in nodes:
        [c] = engine_containers(lab, x, dep.profile.name)
        assert c.running and c.engine == "sglang" and c.image_id == data["image"]["id"], c
        ranks[x] = c.rank
    assert ranks == {x: i for i, x in enumerate(nodes)}
    # the ranks' own logs: each node one (pipeline, tensor) stage of the shape the profile asks
    seen = []
    for x in nodes:
        [c] = engine_containers(lab, x, dep.profile.name)
        cp = lab.ssh(x, ["docker", "logs", c.name])
        line = next(ln for ln in (cp.stdout + cp.stderr).splitlines() if "] world_size=" in ln)
        assert f"world_size={n} rank={ranks[x]} " in line, line
        m = re.match(r"\[[-0-9: ]+ (?:PP(\d+) )?TP(\d+)\]", line)  # SGLang: no PP tag at PP=1
        assert m, line
        seen.append((int(m[1] or 0), int(m[2])))
    assert sorted(seen) == STAGES[n]
    assert stream(url)
    models = requests.get(url.rstrip("/") + "/v1/models", timeout=10).json()
    assert dep.profile.model.repo in [m["id"] for m in models["data"]]


def deploy_on(lab, n: int, state: Path) -> None:
    started = time.monotonic()
    try:
        r = inv(n, state, "deploy.all", *(["--recipe", RECIPES[n]] if n in RECIPES else []))
        took = time.monotonic() - started
        print(f"\nnnodes.deploy_all_{n}_seconds: {took:.1f}")
        assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
        check_serving(lab, n, state, r.stdout)
    finally:
        down = inv(n, state, "serve.down")
        restore = inv(n, state, "services.restore")
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr
    assert restore.returncode == 0, restore.stdout[-2000:] + restore.stderr
    dep = deployment.load(ROOT / PROFILES[n], state, recipe=RECIPES.get(n))
    for x in layout.node_names(n):
        assert engine_containers(lab, x, dep.profile.name) == [], x


def test_three_nodes_pipeline_parallel_deploy_all_serves(grown, tmp_path):
    deploy_on(grown, 3, tmp_path / "state")


def test_four_nodes_the_235b_recipe_deploy_all_serves_on_tp4(grown, tmp_path):
    bad = [r for r in lifecycle.up(nodes=4, flavor=layout.DEFAULT_DOCKERD) if r.failed]
    assert not bad, [r.why for r in bad]
    deploy_on(grown, 4, tmp_path / "state")
