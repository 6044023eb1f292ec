"""Scripted nodes for unit tests: an invoke Context whose ``run`` answers like systemd and
nvidia-smi on simulated nodes, and records every command exactly as sparkdeploy sent it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from invoke import Config, Context, Result


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

    def answer(self, argv: list[str]) -> tuple[int, str, str]:
        if self.unreachable:
            return 255, "", "ssh: connect to host spark1 port 22: No route to host"
        if argv[:2] == ["sudo", "-n"]:
            if self.sudo_password:
                return 1, "", "sudo: a password is required"
            argv = argv[3:] if argv[2] == "--" else argv[2:]
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
        raise AssertionError(f"unexpected command {argv}")


class ScriptedContext(Context):
    def __init__(self, nodes: dict[str, FakeNode], dry: bool = False):
        super().__init__(Config(overrides={"run": {"dry": dry}}))
        self._set("nodes", nodes)
        self._set("calls", [])  # (node alias, remote argv)
        self._set("commands", [])  # the exact local command strings

    def run(self, command, **kwargs):
        self.commands.append(command)
        full = shlex.split(command)
        assert full[0] == "ssh", command
        alias, remote = full[-2], shlex.split(full[-1])
        assert full[-3] == "--"
        self.calls.append((alias, remote))
        code, out, err = self.nodes[alias].answer(remote)
        return Result(stdout=out, stderr=err, exited=code, command=command)
