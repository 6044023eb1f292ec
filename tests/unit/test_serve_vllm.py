"""serve.up with vLLM's own multi-node mode (``kind: vllm``) against scripted nodes: the head,
then the headless worker once the head's master port answers, the worker's rank read from its
log; a worker that never joins is a hang diagnosed as worker-never-joined, and the next engine
(vLLM on Ray in a profile that prefers the native mode) takes over."""

from __future__ import annotations

import pytest

from sparkdeploy.core import labels
from sparkdeploy.core.outcomes import Status
from sparkdeploy.core.records import Endpoint, ServeDecision
from sparkdeploy.engines import NodeFacts, launch
from sparkdeploy.engines.base import run_args
from sparkdeploy.steps import serve
from tests.unit.fakes import WALL
from tests.unit.serve_fakes import Script
from tests.unit.test_serve import IMG, healthy_vllm, lab, runs  # noqa: F401  (the fixture)

LEADER = ("(EngineCore_DP0 pid=7) INFO 12-04 05:01:03 [multiproc_executor.py:131] DP group leader: "
          "node_rank=0, node_rank_within_dp=0, master_addr=192.168.100.10, "
          "mq_connect_ip=192.168.100.10 (local), world_size=2, local_world_size=1")
INIT = ("(Worker pid=9) INFO 12-04 05:01:04 [parallel_state.py:1208] world_size={w} rank={r} local_rank=0 "
        "distributed_init_method=tcp://192.168.100.10:29501 backend=nccl")
JOINED = ("(Worker_TP{r} pid=9) INFO 12-04 05:01:05 [parallel_state.py:1326] rank {r} in world size 2 is "
          "assigned as DP rank 0, PP rank 0, TP rank {r}, EP rank {r}")
LOADED = "(Worker_TP{r} pid=9) INFO 12-04 05:02:05 [gpu_model_runner.py:2370] Model loading took 58.2 GiB " \
         "memory and 60.1 seconds"
HEADLESS = ("INFO 12-04 05:01:03 [serve.py:216] Launching vLLM (v0.17.1) headless multiproc executor, "
            "with head node address 192.168.100.10:29501 for torch.distributed process group.")


@pytest.fixture
def seed_yaml(seed_yaml):
    """The seed with the native mode first and vLLM on Ray as its fallback."""
    engines = seed_yaml["sparkdeploy"]["engines"]
    native = next(e for e in engines if e["kind"] == "vllm")
    ray = next(e for e in engines if e["kind"] == "vllm-ray")
    seed_yaml["sparkdeploy"]["engines"] = [native, ray]
    return seed_yaml


def native(nodes, *, head_reaches_worker=True):
    head = [(1, LEADER), (1, INIT.format(w=2, r=0)), (3, JOINED.format(r=0)), (6, LOADED.format(r=0))]
    if head_reaches_worker:
        head += [(7, "(EngineCore_DP0 pid=7) INFO [kv_cache_utils.py:1087] GPU KV cache size: 262,144 tokens"),
                 (9, "INFO [api_server.py] Starting vLLM API server on http://0.0.0.0:8000")]
    nodes["spark1"].scripts["sparkdeploy-vllm-head"] = Script(
        head, opens={29501: 2, **({8000: 9} if head_reaches_worker else {})})
    nodes["spark2"].scripts["sparkdeploy-vllm-worker"] = Script(
        [(1, HEADLESS), (1, INIT.format(w=2, r=1)), (2, JOINED.format(r=1)), (5, LOADED.format(r=1))])


def test_the_head_then_the_headless_worker_and_no_ray(lab):  # noqa: F811
    dep, ctx, nodes, cluster, clock = lab
    native(nodes)
    results = serve.up(dep)
    assert results[-1].status is Status.OK and results[-1].why == "endpoint: http://10.0.0.1:8000"
    want = launch(dep.profile, dep.profile.engines[0],
                  {"spark1": NodeFacts(3, False), "spark2": NodeFacts(3, False)}, image_id=IMG)
    [head], [worker] = runs(ctx, "spark1"), runs(ctx, "spark2")
    assert head == run_args(want.containers[0], started=labels.started("serve.up", WALL + 1000))
    assert worker == run_args(want.containers[1], started=labels.started("serve.up", WALL + 1002))
    # the worker starts once the head's master port answers from the worker's side of the link
    order = [(a, argv) for a, argv in ctx.calls if argv[3:4] == ["run"] or "connect" in argv]
    assert [a for a, _ in order][:2] == ["spark1", "spark2"] and "29501" in order[1][1]
    assert sorted(nodes["spark1"].containers) == ["sparkdeploy-vllm-head"]
    assert sorted(nodes["spark2"].containers) == ["sparkdeploy-vllm-worker"]
    assert dep.records.read(Endpoint).engine == "vllm"
    assert dep.records.read(ServeDecision).chosen == "vllm"


def test_a_worker_whose_rank_never_shows_is_waited_for_in_its_own_phase(lab):  # noqa: F811
    dep, ctx, nodes, cluster, clock = lab
    native(nodes)
    nodes["spark2"].scripts["sparkdeploy-vllm-worker"] = Script([(1, HEADLESS), (1, INIT.format(w=2, r=1))])
    healthy_vllm(nodes, cluster)
    results = serve.up(dep)
    first = next(r for r in results if r.failed)
    assert first.why.startswith("vllm hang: no log output and no readiness step for 30s during "
                                "sparkdeploy-vllm-worker: rank joined")
    assert results[-1].why == "endpoint: http://10.0.0.1:8000"  # vLLM on Ray took over
    assert dep.records.read(ServeDecision).chosen == "vllm-ray"


def test_a_worker_the_head_never_reaches_is_diagnosed_and_the_fallback_serves(lab):  # noqa: F811
    dep, ctx, nodes, cluster, clock = lab
    native(nodes, head_reaches_worker=False)
    healthy_vllm(nodes, cluster)
    results = serve.up(dep)
    first = next(r for r in results if r.failed)
    assert first.why.startswith("vllm hang: no log output and no readiness step for 30s during port ")
    assert "class: worker-never-joined" in first.why and first.why.endswith("; falling back to vllm-ray")
    rec = dep.records.read(ServeDecision)
    [tried] = rec.tried
    assert (tried.engine, tried.diagnosis, rec.chosen) == ("vllm", "worker-never-joined", "vllm-ray")
    head = "spark1-sparkdeploy-vllm-head.log"
    assert [e[0] for e in tried.evidence] == [head, head]
    assert "DP group leader" in tried.evidence[0][2] and "Model loading took" in tried.evidence[1][2]
    assert results[-1].why == "endpoint: http://10.0.0.1:8000"
    assert "sparkdeploy-vllm-head" in nodes["spark1"].removed
    assert "sparkdeploy-vllm-worker" in nodes["spark2"].removed
