"""A simulated node's stand-in environment in a tmp dir: runs the lab's systemctl and
nvidia-smi stand-ins as subprocesses and, on close, ends every process they started (by the
process groups they recorded) and every helper process the test started itself (by PID)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkdeploy.lab.glm import STANDINS


def wait_for(predicate, what: str, deadline_s: float = 15.0):
    """Poll until ``predicate()`` is truthy (a deadline against hangs, not a speed claim)."""
    end = time.monotonic() + deadline_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) members of a process group: a reaped-later zombie is gone already."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                members.append(int(entry))
    return members


class StandinNode:
    def __init__(self, tmp: Path) -> None:
        self.root = tmp / "standin-root"
        self.unit_dir = tmp / "units"
        self.unit_dir.mkdir(parents=True)
        self.env = {
            **os.environ,
            "SPARKDEPLOY_STANDIN_ROOT": str(self.root),
            "SPARKDEPLOY_UNIT_DIR": str(self.unit_dir),
            "SPARKDEPLOY_STANDIN_STOP_TIMEOUT": "5",
        }
        self.helpers: list[subprocess.Popen] = []

    def run(self, tool: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(STANDINS / tool), *args], env=self.env, capture_output=True,
                              text=True, timeout=60)

    def systemctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run("systemctl", *args)

    def nvidia_smi(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run("nvidia-smi", *args)

    def unit(self, name: str, text: str) -> Path:
        path = self.unit_dir / name
        path.write_text(text)
        return path

    def main_record(self, unit: str) -> dict | None:
        path = self.root / "systemctl" / "units" / unit / "main.json"
        return json.loads(path.read_text()) if path.exists() else None

    def main_pid(self, unit: str) -> int:
        out = self.systemctl("show", "-p", "MainPID", "--value", unit).stdout.strip()
        return int(out)

    def log(self, unit: str) -> str:
        path = self.root / "systemctl" / "logs" / f"{unit}.log"
        return path.read_text() if path.exists() else ""

    def gpu_apps(self) -> list[list[str]]:
        out = self.nvidia_smi("--query-compute-apps=pid,process_name,used_memory",
                              "--format=csv,noheader")
        assert out.returncode == 0, out.stderr
        return [line.split(", ") for line in out.stdout.splitlines()]

    def gpu_user(self, name: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, str(STANDINS / "gpu_user.py"), name],
                                env=self.env)
        self.helpers.append(proc)
        return proc

    def close(self) -> None:
        units = self.root / "systemctl" / "units"
        for main in units.glob("*/main.json") if units.exists() else []:
            pgid = json.loads(main.read_text()).get("pgid")
            if pgid:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.helpers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture(name="node")
def node_fixture(tmp_path):
    """A stand-in node in tmp_path; its processes are ended afterwards."""
    n = StandinNode(tmp_path)
    yield n
    n.close()
