"""serve.list against scripted nodes: what every node's containers' labels place where, with
the engine's own answer for the repo and its health for ``loaded``; another deployment's model
on one node; nothing placed; a node that cannot be reached; the task's JSON document."""

from __future__ import annotations

import json

from sparkdeploy.core.outcomes import Status
from sparkdeploy.steps import serve, serve_list
from sparkdeploy.tasks import serve as serve_tasks
from tests.unit.serve_fakes import Container, Script
from tests.unit.test_serve import MODEL, healthy_sglang, lab  # noqa: F401 - the fixture

OTHER = {"org.sparkdeploy.deployment": "spare", "org.sparkdeploy.engine": "vllm",
         "org.sparkdeploy.engine.kind": "vllm", "org.sparkdeploy.role": "head",
         "org.sparkdeploy.rank": "0", "org.sparkdeploy.port": "8000",
         "org.sparkdeploy.recipe": "gpt-oss-120b",
         "org.sparkdeploy.started": "2026-12-01T10:00:00Z"}


def placed(results) -> list[dict]:
    return [r.details["placed"] for r in results if "placed" in r.details]


def test_the_deployment_serving_is_listed_with_its_nodes_and_url(lab):  # noqa: F811
    """The seed's profile names no recipe: its containers carry none, the engine names the repo."""
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    serve.up(dep)
    res = serve_list.serve_list(dep)
    assert [(r.status, r.node, r.why) for r in res] == [
        (Status.OK, None, f"{MODEL}: sglang on spark1, spark2 at http://10.0.0.1:30000, loaded")]
    assert placed(res) == [{"recipe": None, "repo": MODEL,
                            "nodes": ["spark1", "spark2"], "url": "http://10.0.0.1:30000",
                            "loaded": True, "engine": "sglang",
                            "deployment": dep.profile.name, "on_demand": False}]


def test_another_deployments_model_on_one_node_is_listed_not_loaded(lab):  # noqa: F811
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    serve.up(dep)
    nodes["spark2"].containers["spare-vllm-head"] = Container(
        "spare-vllm-head", clock.now - 5, Script(exit_at=1), OTHER, ["run"])
    res = serve_list.serve_list(dep)
    assert [r.why for r in res][1] == (
        "gpt-oss-120b (openai/gpt-oss-120b): vllm on spark2 at http://10.0.0.1:8000, not loaded "
        "(not running: spare-vllm-head)")
    # its repo from the recipe (the engine does not answer), its url its own port
    assert placed(res)[1] == {"recipe": "gpt-oss-120b", "repo": "openai/gpt-oss-120b",
                              "nodes": ["spark2"], "url": "http://10.0.0.1:8000",
                              "loaded": False, "engine": "vllm", "deployment": "spare",
                              "on_demand": False}


def test_a_running_engine_that_does_not_answer_is_not_loaded(lab):  # noqa: F811
    dep, ctx, nodes, cluster, clock = lab
    nodes["spark1"].containers["spare-vllm-head"] = Container(
        "spare-vllm-head", clock.now, Script(), {**OTHER, "org.sparkdeploy.recipe": ""}, ["run"])
    [r] = serve_list.serve_list(dep)
    assert r.why == ("deployment spare: vllm on spark1 at http://10.0.0.1:8000, not loaded "
                     "(http://10.0.0.1:8000 does not serve)")
    assert r.details["placed"]["recipe"] is None and r.details["placed"]["repo"] is None


def test_this_deployment_down_on_a_node_is_its_profiles_model_not_loaded(lab):  # noqa: F811
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    serve.up(dep)
    nodes["spark2"].containers["sparkdeploy-sglang-worker"].script.exit_at = 0
    nodes["spark1"].containers["sparkdeploy-sglang-head"].script.exit_at = 0
    [r] = serve_list.serve_list(dep)
    assert r.why == (f"{MODEL}: sglang on spark1, spark2 at http://10.0.0.1:30000, not loaded "
                     "(not running: sparkdeploy-sglang-head, sparkdeploy-sglang-worker)")
    assert (r.details["placed"]["repo"], r.details["placed"]["loaded"]) == (MODEL, False)


