"""serve.swap's cut-over against scripted nodes, through the real serve.down and serve.up: the
seed's SGLang serving Qwen, swapped for gpt-oss-120b's vLLM (its own multi-node mode); a vLLM
that hangs in init is diagnosed, removed, and SGLang serves Qwen again. The prepare phase is
left out here (test_swap.py covers it); the coherence check reads /v1/models as the nodes
answer it."""

from __future__ import annotations

import pytest

from sparkdeploy.core.outcomes import Status
from sparkdeploy.core.records import Endpoint
from sparkdeploy.node import endpoint as ep
from sparkdeploy.ops import swap as ops
from sparkdeploy.run import swap as sw
from sparkdeploy.steps import serve
from tests.unit.serve_fakes import Script
from tests.unit.test_serve import IMG, MODEL, healthy_sglang, lab  # noqa: F401  (the fixture)
from tests.unit.test_serve_vllm import native

NEW = "openai/gpt-oss-120b"
NEW_IMAGE = "sparkarena/spark-vllm-docker:mxfp4"


def running(nodes) -> dict[str, list[str]]:
    return {n: sorted(c for c, k in node.containers.items() if k.status(node.clock())[0] == "running")
            for n, node in nodes.items()}


@pytest.fixture
def swapping(lab, monkeypatch):  # noqa: F811
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    assert serve.up(dep)[-1].why == "endpoint: http://10.0.0.1:30000"
    for n in nodes.values():
        n.images[NEW_IMAGE] = IMG
    new = ops.beside(dep, "gpt-oss-120b")
    by_port = {30000: MODEL, 8000: NEW}

    def models(url, deadline=5.0):
        port = int(url.rsplit(":", 1)[1])
        return [by_port[port]] if cluster.listening(port) else []

    monkeypatch.setattr(ep, "models", models)
    monkeypatch.setattr(ops, "coherent", lambda url, want, **kw: None if want in models(url)
                        else f"/v1/models lists {models(url)}, not {want}")
    monkeypatch.setattr(sw, "prepare", lambda ctx, old, keep, engine=None: None)
    monkeypatch.setattr(sw.Health, "__enter__", lambda s: s)
    return dep, new, nodes, cluster


def test_the_cut_over_stops_sglang_and_brings_up_vllm(swapping):
    old, new, nodes, cluster = swapping
    native(nodes)
    out = sw.run(new, old, to_recipe="gpt-oss-120b")
    done = [r for r in out if r.step == "serve.swap"]
    assert done[0].status is Status.CHANGED, [r.why for r in out if r.failed]
    assert done[-1].why == "endpoint: http://10.0.0.1:8000"
    assert running(nodes) == {"spark1": ["sparkdeploy-vllm-head"], "spark2": ["sparkdeploy-vllm-worker"]}
    assert new.records.read(Endpoint).model == NEW
    assert ops.serving_url(new) == ("vllm", "http://10.0.0.1:8000")
    assert ops.serving_url(old) is None


def test_a_hung_vllm_is_removed_and_sglang_serves_qwen_again(swapping):
    old, new, nodes, cluster = swapping
    nodes["spark1"].scripts["sparkdeploy-vllm-head"] = Script(
        [(1, "(Worker pid=9) INFO [parallel_state.py:1208] world_size=2 rank=0 local_rank=0 "
             "distributed_init_method=tcp://192.168.100.10:29501 backend=nccl")], opens={})
    nodes["spark2"].scripts["sparkdeploy-vllm-worker"] = Script([])
    healthy_sglang(nodes)  # the scripts the old engine's containers replay when started again
    out = sw.run(new, old, engine="vllm", to_recipe="gpt-oss-120b")
    last = [r for r in out if r.step == "serve.swap"][-1]
    assert last.status is Status.FAILED
    assert last.why.startswith("swap rolled-back: vllm hang: no log output and no readiness step")
    assert "; class: nccl-init-hang (spark1-sparkdeploy-vllm-head.log:1: " in last.why
    assert last.why.endswith(f"the old model {MODEL} serves again")
    assert running(nodes) == {"spark1": ["sparkdeploy-sglang-head"], "spark2": ["sparkdeploy-sglang-worker"]}
    assert old.records.read(Endpoint).model == MODEL
    assert ops.serving_url(old) == ("sglang", "http://10.0.0.1:30000")
