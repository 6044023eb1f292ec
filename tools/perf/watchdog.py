"""``nox -s perf -- watchdog``: from a frozen worker rank to serving again, on the lab.

The lab's deployment (SGLang over both nodes) is persisted with a fast watchdog
(``serve.watch_s`` and ``serve.canary_s`` 5 s, no backoff); then ``ROUNDS`` times: every
process of the worker's engine container is SIGSTOPped (``lab.fault rank-wedged``), and the
time until a streamed completion brings a token again is measured from the controller (a
request every 0.5 s, each read bounded to 3 s). The supervisors' own figure, the record's
``served_again_after_s`` (from the wedge found to the canary's next token), comes beside it.

- ``watchdog.freeze_to_serving_s``: the median over the rounds (and ``_max_s``);
- ``watchdog.found_to_serving_s``: the record's median.

Needs root and the lab (``inv lab.up``); leaves it as it found it: nothing serving, no unit of
ours, no fault, the head's GLM units back, no restart record.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import yaml

from sparkdeploy.core.events import PlainRenderer
from sparkdeploy.core.files import write_text_atomic
from sparkdeploy.helpers import serve_watchdog as wd
from sparkdeploy.lab import faults
from sparkdeploy.node import endpoint as ep
from sparkdeploy.node.deployment import DEFAULTS, Deployment, load
from sparkdeploy.ops.serve_watch import read_restarts
from sparkdeploy.steps.registry import run_one

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "configs" / "lab.yaml"
STATE = ROOT / DEFAULTS["state_dir"] / "perf-watchdog"
ROUNDS = 3
SERVE = {"stall_s": 45, "poll_s": 1, "ready_timeout_s": 300, "watch_s": 5, "canary_s": 5,
         "restart_backoff_s": 0, "max_restarts": ROUNDS + 1}


def _say(msg: str) -> None:
    print(f"[perf watchdog] {msg}", file=sys.stderr, flush=True)


def _step(dep: Deployment, name: str, **opts) -> None:
    bad = [r.why for r in run_one(dep, name, **opts) if r.failed]
    if bad:
        raise RuntimeError(f"{name}: {bad[0]}")


def _clear_records(dep: Deployment) -> None:
    for n in dep.profile.nodes:
        dep.host(n.name).run(["rm", "-rf", "--", wd.record_path("sglang"), f"{wd.NODE_DIR}/logs"],
                             sudo=True)


def _serving_again(url: str, model: str, t0: float, limit: float = 240) -> float:
    while True:
        if ep.stream_chat(url, model, max_tokens=2, deadline=3):
            return time.monotonic() - t0
        if time.monotonic() - t0 > limit:
            raise RuntimeError(f"not serving again within {limit:.0f} s of the freeze")
        time.sleep(0.5)


def run() -> dict[str, float]:
    STATE.mkdir(parents=True, exist_ok=True)
    prof = STATE / "profile.yaml"
    write_text_atomic(prof, yaml.safe_dump({"extends": str(PROFILE), "sparkdeploy": {"serve": SERVE}}))
    dep = load(prof, STATE)
    took, found = [], []
    with dep.events.listening(PlainRenderer(sys.stderr, progress_every=10)):
        for name, opts in [("services.stop", {}), ("image.build", {}), ("model.download", {}),
                           ("model.sync", {"to": "spark2"}), ("model.verify", {})]:
            _step(dep, name, **opts)
        _clear_records(dep)
        try:
            _step(dep, "serve.up")
            _step(dep, "serve.persist")
            url, model = ep.url(dep), dep.profile.model.repo
            assert url
            _serving_again(url, model, time.monotonic())
            for i in range(ROUNDS):
                t0 = time.monotonic()
                [r] = faults.set_fault("rank-wedged", node="spark2")
                if r.failed:
                    raise RuntimeError(r.why)
                took.append(_serving_again(url, model, t0))
                _say(f"round {i + 1}: serving again {took[-1]:.1f} s after the freeze")
                time.sleep(6)  # the next supervisor run records when its canary first served
            recs = read_restarts(dep.host("spark1"), "sglang")
            found = [r["served_again_after_s"] for r in recs
                     if isinstance(r.get("served_again_after_s"), (int, float))]
        finally:
            faults.set_fault("none")
            run_one(dep, "serve.unpersist")
            run_one(dep, "serve.down")
            _clear_records(dep)
            run_one(dep, "services.restore")
    out = {"freeze_to_serving_s": statistics.median(took), "freeze_to_serving_max_s": max(took)}
    if found:
        out["found_to_serving_s"] = statistics.median(found)
    return out
