"""The labels on sparkdeploy's containers: the exact argv that lists them, the fingerprint they
carry, and reading docker's answer back (any character in a value, a line that is not ours)."""

from __future__ import annotations

import json

from sparkdeploy.core import labels
from sparkdeploy.core.fingerprint import digest, key_digests
from sparkdeploy.helpers import serve_unit

FORMAT = ('[{{json .ID}},{{json .Names}},{{json .State}},{{json .Status}},'
          '{{json (.Label "org.sparkdeploy.deployment")}},{{json (.Label "org.sparkdeploy.engine")}},'
          '{{json (.Label "org.sparkdeploy.engine.kind")}},{{json (.Label "org.sparkdeploy.role")}},'
          '{{json (.Label "org.sparkdeploy.rank")}},{{json (.Label "org.sparkdeploy.image.id")}},'
          '{{json (.Label "org.sparkdeploy.port")}},{{json (.Label "org.sparkdeploy.started")}},'
          '{{json (.Label "org.sparkdeploy.started.by")}},'
          '{{json (.Label "org.sparkdeploy.fingerprint")}},'
          '{{json (.Label "org.sparkdeploy.fingerprint.keys")}},'
          '{{json (.Label "org.sparkdeploy.recipe")}},'
          '{{json (.Label "org.sparkdeploy.placement")}}]')


def test_ps_argv_of_a_deployment_of_an_engine_and_of_any():
    assert labels.ps_args("lab") == [
        "ps", "--all", "--no-trunc", "--filter", "label=org.sparkdeploy.deployment=lab",
        "--filter", "label=org.sparkdeploy.engine", "--format", FORMAT]
    assert labels.ps_args("lab", "sglang")[:7] == [
        "ps", "--all", "--no-trunc", "--filter", "label=org.sparkdeploy.deployment=lab",
        "--filter", "label=org.sparkdeploy.engine=sglang"]
    # any deployment's engine containers (who holds a GPU), and every container of one
    assert labels.ps_args()[3:7] == ["--filter", "label=org.sparkdeploy.deployment",
                                     "--filter", "label=org.sparkdeploy.engine"]
    assert labels.ps_args("lab", engines_only=False)[3:6] == [
        "--filter", "label=org.sparkdeploy.deployment=lab", "--format"]


def test_a_helper_container_says_whose_what_and_since_when():
    assert labels.of_run("lab", "download", "model.download", 1_796_000_000) == [
        "--label=org.sparkdeploy.deployment=lab", "--label=org.sparkdeploy.role=download",
        "--label=org.sparkdeploy.started=2026-11-30T00:53:20Z",
        "--label=org.sparkdeploy.started.by=model.download"]


def test_the_fingerprint_is_the_engines_entry_the_nodes_and_the_model(seed_profile):
    p = seed_profile
    eng = p.engines[0].model_copy(update={"env": {"NCCL_DEBUG": "INFO", "HF_TOKEN": "hf_x"}})
    fp = labels.engine_fingerprint(p, eng)
    assert fp["engine.name"] == "sglang" and fp["engine.env.NCCL_DEBUG"] == "INFO"
    assert fp["model.path"] == p.model.path and fp["model.repo"] == p.model.repo
    assert fp["nodes[1].link.address"] == p.nodes[1].link.address
    assert not any("HF_TOKEN" in k or v == "hf_x" for k, v in fp.items())  # no secret, nor its name
    assert {k.split(".")[0].split("[")[0] for k in fp} == {"engine", "nodes", "model"}
    # another engine of the profile is not part of it
    assert not any(str(v) == p.engines[1].image for v in fp.values())


def row(**kw):
    lab = {k: "" for k in labels.READ} | kw
    return json.dumps(["c0ffee", "sparkdeploy-sglang-head", "running", "Up 2 minutes",
                       *(lab[k] for k in labels.READ)])


def test_reading_docker_ps_back(seed_profile):
    fp = labels.engine_fingerprint(seed_profile, seed_profile.engines[0])
    keys = json.dumps(key_digests(fp))
    out = "\n".join([
        row(**{labels.DEPLOYMENT: "lab", labels.ENGINE: "sglang", labels.ROLE: "head",
               labels.RANK: "0", labels.PORT: "30000", labels.STARTED: "2026-12-04T05:00:00Z",
               labels.STARTED_BY: "serve.up", labels.FINGERPRINT: digest(fp),
               labels.FINGERPRINT_KEYS: keys, labels.IMAGE_ID: "sha256:ab|c,\"d"}),
        "WARNING: something docker said", "[1, 2]", "",
        row(**{labels.DEPLOYMENT: "lab", labels.RANK: "x"})])
    first, second = labels.parse_ps(out)
    assert (first.recipe, second.recipe) == ("", "")
    assert (first.name, first.running, first.role, first.rank, first.port, first.started_by) == (
        "sparkdeploy-sglang-head", True, "head", 0, 30000, "serve.up")
    assert first.image_id == 'sha256:ab|c,"d'
    assert first.differs(fp) == []
    assert (second.rank, second.port, second.differs(fp)) == (None, None, ["fingerprint"])


def test_what_differs_is_named_by_key(seed_profile):
    p = seed_profile
    old = labels.engine_fingerprint(p, p.engines[0])
    c = labels.parse_ps(row(**{labels.DEPLOYMENT: "lab", labels.FINGERPRINT: digest(old),
                               labels.FINGERPRINT_KEYS: json.dumps(key_digests(old))}))[0]
    eng = p.engines[0].model_copy(update={"args": ["--trust-remote-code"], "port": 30001})
    new = labels.engine_fingerprint(p, eng)
    dropped = [f"engine.args[{i}]" for i in range(1, len(p.engines[0].args))]
    assert len(dropped) >= 4 and p.engines[0].args[0] == "--trust-remote-code"
    assert c.differs(new) == [*dropped, "engine.port"]


def test_a_unit_adds_when_and_by_what_it_started_each_container():
    spec = {"node": "spark1", "role": "head", "stages": [], "started_labels": {
        "at": labels.STARTED, "by": labels.STARTED_BY, "by_value": "sparkdeploy-sglang.service"}}
    g = serve_unit.Group(spec, clock=lambda: 1_796_000_000.0)
    assert g.run_args({"run": ["run", "--detach", "--name=x", "img"]}) == [
        "run", "--label=org.sparkdeploy.started=2026-11-30T00:53:20Z",
        "--label=org.sparkdeploy.started.by=sparkdeploy-sglang.service", "--detach", "--name=x",
        "img"]
    # a spec written before the started labels: the arguments as they are
    assert serve_unit.Group({**spec, "started_labels": None}).run_args({"run": ["run", "i"]}) == [
        "run", "i"]


def test_an_engine_container_says_which_recipe_it_serves(seed_profile):
    fp = labels.engine_fingerprint(seed_profile, seed_profile.engines[0])
    kw = dict(deployment="lab", engine="vllm", kind="vllm", role="head", rank=0, port=8000,
              fingerprint=fp)
    assert labels.RECIPE not in labels.engine_labels(**kw)
    got = labels.engine_labels(**kw, recipe="lab-tiny")
    assert got[labels.RECIPE] == "lab-tiny"
    [c] = labels.parse_ps(row(**{labels.DEPLOYMENT: "lab", labels.RECIPE: "lab-tiny"}))
    assert c.recipe == "lab-tiny"
