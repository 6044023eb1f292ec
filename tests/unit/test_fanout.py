"""The tree fan-out planner: rounds that double, and re-planning when a node fails."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparkdeploy.node.fanout import FanOut, Outcome, pick_source, rounds, run

NODES = [f"n{i}" for i in range(2, 10)]


def serial(fn, pairs):
    return [fn(p) for p in pairs]


@pytest.mark.parametrize(("n", "want"), [
    (1, [[("n1", "n2")]]),
    (2, [[("n1", "n2")], [("n2", "n3")]]),
    (3, [[("n1", "n2")], [("n2", "n3"), ("n1", "n4")]]),
    (7, [[("n1", "n2")], [("n2", "n3"), ("n1", "n4")],
         [("n2", "n5"), ("n3", "n6"), ("n4", "n7"), ("n1", "n8")]]),
])
def test_rounds_double_and_the_origin_serves_last(n, want):
    assert rounds("n1", NODES[:n]) == want


def test_no_targets_no_rounds():
    assert rounds("n1", []) == []


def test_pick_source_not_the_origin_then_least_loaded_then_the_earliest():
    assert pick_source(["o", "a", "b"], "o") == "a"
    assert pick_source(["o", "a", "b"], "o", {"a": 1}) == "b"
    assert pick_source(["o", "a"], "o", {"a": 5}) == "a"
    assert pick_source(["o", "a", "b"], "o", {"a": 2, "b": 1}) == "b"
    assert pick_source(["o"], "o", {"o": 3}) == "o"
    assert pick_source(["b", "a"], "o") == "b"
    assert pick_source(["b", "a"], "o", {"b": 1, "a": 1}) == "b"


def test_a_target_that_fails_serves_no_one_and_the_others_go_on():
    fan = FanOut("n1", ["n2", "n3", "n4"])
    assert fan.next_round() == [("n1", "n2")]
    fan.record(("n1", "n2"), Outcome.TARGET, "disk full on n2")
    assert fan.next_round() == [("n1", "n3")]
    fan.record(("n1", "n3"), Outcome.OK)
    assert fan.next_round() == [("n3", "n4")]
    fan.record(("n3", "n4"), Outcome.OK)
    assert fan.finished and fan.done == ["n3", "n4"]
    assert fan.failed == {"n2": "disk full on n2"} and fan.stranded == []


def test_a_lost_source_is_not_asked_again_and_its_target_waits_for_another():
    fan = FanOut("n1", ["n2", "n3", "n4"])
    fan.record(fan.next_round()[0], Outcome.OK)
    assert fan.next_round() == [("n2", "n3"), ("n1", "n4")]
    fan.record(("n2", "n3"), Outcome.SOURCE, "n2 unreachable")
    assert fan.lost == {"n2": "n2 unreachable"} and not fan.finished
    assert fan.next_round() == []  # n1 is still busy with n4
    fan.record(("n1", "n4"), Outcome.OK)
    assert fan.next_round() == [("n4", "n3")]
    fan.record(("n4", "n3"), Outcome.OK)
    # n2 got the item before it was lost: it holds it, and serves no more
    assert fan.finished and fan.done == ["n2", "n3", "n4"] and fan.failed == {}
    assert fan.holders == ["n1", "n4", "n3"]


def test_with_every_source_lost_the_waiting_targets_fail_with_the_reason():
    fan = FanOut("n1", ["n2", "n3"])
    fan.record(fan.next_round()[0], Outcome.SOURCE, "n1: staged helper changed")
    assert fan.finished and fan.next_round() == []
    why = "no node left to send from (n1: n1: staged helper changed)"
    assert fan.failed == {"n2": why, "n3": why} and fan.stranded == ["n2", "n3"]


def test_default_reasons_name_the_node():
    fan = FanOut("n1", ["n2", "n3"])
    fan.record(fan.next_round()[0], Outcome.TARGET)
    fan.record(fan.next_round()[0], Outcome.SOURCE)
    assert fan.failed == {"n2": "n2 failed",
                          "n3": "no node left to send from (n1: n1 failed while sending)"}


def test_run_calls_the_transfer_per_round_and_records_what_it_says():
    calls = []

    def transfer(src, dst):
        calls.append((src, dst))
        if dst == "n3":
            return Outcome.TARGET, "n3 refused"
        return Outcome.OK, ""

    rounds_seen = []

    def each(fn, pairs):
        rounds_seen.append(list(pairs))
        return [fn(p) for p in pairs]

    fan = run(FanOut("n1", ["n2", "n3", "n4", "n5"]), transfer, each)
    assert rounds_seen == [[("n1", "n2")], [("n2", "n3"), ("n1", "n4")], [("n2", "n5")]]
    assert calls == [p for r in rounds_seen for p in r]
    assert fan.done == ["n2", "n4", "n5"] and fan.failed == {"n3": "n3 refused"}


def test_holders_given_up_front_serve_from_the_first_round():
    fan = FanOut("n1", ["n2", "n3", "n4"], holders=["n1", "n2"])
    assert fan.waiting == ["n3", "n4"]
    assert fan.next_round() == [("n2", "n3"), ("n1", "n4")]


@given(n=st.integers(0, 8), fate=st.lists(st.sampled_from(list(Outcome)), max_size=40))
def test_every_target_ends_held_or_failed_and_only_holders_send(n, fate):
    targets = NODES[:n]
    outcomes = iter(fate)
    held = {"n1"}
    sent_by_lost = []
    fan = FanOut("n1", targets)

    def transfer(src, dst):
        assert src in held and src not in fan.lost and dst not in held
        if src in fan.lost:
            sent_by_lost.append(src)
        o = next(outcomes, Outcome.OK)
        if o is Outcome.OK:
            held.add(dst)
        return o, ""

    run(fan, transfer, serial)
    assert fan.finished
    assert set(fan.done) | set(fan.failed) == set(targets)
    assert not set(fan.done) & set(fan.failed)
    assert set(fan.done) == held - {"n1"}
    assert not sent_by_lost
    # a round has at most as many pairs as there are holders, each source and target once
    assert len(fan.holders) <= n + 1


@given(n=st.integers(1, 8))
def test_all_succeeding_the_holders_double_each_round(n):
    have = 1
    for r in rounds("n1", NODES[:n]):
        assert len(r) == min(have, n + 1 - have)
        assert len({s for s, _ in r}) == len(r) == len({t for _, t in r})
        have += len(r)
    assert have == n + 1
