"""The event stream: what steps and hosts report while they work, and how tasks show it.

A deployment carries one ``EventSink``. Steps report their ``Result``s as they happen and
``Progress`` during long work through their ``StepContext`` (``steps/registry.py``), the one
way a result enters the stream; ``Host`` emits its command echo as ``Echo``; long-running
commands hand their output lines over as ``Log``. Nothing below the tasks prints: a task
attaches a renderer to the sink (``live`` on a terminal, ``plain`` otherwise) and the
renderer is the only thing that writes to stdout.

Events are plain frozen dataclasses so that a test can collect them with ``sink.collect()``
and assert on what a step reported, in order.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TextIO

from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.core.redaction import redact


@dataclass(frozen=True)
class Progress:
    """Long work advancing: ``done`` of ``total`` ``unit`` (total None when unknown)."""

    step: str
    node: str | None
    done: float
    total: float | None = None
    unit: str = "B"
    note: str = ""
    """A short word on what is moving (a file name, a layer, a phase)."""


@dataclass(frozen=True)
class Echo:
    """A command a host runs (or, in a dry run, would run)."""

    node: str
    text: str
    would: bool = False


@dataclass(frozen=True)
class Log:
    """One line of output from long work (a docker build, an engine's log)."""

    step: str
    node: str | None
    text: str


@dataclass(frozen=True)
class StepState:
    """A step of a plan changing state: pending, running, done, failed, skipped."""

    step: str
    state: str
    why: str = ""
    elapsed: float | None = None
    """Seconds the step ran (done, failed; skipped after it started)."""


Event = Result | Progress | Echo | Log | StepState
Listener = Callable[[Event], None]


@dataclass
class EventSink:
    """Fan-out of events to listeners, safe to emit from several threads at once."""

    listeners: list[Listener] = field(default_factory=list)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def emit(self, event: Event) -> Event:
        with self._lock:
            for fn in list(self.listeners):
                fn(event)
        return event

    def progress(self, step: str, node: str | None, done: float, total: float | None = None,
                 unit: str = "B", note: str = "") -> None:
        self.emit(Progress(step, node, done, total, unit, note))

    def log(self, step: str, node: str | None, text: str) -> None:
        self.emit(Log(step, node, text))

    @contextmanager
    def listening(self, fn: Listener) -> Iterator[Listener]:
        with self._lock:
            self.listeners.append(fn)
        try:
            yield fn
        finally:
            with self._lock:
                if fn in self.listeners:
                    self.listeners.remove(fn)

    @contextmanager
    def collect(self) -> Iterator[list[Event]]:
        """Every event emitted inside the block, in order (for tests and records)."""
        got: list[Event] = []
        with self.listening(got.append):
            yield got


# --- rendering ----------------------------------------------------------------------------

def _size(n: float, unit: str) -> str:
    if unit != "B":
        return f"{n:,.0f} {unit}"
    for u in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or u == "TB":
            return f"{n:,.1f} {u}" if u != "B" else f"{n:,.0f} B"
        n /= 1000
    return f"{n} B"


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters (an escape sequence from a node's log,
    a server's error, a file name), newlines and bidi overrides shown escaped (``\\x1b``),
    never interpreted, and its secrets hidden (``redaction.redact``: a node's log line echoing a
    token). Every line the renderers write goes through it."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256
                            else f"\\u{ord(m.group()):04x}", redact(text))


def describe(ev: Event) -> str:
    """One line for an event, without time (shared by both renderers), terminal-safe."""
    return printable(_describe(ev))


def _describe(ev: Event) -> str:
    if isinstance(ev, Result):
        return f"{ev.status.value:<8} {ev.step:<18} {ev.node or '-':<8} {ev.why}"
    if isinstance(ev, Progress):
        where = f"[{ev.node}] " if ev.node else ""
        if ev.total:
            pct = 100 * ev.done / ev.total if ev.total else 0
            amount = f"{_size(ev.done, ev.unit)} of {_size(ev.total, ev.unit)} ({pct:.0f}%)"
        else:
            amount = _size(ev.done, ev.unit)
        note = f" {ev.note}" if ev.note else ""
        return f"{'...':<8} {ev.step:<18} {where}{amount}{note}"
    if isinstance(ev, Echo):
        return f"[{ev.node}] would run: {ev.text}" if ev.would else f"[{ev.node}] $ {ev.text}"
    if isinstance(ev, Log):
        return f"[{ev.node or ev.step}] {ev.text}"
    if isinstance(ev, StepState):
        took = f" ({ev.elapsed:.1f}s)" if ev.elapsed is not None else ""
        why = f": {ev.why}" if ev.why else ""
        return f"{'step ' + ev.state:<13} {ev.step}{took}{why}"
    return str(ev)


class PlainRenderer:
    """One timestamped, flushed line per event as it happens (logs, CI, pipes).

    Progress of one (step, node) is throttled to one line every ``progress_every`` seconds
    (and always when it completes), so a long transfer neither floods a log nor goes silent.
    """

    def __init__(self, out: TextIO | None = None, progress_every: float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 stamp: Callable[[], str] | None = None):
        self.out = out or sys.stdout
        self.progress_every = progress_every
        self.clock = clock
        self.stamp = stamp or (lambda: time.strftime("%H:%M:%S"))
        self._last: dict[tuple[str, str | None], float] = {}

    def __call__(self, ev: Event) -> None:
        if isinstance(ev, Progress):
            key = (ev.step, ev.node)
            now = self.clock()
            complete = ev.total is not None and ev.done >= ev.total
            if not complete and now - self._last.get(key, -1e9) < self.progress_every:
                return
            self._last[key] = now
        print(f"{self.stamp()} {describe(ev)}", file=self.out, flush=True)

    def close(self) -> None:
        pass


_STYLE = {Status.OK: "green", Status.CHANGED: "yellow", Status.SKIPPED: "cyan",
          Status.FAILED: "bold red"}


_MARK = {"pending": "·", "running": "▸", "done": "✓", "failed": "✗", "skipped": "-"}


class Board:
    """A plan as a checklist, fed from ``StepState`` and ``Progress`` events: one line per step
    (mark, name, state, elapsed, last word), the progress of its running long work below it.
    ``lines()`` is what the live view draws; elapsed time of a running step ticks."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.steps: dict[str, StepState] = {}
        self.started: dict[str, float] = {}
        self.progress: dict[tuple[str, str | None], Progress] = {}

    def __bool__(self) -> bool:
        return bool(self.steps)

    def feed(self, ev: Event) -> bool:
        """Take an event; True when it is the board's (a step state, or progress of a step
        on the board)."""
        if isinstance(ev, StepState):
            if ev.state == "running":
                self.started[ev.step] = self.clock()
            if ev.state != "running":
                self.progress = {k: v for k, v in self.progress.items() if k[0] != ev.step}
            self.steps[ev.step] = ev
            return True
        if isinstance(ev, Progress) and ev.step in self.steps:
            key = (ev.step, ev.node)
            if ev.total is not None and ev.done >= ev.total:
                self.progress.pop(key, None)
            else:
                self.progress[key] = ev
            return True
        return False

    def lines(self) -> list[str]:
        out = []
        for name, st in self.steps.items():
            if st.state == "running":
                took = f"{self.clock() - self.started.get(name, self.clock()):5.0f}s"
            else:
                took = f"{st.elapsed:5.1f}s" if st.elapsed is not None else " " * 6
            why = f"  {st.why}" if st.why and st.state != "running" else ""
            out.append(printable(f"{_MARK.get(st.state, '?')} {name:<18} {st.state:<8} {took}"
                                 f"{why}")[:160])
            for (step, _node), p in self.progress.items():
                if step == name:
                    out.append("    " + describe(p).split(None, 2)[-1])
        return out


class LiveRenderer:
    """A rich live view on a terminal: results and echo scroll above; below, the plan's board
    when a plan runs (else a progress line per (step, node)), redrawn in place."""

    def __init__(self, console: Any = None, clock: Callable[[], float] = time.monotonic):
        from rich.console import Console
        from rich.live import Live

        self.console = console or Console()
        self.board = Board(clock)
        self._bars: dict[tuple[str, str | None], Progress] = {}
        self._live = Live(self, console=self.console, refresh_per_second=4, transient=True)
        self._live.start()

    def __rich__(self) -> Any:
        from rich.text import Text

        lines = self.board.lines() + [describe(p) for p in self._bars.values()]
        return Text("\n".join(lines))

    def __call__(self, ev: Event) -> None:
        from rich.markup import escape

        if self.board.feed(ev):
            pass
        elif isinstance(ev, Progress):
            key = (ev.step, ev.node)
            if ev.total is not None and ev.done >= ev.total:
                self._bars.pop(key, None)
            else:
                self._bars[key] = ev
        elif isinstance(ev, Result):
            self._bars = {k: v for k, v in self._bars.items() if k[0] != ev.step or k[1] != ev.node}
            step, node, why = (escape(printable(t)) for t in (ev.step, ev.node or "-", ev.why))
            self.console.print(f"[{_STYLE[ev.status]}]{ev.status.value:<8}[/] "
                               f"{step:<18} {node:<8} {why}", highlight=False, markup=True)
        else:
            self.console.print(describe(ev), highlight=False, markup=False)
        self._live.refresh()

    def close(self) -> None:
        self._live.stop()
        if self.board:  # the final checklist stays on the screen
            self.console.print("\n".join(self.board.lines()), highlight=False, markup=False)


def renderer_for(out: TextIO | None = None, live: bool = True) -> PlainRenderer | LiveRenderer:
    """The live view on a terminal (unless ``live`` is False), plain lines otherwise."""
    out = out or sys.stdout
    if live and out.isatty():
        return LiveRenderer()
    return PlainRenderer(out)


@contextmanager
def rendering(sink: EventSink, out: TextIO | None = None,
              live: bool = True) -> Iterator[PlainRenderer | LiveRenderer]:
    """Attach the right renderer to ``sink`` for the duration of a task (``live=False`` for a
    task that asks questions on the terminal)."""
    r = renderer_for(out, live)
    try:
        with sink.listening(r):
            yield r
    finally:
        r.close()
