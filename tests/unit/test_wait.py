"""The one deadline loop, on an injected clock."""

import pytest

from sparkdeploy.core.wait import Deadline, Stop, WaitTimeout, retry, wait_for
from tests.unit.fakes import FakeClock


def answers(*values):
    it = iter(values)
    calls = []

    def probe():
        calls.append(1)
        return next(it)

    return probe, calls


def test_returns_the_first_truthy_value_ticking_in_between():
    clock, ticks = FakeClock(), []
    probe, calls = answers(None, 0, "", {"ready": True})
    got = wait_for(probe, deadline=60, interval=2, clock=clock, sleep=clock.sleep,
                   tick=ticks.append)
    assert got == {"ready": True}
    assert len(calls) == 4
    assert clock.sleeps == [2, 2, 2]
    assert ticks == [0, 2, 4]


def test_timeout_says_what_and_the_last_value():
    clock = FakeClock()
    probe, calls = answers(*[[]] * 100)
    with pytest.raises(WaitTimeout) as e:
        wait_for(probe, deadline=5, interval=2, what="a free GPU", clock=clock,
                 sleep=clock.sleep, describe=lambda v: f"busy: {len(v)} free slots")
    assert str(e.value) == "timed out after 5s waiting for a free GPU (last: busy: 0 free slots)"
    assert e.value.last == "busy: 0 free slots" and e.value.waited == 5
    # probes at 0, 2, 4 and at the deadline itself; the last sleep is cut to the deadline
    assert len(calls) == 4 and clock.sleeps == [2, 2, 1]


def test_timeout_without_a_last_value_is_one_clean_line():
    clock = FakeClock()
    with pytest.raises(WaitTimeout, match=r"^timed out after 3s waiting for the port$"):
        wait_for(lambda: False, deadline=3, interval=1, what="the port", clock=clock,
                 sleep=clock.sleep)


def test_stop_ends_the_wait_at_once():
    clock = FakeClock()
    seen = []

    def probe():
        seen.append(clock.now)
        if len(seen) == 2:
            raise Stop("the container exited (137)")
        return None

    with pytest.raises(Stop, match="exited"):
        wait_for(probe, deadline=600, interval=5, clock=clock, sleep=clock.sleep)
    assert seen == [0, 5]


def test_deadline_zero_probes_exactly_once():
    clock = FakeClock()
    probe, calls = answers(None, True)
    with pytest.raises(WaitTimeout):
        wait_for(probe, deadline=0, interval=1, clock=clock, sleep=clock.sleep)
    assert len(calls) == 1 and clock.sleeps == []


@pytest.mark.parametrize("deadline,interval", [(-1, 1), (5, 0)])
def test_nonsense_arguments_are_refused(deadline, interval):
    with pytest.raises(ValueError):
        wait_for(lambda: True, deadline=deadline, interval=interval)


def test_one_deadline_shared_by_waits_in_turn_gives_each_what_is_left():
    clock = FakeClock()
    budget = Deadline(10, clock)
    first, _ = answers(None, None, None, "up")
    assert wait_for(first, deadline=budget.left(), interval=2, clock=clock, sleep=clock.sleep) == "up"
    assert budget.left() == 4  # three sleeps of 2 s spent
    second, calls = answers(*[None] * 10)
    with pytest.raises(WaitTimeout) as e:
        wait_for(second, deadline=budget.left(), interval=3, what="health", clock=clock,
                 sleep=clock.sleep)
    assert (len(calls), clock.now, e.value.waited) == (3, 10, 4)
    assert budget.left() == 0  # passed: the next wait probes once and times out


def test_retry_tries_again_while_the_answer_says_so_and_gives_the_last():
    clock = FakeClock()
    probe, calls = answers((None, "connect refused"), (None, "connect refused"), (9.5, ""))
    assert retry(probe, tries=5, again=lambda got: got[0] is None, interval=0.3,
                 sleep=clock.sleep) == (9.5, "")
    assert (len(calls), clock.sleeps) == (3, [0.3, 0.3])
    probe, calls = answers(*[(None, "connect refused")] * 3)
    assert retry(probe, tries=3, again=lambda got: got[0] is None, sleep=clock.sleep) == (
        None, "connect refused")  # no try left: the last answer, no sleep after it
    assert len(calls) == 3 and clock.sleeps == [0.3, 0.3, 0.0, 0.0]


def test_retry_tries_again_on_the_errors_it_is_given_only():
    clock = FakeClock()
    seen = []

    def flaky():
        seen.append(1)
        if len(seen) < 3:
            raise ConnectionRefusedError("not yet")
        return "up"

    assert retry(flaky, tries=3, errors=(ConnectionRefusedError,), sleep=clock.sleep) == "up"
    seen.clear()
    with pytest.raises(ConnectionRefusedError):
        retry(flaky, tries=2, errors=(ConnectionRefusedError,), sleep=clock.sleep)
    with pytest.raises(ValueError):
        retry(lambda: int("x"), tries=3, errors=(ConnectionRefusedError,), sleep=clock.sleep)
    with pytest.raises(ValueError, match="tries"):
        retry(lambda: 1, tries=0)
