"""serve.swap: what it reads on the nodes (docker stats, the models' directories, the head's
phase record), the coherence check against the engine stand-in, the fit and disk checks'
numbers, and the swap's order of steps: prepare while the old one serves, nothing stopped when
the prepare fails, the old one back on a failed bring-up or an incoherent answer."""

from __future__ import annotations

import json

import pytest

from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.lab.standins import engine_server as es
from sparkdeploy.node.memory import NodeMemory
from sparkdeploy.ops import swap as ops
from sparkdeploy.run import swap as sw
from sparkdeploy.steps import model_fit
from sparkdeploy.steps import model_prune as checks_prune
from sparkdeploy.steps import swap as checks
from sparkdeploy.steps.registry import StepContext, run_one
from tests.unit.fakes import FakeContext, deployment, split_command
from tests.unit.profiles import SEED

GIB = 1024 ** 3


class Answering(FakeContext):
    """Answers each argv by the first rule whose words it contains."""

    def __init__(self, rules: dict[str, tuple[int, str]]):
        super().__init__()
        self._set("rules", rules)

    def answer(self, alias, argv, stdin, command, kw):
        for key, (code, out) in self.rules.items():
            if key in argv:
                return self.result(command, code, out)
        return self.result(command, 1, "", "not scripted")


@pytest.fixture
def dep(tmp_path):
    def make(rules=None, recipe=None):
        ctx = Answering(rules or {})
        from sparkdeploy.profile.config import load_profile

        prof = load_profile(SEED, recipe)
        return deployment(SEED, tmp_path / "state", ctx, profile=prof), ctx
    return make


@pytest.mark.parametrize("text,want", [
    ("1.5GiB", int(1.5 * GIB)), ("512MiB", 512 * 2**20), ("0B", 0), ("2GB", 2 * 10**9),
    (" 10.25kB ", 10250), ("--", None), ("12", None), ("1.2.3GiB", None), ("3 parsecs", None),
])
def test_parse_size(text, want):
    assert ops.parse_size(text) == want


def test_held_sums_the_old_containers_memory_usage(dep):
    d, ctx = dep({"stats": (0, "sd-sglang-head\t1.5GiB / 119.7GiB\nother\t9GiB / 119.7GiB\n"
                               "sd-sglang-w\t512MiB / 119.7GiB\n")})
    got = ops.held(d.host("spark1"), ["sd-sglang-head", "sd-sglang-w"])
    assert got == int(1.5 * GIB) + 512 * 2**20  # the container not asked for is left out
    _, argv = split_command(ctx.commands[-1])
    assert argv[argv.index("stats"):] == ["stats", "--no-stream", "--format",
                                          "{{.Name}}\t{{.MemUsage}}", "sd-sglang-head",
                                          "sd-sglang-w"]


def test_held_of_nothing_runs_nothing(dep):
    d, ctx = dep()
    assert ops.held(d.host("spark1"), []) == 0
    assert ctx.commands == []


def test_model_dirs_reads_du(dep):
    d, ctx = dep({"sh": (0, "1000\t1700000000\t/srv/models/a/\n2500\t1700000500\t/srv/models/b/\n"
                           "garbage\n12\tnot-a-time\t/srv/models/c/\n")})
    assert ops.model_dirs(d.host("spark1"), "/srv/models/") == {
        "/srv/models/a": ops.ModelDir("/srv/models/a", 1000, 1700000000),
        "/srv/models/b": ops.ModelDir("/srv/models/b", 2500, 1700000500)}
    _, argv = split_command(ctx.commands[-1])
    assert argv[-4:] == ["-c", ops.DU, "sh", "/srv/models"]
    assert '[ -f "$d/config.json" ]' in ops.DU  # only a model's directory is ever listed


def _dirs(*rows):
    return {p: ops.ModelDir(p, b, t) for p, b, t in rows}


@pytest.mark.parametrize("keep,gone", [
    (0, ["/m/a", "/m/b", "/m/c"]),
    (1, ["/m/a", "/m/b"]),            # the most recent other (c) stays
    (2, ["/m/a"]),
    (5, []),
])
def test_to_prune_keeps_the_serving_one_and_the_most_recent_others(keep, gone):
    dirs = _dirs(("/m/serving", 9, 1), ("/m/a", 1, 10), ("/m/b", 2, 20), ("/m/c", 3, 30))
    assert [d.path for d in ops.to_prune(dirs, ["/m/serving/"], keep)] == gone


