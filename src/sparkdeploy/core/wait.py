"""One deadline loop for everything that waits (a GPU to free, a daemon to answer, a port to
open, an endpoint to be healthy).

``wait_for(probe, deadline=..., interval=...)`` calls ``probe()`` until it returns something
truthy and returns that. When the deadline passes it raises ``WaitTimeout`` carrying the last
thing the probe said, so the caller can fail with one line of why. The clock and the sleep are
injectable, so tests run instantly and deterministically; ``tick(elapsed)`` is called after
every unsuccessful probe (progress on long waits). ``Deadline`` is one deadline shared by waits
made one after another (serve.up's phases): each ``wait_for`` gets what is ``left()`` of it.
``retry(attempt, tries=..., again=...)`` is the one retry: a few tries of one action that may
fail for a moment (a server not listening yet), the same clock-free sleep injectable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from sparkdeploy.core.errors import RunError

T = TypeVar("T")


class WaitTimeout(RunError):
    def __init__(self, what: str, waited: float, last: object = None):
        self.what = what
        self.waited = waited
        self.last = last
        tail = f" (last: {last})" if last not in (None, "", False) else ""
        super().__init__(f"timed out after {waited:.0f}s waiting for {what}{tail}")


class Deadline:
    """``seconds`` from now on ``clock``: what is left of it, for each of several waits in turn."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.end = clock() + seconds

    def left(self) -> float:
        """The seconds left (0 once it has passed: the next wait probes once, then times out)."""
        return max(self.end - self.clock(), 0.0)


class Stop(RunError):
    """Raised by a probe to end the wait at once (e.g. the container it waits on exited)."""


def wait_for(
    probe: Callable[[], T],
    *,
    deadline: float,
    interval: float = 1.0,
    what: str = "the condition",
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    tick: Callable[[float], None] | None = None,
    describe: Callable[[T], object] | None = None,
) -> T:
    """Probe until truthy or ``deadline`` seconds have passed; at least one probe always runs.

    ``describe(value)`` turns a falsy probe result into the ``last`` shown on timeout."""
    if deadline < 0 or interval <= 0:
        raise ValueError("deadline must be >= 0 and interval > 0")
    start = clock()
    last: object = None
    while True:
        value = probe()
        if value:
            return value
        last = describe(value) if describe else value
        elapsed = clock() - start
        if elapsed >= deadline:
            raise WaitTimeout(what, elapsed, last)
        if tick is not None:
            tick(elapsed)
        sleep(min(interval, max(deadline - elapsed, 0.0)) or interval)


def retry(
    attempt: Callable[[], T],
    *,
    tries: int,
    again: Callable[[T], bool] = lambda value: False,
    errors: tuple[type[Exception], ...] = (),
    interval: float = 0.0,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``attempt()`` at most ``tries`` times, ``interval`` seconds apart, while what it returned
    is worth another try (``again(value)``) or it raised one of ``errors``: what the last try
    returned (or its error). The one retry beside ``wait_for`` (which waits for a condition
    until a deadline): a few tries of one action that may fail for a moment."""
    if tries < 1:
        raise ValueError("tries must be >= 1")
    for n in range(1, tries + 1):
        try:
            value = attempt()
        except errors:
            if n == tries:
                raise
        else:
            if n == tries or not again(value):
                return value
        sleep(interval)
    raise AssertionError("unreachable")  # pragma: no cover
