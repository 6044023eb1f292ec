"""What the unit tests fake: one clock, one invoke Context (every fake node derives from it),
and scripted nodes that answer like systemd and nvidia-smi."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from invoke import Config, Context, Result

from sparkdeploy.core.state import StateDir
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host
from sparkdeploy.profile.config import Profile, load_profile
from tests.unit.profiles import SEED


class FakeClock:
    """A clock that moves only when slept on (``clock()``, ``clock.sleep(s)``); every sleep is
    kept. ``min_sleep``: the least a sleep moves it (a loop that sleeps 0 still ends)."""

    def __init__(self, now: float = 0.0, min_sleep: float = 0.0):
        self.now = now
        self.min_sleep = min_sleep
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += max(s, self.min_sleep)


def split_command(command: str) -> tuple[str | None, list[str]]:
    """(the node's ssh alias, the argv it runs) of a command as ``Host`` sent it; (None, argv)
    for a command run on this machine."""
    full = shlex.split(command)
    # ssh's options end at "--", then the destination, then the remote command (one word)
    if full[0] != "ssh" or len(full) < 3 or full[-3] != "--":
        return None, full
    return full[-2], shlex.split(full[-1])


class FakeContext(Context):
    """An invoke Context that runs nothing: each command is recorded as sent (``commands``) and
    as (node alias, argv) (``calls``, see ``call``), and ``answer`` says what the node would.
    ``stdin`` is what the command was given on its stdin (None when nothing)."""

    def __init__(self, dry: bool = False):
        super().__init__(Config(overrides={"run": {"dry": dry}}))
        self._set("commands", [])
        self._set("calls", [])

    def run(self, command, **kw):
        self.commands.append(command)
        alias, argv = split_command(command)
        stream = kw.get("in_stream")
        stdin = stream.read() if stream not in (None, False) else None
        self.calls.append(self.call(alias, argv, stdin))
        return self.answer(alias, argv, stdin, command, kw)

    def call(self, alias: str | None, argv: list[str], stdin: str | None) -> tuple:
        return alias, argv

    def answer(self, alias: str | None, argv: list[str], stdin: str | None, command: str,
               kw: dict) -> Result:
        raise NotImplementedError

    @staticmethod
    def result(command: str, exited: int = 0, stdout: str = "", stderr: str = "") -> Result:
        return Result(stdout=stdout, stderr=stderr, exited=exited, command=command)


def deployment(path: Path, state_dir: Path, ctx: Context | None = None, *, dry: bool = False,
               clock: FakeClock | None = None, profile: Profile | None = None) -> Deployment:
    """A deployment of the profile at ``path`` (or ``profile``, loaded from there) whose hosts
    run through ``ctx``, with ``clock`` as its clock and sleep when given."""
    prof = profile or load_profile(path)
    state = StateDir(state_dir)
    hosts = {n.name: Host(n, prof.ssh, ctx, state) for n in prof.nodes}
    timing = {"clock": clock, "sleep": clock.sleep,
              "wall": lambda: WALL + clock()} if clock is not None else {}
    return Deployment(prof, str(path), state, hosts, dry=dry, **timing)


WALL = 1_796_000_000.0
"""The time of day at a fake clock's 0 (2026-11-30T00:53:20Z): what a container's ``started`` label says."""


def has_label(labels: dict[str, str], want: str) -> bool:
    """docker's ``--filter label=K`` (the key is there) or ``label=K=V`` (with that value)."""
    k, _, v = want.partition("=")
    return k in labels and (not _ or labels[k] == v)


def ps_line(fmt: str, cid: str, name: str, state: str, code: int, labels: dict[str, str]) -> str:
    """One ``docker ps --format`` line: ``{{json .Field}}`` and ``{{json (.Label "k")}}`` (a
    missing label is ''), as docker's template renders them."""
    fields = {".ID": cid, ".Names": name, ".State": state,
              ".Status": "Up 1 second" if state == "running" else f"Exited ({code}) 1 second ago"}

    def value(m: re.Match) -> str:
        expr = m.group(1)
        label = re.fullmatch(r'\(\.Label "([^"]+)"\)', expr)
        return json.dumps(labels.get(label.group(1), "") if label else fields[expr])

    return re.sub(r"\{\{json (.+?)\}\}", value, fmt)


@dataclass
class EngineContainer:
    """A container on a scripted node: its labels and the host PIDs of its processes."""

    name: str
    labels: dict[str, str]
    pids: list[int]
    state: str = "running"


@dataclass
class FakeNode:
    units: dict[str, str] = field(default_factory=dict)  # unit -> active|inactive|failed
    gpu: list[tuple[int, str]] = field(default_factory=list)
    holds_gpu: dict[str, tuple[int, str]] = field(default_factory=dict)  # unit -> its GPU process
    gpu_lingers: int = 0  # polls the GPU stays busy after its unit stopped
    unreachable: bool = False
    sudo_password: bool = False
    fail_stop: set[str] = field(default_factory=set)
    fail_start: set[str] = field(default_factory=set)
    containers: list[EngineContainer] = field(default_factory=list)
    node_files: dict[str, str] = field(default_factory=dict)
    """The node's own files (its records), by path."""

    def docker(self, a: list[str]) -> tuple[int, str, str]:
        if a[0] == "ps":
            filters = [a[i + 1].removeprefix("label=") for i, x in enumerate(a) if x == "--filter"]
            fmt = a[a.index("--format") + 1]
            return 0, "".join(ps_line(fmt, c.name + "-id", c.name, c.state, 0, c.labels) + "\n"
                              for c in self.containers
                              if all(has_label(c.labels, f) for f in filters)), ""
        if a[0] == "top" and a[2:] == ["-eo", "pid"]:
            [c] = [c for c in self.containers if c.name + "-id" == a[1]]
            return 0, "PID\n" + "".join(f"{p}\n" for p in c.pids), ""
        raise AssertionError(f"unexpected docker {a}")

    def file(self, argv: list[str], stdin: str | None) -> tuple[int, str, str] | None:
        """``cat``, ``rm -f`` and the atomic write through stdin of the node's record files."""
        if argv[:2] == ["cat", "--"]:
            if argv[2] in self.node_files:
                return 0, self.node_files[argv[2]], ""
            return 1, "", f"cat: {argv[2]}: No such file or directory"
        if argv[:3] == ["rm", "-f", "--"]:
            for f in argv[3:]:
                self.node_files.pop(f, None)
            return 0, "", ""
        if argv[:2] == ["sh", "-c"] and argv[2].endswith('mv -f -- "$1.part" "$1"'):
            self.node_files[argv[4]] = stdin or ""
            return 0, "", ""
        return None

    def answer(self, argv: list[str], stdin: str | None = None) -> tuple[int, str, str]:
        if self.unreachable:
            return 255, "", "ssh: connect to host spark1 port 22: No route to host"
        if argv[:2] == ["sudo", "-n"]:
            if self.sudo_password:
                return 1, "", "sudo: a password is required"
            argv = argv[3:] if argv[2] == "--" else argv[2:]
        done = self.file(argv, stdin)
        if done is not None:
            return done
        if argv[:2] == ["systemctl", "list-units"]:
            names = argv[argv.index("--") + 1:]
            lines = [f"{u} loaded {s} {'running' if s == 'active' else 'dead'} unit {u}"
                     for u in names if (s := self.units.get(u))]
            return 0, "\n".join(lines) + ("\n" if lines else ""), ""
        if argv[:2] == ["systemctl", "stop"]:
            u = argv[2]
            if u in self.fail_stop:
                return 1, "", f"Job for {u} failed."
            if u in self.units:
                self.units[u] = "inactive"
            if u in self.holds_gpu:
                self._gone = self.holds_gpu[u]
            return 0, "", ""
        if argv[:2] == ["systemctl", "start"]:
            u = argv[2]
            if u not in self.units:
                return 5, "", f"Failed to start {u}: Unit {u} not found."
            if u in self.fail_start:
                return 1, "", f"Job for {u} failed because the control process exited with error code."
            self.units[u] = "active"
            if u in self.holds_gpu and self.holds_gpu[u] not in self.gpu:
                self.gpu.append(self.holds_gpu[u])
            return 0, "", ""
        if argv[0] == "nvidia-smi":
            gone = getattr(self, "_gone", None)
            if gone and gone in self.gpu:
                if self.gpu_lingers > 0:
                    self.gpu_lingers -= 1
                else:
                    self.gpu.remove(gone)
            return 0, "".join(f"{pid}, {name}, [N/A]\n" for pid, name in self.gpu), ""
        if argv == ["true"]:
            return 0, "", ""
        if argv[:2] == ["docker", "-H"]:
            return self.docker(argv[3:])
        raise AssertionError(f"unexpected command {argv}")


def scripted(tmp_path: Path, nodes: dict[str, FakeNode], dry: bool = False,
             profile: Path = SEED) -> tuple[Deployment, ScriptedContext, FakeClock]:
    """A deployment of scripted nodes on a fake clock."""
    ctx = ScriptedContext(nodes, dry=dry)
    clock = FakeClock()
    return deployment(profile, tmp_path / "state", ctx, dry=dry, clock=clock), ctx, clock


class ScriptedContext(FakeContext):
    def __init__(self, nodes: dict[str, FakeNode], dry: bool = False):
        super().__init__(dry)
        self._set("nodes", nodes)

    def answer(self, alias, argv, stdin, command, kw):
        assert alias is not None, command
        code, out, err = self.nodes[alias].answer(argv, stdin)
        return self.result(command, code, out, err)