def test_read_phase_and_a_record_that_is_none(dep):
    rec = ops.Phase(phase=ops.CUT_OVER, deployment="lab", from_model="a/A", to_model="b/B",
                    engine="sglang")
    d, _ = dep({"cat": (0, rec.model_dump_json())})
    assert ops.read_phase(d.host("spark1")) == rec
    assert ops.read_phase(d.host("spark1"), "lab") == rec
    assert ops.read_phase(d.host("spark1"), "another") is None  # another deployment's swap
    d, _ = dep({"cat": (0, "{not json")})
    assert ops.read_phase(d.host("spark1")) is None
    d, _ = dep({"cat": (1, "")})
    assert ops.read_phase(d.host("spark1")) is None


@pytest.fixture
def standin():
    srv = es.start_in_thread(es.Config(port=0, ttft_ms=1, gap_ms=1, model="org/new",
                                       reasoning_tokens=0))
    yield f"http://127.0.0.1:{srv.port}", srv
    srv.shutdown()


def test_coherent_when_the_new_model_answers(standin, monkeypatch):
    monkeypatch.delenv("SPARKDEPLOY_API_KEY", raising=False)
    url, _ = standin
    assert ops.coherent(url, "org/new") is None


def test_incoherent_when_another_model_is_listed(standin, monkeypatch):
    monkeypatch.delenv("SPARKDEPLOY_API_KEY", raising=False)
    url, _ = standin
    assert ops.coherent(url, "org/old") == "/v1/models lists org/new, not org/old"


@pytest.mark.parametrize(("fault", "said"), [
    ("http500", "': HTTP 500"),       # the completion fails
    ("garbage", "' came back "),      # the model answers nonsense
])
def test_incoherent_when_the_gate_fails(standin, monkeypatch, fault, said):
    monkeypatch.delenv("SPARKDEPLOY_API_KEY", raising=False)
    url, srv = standin
    srv.state.control({"faults": fault})
    assert ops.coherent(url, "org/new").startswith(
        "coherence gate: 'What is 17 + 25? Answer with the number only." + said)


def test_incoherent_when_nothing_answers():
    assert ops.coherent("http://127.0.0.1:9", "org/new", deadline=2).startswith(
        "/v1/models lists nothing")


# --- the checks ------------------------------------------------------------------------------

def _mem(usable_gib: float) -> NodeMemory:
    return NodeMemory(gpus=1, unified=True, gpu_total=int(119.7 * GIB),
                      gpu_usable=int(usable_gib * GIB), source="test")


def test_fit_counts_what_the_old_engine_holds(dep, monkeypatch):
    new, _ = dep(recipe="gpt-oss-120b")
    old, _ = dep()
    files = [{"path": "model.safetensors", "size": 60 * GIB}]
    monkeypatch.setattr(model_fit, "selected", lambda d: ({"files": files}, ""))
    monkeypatch.setattr(model_fit, "node_memory",
                        lambda ctx: {"spark1": _mem(10), "spark2": _mem(10)})
    monkeypatch.setattr(checks, "old_containers", lambda o, n: [f"{n}-old"])
    held = {"spark1": 100 * GIB, "spark2": 5 * GIB}
    monkeypatch.setattr(ops, "held", lambda h, names: held[h.name])
    out = run_one(new, checks.FIT, old=old)
    by_node = {r.node: r for r in out if r.node}
    assert by_node["spark1"].status is Status.OK
    assert by_node["spark1"].details["usable"] == 110 * GIB
    assert by_node["spark2"].status is Status.FAILED
    assert "15.0 GiB usable" in by_node["spark2"].why
    assert "spark1 100.0 GiB, spark2 5.0 GiB" in by_node["spark2"].why


