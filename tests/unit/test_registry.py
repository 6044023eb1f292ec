"""The step registry and its protocol: every step registered under its name, needs that form a
graph, what a plan needs of a step declared with it, a duplicate name refused, every result on
the stream exactly once through the step's context, and an unreachable node one failed result
for that node."""

import graphlib

import pytest

from sparkdeploy.core.events import EventSink, Progress
from sparkdeploy.core.fingerprint import Fingerprint
from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.node.hosts import NodeUnreachable
from sparkdeploy.steps.registry import REGISTRY, StepContext, get, load_all, run_one, step
from tests.unit.fakes import FakeNode, scripted

EXISTING = {"hosts.check", "hosts.trust", "services.stop", "services.restore", "services.status",
            "image.probe", "image.build", "image.ship", "bench.run"}


@pytest.fixture
def scratch():
    """Register test steps; take them out again afterwards."""
    before = dict(REGISTRY)
    yield
    REGISTRY.clear()
    REGISTRY.update(before)


def test_every_existing_step_is_registered_and_the_needs_form_a_graph():
    steps = load_all()
    assert EXISTING <= set(steps)
    for spec in steps.values():
        assert (spec.body.__doc__ or "").strip(), f"{spec.name} has no docstring"
        assert set(spec.needs) | set(spec.after_start) <= set(steps), \
            f"{spec.name} needs an unknown step"
    order = list(graphlib.TopologicalSorter({n: s.needs for n, s in steps.items()}).static_order())
    assert order.index("hosts.check") < order.index("image.probe") < order.index("image.build") \
        < order.index("image.ship")
    assert get("image.build").long and get("image.ship").long


def test_a_second_step_under_a_taken_name_is_refused(scratch):
    @step("test.one")
    def one(ctx):
        """One."""

    step("test.one")(one)  # the same function again (a module re-imported) is fine
    with pytest.raises(TypeError, match="'test.gen': a body reports through its context"):
        @step("test.gen")
        def gen(ctx):
            yield ctx.ok("not like this")
    with pytest.raises(ValueError, match="'test.one' registered twice"):
        @step("test.one")
        def other(ctx):
            pass


def test_a_step_declares_how_a_plan_runs_it_and_reuse_needs_a_fingerprint(scratch):
    def why(dep, runs, forced):
        return None if forced else "not asked for"

    @step("test.decide", fingerprint=Fingerprint("model", asks=lambda d: {}), reuse=True, when=why)
    def decide(ctx):
        """Decide."""

    spec = get("test.decide")
    assert (spec.reuse, spec.redo, spec.when) == (True, None, why)
    assert spec.fingerprint is not None and spec.fingerprint.sections == ("model",)
    assert spec.fingerprint.asks_nodes and not Fingerprint("model").asks_nodes
    for declared in ({"reuse": True}, {"redo": "test.undo"}):
        with pytest.raises(TypeError, match="'test.bare': reuse and redo follow a fingerprint"):
            step("test.bare", **declared)


def test_unknown_step_names_the_known_ones():
    with pytest.raises(KeyError, match="no step named 'nope'.*services.stop"):
        get("nope")


def test_a_step_reports_through_its_context_each_result_once_in_order(scratch, tmp_path):
    dep, _, _ = scripted(tmp_path, {"spark1": FakeNode()})

    @step("test.inner")
    def inner(ctx, node=None):
        """Run by test.outer."""
        ctx.ok("inner's", node)

    @step("test.outer")
    def outer(ctx, node=None):
        """Reports, shows progress, runs another step, says what it would do."""
        ctx.changed(f"did it on {node}", node)
        ctx.progress(node, 1, 2, "steps")
        assert [r.why for r in ctx.call("test.inner", node=node)] == ["inner's"]
        ctx.would("do more", node)

    with dep.events.collect() as got:
        results = outer(dep, node="spark1")
    assert [(r.step, r.status, r.why) for r in results] == [
        ("test.outer", Status.CHANGED, "did it on spark1"), ("test.inner", Status.OK, "inner's"),
        ("test.outer", Status.SKIPPED, "would do more")]
    assert [e for e in got if isinstance(e, Result)] == results
    assert [type(e).__name__ for e in got] == ["Result", "Progress", "Result", "Result"]
    assert got[1] == Progress("test.outer", "spark1", 1, 2, "steps")
    assert run_one(dep, "test.inner") == [Result("test.inner", Status.OK, "inner's")]


