"""serve.swap on the lab pair, through the real `inv` (tests run in file order): the lab
profile's model serving (deployed first when nothing serves), a swap to gpt-oss-120b with a
client asking every 0.5 s through it (the new model answers, the downtime about one bring-up),
a swap to the model already serving (ok, nothing stopped), then a swap back whose engine hangs
(`lab.fault engine-hang --model`, `--engine sglang`): exit 1, the diagnosis named, gpt-oss-120b
serving again.

A profile on top of the lab's shortens the stall so that the hang is found within ~45 s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sparkdeploy.lab import faults
from sparkdeploy.node.deployment import load
from sparkdeploy.ops import swap as ops
from tools.perf.swap import Client, bringup_s, inv, urls

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
NEW = "gpt-oss-120b"
BACK = "qwen3.5-122b-a10b-fp8"
STALL = 45.0


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    d = tmp_path_factory.mktemp("swap")
    prof = d / "lab-swap.yaml"
    prof.write_text(yaml.safe_dump({"extends": str(ROOT / "configs" / "lab.yaml"), "sparkdeploy": {
        "serve": {"stall_s": STALL, "poll_s": 1, "ready_timeout_s": 300}}}))
    state = d / "state"
    old = load(prof, state)
    if ops.serving_url(old) is None:
        r = inv(state, "deploy.all", profile=prof)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    yield prof, state
    faults.set_fault("none")
    # the pair as the other lab tests expect it: nothing of either model serving, the head's
    # units back, no swap record, gpt-oss-120b's weights gone (the lab profile's stay)
    for args in (("deploy.rollback", "--recipe", NEW), ("deploy.rollback",)):
        r = inv(state, *args, profile=prof)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    new = load(prof, state, recipe=NEW)
    for n in ("spark1", "spark2"):
        lab.ssh(n, ["rm", "-rf", "--", new.profile.model.path, ops.NODE_RECORD])


def test_swap_serves_the_new_model_with_a_bringups_downtime(env):
    prof, state = env
    old, new = load(prof, state), load(prof, state, recipe=NEW)
    with Client(urls(old) + urls(new)) as client:
        r = inv(state, "serve.swap", "--recipe", NEW, profile=prof)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-3:]
    assert last[0].startswith("bring-up ") and last[1].startswith("endpoint: http://")
    assert "swap.prepare" in r.stdout and "swap.cut-over" in r.stdout
    assert f"old model {old.profile.model.repo}: serving" in r.stdout  # its health while preparing
    took = bringup_s(r.stdout)
    down = client.downtime(old.profile.model.repo, new.profile.model.repo)
    assert took and down is not None, client.seen[-20:]
    # the ratio is a figure (nox -s perf -- swap), not a timed assertion: here the stand-in's
    # bring-up is a second or two, so the fixed cost of the cut-over dominates it
    print(f"\nswap.downtime_over_bringup: {down / took:.3f} ({down:.1f} s / {took:.1f} s)")
    assert 0 < down < 60
    assert ops.serving_url(new) is not None and ops.serving_url(old) is None
    rec = json.loads(Path(last[2].split(" ", 1)[1]).with_suffix(".json").read_text())["data"]
    assert (rec["from_model"], rec["to_model"], rec["outcome"]) == (
        old.profile.model.repo, new.profile.model.repo, "swapped")
    assert ops.read_phase(new.host("spark1")).phase == ops.DONE


def test_a_swap_to_the_serving_model_stops_nothing(env):
    prof, state = env
    new = load(prof, state, recipe=NEW)
    before = ops.serving_url(new)
    r = inv(state, "serve.swap", "--recipe", NEW, profile=prof)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "already serves openai/gpt-oss-120b: nothing stopped" in r.stdout
    assert ops.serving_url(new) == before


def test_a_hung_new_engine_brings_the_old_model_back(env):
    prof, state = env
    serving, back = load(prof, state, recipe=NEW), load(prof, state, recipe=BACK)
    [f] = faults.set_fault("engine-hang", model=back.profile.model.repo)
    assert not f.failed, f.why
    try:
        with Client(urls(serving) + urls(back)) as client:
            # sglang alone (no fallback to vllm-ray, which would hang the same way)
            r = inv(state, "serve.swap", "--recipe", BACK, "--engine", "sglang", profile=prof)
    finally:
        faults.set_fault("none")
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-2000:]
    assert "class: nccl-init-hang" in r.stdout
    assert f"the old model {serving.profile.model.repo} serves again" in r.stdout
    assert ops.serving_url(serving) is not None
    assert client.seen and client.seen[-1][1] == serving.profile.model.repo
    assert back.profile.model.repo not in {m for _, m in client.seen}
    assert ops.read_phase(serving.host("spark1")).phase == ops.ROLLED_BACK