def test_fit_counts_what_the_old_engine_asked_for_when_its_cgroup_says_less(dep, monkeypatch):
    """On a GB10 the CUDA allocations may not show in docker stats: the old sglang's
    --mem-fraction-static 0.85 x the node's total counts when larger; never above the total."""
    new, _ = dep(recipe="gpt-oss-120b")
    old, _ = dep()
    files = [{"path": "model.safetensors", "size": 60 * GIB}]
    monkeypatch.setattr(model_fit, "selected", lambda d: ({"files": files}, ""))
    monkeypatch.setattr(checks, "selected", lambda d: ({"files": files}, ""))
    monkeypatch.setattr(model_fit, "node_memory",
                        lambda ctx: {"spark1": _mem(10), "spark2": _mem(10)})
    monkeypatch.setattr(checks.memory, "read", lambda h: _mem(10))
    monkeypatch.setattr(checks, "old_containers", lambda o, n: [f"{n}-old"])
    monkeypatch.setattr(ops, "held", lambda h, names: 2 * GIB)
    out = run_one(new, checks.FIT, old=old, engine="sglang")
    asked = int(0.85 * int(119.7 * GIB))
    by_node = {r.node: r for r in out if r.node}
    assert by_node["spark1"].details["usable"] == min(10 * GIB + asked, int(119.7 * GIB))
    assert by_node["spark1"].status is Status.OK
    assert checks.old_demand(old, "nosuch", {"spark1": GIB}) == {}


def test_disk_refuses_with_free_needed_and_what_prune_frees(dep, monkeypatch):
    new, _ = dep(recipe="gpt-oss-120b")
    path = new.profile.model.path
    files = [{"path": "a.safetensors", "size": 50 * 10**9}, {"path": "config.json", "size": 0}]
    monkeypatch.setattr(checks, "selected", lambda d: ({"files": files}, ""))
    free = {"spark1": 200 * 10**9, "spark2": 20 * 10**9}
    monkeypatch.setattr(checks, "free_space", lambda h, p: (free[h.name], "/srv"))
    dirs = _dirs((path, 10 * 10**9, 5), ("/srv/models/Qwen3.5-122B-A10B-FP8", 125 * 10**9, 4),
                 ("/srv/models/old-one", 30 * 10**9, 1), ("/srv/models/recent", 7 * 10**9, 3))
    monkeypatch.setattr(ops, "model_dirs", lambda h, parent: dict(dirs))
    out = run_one(new, checks.DISK, keep=["/srv/models/Qwen3.5-122B-A10B-FP8"])
    by_node = {r.node: r for r in out}
    assert by_node["spark1"].status is Status.OK
    assert by_node["spark1"].details["need"] == 40 * 10**9  # 10 GB are there already
    bad = by_node["spark2"]
    assert bad.status is Status.FAILED
    assert bad.details["free"] == 20 * 10**9
    assert "20.00 GB free on /srv" in bad.why
    # model.keep 1: the most recent other model (recent) stays
    assert "model.prune would free 30.00 GB (/srv/models/old-one 30.00 GB)" in bad.why


# --- the swap's order ------------------------------------------------------------------------

class Swap:
    """The swap's collaborators scripted: what serves, what each step says."""

    def __init__(self, monkeypatch, new, old, *, serving_new=None, up_fails=False,
                 prepare_fails=None, coherent=None, persisted=False, was=None, old_serves=True,
                 down_fails=False):
        self.calls: list[tuple[str, str, dict]] = []
        self.phases: list[str] = []
        self.new, self.old = new, old
        monkeypatch.setattr(ops, "serving_url", lambda d: serving_new if d is new else (
            ("sglang", "http://h:30000") if old_serves else None))
        monkeypatch.setattr(ops, "read_phase", lambda h, deployment=None: was)
        monkeypatch.setattr(ops, "write_phase", lambda h, rec: self.phases.append(rec.phase))
        monkeypatch.setattr(ops, "coherent", lambda url, want, **kw: coherent)
        monkeypatch.setattr(sw, "persisted", lambda d: persisted)
        monkeypatch.setattr(sw, "prepare", lambda ctx, o, keep, engine=None: prepare_fails)
        monkeypatch.setattr(sw.Health, "__enter__", lambda s: s)

        real_call = StepContext.call

        def call(ctx, name, *, on=None, **opts):
            if on is None:
                return real_call(ctx, name, **opts)
            which = "new" if on is new else "old"
            self.calls.append((which, name, opts))
            if name == "serve.down" and which == "old" and down_fails:
                return [ctx.report(Result("serve.down", Status.FAILED, "still there: x", "spark2"))]
            if name == "serve.up" and which == "new" and up_fails:
                return [ctx.report(Result("serve.up", Status.FAILED, "sglang stalled; class: "
                                          "sglang-hang"))]
            if name == "serve.up":
                return [ctx.report(Result("serve.up", Status.OK, "endpoint: http://h:30000", None,
                                          {"endpoint": "http://h:30000", "engine": "sglang"}))]
            return [ctx.report(Result(name, Status.CHANGED, "done"))]
        monkeypatch.setattr(StepContext, "call", call)

    def run(self, **kw):
        return sw.run(self.new, self.old, **kw)


