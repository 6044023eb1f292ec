"""The deploy plan's fingerprints read one snapshot of node facts: each fact command runs once per
node per run (however many fingerprints, before and after a reuse step), again only after a step
changed that node."""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from sparkdeploy.core.records import ImageDecision
from sparkdeploy.core.state import StateDir
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.facts import Facts
from sparkdeploy.node.hosts import Host
from sparkdeploy.ops.image import image_id
from sparkdeploy.run import plan as plans
from sparkdeploy.run.run_record import write_record
from sparkdeploy.run.runner import Runner
from sparkdeploy.steps import registry
from sparkdeploy.steps.registry import StepContext
from tests.unit.fakes import FakeNode, ScriptedContext

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "configs" / "qwen3.5-122b-a10b-fp8.yaml"
SOCK = ["docker", "-H", "unix:///var/run/docker.sock"]
IMAGE_LS = [*SOCK, "image", "ls", "--no-trunc", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}"]
GLM = ["vllm-proxy.service", "vllm-embeddings.service", "vllm-reranker.service",
       "vllm-cluster.service"]
LIST_UNITS = ["systemctl", "list-units", "--all", "--plain", "--no-legend", "--no-pager",
              "--type=service", "--", *GLM]
BASE, LAYER = "scitrera/dgx-spark-sglang:0.5.10rc0", "sparkdeploy/sglang-qwen3.5:latest"
IDS = {"hellohal2064/vllm-qwen3.5-gb10:latest": "sha256:" + "a" * 64, BASE: "sha256:" + "b" * 64,
       LAYER: "sha256:" + "c" * 64}


class DockerNode(FakeNode):
    """A node that also answers ``docker image ls`` and ``docker image inspect``."""

    def __init__(self, images: dict[str, str], **kw):
        super().__init__(**kw)
        self.images = dict(images)

    def answer(self, argv, stdin=None):
        if self.unreachable:
            return super().answer(argv, stdin)
        if argv[:3] == SOCK and argv[3:5] == ["image", "ls"]:
            return 0, "".join(f"{t} {i}\n" for t, i in self.images.items()), ""
        if argv[:3] == SOCK and argv[3:5] == ["image", "inspect"]:
            found = self.images.get(argv[-1])
            return (0, json.dumps({"Id": found}), "") if found else (1, "", "No such image")
        return super().answer(argv, stdin)


@pytest.fixture
def lab(tmp_path):
    from sparkdeploy.profile.config import load_profile

    prof = load_profile(SEED)
    nodes = {"spark1": DockerNode(IDS, units={u: "active" for u in GLM}), "spark2": DockerNode(IDS)}
    ctx = ScriptedContext(nodes)
    state = StateDir(tmp_path / "state")
    hosts = {n.name: Host(n, prof.ssh, ctx, state) for n in prof.nodes}
    dep = Deployment(prof, str(SEED), state, hosts)
    chosen = {"image": BASE, "kind": "sglang", "needs_layer": True, "serve_image": LAYER}
    dep.records.write(ImageDecision(node="spark1", arch="arm64", config_from="hub",
                                    chosen={"engine": "sglang", **chosen}, engines={"sglang": chosen},
                                    candidates=[], summary="chosen"))
    return dep, ctx, nodes


@pytest.fixture
def fake_steps():
    """Every step of the plan replaced by one that reports ``status`` on the head."""
    registry.load_all()
    saved = dict(registry.REGISTRY)

    def install(status):
        for name, spec in saved.items():
            def fn(ctx, _name=name, **options):
                getattr(ctx, status)("did it", ctx.dep.profile.head.name)
            registry.REGISTRY[name] = replace(spec, body=fn)  # as declared: the fingerprint, reuse, ...
    yield install
    registry.REGISTRY.clear()
    registry.REGISTRY.update(saved)


def fingerprint(step: str):
    """The fingerprint ``step`` declares."""
    fp = registry.get(step).fingerprint
    assert fp is not None
    return fp


def facts_asked(ctx) -> Counter:
    return Counter((alias, tuple(argv)) for alias, argv in ctx.calls
                   if argv[:3] == SOCK or argv[:2] == ["systemctl", "list-units"])


