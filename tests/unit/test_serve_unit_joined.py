"""The persisted supervisors wait for a stage whose containers have no API (vLLM's headless
workers) by their logs: each node's supervisor reads its containers' logs for the stage's
``joined`` line and publishes them; the head goes on once every one of the stage's containers
is in some node's ``joined``."""

from __future__ import annotations

import sys

from sparkdeploy.engines.vllm import RANK_JOINED
from tests.unit.test_serve_unit import KEY, su  # noqa: F401  (the fixture)

WORKER = "sparkdeploy-vllm-worker"


def spec(tmp_path, node: str) -> dict:
    log = tmp_path / "worker.log"
    log.write_text("INFO [serve.py:216] Launching vLLM (v0.17.1) headless multiproc executor\n")
    # a docker CLI that knows one command: `logs NAME` prints the container's log
    fake = [sys.executable, "-c", f"import sys; sys.argv[1] == 'logs' and print(open({str(log)!r}).read())"]
    return {"node": node, "role": "worker" if node == "spark2" else "head", "docker": fake,
            "listen": ["127.0.0.1", 0],
            "stages": [{"wait": "dist-port", "joined": None, "containers": [
                           {"node": "spark1", "name": "sparkdeploy-vllm-head", "run": []}]},
                       {"wait": "ranks-joined", "joined": RANK_JOINED, "containers": [
                           {"node": "spark2", "name": WORKER, "run": []}]}]}, log


def test_a_worker_publishes_its_container_once_its_rank_joined(su, tmp_path):  # noqa: F811
    s, log = spec(tmp_path, "spark2")
    g = su.Group(s, KEY)
    g.note_joined(1)
    assert g.state["joined"] == []
    with log.open("a") as f:
        f.write("(Worker_TP1 pid=9) INFO [parallel_state.py:1326] rank 1 in world size 2 is assigned "
                "as DP rank 0, PP rank 0, TP rank 1, EP rank 1\n")
    g.note_joined(0)  # stage 0 waits for no rank: nothing read yet
    assert g.state["joined"] == []
    g.note_joined(1)
    assert g.state["joined"] == [WORKER]


def test_the_head_goes_on_once_every_container_of_the_stage_joined(su, tmp_path):  # noqa: F811
    s, _log = spec(tmp_path, "spark1")
    g = su.Group(s, KEY)
    stage = s["stages"][1]
    assert not su.stage_ready(g, stage, {"spark2": None})
    assert not su.stage_ready(g, stage, {"spark2": {"joined": []}})
    assert su.stage_ready(g, stage, {"spark2": {"joined": [WORKER]}})
    assert su.stage_ready(g, {"wait": None, "containers": []}, {})