def test_swap_to_what_serves_is_ok_and_stops_nothing(dep, monkeypatch):
    new, _ = dep(recipe="gpt-oss-120b")
    old, _ = dep()
    s = Swap(monkeypatch, new, old, serving_new=("sglang", "http://h:30000"))
    out = s.run()
    assert [r.status for r in out] == [Status.OK]
    assert "already serves openai/gpt-oss-120b: nothing stopped" in out[0].why
    assert s.calls == [] and s.phases == []


def test_a_failed_prepare_stops_nothing(dep, monkeypatch):
    new, _ = dep(recipe="gpt-oss-120b")
    old, _ = dep()
    s = Swap(monkeypatch, new, old, prepare_fails="swap.fit: spark2: does not fit")
    out = s.run()
    assert s.calls == []
    assert out[-1].status is Status.FAILED
    assert out[-1].why == ("swap refused: prepare: swap.fit: spark2: does not fit; nothing was "
                           "stopped")


def test_swap_stops_the_old_then_brings_up_the_new(dep, monkeypatch):
    new, _ = dep(recipe="gpt-oss-120b")
    old, _ = dep()
    s = Swap(monkeypatch, new, old)
    out = s.run(engine="sglang", to_recipe="gpt-oss-120b")
    assert [(w, n) for w, n, _ in s.calls] == [("old", "serve.down"), ("new", "serve.up")]
    assert s.calls[1][2] == {"engine": "sglang"}
    assert s.phases == [ops.PREPARE, ops.CUT_OVER, ops.DONE]
    done = [r for r in out if r.step == sw.STEP]
    assert done[0].status is Status.CHANGED
    assert done[0].details["bringup_s"] is not None and done[0].details["outcome"] == "swapped"
    assert done[-1].why == "endpoint: http://h:30000"
    rec = new.records.read(sw.SwapRecord, done[0].details["record"].rsplit("/", 1)[1][:-3])
    assert (rec.from_model, rec.to_model, rec.outcome) == (old.profile.model.repo,
                                                           "openai/gpt-oss-120b", "swapped")


def test_a_failed_bringup_brings_the_old_one_back(dep, monkeypatch):
    new, _ = dep(recipe="gpt-oss-120b")
    old, _ = dep()
    s = Swap(monkeypatch, new, old, up_fails=True)
    out = s.run()
    assert [(w, n) for w, n, _ in s.calls] == [("old", "serve.down"), ("new", "serve.up"),
                                              ("new", "serve.down"), ("old", "serve.up")]
    assert s.calls[-1][2] == {"engine": "sglang"}  # the engine that served before
    assert s.phases == [ops.PREPARE, ops.CUT_OVER, ops.ROLLED_BACK]
    last = [r for r in out if r.step == sw.STEP][-1]
    assert last.status is Status.FAILED
    assert last.why.startswith("swap rolled-back: sglang stalled; class: sglang-hang; the old "
                               f"model {old.profile.model.repo} serves again")


def test_an_incoherent_answer_brings_the_old_one_back(dep, monkeypatch):
    new, _ = dep(recipe="gpt-oss-120b")
    old, _ = dep()
    s = Swap(monkeypatch, new, old, coherent="the completion came back 500")
    out = s.run()
    assert [(w, n) for w, n, _ in s.calls][-2:] == [("new", "serve.down"), ("old", "serve.up")]
    assert "coherence check: the completion came back 500" in out[-1].why


def test_a_persisted_deployment_swaps_its_units_after_the_new_one_passed(dep, monkeypatch):
    new, _ = dep(recipe="gpt-oss-120b")
    old, _ = dep()
    s = Swap(monkeypatch, new, old, persisted=True)
    s.run()
    assert [(w, n) for w, n, _ in s.calls] == [("old", "serve.down"), ("new", "serve.up"),
                                              ("old", "serve.unpersist"), ("new", "serve.persist")]
    s2 = Swap(monkeypatch, new, old, persisted=True, up_fails=True)
    s2.run()
    assert [(w, n) for w, n, _ in s2.calls][-2:] == [("new", "serve.down"),
                                                    ("old", "serve.persist")]


