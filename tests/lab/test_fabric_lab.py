"""link.fabric on the lab pair with the real engine's image (``lab.up --real-engine``: vLLM 0.32.0
built for the CPU, real torch, gloo): through the real ``inv link.fabric --recipe lab-tiny
--json``, the healthy link is ok; the ``link-throttled`` fault on spark2 is named degraded
(measured against ``link.expect_gbps``); the ``link-drop`` fault (the bridge port towards spark2
disabled) is a hang, ended by its deadline and named, with no rank's container left behind.
Each fault is undone (``lab.fault none``) whatever the test found."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from sparkdeploy.lab import faults, lifecycle, link_faults, tiny
from sparkdeploy.profile.config import load_profile

pytestmark = [pytest.mark.lab, pytest.mark.real_engine]

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "configs" / "lab.yaml"


def inv(state: Path, *args: str, timeout: float = 900, profile: Path = LAB) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "INVOKE_SPARKDEPLOY_PROFILE": str(profile),
           "INVOKE_SPARKDEPLOY_STATE_DIR": str(state)}
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def fabric(state: Path, profile: Path = LAB) -> tuple[subprocess.CompletedProcess, dict, float]:
    start = time.monotonic()
    r = inv(state, "link.fabric", "--recipe", tiny.RECIPE, "--json", profile=profile)
    took = time.monotonic() - start
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        pytest.fail(f"not one JSON document on stdout:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    assert list(doc) == ["verdict", "expected_gbs", "sizes", "why"], doc
    return r, doc, took


def leftovers(lab) -> dict[str, str]:
    """The fabric ranks' containers still on each node (none after any run)."""
    out = {}
    for node in ("spark1", "spark2"):
        cp = lab.ssh(node, ["docker", "ps", "--all", "--filter", "label=org.sparkdeploy.role=fabric",
                            "--format", "{{.Names}}"])
        out[node] = cp.stdout.strip()
    return out


def fabric_with(state: Path, fault: str, profile: Path = LAB) -> tuple[subprocess.CompletedProcess, dict, float]:
    """link.fabric with ``fault`` on spark2, undone whatever the run found."""
    try:
        [f] = faults.set_fault(fault, node="spark2")
        assert not f.failed, f.why
        return fabric(state, profile)
    finally:
        [undo] = faults.set_fault("none")
        assert not undo.failed, undo.why


@pytest.fixture(scope="module")
def pair(lab, tmp_path_factory):
    """The lab pair with the real engine's image on both nodes (probed, shipped: only those
    steps of deploy.all --recipe lab-tiny)."""
    bad = [r for r in lifecycle.up(nodes=2, real_engine=True) if r.failed]
    assert not bad, [f"{r.step}: {r.why}" for r in bad]
    state = tmp_path_factory.mktemp("fabric") / "state"
    r = inv(state, "deploy.all", "--recipe", tiny.RECIPE, "--only", "image.probe,image.build,image.ship",
            timeout=1500)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
    yield lab, state
    faults.set_fault("none")


def test_the_healthy_link_is_ok_with_nccl_tests_figures(pair):
    lab, state = pair
    r, doc, _ = fabric(state)
    assert r.returncode == 0, r.stderr[-4000:]
    assert doc["verdict"] == "ok", doc
    assert doc["expected_gbs"] == 0.125  # configs/lab.yaml: link.expect_gbps 1 (Gb/s)
    sizes = doc["sizes"]
    assert sizes and sizes[0]["bytes"] == 1 << 20
    assert all(b["bytes"] == 4 * a["bytes"] for a, b in zip(sizes, sizes[1:], strict=False))
    # two ranks: busbw = algbw * 2(n-1)/n = algbw
    assert all(s["busbw_gbs"] == s["algbw_gbs"] > 0 for s in sizes)
    assert "(gloo)" in doc["why"]
    assert "perftest (ib_write_bw) not run: spark1, spark2 has no RDMA device" in r.stderr
    assert leftovers(lab) == {"spark1": "", "spark2": ""}


def test_a_throttled_link_is_named_degraded(pair):
    lab, state = pair
    r, doc, _ = fabric_with(state, "link-throttled")
    assert r.returncode == 1, r.stderr[-4000:]
    assert doc["verdict"] == "degraded", doc
    assert "under the 0.125 GB/s expected" in doc["why"]
    assert max(s["busbw_gbs"] for s in doc["sizes"]) < 0.125
    assert leftovers(lab) == {"spark1": "", "spark2": ""}


def test_a_dropped_link_is_a_hang_ended_by_its_deadline_and_named(pair, tmp_path):
    lab, state = pair
    # the lab's deadline (150 s) leaves room for a loaded machine's healthy run; a hang needs
    # less to be one: the profile's own key, shortened for this run
    short = tmp_path / "short.yaml"
    short.write_text(yaml.safe_dump({"extends": str(LAB),
                                     "sparkdeploy": {"link": {"fabric_timeout_s": 40}}}))
    deadline = load_profile(short).link.fabric_timeout_s
    assert deadline == 40 and load_profile(short).link.expect_gbps == 1
    r, doc, took = fabric_with(state, "link-drop", short)
    assert link_faults.heal("spark2") == []  # the bridge port forwards again
    assert r.returncode == 1, r.stderr[-4000:]
    assert doc["verdict"] == "hang", doc
    assert doc["why"].startswith(f"the all-reduce did not end within {deadline:.0f} s"), doc
    assert "spark2" in doc["why"]
    assert deadline <= took < deadline + 90, took
    assert leftovers(lab) == {"spark1": "", "spark2": ""}
