"""model.fit on the lab, through the real `inv`: with ``lab.fault memory-small --nodes spark2``
(a crafted /proc/meminfo bound in spark2's mount namespace: what its memory helper really
reads), ``deploy.all`` from a fresh state dir exits 1 naming spark2 and both numbers, and no
weight file leaves the hub nor anything lands in the head's model dir; after ``lab.fault none``,
``model.fit`` is ok on both nodes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from sparkdeploy.lab import faults, layout
from sparkdeploy.model.fit import WEIGHT_SUFFIXES
from sparkdeploy.node import deployment

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
PROFILE = "configs/lab.yaml"


def inv(state_dir: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "INVOKE_SPARKDEPLOY_PROFILE": PROFILE,
           "INVOKE_SPARKDEPLOY_STATE_DIR": str(state_dir)}
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def model_dir_listing(dep) -> dict[str, tuple[int, float]]:
    """{path: (size, mtime)} of every file under the head's model dir, as the head sees it."""
    backing = layout.node_dir(dep.profile.head.name) / layout.PRIVATE_MOUNTS[layout.MODEL_DIR]
    rel = Path(dep.profile.model.path).relative_to(layout.MODEL_DIR)
    top = backing / rel
    return {str(p.relative_to(top)): (p.stat().st_size, p.stat().st_mtime)
            for p in top.rglob("*") if p.is_file()} if top.is_dir() else {}


def hub_log(dep) -> list[dict]:
    """The lab hub's request log (its last 2000 requests)."""
    return requests.get(dep.profile.model.endpoint + "/_lab/stats", timeout=10).json()["requests"]


def weights_served_since(before: list[dict], after: list[dict]) -> list[dict]:
    """The requests for weight files in ``after`` that came after the last request of
    ``before`` (image.probe reads the model's config.json from the hub: not a weight)."""
    start = 0
    if before:
        start = len(after) - after[::-1].index(before[-1]) if before[-1] in after else 0
    return [e for e in after[start:] if str(e.get("file") or "").endswith(WEIGHT_SUFFIXES)]


def test_memory_small_refuses_deploy_before_any_byte(lab, tmp_path):
    dep = deployment.load(ROOT / PROFILE, tmp_path / "probe-state")
    before_dir, before_hub = model_dir_listing(dep), hub_log(dep)
    [r] = faults.set_fault("memory-small", node="spark2")
    assert not r.failed, r.why
    out = None
    try:
        seen = lab.ssh("spark2", "grep MemAvailable /proc/meminfo").stdout
        assert seen.split()[1] == "1048576", seen
        assert "1048576" not in lab.ssh("spark1", "grep MemAvailable /proc/meminfo").stdout
        out = inv(tmp_path / "state", "deploy.all")
        assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
        lines = [ln for ln in out.stdout.splitlines() if "model.fit" in ln and "spark2" in ln
                 and "does not fit" in ln]
        assert lines, out.stdout[-4000:]
        assert re.search(r"spark2: \S+ does not fit: \d+\.\d GiB needed \(.*\) > 1\.0 GiB usable",
                         lines[0]), lines[0]
        assert re.search(r"x \d+\.\d GiB = \d+\.\d GiB > 1\.0 GiB usable", lines[0]), lines[0]
        assert not [ln for ln in out.stdout.splitlines() if "model.fit" in ln and "spark1" in ln
                    and "does not fit" in ln]
        # the precheck before services.stop counted spark2 as it would be with its units
        # stopped (MemTotal less the OS's share), not its 1 GiB available: it let it through
        pre = [ln for ln in out.stdout.splitlines() if "model.precheck" in ln and "spark2: " in ln]
        assert pre and all(" fits: " in ln and "usable at most, every unit stopped" in ln
                           for ln in pre), pre or out.stdout[-4000:]
        blocked = [ln for ln in out.stdout.splitlines()
                   if " model.download" in ln and re.search(r"needs (\S+, )*model\.fit\b", ln)]
        assert blocked, out.stdout[-4000:]
        assert model_dir_listing(dep) == before_dir  # nothing new nor changed on the head
        assert weights_served_since(before_hub, hub_log(dep)) == []  # no weight left the hub
    finally:
        [undo] = faults.set_fault("none")
        if out is not None and any(ln.split()[1:3] == ["changed", "services.stop"]
                                   for ln in out.stdout.splitlines() if len(ln.split()) > 2):
            back = inv(tmp_path / "state", "services.restore", "--nodes", "spark1")  # as found
            assert back.returncode == 0, back.stdout[-2000:] + back.stderr[-2000:]
        assert not undo.failed, undo.why
    assert "1048576" not in lab.ssh("spark2", "grep MemAvailable /proc/meminfo").stdout
    ok = inv(tmp_path / "state", "model.fit")
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-2000:]
    fits = [ln for ln in ok.stdout.splitlines() if " fits: " in ln]
    assert any("spark1: " in ln for ln in fits) and any("spark2: " in ln for ln in fits), ok.stdout