def test_a_run_asks_each_node_each_fact_once(lab, fake_steps):
    dep, ctx, _ = lab
    fake_steps("changed")
    Runner(dep, plans.plan(dep)).run()  # the first run: every step ran and changed something
    fake_steps("ok")
    again = Deployment(dep.profile, dep.profile_path, dep.state, dep.hosts)
    ctx.calls.clear()
    out = Runner(again, plans.plan(again)).run()
    assert not out.failed and {n for n, r in out.runs.items() if r.reused} == {
        "model.precheck", "services.stop", "model.fit", "image.probe", "image.ship", "link.fabric"}
    written = write_record(again, out, plans.plan(again))
    assert f"serving `{LAYER}` = `{IDS[LAYER]}`" in written.markdown.read_text()
    assert facts_asked(ctx) == {
        ("spark1", tuple(IMAGE_LS)): 1,
        ("spark1", tuple(LIST_UNITS)): 1,
        # the one candidate the head's image list lacks: inspected once (it may be a name
        # the list spells otherwise)
        ("spark1", (*SOCK, "image", "inspect", "--format", "{{json .}}", "lmsysorg/sglang:spark")): 1,
        ("spark2", tuple(IMAGE_LS)): 1,
    }


def test_a_change_on_a_node_asks_that_node_again(lab):
    dep, ctx, nodes = lab
    assert image_id(dep, LAYER) == IDS[LAYER]
    assert image_id(dep, LAYER, "spark2") == IDS[LAYER]
    nodes["spark1"].images[LAYER] = "sha256:" + "d" * 64
    assert image_id(dep, LAYER) == IDS[LAYER]  # the snapshot, not the node, until ...
    StepContext("image.build", dep.events, dep).changed("built", "spark1")  # ... a step changed the node
    assert image_id(dep, LAYER) == "sha256:" + "d" * 64
    assert image_id(dep, LAYER, "spark2") == IDS[LAYER]
    StepContext("image.ship", dep.events, dep).ok("already there", "spark2")  # no change: nothing forgotten
    assert facts_asked(ctx) == {("spark1", tuple(IMAGE_LS)): 2, ("spark2", tuple(IMAGE_LS)): 1}


def test_services_fingerprint_sees_the_units_stopped_after_the_stop(lab):
    dep, ctx, nodes = lab
    assert fingerprint("services.stop")(dep)["units_now.vllm-cluster.service"] == "active"
    nodes["spark1"].units = {u: "inactive" for u in GLM}
    StepContext("services.stop", dep.events, dep).changed("stopped", "spark1")
    assert fingerprint("services.stop")(dep)["units_now.vllm-cluster.service"] == "inactive"
    assert facts_asked(ctx)[("spark1", tuple(LIST_UNITS))] == 2


def test_an_unreachable_node_is_asked_once_and_has_no_images(lab):
    dep, ctx, nodes = lab
    nodes["spark2"].unreachable = True
    assert image_id(dep, LAYER, "spark2") is None
    assert image_id(dep, BASE, "spark2") is None
    assert facts_asked(ctx) == {("spark2", tuple(IMAGE_LS)): 1}  # nothing inspected there


def test_threads_asking_at_once_gather_once():
    gathered = []
    started, release = threading.Event(), threading.Event()

    def gather(host):
        gathered.append(host)
        started.set()
        release.wait(5)
        return {"x": "sha256:1"}

    facts = Facts({"spark1": "the host"})
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(facts.get("spark1", "images", gather)))
               for _ in range(4)]
    for t in threads:
        t.start()
    started.wait(5)
    release.set()
    for t in threads:
        t.join(5)
    assert gathered == ["the host"] and got == [{"x": "sha256:1"}] * 4


def test_a_fact_forgotten_while_gathered_is_not_kept():
    answers = iter(["old", "new"])
    facts = Facts({"spark1": "h"})

    def gather(host):
        value = next(answers)
        if value == "old":
            facts.forget("spark1")  # a step changed the node while the command ran
        return value

    assert facts.get("spark1", "images", gather) == "old"
    assert facts.get("spark1", "images", gather) == "new"


def test_the_probe_is_not_reused_once_its_decision_is_gone(lab):
    from sparkdeploy.core.fingerprint import diff_keys

    dep, _, _ = lab
    before = fingerprint("image.probe")(dep)
    assert before["decided"] is not None
    dep.records.remove(ImageDecision)
    assert diff_keys(before, fingerprint("image.probe")(dep)) == ["decided"]


def test_a_fingerprint_asks_the_nodes_only_where_its_declaration_says_so(lab):
    dep, ctx, _ = lab
    declared = {n: s.fingerprint for n, s in registry.load_all().items() if s.fingerprint is not None}
    asked = set()
    for name, fp in declared.items():
        dep.facts.forget(None)
        ctx.calls.clear()
        fp.local(dep)
        assert ctx.calls == [], name  # the sections and ``also``: the controller alone
        fp(dep)
        if ctx.calls:
            asked.add(name)
    assert asked == {n for n, fp in declared.items() if fp.asks_nodes} == {
        "services.stop", "image.probe", "image.ship", "serve.up", "link.fabric"}
