"""``nox -s perf -- deploy``: how well ``deploy.all`` overlaps its steps, measured on the lab.

The lab hub's bandwidth is set so that the download takes about ``DOWNLOAD_S`` seconds (the
longest step, as on a real pair). Each run starts from the same place (``serve.down``, the
weights removed from every node, the run's resume state forgotten; images stay, so their steps
only probe), then runs the whole plan (bench smoke included), once serial, once pipelined.

- ``deploy.pipeline_ratio``: pipelined wall time / the longest chain of dependent steps, each
  step's time taken from the same pipelined run (goal <= 1.15: the runner adds little to what
  the dependencies force).
- ``deploy.serial_ratio``: serial wall time / pipelined wall time.

Before them, ``deploy.rerun_seconds``: a re-run of the finished deployment (the hub unlimited
again), which must change nothing (goal <= 10 s).

Needs root and the lab (``inv lab.up``); leaves the lab serving the deployment and the hub at
the bandwidth it had.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from sparkdeploy.core.events import PlainRenderer
from sparkdeploy.core.records import PlanMemory
from sparkdeploy.lab import hub, layout
from sparkdeploy.node.deployment import DEFAULTS, Deployment, load
from sparkdeploy.run import plan as plans
from sparkdeploy.run.plan import PlanRun
from sparkdeploy.run.runner import Runner, longest_chain

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "configs" / "lab.yaml"
STATE = ROOT / DEFAULTS["state_dir"] / "perf-deploy"
DOWNLOAD_S = 45.0


def _say(msg: str) -> None:
    print(f"[perf deploy] {msg}", file=sys.stderr, flush=True)


def repo_bytes(url: str, repo: str) -> int:
    from huggingface_hub import HfApi

    info = HfApi(endpoint=url).model_info(repo, files_metadata=True)
    return sum(s.size or 0 for s in info.siblings or [])


def fresh(dep: Deployment) -> None:
    """No engine and no weights on any node, the run's resume state forgotten. Images stay
    (built and shipped ones are cached artifacts; their steps then only probe)."""
    from sparkdeploy.steps.registry import run_one

    bad = [r.why for r in run_one(dep, "serve.down") if r.failed]
    path = dep.profile.model.path
    if not path.startswith(layout.MODEL_DIR + "/"):  # the lab made MODEL_DIR on its nodes
        raise RuntimeError(f"model.path {path!r} is not under the lab's {layout.MODEL_DIR}")
    for n in dep.profile.nodes:
        r = dep.host(n.name).run(["rm", "-rf", "--", path], sudo=True)
        if not r.ok:
            bad.append(f"{n.name}: rm {path}: {r.one_line_error()}")
    if bad:
        raise RuntimeError("could not start from scratch: " + "; ".join(bad))
    dep.records.remove(PlanMemory, f"deploy-{dep.profile.name}")


def deploy(dep: Deployment, serial: bool, bench: bool = True) -> tuple[PlanRun, list]:
    steps = plans.plan(dep, bench=bench)
    out = Runner(dep, steps, serial=serial).run()
    bad = [f"{n}: {r.why}" for n, r in out.runs.items() if r.state == "failed"]
    if bad:
        raise RuntimeError(f"deploy.all{' --serial' if serial else ''} failed: " + "; ".join(bad))
    return out, steps


def run() -> dict[str, float]:
    dep = load(PROFILE, STATE)
    url = dep.profile.model.endpoint
    if not url:
        raise RuntimeError(f"{PROFILE}: model.endpoint (the lab hub) is not set")
    with dep.events.listening(PlainRenderer(sys.stderr, progress_every=10)):
        before = hub.set_knobs(url).get("bandwidth_bps")
        size = repo_bytes(url, dep.profile.model.repo)
        rate = int(size / DOWNLOAD_S)
        _say(f"repo {size / 1e6:.0f} MB; hub limited to {rate / 1e6:.1f} MB/s "
             f"(download ~{DOWNLOAD_S:.0f} s)")
        hub.set_knobs(url, bandwidth_bps=rate)
        try:
            took = {}
            for serial in (True, False):
                fresh(dep)
                t0 = time.monotonic()
                out, steps = deploy(dep, serial)
                took[serial] = out
                _say(f"{'serial' if serial else 'pipelined'}: {out.wall:.1f} s "
                     f"(measured around it: {time.monotonic() - t0:.1f} s)")
        finally:
            hub.set_knobs(url, bandwidth_bps=before)
        again, _ = deploy(dep, False, bench=False)
        if again.changed:
            raise RuntimeError("a re-run of the finished deployment changed: " + ", ".join(
                n for n, r in again.runs.items() if r.changed))
    piped, serial_out = took[False], took[True]
    chain, names = longest_chain(piped, steps)
    _say(f"longest chain {chain:.1f} s: {' -> '.join(names)}; "
         + ", ".join(f"{n} {r.elapsed:.1f}s" for n, r in piped.runs.items() if r.elapsed))
    return {"rerun_seconds": again.wall, "pipeline_ratio": piped.wall / chain,
            "serial_ratio": serial_out.wall / piped.wall}
