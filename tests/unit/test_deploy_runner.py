"""The graph runner behind deploy.all, with fake steps in the real registry: order, concurrency,
--serial, --only/--skip, failure and resume, fingerprints, dry run, the events it emits."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
from invoke import Config, Context

from sparkdeploy.core.events import PlainRenderer, StepState
from sparkdeploy.core.fingerprint import Fingerprint, diff_keys, flat
from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.core.records import Endpoint, ImageDecision, PlanMemory, ServeDecision
from sparkdeploy.node import deployment
from sparkdeploy.run.plan import PlanStep
from sparkdeploy.run.runner import PlanError, Runner, select
from sparkdeploy.steps import registry
from sparkdeploy.steps.registry import step
from tests.unit.profiles import ROOT, SEED


class Calls:
    """What the fake steps did: start/end order, how many ran at once, options they got."""

    def __init__(self):
        self.lock = threading.Lock()
        self.log: list[str] = []
        self.now = 0
        self.peak = 0
        self.options: dict[str, dict] = {}
        self.fail: set[str] = set()
        self.events: dict[str, threading.Event] = {}

    def enter(self, name, options):
        with self.lock:
            self.log.append(f"start {name}")
            self.options[name] = options
            self.now += 1
            self.peak = max(self.peak, self.now)

    def leave(self, name):
        with self.lock:
            self.log.append(f"end {name}")
            self.now -= 1

    def count(self, name):
        return self.log.count(f"start {name}")


@pytest.fixture
def calls(monkeypatch):
    registry.load_all()
    saved = dict(registry.REGISTRY)
    c = Calls()

    def fake(name, *, needs=(), after_start=(), long=False, work=0.05, waits_for=None, sets=None,
             status="changed", **declared):
        def fn(ctx, **options):
            c.enter(name, options)
            try:
                if sets:
                    c.events.setdefault(sets, threading.Event()).set()
                if waits_for:
                    got = c.events.setdefault(waits_for, threading.Event()).wait(3)
                    if not got:
                        ctx.failed(f"{waits_for} never came")
                        return
                time.sleep(work)
                ctx.failed("broke") if name in c.fail else getattr(ctx, status)("did it")
            finally:
                c.leave(name)

        step(name, needs=needs, after_start=after_start, long=long, **declared)(fn)

    c.fake = fake
    yield c
    registry.REGISTRY.clear()
    registry.REGISTRY.update(saved)


def dep_for(tmp_path, dry=False):
    ctx = Context(Config(overrides={"run": {"dry": dry}}))
    return deployment.load(SEED, tmp_path / "state", ctx)


def states(events):
    return [(e.step, e.state) for e in events if isinstance(e, StepState)]


def test_needs_order_and_long_steps_first(tmp_path, calls):
    calls.fake("t.a")
    calls.fake("t.b", needs=("t.a",))
    calls.fake("t.long", long=True)
    calls.fake("t.c", needs=("t.b",))
    plan = [PlanStep("t.a"), PlanStep("t.b"), PlanStep("t.c"), PlanStep("t.long")]
    dep = dep_for(tmp_path)
    out = Runner(dep, plan, serial=True).run()
    assert not out.failed
    starts = [x for x in calls.log if x.startswith("start")]
    # serial: the long step first, then plan order as needs allow; t.b after t.a (registry need)
    assert starts == ["start t.long", "start t.a", "start t.b", "start t.c"]
    assert calls.peak == 1


def test_independent_steps_run_at_once(tmp_path, calls):
    barrier = threading.Barrier(3, timeout=3)

    def together(name):
        def fn(ctx, **options):
            calls.enter(name, options)
            try:
                barrier.wait()  # breaks (raises) unless all three run at the same time
                ctx.ok("met")
            finally:
                calls.leave(name)
        step(name)(fn)

    for n in ("t.x", "t.y", "t.z"):
        together(n)
    dep = dep_for(tmp_path)
    with dep.events.collect() as got:
        out = Runner(dep, [PlanStep("t.x"), PlanStep("t.y"), PlanStep("t.z")]).run()
    assert not out.failed, [r.why for r in out.results()]
    assert calls.peak == 3
    assert {s for s, st in states(got) if st == "done"} == {"t.x", "t.y", "t.z"}


def test_serial_runs_one_at_a_time_and_the_same_plan_concurrently_overlaps(tmp_path, calls):
    # the same three steps: --serial never has two running; without it all three meet at a barrier
    # (which raises unless they run at the same time), so no wall-clock comparison is needed
    meet = threading.Barrier(3, timeout=5)
    serial_mode = {"on": True}

    def step_fn(name):
        def fn(ctx, **options):
            calls.enter(name, options)
            try:
                if not serial_mode["on"]:
                    meet.wait()
                ctx.changed("did it")
            finally:
                calls.leave(name)
        step(name)(fn)

    for n in ("t.p", "t.q", "t.r"):
        step_fn(n)
    plan = [PlanStep("t.p"), PlanStep("t.q"), PlanStep("t.r")]
    serial = Runner(dep_for(tmp_path), plan, serial=True).run()
    assert not serial.failed and calls.peak == 1
    assert [x.split()[0] for x in calls.log] == ["start", "end"] * 3
    calls.peak, serial_mode["on"] = 0, False
    piped = Runner(dep_for(tmp_path / "2"), plan).run()
    assert not piped.failed, [r.why for r in piped.results()]
    assert calls.peak == 3


def test_after_start_overlaps_a_running_step(tmp_path, calls):
    # the sync needs the download running (it sets "started" and then waits for the sync)
    calls.fake("t.download", long=True, sets="dl", waits_for="sync")
    calls.fake("t.sync", waits_for="dl", sets="sync", after_start=("t.download",))
    calls.fake("t.serve", needs=("t.download", "t.sync"))
    plan = [PlanStep("t.download"), PlanStep("t.sync"), PlanStep("t.serve")]
    dep = dep_for(tmp_path)
    with dep.events.collect() as got:
        out = Runner(dep, plan).run()
    assert not out.failed, [r.why for r in out.results()]
    seq = states(got)
    assert seq.index(("t.sync", "running")) < seq.index(("t.download", "done"))
    assert seq.index(("t.serve", "running")) > seq.index(("t.sync", "done"))


def test_a_failure_skips_what_needs_it_and_nothing_else(tmp_path, calls):
    for n, needs in (("t.a", ()), ("t.b", ("t.a",)), ("t.c", ("t.b",)), ("t.other", ())):
        calls.fake(n, needs=needs)
    calls.fail.add("t.a")
    plan = [PlanStep("t.a"), PlanStep("t.b"), PlanStep("t.c"), PlanStep("t.other")]
    dep = dep_for(tmp_path)
    with dep.events.collect() as got:
        out = Runner(dep, plan).run()
    assert out.failed
    assert out.runs["t.a"].state == "failed"
    assert out.runs["t.b"].state == "skipped" and "t.a, which failed" in out.runs["t.b"].why
    assert out.runs["t.c"].state == "skipped" and "t.b" in out.runs["t.c"].why
    assert out.runs["t.other"].state == "done"
    assert calls.count("t.b") == 0 and calls.count("t.c") == 0
    ends = [e for e in got if isinstance(e, StepState) and e.state in ("done", "failed")]
    assert all(e.elapsed is not None and e.elapsed >= 0.04 for e in ends)


def test_a_step_that_raises_fails_alone(tmp_path, calls):
    def boom(ctx, **options):
        raise RuntimeError("kaput")
    step("t.boom")(boom)
    calls.fake("t.fine")
    out = Runner(dep_for(tmp_path), [PlanStep("t.boom"), PlanStep("t.fine")]).run()
    assert out.runs["t.boom"].state == "failed"
    assert "RuntimeError: kaput" in out.runs["t.boom"].why
    assert out.runs["t.fine"].state == "done"


def test_resume_after_a_failure_reruns_from_the_failed_step(tmp_path, calls):
    for n, needs in (("t.a", ()), ("t.b", ("t.a",)), ("t.c", ("t.b",))):
        calls.fake(n, needs=needs)
    calls.fake("t.decide", reuse=True, fingerprint=Fingerprint(also=lambda d: {"x": 1}))
    plan = [PlanStep("t.decide"), PlanStep("t.a"), PlanStep("t.b"), PlanStep("t.c")]
    calls.fail.add("t.b")
    first = Runner(dep_for(tmp_path), plan).run()
    assert first.runs["t.b"].state == "failed" and first.runs["t.c"].state == "skipped"
    calls.fail.clear()
    second = Runner(dep_for(tmp_path), plan).run()
    assert not second.failed
    assert calls.count("t.decide") == 1  # a decision unchanged since it finished is reused
    assert second.runs["t.decide"].reused
    assert calls.count("t.b") == 2 and calls.count("t.c") == 1
    state = dep_for(tmp_path).records.read(PlanMemory, "deploy-qwen3.5-122b-a10b-fp8")
    assert {n: s.state for n, s in state.steps.items()} == {
        "t.decide": "done", "t.a": "done", "t.b": "done", "t.c": "done"}


def test_profile_change_redoes_the_step_and_names_the_keys(tmp_path, calls):
    fp = {"engines[0].args[0]": "--x", "model.path": "/m"}
    calls.fake("t.up", fingerprint=Fingerprint(also=lambda d: dict(fp)), redo="t.down")
    calls.fake("t.down")
    calls.fake("t.decide", reuse=True, fingerprint=Fingerprint(also=lambda d: {"images": fp["model.path"]}))
    plan = [PlanStep("t.decide"), PlanStep("t.up")]
    Runner(dep_for(tmp_path), plan).run()
    assert calls.count("t.down") == 0
    Runner(dep_for(tmp_path), plan).run()  # unchanged: no redo
    assert calls.count("t.down") == 0 and calls.count("t.up") == 2 and calls.count("t.decide") == 1
    fp["engines[0].args[0]"] = "--y"
    dep = dep_for(tmp_path)
    with dep.events.collect() as got:
        Runner(dep, plan).run()
    assert calls.count("t.down") == 1 and calls.count("t.up") == 3 and calls.count("t.decide") == 1
    assert calls.log.index("start t.down") < len(calls.log) - 1 - calls.log[::-1].index("start t.up")
    said = [e.why for e in got if getattr(e, "step", None) == "t.up" and hasattr(e, "status")]
    assert any("changed since the last run (engines[0].args[0]): t.down first" in w for w in said)


def test_a_new_model_revision_redoes_serve_up(tmp_path, calls):
    """serve.up's own fingerprint (less what it asks the nodes): a new revision is serve.down
    first, then serve.up again, not the old weights kept serving."""
    real = registry.get("serve.up").fingerprint
    calls.fake("t.up", fingerprint=Fingerprint(*real.sections, also=real.also), redo="t.down")
    calls.fake("t.down")

    def at(revision):
        dep = dep_for(tmp_path)
        dep.profile = dep.profile.model_copy(update={"model": dep.profile.model.model_copy(
            update={"revision": revision})})
        return dep

    Runner(at("main"), [PlanStep("t.up")]).run()
    Runner(at("main"), [PlanStep("t.up")]).run()
    assert calls.count("t.down") == 0
    dep = at("v2")
    with dep.events.collect() as got:
        Runner(dep, [PlanStep("t.up")]).run()
    assert calls.count("t.down") == 1 and calls.count("t.up") == 3
    said = [e.why for e in got if getattr(e, "step", None) == "t.up" and hasattr(e, "status")]
    assert any("changed since the last run (model.revision): t.down first" in w for w in said)


def test_dry_run_writes_no_state_and_runs_steps_dry(tmp_path, calls):
    seen = {}

    def look(ctx, **options):
        seen["dry"] = ctx.dry
        ctx.ok("would")
    step("t.look", needs=("t.unreachable",))(look)
    calls.fake("t.unreachable")
    calls.fail.add("t.unreachable")
    dep = dep_for(tmp_path, dry=True)
    out = Runner(dep, [PlanStep("t.unreachable"), PlanStep("t.look")],
                 serial=True).run()
    assert seen["dry"] is True  # what depends on a failed step still shows what it would do
    assert out.runs["t.unreachable"].state == "failed" and out.runs["t.look"].state == "done"
    assert not (tmp_path / "state").exists()


def test_only_and_skip_and_bad_names():
    plan = [PlanStep("a"), PlanStep("b"), PlanStep("c")]
    steps, left = select(plan, ["b"], [])
    assert [s.name for s in steps] == ["b"] and left == {"a": "not in --only", "c": "not in --only"}
    steps, left = select(plan, [], ["a", "c"])
    assert [s.name for s in steps] == ["b"] and left == {"a": "--skip", "c": "--skip"}
    with pytest.raises(PlanError, match=r"^--only: no step 'nope' in the plan \(steps: a, b, c\)$"):
        select(plan, ["nope"], [])
    with pytest.raises(PlanError, match="--skip: no step 'x'"):
        select(plan, [], ["x"])


def test_option_values_resolved_when_the_step_starts_and_when_skips(tmp_path, calls):
    calls.fake("t.up")
    calls.fake("t.bench", needs=("t.up",))
    calls.fake("t.never", when=lambda d, runs, forced: None if forced else "not needed")
    calls.fake("t.asked", when=lambda d, runs, forced: None if forced else "not needed")
    plan = [PlanStep("t.up"),
            PlanStep("t.bench", {"url": lambda d, runs: f"from {runs['t.up'].state}", "n": 4}),
            PlanStep("t.never"), PlanStep("t.asked", forced=True)]
    out = Runner(dep_for(tmp_path), plan).run()
    assert calls.options["t.bench"] == {"url": "from done", "n": 4}
    assert out.runs["t.never"].state == "skipped" and out.runs["t.never"].why == "not needed"
    assert calls.count("t.never") == 0 and calls.count("t.asked") == 1  # the plan forced it


def test_plan_errors(calls):
    from sparkdeploy.run.runner import check

    calls.fake("t.a", needs=("t.zz",))
    with pytest.raises(PlanError, match="^plan: t.a needs 't.zz', which is no step$"):
        check([PlanStep("t.a")])
    calls.fake("t.zz", needs=("t.a",))
    with pytest.raises(PlanError, match="cycle"):
        check([PlanStep("t.a"), PlanStep("t.zz")])


def test_an_edge_through_a_step_left_out_still_orders(calls):
    from sparkdeploy.run.plan import graph

    calls.fake("t.probe")
    calls.fake("t.build", needs=("t.probe",))
    calls.fake("t.ship", needs=("t.build",))
    assert graph([PlanStep("t.probe"), PlanStep("t.ship")]) == {"t.probe": set(), "t.ship": {"t.probe"}}
    assert graph([PlanStep("t.ship")]) == {"t.ship": set()}


def test_fingerprint_helpers():
    assert flat({"a": {"b": [1, {"c": 2}]}, "d": []}) == {"a.b[0]": 1, "a.b[1].c": 2, "d": []}
    assert diff_keys({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 0}) == ["b", "c"]


def test_plain_lines_carry_state_and_elapsed():
    buf = io.StringIO()
    PlainRenderer(buf, stamp=lambda: "12:00:00")(StepState("model.sync", "done", "changed: sent", 12.34))
    assert buf.getvalue() == "12:00:00 step done     model.sync (12.3s): changed: sent\n"


def test_task_bad_step_name_is_one_line_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "invoke", "deploy.all", "--only", "nope,serve.up"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"),
                            "INVOKE_SPARKDEPLOY_STATE_DIR": str(tmp_path)})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "--only: no step 'nope' in the plan (steps: link.check, model.download, hosts.check, model.precheck, "
        "services.stop, model.fit, image.probe, image.build, image.ship, link.fabric, model.sync, model.verify, "
        "serve.up, metrics.up, bench.run)"]


def test_the_deploy_plan_pipelines_and_records(tmp_path, calls, monkeypatch):
    from sparkdeploy.ops import image
    from sparkdeploy.run import plan as plans
    from sparkdeploy.run.run_record import write_record

    # every image is on every node, under its name's ID: no node's image list is read
    monkeypatch.setattr(image, "_image_list", lambda host: {})
    monkeypatch.setattr(image, "_inspected_id", lambda host, ref: f"sha256:{ref}")
    dep = dep_for(tmp_path)
    chosen = {"image": "base:1", "kind": "sglang", "serve_image": "layer:1", "needs_layer": False}
    dep.records.write(ImageDecision(
        node="spark1", arch="arm64", config_from="the hub", chosen={"engine": "sglang", **chosen},
        engines={"sglang": chosen}, summary="chosen base:1 for sglang", candidates=[
            {"image": "base:1", "engine": "sglang", "verdict": "viable", "why": "all there"}]))
    steps = plans.plan(dep)
    real = {s.name: registry.REGISTRY[s.name] for s in steps}
    registry.REGISTRY.clear()
    for s in steps:  # the fakes keep the real steps' edges and what they declare for a plan
        r = real[s.name]
        calls.fake(s.name, needs=r.needs, after_start=r.after_start, fingerprint=r.fingerprint,
                   reuse=r.reuse, redo=r.redo, when=r.when,
                   long=s.name in ("model.download", "image.ship", "model.sync"),
                   work=1.5 if s.name == "model.download" else 0.05,
                   status="ok" if s.name != "serve.up" else "changed")
    with dep.events.collect() as got:
        out = Runner(dep, steps).run()
    assert not out.failed, [r.why for r in out.results()]
    launched = [s for s, st in states(got) if st == "running"]
    # the head's units stopped, the fit checked, then the long step first, its follower next
    assert calls.log.index("end services.stop") < calls.log.index("start model.fit")
    assert calls.log.index("end model.fit") < calls.log.index("start model.download")
    i = launched.index("model.download")
    assert launched[i:i + 2] == ["model.download", "model.sync"]
    assert calls.log.index("start model.sync") < calls.log.index("end model.download")
    assert calls.log.index("start image.ship") < calls.log.index("end model.download"), " ".join(calls.log)
    assert out.runs["image.build"].state == "skipped"
    assert "needs no layer" in out.runs["image.build"].why
    assert calls.options["model.sync"] == {"to": "spark2"}
    assert calls.options["bench.run"]["concurrency"] == [1]
    dep.records.write(ServeDecision(chosen="vllm-ray", run_dir="/runs/1",
                                    startup={"port_open": 40.2, "first_token": 41.0}, tried=[
        {"engine": "sglang", "outcome": "hang", "class": "nccl-init-hang", "phase": "init",
         "why": "no progress for 60s", "fallback_after_s": 61.5,
         "evidence": [["spark1.log", 41, "CustomAllreduce is disabled because this process group "
                       "spans across nodes."]]}]))
    dep.records.write(Endpoint(url="http://h:8000", engine="vllm-ray", model="m"))
    written = write_record(dep, out, steps)
    md = written.markdown.read_text()
    assert "serving `layer:1` = `sha256:layer:1`" in md and "| model.download | done |" in md
    assert "serving with **vllm-ray**" in md
    assert "- bring-up 41.0 s (port 40.2 s, first token 41.0 s), from the engine's start" in md
    assert json.loads(written.json.read_text())["data"]["engine"]["startup"] == {
        "first_token": 41.0, "port_open": 40.2}
    assert "sglang was tried first: hang in init, diagnosis `nccl-init-hang`: no progress for 60s" in md
    assert "evidence: `spark1.log:41`: `CustomAllreduce is disabled" in md
    assert written.json.exists() and '"chosen": "vllm-ray"' in written.json.read_text()
    # nothing changed the second time (every fake says ok): no bench smoke
    calls.log.clear()
    registry.REGISTRY["serve.up"] = replace(registry.REGISTRY["serve.up"],
                                            body=lambda ctx, **o: ctx.ok("already serving"))
    again = Runner(dep_for(tmp_path), plans.plan(dep)).run()
    assert again.runs["bench.run"].state == "skipped"
    assert again.runs["bench.run"].why.startswith("nothing changed")


def test_longest_chain_counts_after_start_from_the_start(calls):
    from sparkdeploy.run.plan import PlanRun, StepRun
    from sparkdeploy.run.runner import longest_chain

    calls.fake("dl")
    calls.fake("sync", after_start=("dl",))
    calls.fake("probe")
    calls.fake("ship", needs=("probe",))
    calls.fake("up", needs=("dl", "sync", "ship"))
    plan = [PlanStep("dl"), PlanStep("sync"), PlanStep("probe"), PlanStep("ship"), PlanStep("up")]
    took = {"dl": 60.0, "sync": 63.0, "probe": 5.0, "ship": 20.0, "up": 10.0}
    runs = {n: StepRun(n, "done", elapsed=t) for n, t in took.items()}
    secs, chain = longest_chain(PlanRun("deploy", runs, 80.0, False), plan)
    assert (secs, chain) == (73.0, ["sync", "up"])
    took["ship"] = 70.0
    runs = {n: StepRun(n, "done", elapsed=t) for n, t in took.items()}
    assert longest_chain(PlanRun("deploy", runs, 80.0, False), plan) == (85.0, ["probe", "ship", "up"])


def test_a_later_result_for_the_same_target_supersedes_a_failure(tmp_path, calls):
    def fallback(ctx, **o):
        ctx.failed("sglang hung; class: nccl-init-hang; falling back")
        ctx.changed("vllm serves", engine="vllm")
        ctx.ok("endpoint: http://x:1", endpoint="http://x:1")

    def per_node(ctx, **o):
        ctx.failed("disk full", "spark2")
        ctx.changed("shipped", "spark3")
    step("t.up")(fallback)
    step("t.ship")(per_node)
    out = Runner(dep_for(tmp_path), [PlanStep("t.up"), PlanStep("t.ship")]).run()
    assert out.runs["t.up"].state == "done" and out.runs["t.up"].why == "changed: vllm serves"
    assert out.runs["t.ship"].state == "failed" and out.runs["t.ship"].why == "failed: disk full"


def test_the_board_is_the_plan_as_a_checklist():
    from sparkdeploy.core.events import Board, Progress

    now = [100.0]
    b = Board(clock=lambda: now[0])
    for n in ("model.download", "image.probe", "serve.up"):
        b.feed(StepState(n, "pending"))
    b.feed(StepState("model.download", "running"))
    b.feed(StepState("image.probe", "done", "changed: chosen X", 3.25))
    assert b.feed(Progress("model.download", "spark1", 1.5e9, 3e9, "B", "4/15 files"))
    assert not b.feed(Progress("elsewhere", None, 1, 2))
    now[0] = 112.0
    assert b.lines() == [
        "▸ model.download     running     12s",
        "    [spark1] 1.5 GB of 3.0 GB (50%) 4/15 files",
        "✓ image.probe        done       3.2s  changed: chosen X",
        "· serve.up           pending        ",
    ]
    b.feed(StepState("model.download", "failed", "failed: disk full", 14.0))
    assert b.lines()[0] == "✗ model.download     failed    14.0s  failed: disk full"
    assert len(b.lines()) == 3  # the progress of a finished step is gone


def test_a_reuse_step_keeps_the_fingerprint_it_left_behind(tmp_path, calls):
    node = {"units": "active"}

    def stop(ctx, **o):
        calls.enter("t.stop", o)
        node["units"] = "inactive"
        calls.leave("t.stop")
        ctx.changed("stopped")
    step("t.stop", fingerprint=Fingerprint(asks=lambda d: dict(node)), reuse=True)(stop)
    plan = [PlanStep("t.stop")]
    Runner(dep_for(tmp_path), plan).run()
    again = Runner(dep_for(tmp_path), plan).run()
    assert calls.count("t.stop") == 1 and again.runs["t.stop"].reused
    node["units"] = "active"  # someone started them again: the step runs again
    Runner(dep_for(tmp_path), plan).run()
    assert calls.count("t.stop") == 2


def test_the_records_bench_summary_has_counts_rates_and_medians_not_raw_requests():
    from sparkdeploy.bench.metrics import RequestMetrics, summarize
    from sparkdeploy.core.records import markdown_table
    from sparkdeploy.run.plan import StepRun
    from sparkdeploy.run.run_record import _bench_summary

    def req(ttft, tok_s, start, end, error=None):
        return RequestMetrics(ttft, (end - start) * 1000, 64, 512, [], 37.0, tok_s, "usage",
                              error, start, end)

    reqs = [req(120.0, 27.0, 0.0, 2.0), req(130.0, 26.0, 2.0, 4.0), req(None, None, 4.0, 4.5, "HTTP 500")]
    run = {"concurrency": 1, "rate": None, "summary": summarize(reqs),
           "requests": [r.as_json() for r in reqs]}
    sr = StepRun("bench.run", state="done",
                 results=[Result("bench.run", Status.OK, "c1", None, {"run": run})])
    out = _bench_summary({"bench.run": sr})
    assert out == {"state": "done", "levels": [{
        "concurrency": 1, "rate": None, "requests": 3, "completed": 2, "failed": 1,
        "output_tok_s": 28.4, "decode_tok_s_median": 26.5, "ttft_ms_median": 125.0,
        "tpot_ms_median": 37.0}]}
    table = markdown_table(list(out["levels"][0]), [list(lv.values()) for lv in out["levels"]])
    assert "ttft_ms" not in table.splitlines()[2] and "[" not in table
    assert _bench_summary({}) is None
    assert _bench_summary({"bench.run": StepRun("bench.run", state="skipped", why="nothing changed")}) == {
        "state": "skipped", "why": "nothing changed"}