class _Ctx:
    """What ``prepare`` uses of a step context: the deployment, ``call``, the results."""

    def __init__(self, dep, fail=None):
        self.dep, self.fail, self.called, self.results = dep, fail, [], []

    def call(self, name, **opts):
        self.called.append((name, opts))
        return [Result(name, Status.FAILED, "no room")] if name == self.fail else []


def test_prepare_runs_the_new_deployments_steps_and_stops_nothing(dep, monkeypatch):
    from sparkdeploy.run.plan import PlanRun, StepRun

    new, _ = dep(recipe="gpt-oss-120b")
    old, _ = dep()
    ran = {}

    class FakeRunner:
        def __init__(self, d, steps, name, serial):
            ran.update(dep=d, steps=[s.name for s in steps], name=name)

        def run(self):
            return PlanRun("swap", {n: StepRun(n, state="done") for n in ran["steps"]}, 1.0, False)

    monkeypatch.setattr(sw, "Runner", FakeRunner)
    ctx = _Ctx(new)
    assert sw.prepare(ctx, old, ["/srv/models/old"]) is None
    assert ran["dep"] is new and ran["name"] == "swap"
    assert ran["steps"] == ["model.download", "image.probe", "image.build", "image.ship",
                            "model.sync", "model.verify"]
    assert ctx.called == [("swap.fit", {"old": old, "engine": None}),
                          ("swap.disk", {"keep": ["/srv/models/old"]}), ("swap.flags", {"on": new})]


def test_prepare_stops_at_a_check_before_the_plan(dep, monkeypatch):
    new, _ = dep(recipe="gpt-oss-120b")
    old, _ = dep()
    monkeypatch.setattr(sw, "Runner", lambda *a, **k: pytest.fail("the plan ran"))
    ctx = _Ctx(new, fail="swap.disk")
    assert sw.prepare(ctx, old, []) == "swap.disk: no room"


def test_the_old_deployment_is_the_one_the_nodes_serve(dep, monkeypatch):
    new, _ = dep(recipe="gpt-oss-120b")
    rec = ops.Phase(phase=ops.DONE, from_model="Qwen/Qwen3.5-122B-A10B-FP8",
                    to_model="openai/gpt-oss-20b", from_recipe=None, to_recipe="gpt-oss-20b")
    monkeypatch.setattr(ops, "read_phase", lambda h, deployment=None: rec)
    serves = {"openai/gpt-oss-20b"}
    monkeypatch.setattr(ops, "serving_url", lambda d: ("vllm", "http://h:8000")
                        if d.profile.model.repo in serves else None)
    old, recipe = ops.old_deployment(new)
    assert (old.profile.model.repo, recipe) == ("openai/gpt-oss-20b", "gpt-oss-20b")
    assert old.events is new.events and old.hosts is new.hosts
    serves = {"Qwen/Qwen3.5-122B-A10B-FP8"}  # the swap's model was replaced since: the profile's
    old, recipe = ops.old_deployment(new)
    assert (old.profile.model.repo, recipe) == ("Qwen/Qwen3.5-122B-A10B-FP8", None)


def _head_ps(deployment: str, recipe: str) -> str:
    from sparkdeploy.core import labels

    lab = {k: "" for k in labels.READ} | {labels.DEPLOYMENT: deployment, labels.ENGINE: "vllm",
                                          labels.ROLE: "head", labels.RECIPE: recipe}
    return json.dumps(["c1", "sparkdeploy-vllm-head", "running", "Up 2 minutes",
                       *(lab[k] for k in labels.READ)]) + "\n"


