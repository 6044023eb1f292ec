"""The step registry: every step registered under its name, needs that form a graph, a
duplicate name refused, and every result on the stream exactly once."""

import graphlib

import pytest

from sparkdeploy.events import Progress
from sparkdeploy.results import Result, changed, ok
from sparkdeploy.steps.registry import REGISTRY, get, load_all, run_one, step
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
        assert spec.name == spec.fn.step_name
        assert (spec.fn.__doc__ or "").strip(), f"{spec.name} has no docstring"
        assert set(spec.needs) | set(spec.after_start) <= set(steps), \
            f"{spec.name} needs an unknown step"
    order = list(graphlib.TopologicalSorter({n: s.needs for n, s in steps.items()}).static_order())
    assert order.index("hosts.check") < order.index("image.probe") < order.index("image.build") \
        < order.index("image.ship")
    assert get("image.build").long and get("image.ship").long


def test_a_second_step_under_a_taken_name_is_refused(scratch):
    @step("test.one")
    def one(dep):
        """One."""
        return []

    step("test.one")(one)  # the same function again (a module re-imported) is fine
    with pytest.raises(ValueError, match="'test.one' registered twice"):
        @step("test.one")
        def other(dep):
            return []


def test_unknown_step_names_the_known_ones():
    with pytest.raises(KeyError, match="no step named 'nope'.*services.stop"):
        get("nope")


def test_run_one_puts_every_result_on_the_stream_exactly_once(scratch, tmp_path):
    dep, _, _ = scripted(tmp_path, {"spark1": FakeNode()})

    @step("test.mixed")
    def mixed(dep, node=None):
        """Reports one result as it happens, returns another without emitting it."""
        first = dep.report(changed("test.mixed", f"did it on {node}", node))
        dep.events.emit(Progress("test.mixed", node, 1, 2, "steps"))
        return [first, ok("test.mixed", "and this", node)]

    with dep.events.collect() as got:
        results = run_one(dep, "test.mixed", node="spark1")
    assert [r.why for r in results] == ["did it on spark1", "and this"]
    on_stream = [e for e in got if isinstance(e, Result)]
    assert [r.why for r in on_stream] == ["did it on spark1", "and this"]
    assert [type(e).__name__ for e in got] == ["Result", "Progress", "Result"]


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