def test_nothing_placed(lab):  # noqa: F811
    dep, *_ = lab
    res = serve_list.serve_list(dep)
    assert [(r.status, r.why) for r in res] == [(Status.OK, "nothing placed on spark1, spark2")]
    assert placed(res) == []


def test_a_node_that_cannot_be_reached_fails_and_the_others_are_listed(lab):  # noqa: F811
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    serve.up(dep)
    nodes["spark2"].unreachable = True
    res = serve_list.serve_list(dep)
    assert [(r.status, r.node) for r in res] == [(Status.FAILED, "spark2"), (Status.OK, None)]
    assert placed(res)[0]["nodes"] == ["spark1"]


def test_the_json_flag_prints_the_list_alone_on_stdout(lab, monkeypatch, capsys, tmp_path):  # noqa: F811
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    serve.up(dep)
    capsys.readouterr()
    monkeypatch.setattr("sparkdeploy.tasks._common.load", lambda *a, **kw: dep)
    serve_tasks.list_(ctx, json=True)
    out, err = capsys.readouterr()
    assert json.loads(out) == [{"recipe": None, "repo": MODEL,
                                "nodes": ["spark1", "spark2"], "url": "http://10.0.0.1:30000",
                                "loaded": True, "engine": "sglang",
                                "deployment": dep.profile.name, "on_demand": False}]
    assert "loaded" in err and out.count("\n") == 1


def test_a_worker_down_while_the_head_answers_is_not_loaded(lab):  # noqa: F811
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    serve.up(dep)
    nodes["spark2"].containers["sparkdeploy-sglang-worker"].script.exit_at = 0
    [r] = serve_list.serve_list(dep)
    assert r.why == (f"{MODEL}: sglang on spark1, spark2 at http://10.0.0.1:30000, not loaded "
                     "(not running: sparkdeploy-sglang-worker)")
    assert r.details["placed"]["loaded"] is False


def test_an_engine_that_answers_health_but_lists_no_model_is_not_loaded(lab, monkeypatch):  # noqa: F811
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    serve.up(dep)
    monkeypatch.setattr(serve_list.ep, "models", lambda url: [])
    [r] = serve_list.serve_list(dep)
    assert r.details["placed"]["loaded"] is False
    assert r.why.endswith("not loaded (http://10.0.0.1:30000 does not serve)")


def test_the_repo_is_what_the_engine_lists_over_what_the_recipe_says(lab):  # noqa: F811
    dep, ctx, nodes, cluster, clock = lab
    nodes["spark1"].containers["spare-vllm-head"] = Container(
        "spare-vllm-head", clock.now, Script(opens={8000: 0}), OTHER, ["run"])
    [r] = serve_list.serve_list(dep)
    assert r.details["placed"]["repo"] == MODEL  # what it serves, not the recipe's gpt-oss-120b
    assert r.why == (f"gpt-oss-120b ({MODEL}): vllm on spark1 at http://10.0.0.1:8000, loaded")


def test_containers_without_an_api_port_have_no_url(lab):  # noqa: F811
    dep, ctx, nodes, cluster, clock = lab
    labels = {k: v for k, v in OTHER.items() if k != "org.sparkdeploy.port"}
    nodes["spark2"].containers["spare-vllm-worker"] = Container(
        "spare-vllm-worker", clock.now, Script(), labels, ["run"])
    [r] = serve_list.serve_list(dep)
    assert r.why == ("gpt-oss-120b (openai/gpt-oss-120b): vllm on spark2, not loaded "
                     "(no API port on its containers)")
    assert (r.details["placed"]["url"], r.details["placed"]["loaded"]) == (None, False)


def test_a_recipe_no_directory_knows_gives_no_repo(lab):  # noqa: F811
    dep, ctx, nodes, cluster, clock = lab
    nodes["spark2"].containers["spare-vllm-head"] = Container(
        "spare-vllm-head", clock.now, Script(exit_at=0),
        {**OTHER, "org.sparkdeploy.recipe": "someone-elses"}, ["run"])
    [r] = serve_list.serve_list(dep)
    assert (r.details["placed"]["recipe"], r.details["placed"]["repo"]) == ("someone-elses", None)
    assert r.why.startswith("someone-elses: vllm on spark2 at http://10.0.0.1:8000, not loaded")
