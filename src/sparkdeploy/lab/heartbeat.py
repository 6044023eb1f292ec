"""A heartbeat for long lab phases: while a phase runs and nothing else was said for
``every`` seconds, emit a ``Progress`` line naming the phase and how long it has run, so a log
of ``lab.up`` never goes quiet for long (debootstrap, wheel downloads, image builds)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sparkdeploy.core.events import Event, EventSink


class Heartbeat:
    def __init__(self, events: EventSink, every: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.events, self.every, self.clock = events, every, clock
        self._lock = threading.Lock()
        self._phases: list[tuple[str, str | None, str, float]] = []
        self._last = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _heard(self, ev: Event) -> None:
        self._last = self.clock()

    @contextmanager
    def phase(self, step: str, node: str | None = None, note: str = "") -> Iterator[None]:
        entry = (step, node, note, self.clock())
        with self._lock:
            self._phases.append(entry)
        try:
            yield
        finally:
            with self._lock:
                self._phases.remove(entry)

    def beat(self) -> bool:
        """Emit one line for the innermost phase if it has been quiet; True if it did."""
        now = self.clock()
        with self._lock:
            if not self._phases or now - self._last < self.every:
                return False
            step, node, note, since = self._phases[-1]
        self.events.progress(step, node, round(now - since), None, "s",
                             f"elapsed, {note or 'working'}")
        return True

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.beat()

    def __enter__(self) -> Heartbeat:
        self._remove = self.events.listening(self._heard)
        self._remove.__enter__()
        self._thread = threading.Thread(target=self._loop, name="lab-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._remove.__exit__(None, None, None)
