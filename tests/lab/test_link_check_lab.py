"""link.check on the lab, through the real `inv`: exit 0 on the healthy pair (the bandwidth
measured over the lab's veths); each link fault made on spark2 through the real tools (``ip``,
``tc`` in its namespace, the RoCE stand-in's sysfs) exits 1 with a line naming spark2 and the
problem; ``lab.fault none`` undoes it and the pair passes again."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkdeploy.lab import faults, link_faults

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
PROFILE = "configs/lab.yaml"

FAULTS = {
    "mtu-mismatch": "enp1s0f0np0: MTU 1500, must be jumbo (>= 9000)",
    "address-missing": "enp1s0f0np0: lacks the profile's address 10.77.1.2 (has: none)",
    "twin-down": "roceP2p1s0f0 (enp1s0f0np0): port 1 is DOWN, must be ACTIVE",
    "link-throttled": "Gb/s measured (stream), the profile expects >= 1 Gb/s (link.expect_gbps)",
    "second-interface": "labextra0: holds 10.77.1.202/24, in the link's subnet 10.77.1.0/24 "
                        "(only enp1s0f0np0 may)",
    "interface-down": "enp1s0f0np0: is down, must be up",
}


def link_check(state_dir: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "INVOKE_SPARKDEPLOY_PROFILE": PROFILE,
           "INVOKE_SPARKDEPLOY_STATE_DIR": str(state_dir)}
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "invoke", "link.check"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    return out, time.monotonic() - start


def failed_lines(out: subprocess.CompletedProcess) -> list[tuple[str, str]]:
    """(node, why) of link.check's failed results (``TIME failed link.check NODE WHY``)."""
    rows = [ln.split(None, 4) for ln in out.stdout.splitlines()]
    return [(r[3], r[4]) for r in rows if len(r) == 5 and r[1:3] == ["failed", "link.check"]]


def test_the_healthy_lab_passes_and_its_bandwidth_is_measured(lab, tmp_path):
    out, took = link_check(tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    measured = [ln for ln in out.stdout.splitlines() if "spark1 -> spark2: " in ln]
    assert measured and "Gb/s (stream, 2 s), expected >= 1" in measured[0], out.stdout
    assert took < 30, f"link.check took {took:.1f}s"


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_link_fault_fails_naming_the_node_and_the_problem(lab, tmp_path, fault):
    try:
        [r] = faults.set_fault(fault, node="spark2")
        assert not r.failed, r.why
        out, _ = link_check(tmp_path)
        assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
        bad = failed_lines(out)
        assert any(node == "spark2" and FAULTS[fault] in why for node, why in bad), bad or out.stdout
        assert all(node == "spark2" for node, _ in bad), bad  # the head's end is fine
    finally:
        [undo] = faults.set_fault("none")
    assert not undo.failed, undo.why
    assert "spark2's link restored" in undo.why, undo.why
    again, _ = link_check(tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    assert link_faults.heal("spark2") == []  # nothing left to undo