@pytest.mark.parametrize("label,serving,want", [
    # deploy.all --recipe gpt-oss-20b, then serve.swap: no swap record on the head, yet the head's
    # engine containers say which recipe they serve
    ("gpt-oss-20b", "openai/gpt-oss-20b", ("openai/gpt-oss-20b", "gpt-oss-20b")),
    # a recipe another controller deployed from its own directory: passed over
    ("an-owners-own", "Qwen/Qwen3.5-122B-A10B-FP8", ("Qwen/Qwen3.5-122B-A10B-FP8", None)),
])
def test_the_recipe_the_heads_containers_carry_is_a_candidate(dep, monkeypatch, label, serving, want):
    probe, _ = dep()
    new, ctx = dep({"ps": (0, _head_ps(probe.profile.name, label))}, recipe="gpt-oss-120b")
    monkeypatch.setattr(ops, "read_phase", lambda h, deployment=None: None)
    monkeypatch.setattr(ops, "serving_url", lambda d: ("vllm", "http://h:8000")
                        if d.profile.model.repo == serving else None)
    old, recipe = ops.old_deployment(new)
    assert (old.profile.model.repo, recipe) == want
    _, argv = split_command(ctx.commands[-1])
    assert argv[argv.index("ps"):argv.index("--format")] == [
        "ps", "--all", "--no-trunc", "--filter", f"label=org.sparkdeploy.deployment={probe.profile.name}",
        "--filter", "label=org.sparkdeploy.engine"]


@pytest.mark.parametrize("phase,to,serves,want", [
    (None, None, False, None),
    (ops.PREPARE, "openai/gpt-oss-20b", True, None),       # the old one serves: watched as ever
    (ops.CUT_OVER, "openai/gpt-oss-20b", False, "paused"),  # stopped on purpose: no restart
    (ops.ROLLED_BACK, "openai/gpt-oss-20b", True, None),
    (ops.DONE, "openai/gpt-oss-20b", False, "swapped"),     # another model serves: it ends
    (ops.DONE, "openai/gpt-oss-20b", True, None),           # deployed again since the swap
    (ops.DONE, "Qwen/Qwen3.5-122B-A10B-FP8", True, None),   # a swap back to this one
])
def test_the_watchdog_pauses_for_the_cut_over(dep, monkeypatch, phase, to, serves, want):
    from sparkdeploy.steps import watchdog
    from sparkdeploy.steps.registry import StepContext

    d, _ = dep()
    rec = ops.Phase(phase=phase, from_model="x/y", to_model=to) if phase else None
    monkeypatch.setattr(ops, "read_phase", lambda h, deployment=None: rec)
    monkeypatch.setattr(ops, "serving_url", lambda x: ("sglang", "http://h:30000") if serves else None)
    ctx = StepContext("serve.watch", d.events, d)
    assert watchdog.swap_pause(ctx) == want
    if want == "swapped":
        assert ctx.results[-1].why.startswith("serve.swap replaced Qwen/Qwen3.5-122B-A10B-FP8 "
                                              "with openai/gpt-oss-20b: this watch ends")


@pytest.mark.parametrize("old,new,clash", [
    (("a/m", "main", "/srv/models/m"), ("b/m", "main", "/srv/models/m"), True),
    (("a/m", "main", "/srv/models/m"), ("a/m", "v2", "/srv/models/m"), True),
    (("a/m", "main", "/srv/models/m"), ("a/n", "main", "/srv/models/m/n"), True),
    (("a/m", "main", "/srv/models/m/x"), ("a/n", "main", "/srv/models/m"), True),
    (("a/m", "main", "/srv/models/m"), ("a/m", "main", "/srv/models/m"), False),
    (("a/m", "main", "/srv/models/m"), ("a/mm", "main", "/srv/models/mm"), False),
])
def test_two_models_never_share_a_directory(old, new, clash):
    from types import SimpleNamespace as M

    o, n = (M(repo=r, revision=v, path=p) for r, v, p in (old, new))
    why = ops.shared_dir(o, n)
    assert (why is not None) == clash
    if clash:
        assert why.startswith(f"model.path: {n.repo}@{n.revision} would go to {n.path}, which "
                              f"holds {o.repo}@{o.revision}")