def test_an_unreachable_node_is_one_failed_result_for_it_and_the_others_go_on(scratch, tmp_path):
    dep, _, _ = scripted(tmp_path, {"spark1": FakeNode()})
    done = []

    def work(host_name):
        if host_name == "b":
            raise NodeUnreachable("b", "no route to host")
        done.append(host_name)
        return host_name.upper()

    class H:
        def __init__(self, name):
            self.name = name

    @step("test.fan")
    def fan(ctx, parallel=False):
        """Fans out over three nodes, the second unreachable."""
        got = ctx.each([H("a"), H("b"), H("c")], lambda h: work(h.name), parallel=parallel)
        assert got == ["A", None, "C"]
        ctx.ok("after the fan-out")

    @step("test.stops")
    def stops(ctx):
        """Stops at an unreachable node."""
        raise NodeUnreachable("spark1", "connection refused")

    for parallel in (False, True):
        done.clear()
        results = fan(dep, parallel=parallel)
        assert [(r.status, r.node, r.why) for r in results] == [
            (Status.FAILED, "b", "unreachable: no route to host"),
            (Status.OK, None, "after the fan-out")]
        assert sorted(done) == ["a", "c"]
    assert [(r.step, r.status, r.node, r.why) for r in stops(dep)] == [
        ("test.stops", Status.FAILED, "spark1", "unreachable: connection refused")]


def test_a_context_without_a_deployment_reports_but_has_no_dep():
    from sparkdeploy.core.events import EventSink

    ctx = StepContext("bench.run", EventSink())
    with ctx.events.collect() as got:
        ctx.failed("no endpoint")
    assert got == ctx.results == [Result("bench.run", Status.FAILED, "no endpoint")]
    assert ctx.dry is False
    with pytest.raises(RuntimeError, match="bench.run runs without a deployment"):
        _ = ctx.dep


def test_steps_report_as_they_happen(tmp_path):
    """services.stop emits each node's result before it goes on to the next node."""
    dep, ctx, _ = scripted(tmp_path, {"spark1": FakeNode(), "spark2": FakeNode()})
    seen_calls_at_result: list[tuple[str, int]] = []
    dep.events.listeners.append(
        lambda e: isinstance(e, Result) and seen_calls_at_result.append((e.node, len(ctx.calls))))
    run_one(dep, "services.status")
    # spark1's result was on the stream before spark2 was asked anything
    (n1, calls1), (n2, calls2) = seen_calls_at_result
    assert (n1, n2) == ("spark1", "spark2") and calls1 < calls2
    assert all(a == "spark1" for a, _ in ctx.calls[:calls1])



def test_a_superseded_failure_stays_failed_on_the_stream_but_does_not_fail_the_task():

    from sparkdeploy.core.events import EventSink
    from sparkdeploy.tasks._common import failed_count

    ctx = StepContext("serve.up", EventSink())
    first = ctx.failed("sglang hang; falling back to vllm-ray")
    ctx.ok("endpoint: http://x:1")
    assert failed_count(ctx.results) == "1 step(s) failed"
    ctx.supersede([first])
    assert failed_count(ctx.results) is None
    assert first.failed and first in ctx.results


def test_work_aside_shows_its_progress_but_its_results_only_to_the_step_that_judges_them():
    events = EventSink()
    ctx = StepContext("model.verify", events)
    with events.collect() as got:
        sub = ctx.aside()
        sub.progress("spark1", 5, 10)
        fetched = sub.changed("fetched 2 files", "spark1")
        ctx.changed(f"repaired ({fetched.why})", "spark1")
    assert [type(e).__name__ for e in got] == ["Progress", "Result"]
    assert [(r.step, r.why) for r in ctx.results] == [("model.verify", "repaired (fetched 2 files)")]
    assert sub.results == [fetched] and fetched.step == "model.verify"


def test_a_step_fails_by_raising_and_its_context_makes_the_one_failed_result(tmp_path, scratch):
    from sparkdeploy.core.errors import PartFailed, RunError, StepFailed

    dep, _, _ = scripted(tmp_path, {"spark1": FakeNode()})

    @step("test.refuses")
    def refuses(ctx):
        """Cannot go on: one failed result, for the node the error names."""
        ctx.ok("probed")
        raise StepFailed("no weights in /srv/m", node="spark1")

    @step("test.parts")
    def parts(ctx):
        """One node's part fails, the others go on; an engine refused, the next one tried."""
        def one(n):
            if n == "b":
                raise PartFailed("b: python3 is not installed", "b")
            return n

        assert ctx.each(["a", "b", "c"], one) == ["a", None, "c"]
        for eng in ("sglang", "vllm"):
            with ctx.failing(KeyError, lead=f"{eng}: ", engine=eng) as caught:
                {"vllm": 1}[eng]
            if caught.error is None:
                ctx.ok(f"{eng} fits")
        assert caught.result is None

    @step("test.crashes")
    def crashes(ctx):
        """A run error is no step failure: it goes up to the runner or the task driver."""
        raise RunError("the lock is held")

    assert [(r.status, r.node, r.why) for r in refuses(dep)] == [
        (Status.OK, None, "probed"), (Status.FAILED, "spark1", "no weights in /srv/m")]
    assert [(r.status, r.node, r.why, r.details) for r in parts(dep)] == [
        (Status.FAILED, "b", "b: python3 is not installed", {}),
        (Status.FAILED, None, "sglang: 'sglang'", {"engine": "sglang"}),
        (Status.OK, None, "vllm fits", {})]
    with pytest.raises(RunError, match="the lock is held"):
        crashes(dep)
