"""hosts.trust / hosts.check against the lab's real sshd: keys are added only when confirmed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[2]


def inv(tmp_path: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "INVOKE_SPARKDEPLOY_PROFILE": str(tmp_path / "lab.yaml"),
           "INVOKE_SPARKDEPLOY_STATE_DIR": str(tmp_path / "state")}
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, env=env, input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_trust_asks_then_adds_host_keys_and_check_passes(lab, tmp_path):
    known = tmp_path / "known_hosts"
    # the lab profile with an empty known_hosts of our own (an overlay over configs/lab.yaml)
    (tmp_path / "lab.yaml").write_text(
        f"extends: {REPO / 'configs' / 'lab.yaml'}\n"
        f"sparkdeploy:\n  ssh:\n    known_hosts: {known}\n")

    before = inv(tmp_path, "hosts.check")
    assert before.returncode == 1
    assert re.search(r"^\d\d:\d\d:\d\d failed +hosts\.check +spark1 +unreachable: "
                     r"Host key verification failed\.$", before.stdout, re.M), before.stdout

    declined = inv(tmp_path, "hosts.trust", "--nodes", "spark1", "--profile",
                   str(tmp_path / "lab.yaml"), stdin="n\n")
    assert declined.returncode == 0
    assert "trust this host key? [y/N]" in declined.stdout
    assert re.search(r"skipped +hosts\.trust +spark1 +not confirmed: 256 SHA256:", declined.stdout)
    assert not known.exists() or known.read_text() == ""

    added = inv(tmp_path, "hosts.trust", "--yes")
    assert added.returncode == 0, added.stdout + added.stderr
    lines = known.read_text().splitlines()
    assert [ln.split()[0] for ln in lines] == [lab.addr("spark1", "mgmt"), lab.addr("spark2", "mgmt")]
    # the very keys the lab recorded for its nodes
    lab_keys = Path(lab.known_hosts).read_text()
    assert all(ln.split()[2] in lab_keys for ln in lines)

    again = inv(tmp_path, "hosts.trust", "--yes")
    assert again.stdout.count("already in") == 2
    after = inv(tmp_path, "hosts.check")
    assert after.returncode == 0 and after.stdout.count("reachable (ssh") == 2
