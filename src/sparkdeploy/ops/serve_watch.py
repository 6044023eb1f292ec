"""Following engine containers while they come up: their state, their new log lines, and
whether anything moves at all; and, once they serve, the watchdog's policy and its restart
records on the head (``helpers/serve_watchdog.py`` has the decisions and the record's shape).

``Watch.poll()`` fetches each followed container's new log lines (``docker logs --timestamps
--since``), emits them as ``Log`` events and checks the containers' states. A container that
stopped raises ``Exited`` at once (with its last lines); no new log line and no readiness step
for the stall time raises ``Stalled``: a hang. Both are ``wait.Stop``, so a phase waiting with
``wait_for`` ends at once.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from sparkdeploy.core.errors import StepFailed
from sparkdeploy.core.wait import Stop, WaitTimeout, wait_for
from sparkdeploy.engines.base import ContainerSpec
from sparkdeploy.helpers import serve_watchdog as wd
from sparkdeploy.node.hosts import Host
from sparkdeploy.node.nodeops import docker
from sparkdeploy.ops import Ctx
from sparkdeploy.profile.config import Serve

T = TypeVar("T")
_TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)) ?(.*)$")
TAIL = 15


class EngineFailed(StepFailed):
    """The engine did not come up; ``kind`` is ``exited``, ``hang``, ``timeout`` or ``start``."""

    kind = "failed"

    def __init__(self, why: str, phase: str = ""):
        super().__init__(why)
        self.why = why
        self.phase = phase


class Exited(Stop, EngineFailed):
    kind = "exited"


class Stalled(Stop, EngineFailed):
    kind = "hang"

    def __init__(self, why: str, phase: str, silent_s: float, hang_start: float):
        EngineFailed.__init__(self, why, phase)
        self.silent_s = silent_s
        self.hang_start = hang_start


class TimedOut(EngineFailed):
    kind = "timeout"


class StartFailed(EngineFailed):
    kind = "start"


@dataclass
class Followed:
    host: Host
    spec: ContainerSpec
    since: str | None = None
    at_since: set[str] = field(default_factory=set)
    lines: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.host.name}-{self.spec.name}.log"


def split_stamped(text: str) -> list[tuple[str, str]]:
    """``docker logs --timestamps`` output -> [(timestamp, line)]; unstamped lines keep ''."""
    out = []
    for raw in text.splitlines():
        m = _TS.match(raw)
        out.append((m.group(1), m.group(2)) if m else ("", raw))
    return out


def container_states(host: Host, names: list[str]) -> dict[str, tuple[str, int]]:
    """{name: (status, exit code)} for the named containers the node has (absent ones left out)."""
    r = host.run(docker(host, "inspect", "--format", "{{.Name}}|{{.State.Status}}|{{.State.ExitCode}}",
                        *names), change=False)
    out: dict[str, tuple[str, int]] = {}
    for line in r.stdout.splitlines():
        parts = line.strip().lstrip("/").split("|")
        if len(parts) == 3 and parts[2].lstrip("-").isdigit():
            out[parts[0]] = (parts[1], int(parts[2]))
    return out


def full_log(host: Host, name: str) -> list[str]:
    r = host.run(docker(host, "logs", "--timestamps", name), change=False, timeout=120)
    pairs = split_stamped(r.stdout) + split_stamped(r.stderr)
    pairs.sort(key=lambda p: p[0])
    return [t for _, t in pairs]


class Watch:
    def __init__(self, ctx: Ctx, stall_s: float, poll_s: float):
        self.ctx = ctx
        self.dep = dep = ctx.dep
        self.stall_s = stall_s
        self.poll_s = poll_s
        self.followed: list[Followed] = []
        self.last_progress = dep.clock()
        self.last_what = "start"
        self.t0 = self.last_progress
        self.marks: dict[str, float] = {}
        """Startup milestones: {name: seconds from the watch's start}, each the first time."""
        self.marked_by_log: dict[str, re.Pattern[str]] = {}
        """{milestone: the log line that marks it} (e.g. the engine's distributed init done)."""

    def mark(self, name: str, again: bool = False) -> None:
        """``name`` reached now (kept from the first time unless ``again``)."""
        if again or name not in self.marks:
            self.marks[name] = round(self.dep.clock() - self.t0, 2)

    def add(self, host: Host, spec: ContainerSpec) -> None:
        self.followed.append(Followed(host, spec))
        self.progress(f"started {spec.name}")

    def progress(self, what: str) -> None:
        self.last_progress = self.dep.clock()
        self.last_what = what

    def _new_lines(self, f: Followed) -> list[str]:
        args = ["logs", "--timestamps"]
        if f.since:
            args += ["--since", f.since]
        r = f.host.run(docker(f.host, *args, f.spec.name), change=False, timeout=60)
        if not r.ok and not r.stdout:
            return []
        pairs = split_stamped(r.stdout) + split_stamped(r.stderr)
        pairs.sort(key=lambda p: p[0])
        new = []
        for ts, text in pairs:
            if f.since and ts and (ts < f.since or (ts == f.since and text in f.at_since)):
                continue
            new.append((ts, text))
        if new:
            last = max(ts for ts, _ in new) or f.since
            if last != f.since:
                f.at_since = set()
            f.since = last
            f.at_since |= {t for ts, t in new if ts == last}
        return [t for _, t in new]

    def poll(self, phase: str) -> None:
        for f in self.followed:
            new = self._new_lines(f)
            if new:
                f.lines += new
                self.progress(f"log of {f.spec.name}")
                for line in new:
                    self.ctx.log(f.host.name, f"{f.spec.name}: {line}")
                for name, rx in self.marked_by_log.items():
                    if name not in self.marks and any(rx.search(line) for line in new):
                        self.mark(name)
        by_host: dict[str, list[Followed]] = {}
        for f in self.followed:
            by_host.setdefault(f.host.name, []).append(f)
        for fs in by_host.values():
            states = container_states(fs[0].host, [f.spec.name for f in fs])
            for f in fs:
                status, code = states.get(f.spec.name, ("gone", -1))
                if status not in ("running", "created", "restarting"):
                    tail = " | ".join(f.lines[-3:]) or "no output"
                    raise Exited(f"{f.host.name}: {f.spec.name} {status} (exit code {code}) during "
                                 f"{phase}; last lines: {tail}", phase)
        silent = self.dep.clock() - self.last_progress
        if silent >= self.stall_s:
            raise Stalled(f"no log output and no readiness step for {silent:.0f}s during {phase} "
                          f"(stall time {self.stall_s:g}s; last: {self.last_what})", phase, silent,
                          self.last_progress)

    def phase(self, what: str, probe: Callable[[], T], deadline: float) -> T:
        """Wait for ``probe`` with the stall check and the containers' states in the loop."""
        def p() -> T:
            self.poll(what)
            v = probe()
            if v:
                self.progress(what)
            return v

        self.ctx.progress(None, 0, None, "s", what)
        try:
            return wait_for(p, deadline=max(deadline, 0.0), interval=self.poll_s, what=what,
                            clock=self.dep.clock, sleep=self.dep.sleep,
                            tick=lambda el: self.ctx.progress(None, el, None, "s", what))
        except WaitTimeout as e:
            raise TimedOut(str(e), what) from None

    def logs(self) -> dict[str, list[str]]:
        """Every followed container's whole log, fetched afresh ({label: lines})."""
        out = {}
        for f in self.followed:
            lines = full_log(f.host, f.spec.name)
            out[f.label] = lines or f.lines
        return out


# --- the watchdog: its policy, its records on the head ------------------------------------------


def policy(s: Serve) -> wd.Policy:
    """The profile's ``serve`` values the watchdog decides by."""
    return wd.Policy(watch_s=s.watch_s, canary_s=s.canary_s, max_restarts=s.max_restarts,
                     window_s=s.restart_window_s, backoff_s=s.restart_backoff_s,
                     backoff_max_s=s.restart_backoff_max_s)


def read_restarts(head: Host, engine: str) -> list[dict]:
    """The restart records on the head for ``engine``, oldest first ([] when none)."""
    r = head.run(["cat", "--", wd.record_path(engine)], change=False, sudo=True)
    return wd.parse_records(r.stdout) if r.ok else []


def describe(rec: dict) -> str:
    """One line for a restart record (what ``serve.status`` says)."""
    again = rec.get("served_again_after_s")
    served = (f"served again after {again:g}s" if isinstance(again, (int, float))
              else "not serving again yet")
    what = "gave up" if rec.get("outcome") == "gave-up" else f"restart {rec.get('restart')}"
    cls = f"; class {rec['class']}" if rec.get("class") else ""
    return f"{what} at {rec.get('at')} by {rec.get('by')}: {rec.get('why')}{cls}; " + (
        served if rec.get("outcome") != "gave-up" else "the group stays down")