def test_prune_removes_beyond_keep_never_the_serving_one(dep, monkeypatch):
    d, ctx = dep({"rm": (0, "")})
    monkeypatch.setattr(ops, "read_phase", lambda h, deployment=None: None)
    dirs = _dirs(("/srv/models/serving", 9 * 10**9, 1), ("/srv/models/a", 2 * 10**9, 10),
                 ("/srv/models/b", 3 * 10**9, 20))
    monkeypatch.setattr(ops, "model_dirs", lambda h, parent: dict(dirs))
    out = run_one(d, "model.prune", serving="/srv/models/serving")
    assert [(r.node, r.status) for r in out] == [("spark1", Status.CHANGED),
                                                 ("spark2", Status.CHANGED)]
    assert out[0].why == "removed /srv/models/a (2.00 GB): 2.00 GB freed"
    rms = [split_command(c)[1] for c in ctx.commands if "rm" in split_command(c)[1]]
    assert [a[a.index("rm"):] for a in rms] == [["rm", "-rf", "--", "/srv/models/a"]] * 2


def test_prune_leaves_both_models_of_a_swap_under_way(dep, monkeypatch):
    d, ctx = dep({"rm": (0, "")})
    rec = ops.Phase(phase=ops.PREPARE, from_model="a/s", to_model="a/b",
                    from_path="/srv/models/serving", to_path="/srv/models/b")
    monkeypatch.setattr(ops, "read_phase", lambda h, deployment=None: rec)
    dirs = _dirs(("/srv/models/serving", 1, 1), ("/srv/models/a", 1, 10), ("/srv/models/b", 1, 5),
                 ("/srv/models/c", 1, 20))
    monkeypatch.setattr(ops, "model_dirs", lambda h, parent: dict(dirs))
    out = run_one(d, "model.prune", serving="/srv/models/serving")
    assert out[0].why == "removed /srv/models/a (0.00 GB): 0.00 GB freed"  # c: model.keep 1
    rec.phase = ops.DONE  # ended: b is just another model
    assert [x.path for x in checks_prune.targets(d, d.host("spark1"), "/srv/models/serving")] == [
        "/srv/models/a", "/srv/models/b"]


def test_prune_with_nothing_beyond_keep_removes_nothing(dep, monkeypatch):
    d, ctx = dep()
    monkeypatch.setattr(ops, "read_phase", lambda h, deployment=None: None)
    monkeypatch.setattr(ops, "model_dirs", lambda h, parent: _dirs(("/srv/models/s", 1, 1),
                                                                   ("/srv/models/a", 1, 2)))
    out = run_one(d, "model.prune", serving="/srv/models/s")
    assert [r.status for r in out] == [Status.OK, Status.OK]
    assert ctx.commands == []


def test_a_rerun_after_a_killed_cut_over_completes_or_brings_the_old_one_back(dep, monkeypatch):
    new, _ = dep(recipe="gpt-oss-120b")
    old, _ = dep()
    killed = ops.Phase(phase=ops.CUT_OVER, from_model=old.profile.model.repo,
                       to_model="openai/gpt-oss-120b", from_engine="vllm-ray")
    # the new one came up before the controller died: the record is completed, nothing stopped
    s = Swap(monkeypatch, new, old, serving_new=("vllm", "http://h:8000"), was=killed.model_copy())
    out = s.run()
    assert s.calls == [] and s.phases == [ops.DONE] and out[-1].status is Status.OK
    # neither serves: the cut-over runs again; a failure brings back the engine that served
    monkeypatch.setattr(sw, "prepare", lambda ctx, o, keep, engine=None: None)
    s = Swap(monkeypatch, new, old, was=killed.model_copy(), old_serves=False, up_fails=True)
    s.run()
    assert s.calls[-1] == ("old", "serve.up", {"engine": "vllm-ray"})
    assert s.phases == [ops.CUT_OVER, ops.ROLLED_BACK]  # nothing served: no prepare record


def test_nothing_serving_and_no_swap_under_way_is_refused(dep, monkeypatch):
    new, _ = dep(recipe="gpt-oss-120b")
    old, _ = dep()
    s = Swap(monkeypatch, new, old, old_serves=False)
    out = s.run(to_recipe="gpt-oss-120b")
    assert s.calls == [] and out[-1].status is Status.FAILED
    assert out[-1].why == (f"nothing of this deployment serves {old.profile.model.repo}: "
                           "deploy.all --recipe gpt-oss-120b deploys the new model")


def test_a_dry_swap_writes_nothing(dep, monkeypatch, tmp_path):
    from sparkdeploy.profile.config import load_profile

    state = tmp_path / "dry-state"
    new = deployment(SEED, state, FakeContext(dry=True),
                     profile=load_profile(SEED, "gpt-oss-120b"), dry=True)
    old, _ = dep()
    s = Swap(monkeypatch, new, old)
    out = s.run()
    assert s.phases == [] and not state.exists()  # no phase on the head, no record
    assert out[-1].status is Status.SKIPPED
    assert out[-1].why == f"would swap {old.profile.model.repo} for openai/gpt-oss-120b"


