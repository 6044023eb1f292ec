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
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import BaseModel

from sparkdeploy import endpoint as ep
from sparkdeploy.config import Serve
from sparkdeploy.engines import EngineError, Launch
from sparkdeploy.engines.base import ContainerSpec
from sparkdeploy.helpers import serve_watchdog as wd
from sparkdeploy.hosts import Host
from sparkdeploy.nodeops import docker, run_helper
from sparkdeploy.steps.registry import StepContext, step
from sparkdeploy.wait import Stop, WaitTimeout, wait_for

T = TypeVar("T")
_TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)) ?(.*)$")
TAIL = 15


class EngineFailed(Exception):
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
    def __init__(self, ctx: StepContext, stall_s: float, poll_s: float):
        self.ctx = ctx
        self.dep = dep = ctx.dep
        self.stall_s = stall_s
        self.poll_s = poll_s
        self.followed: list[Followed] = []
        self.last_progress = dep.clock()
        self.last_what = "start"

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


# --- serve.watch: the watchdog of an unpersisted deployment, from the controller ---------------

STEP_WATCH = "serve.watch"
HELPER = "serve_watchdog.py"
WALL: Callable[[], float] = time.time
"""Wall-clock time for the records (the deployment's clock is monotonic)."""


class _Ranks(BaseModel):
    ranks: dict[str, str | None]


class _Saved(BaseModel):
    dir: str
    files: list[str] = []


def _docker_flags(host: Host, names: list[str]) -> list[str]:
    return [*(f"--docker={a}" for a in docker(host)), *(f"--name={n}" for n in names)]


def look(ctx: StepContext, lau: Launch, url: str, pol: wd.Policy) -> wd.Wedge | None:
    """One look: every rank's engine on its node, then (all of them running) the canary."""
    dep = ctx.dep
    ranks: dict[str, str | None] = {}
    for node in sorted({c.node for c in lau.containers}):
        h = dep.host(node)
        got = run_helper(h, HELPER, ["ranks", *_docker_flags(h, [c.name for c in lau.on(node)])],
                         result=_Ranks, where=f"{node}: the ranks", timeout=60)
        ranks.update({f"{node}: {n}": p for n, p in got.ranks.items()})
    err = None
    if not any(ranks.values()):
        text = ep.stream_chat(url, lau.served_model, max_tokens=2, deadline=pol.canary_s)
        err = None if text else f"no token within {pol.canary_s:g}s"
    return wd.wedge(err, ranks)


def write_restarts(head: Host, engine: str, recs: list[dict]) -> None:
    from sparkdeploy.steps.serve_persist import drop_previous, put_file  # it imports this module

    path = wd.record_path(engine)
    if put_file(head, path, wd.records_text(recs), "0644"):
        drop_previous(head, [path])


def restart(ctx: StepContext, lau: Launch, w: wd.Wedge, pol: wd.Policy) -> str:
    """Save every node's logs (on the node), classify them, record the restart on the head, then
    (within the budget, after the backoff) every rank removed and started again together.
    ``serving``, ``failed`` (the ranks did not come up again: removed) or ``gave-up`` (the
    budget is spent: recorded, said, nothing restarted)."""
    from sparkdeploy.diagnose import classify
    from sparkdeploy.steps.serve import Run, bring_up  # serve imports this module
    from sparkdeploy.steps.serve_containers import remove

    dep = ctx.dep
    head = dep.host(lau.head)
    recs = read_restarts(head, lau.engine.name)
    now = WALL()
    go, wait, n = wd.next_restart(recs, now, pol)
    rid = wd.restart_id(now, secrets.token_hex(2))
    nodes = sorted({c.node for c in lau.containers})
    saved, logs = {}, {}
    for node in nodes:
        h = dep.host(node)
        names = [c.name for c in lau.on(node)]
        saved[node] = run_helper(h, HELPER, ["save-logs", *_docker_flags(h, names), "--id", rid],
                                 result=_Saved, where=f"{node}: saving the logs", sudo=True,
                                 timeout=300).dir
        logs.update({f"{node}-{c}.log": full_log(h, c) for c in names})
    diag = classify(logs)
    recs.append(wd.entry(w, rid=rid, t=now, by=STEP_WATCH, engine=lau.engine.name, n=n,
                         backoff_s=wait, gave_up=not go, logs=saved, cls=diag.cls))
    write_restarts(head, lau.engine.name, recs)
    if not go:
        ctx.failed(f"wedge: {w.why}; class {diag.cls}; the restart budget is spent "
                   f"({pol.max_restarts} within {pol.window_s:g}s): not restarted", restart=recs[-1])
        return "gave-up"
    ctx.progress(None, 0, None, "s", f"restart {n}: backoff {wait:.0f}s")
    dep.sleep(wait)
    hosts = [dep.host(x) for x in nodes]
    remove(dep, hosts, lau.engine.name)
    try:
        bring_up(dep, lau, Run(dep), Watch(ctx, dep.profile.serve.stall_s, dep.profile.serve.poll_s))
    except EngineFailed as e:
        remove(dep, hosts, lau.engine.name)
        ctx.failed(f"restart {n} after {w.why}: {e}", restart=recs[-1])
        return "failed"
    wd.served_again(recs, WALL())
    write_restarts(head, lau.engine.name, recs)
    ctx.changed(f"restart {n}: {w.why}; class {diag.cls}; every rank restarted, serving again "
                f"after {recs[-1]['served_again_after_s']:g}s", restart=recs[-1])
    return "serving"


@step(STEP_WATCH)
def watch(ctx: StepContext, checks: int | None = None) -> None:
    """Watch a deployment serve.up started (not persisted): every ``serve.watch_s`` every rank's
    engine and a canary; a wedge restarts every rank together (budget, backoff), recorded on
    the head. ``checks``: that many looks, then end (default: until interrupted)."""
    from sparkdeploy.steps.serve_containers import active, installed, unit_name
    from sparkdeploy.steps.serve_persist import engine_of, running_launch

    dep = ctx.dep
    eng = engine_of(dep, None)
    if eng is None:
        ctx.failed("no engine recorded: serve.up first")
        return
    units = {n.name: active(dep.host(n.name), installed(dep, dep.host(n.name)))
             for n in dep.profile.nodes}
    if any(units.values()):
        ctx.ok(f"the persisted supervisors watch it ({unit_name(eng.name)}): nothing to do")
        return
    try:
        lau = running_launch(dep, eng)
    except EngineError as e:
        ctx.failed(str(e))
        return
    pol = policy(dep.profile.serve)
    url = f"http://{ep.controller_address(dep.host(lau.head))}:{lau.port}"
    if dep.dry:
        ctx.would(f"watch {url}: a canary every {pol.watch_s:g}s, every rank's engine read")
        return
    done, now = 0, "serving"
    while checks is None or done < checks:
        done += 1
        w = look(ctx, lau, url, pol)
        now = "serving" if w is None else restart(ctx, lau, w, pol)
        if now == "gave-up":
            return
        ctx.progress(None, done, checks, "checks", now)
        if checks is None or done < checks:
            dep.sleep(pol.watch_s)
    if now == "serving":  # else the failed restart said why
        ctx.ok(f"{done} check(s) of {url}: serving")