def test_an_old_engine_that_does_not_stop_is_brought_back_and_nothing_new_starts(dep, monkeypatch):
    new, _ = dep(recipe="gpt-oss-120b")
    old, _ = dep()
    s = Swap(monkeypatch, new, old, down_fails=True)
    out = s.run()
    assert [(w, n) for w, n, _ in s.calls] == [("old", "serve.down"), ("new", "serve.down"),
                                              ("old", "serve.up")]
    assert out[-1].why.startswith("swap rolled-back: the old engine did not stop: still there: x")


def test_the_task_prints_bringup_endpoint_record_and_exits_with_the_swaps_reason(monkeypatch, capsys):
    from sparkdeploy.tasks import _swap

    rolled = [Result("serve.up", Status.FAILED, "vllm hang: ..."),
              Result("serve.up", Status.OK, "endpoint: http://h:30000", None,
                     {"endpoint": "http://h:30000", "engine": "sglang"}),
              Result("serve.swap", Status.FAILED, "swap rolled-back: vllm hang: ...; the old model "
                     "a/b serves again", None, {"bringup_s": 41.5, "record": "/s/swap.md"})]
    seen = {}

    def drive(c, name, work, **kw):
        kw["show"](None, rolled)
        seen.update(name=name, verdict=kw["verdict"](rolled))
        return rolled

    monkeypatch.setattr(_swap, "drive", drive)
    _swap.swap(None, recipe="gpt-oss-120b", engine=None, profile=None)
    assert capsys.readouterr().out.splitlines() == ["bring-up 41.5 s", "endpoint: http://h:30000",
                                                    "record: /s/swap.md"]
    assert seen == {"name": "serve.swap",
                    "verdict": "swap rolled-back: vllm hang: ...; the old model a/b serves again"}


def test_a_rerun_completes_a_persisted_swap_killed_before_its_units_were_replaced(dep, monkeypatch):
    new, _ = dep(recipe="gpt-oss-120b")
    old, _ = dep()
    killed = ops.Phase(phase=ops.CUT_OVER, from_model=old.profile.model.repo,
                       to_model="openai/gpt-oss-120b", from_engine="sglang", persisted=True)
    s = Swap(monkeypatch, new, old, serving_new=("vllm", "http://h:8000"), was=killed)
    s.run()
    assert [(w, n) for w, n, _ in s.calls] == [("old", "serve.unpersist"), ("new", "serve.persist")]
    assert s.calls[-1][2] == {"engine": "vllm"} and s.phases == [ops.DONE]


def test_flags_are_checked_before_anything_stops(dep, monkeypatch):
    from sparkdeploy.ops import serve_preflight

    new, _ = dep()
    monkeypatch.setattr(serve_preflight, "engine_version", lambda d, e: {
        "sglang": "0.5.4", "vllm-ray": "0.17.1", "vllm": "0.17.1"}[e.name])
    out = run_one(new, checks.FLAGS)
    assert [r.status for r in out] == [Status.OK] * len(new.profile.engines)
    assert out[0].why == "sglang: flags checked against sglang 0.5.4"
    eng = new.profile.engines[0]
    bad = eng.model_copy(update={"args": [*eng.args, "--tp-sise", "2"]})
    new.profile = new.profile.model_copy(update={"engines": [bad]})
    [r] = run_one(new, checks.FLAGS)
    assert r.status is Status.FAILED and r.why.startswith("sglang: ") and "--tp-sise" in r.why


def test_the_bringup_is_serve_ups_own_timing_when_it_gives_one():
    timed = [Result("serve.up", Status.CHANGED, "vllm serves x", None,
                    {"startup": {"containers_running": 3.1, "port_open": 40.2, "first_token": 41.04}}),
             Result("serve.up", Status.OK, "endpoint: u", None, {"endpoint": "u"})]
    assert sw.bringup_s(timed, 55.0) == 41.0
    assert sw.bringup_s(timed[1:], 55.04) == 55.0  # serve.up without its timings: its wall time
