"""``nox -s perf -- swap``: a model swap's downtime on the lab, against its own bring-up and
against the outage changing models costs today (a cold ``deploy.all`` of the new model).

The lab's deployment (the lab profile's model) serves; a client asks every ``EVERY_S`` seconds
(one short chat completion, to whichever endpoint answers: the old engine's port or the new
one's) while ``inv serve.swap --recipe NEW`` runs. The downtime is the gap between the old
model's last good answer and the new model's first.

- ``swap.downtime_s``, ``swap.bringup_s`` (the ``bring-up N s`` serve.swap prints: the new
  engine's serve.up);
- ``swap.downtime_over_bringup``: their ratio (goal <= 1.2: the swap costs one bring-up);
- ``swap.loaded.*``: the same after swapping back, to a copy of the recipe whose engines take
  ``LOAD_S`` to load their weights (the stand-in's ``SPARKDEPLOY_STANDIN_STARTUP_S``): the lab's
  bring-up is otherwise a second or two, where a Spark's is minutes, so the cut-over's fixed
  cost (stopping the old engine, the new one's preflight, the coherence gate, the client's
  0.5 s between questions) is most of it;
- ``swap.cold_deploy_s``: ``deploy.all --recipe NEW`` from nothing (its weights and images
  removed first: ``deploy.rollback --purge``), the outage a model change costs without a swap;
- ``swap.downtime_over_cold_deploy``.

Needs root and the lab (``inv lab.up``); leaves the pair with nothing of either deployment on
it and the lab's images loaded again (``lab.up``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from sparkdeploy.core.outside import OutsideError, request
from sparkdeploy.node import endpoint as ep
from sparkdeploy.node.deployment import DEFAULTS, Deployment, load

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "configs" / "lab.yaml"
STATE = ROOT / DEFAULTS["state_dir"] / "perf-swap"
NEW = "gpt-oss-120b"
"""The recipe swapped to: the lab's hub holds its repository (``lab.hub_layouts``)."""
EVERY_S = 0.5
LOAD_S = 30
"""Seconds the ``swap.loaded`` recipe's engines take to load (a Spark's load of 65-125 GB takes
minutes: the seed's session)."""
BRINGUP = re.compile(r"^bring-up ([0-9.]+) s$", re.M)


def _say(msg: str) -> None:
    print(f"[perf swap] {msg}", file=sys.stderr, flush=True)


def inv(state: Path, *args: str, profile: Path = PROFILE,
        timeout: float = 1800) -> subprocess.CompletedProcess:
    """``inv ARGS`` on the lab profile with ``state`` as the state dir (as a user runs it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"),
           "INVOKE_SPARKDEPLOY_PROFILE": str(profile),
           "INVOKE_SPARKDEPLOY_STATE_DIR": str(state)}
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def bringup_s(stdout: str) -> float | None:
    m = BRINGUP.search(stdout)
    return float(m.group(1)) if m else None


def urls(dep: Deployment) -> list[str]:
    """Every endpoint an engine of ``dep`` would answer on (the head, each engine's port)."""
    addr = ep.controller_address(dep.host(dep.profile.head.name))
    return list(dict.fromkeys(f"http://{addr}:{e.port}" for e in dep.profile.engines))


def answered_by(url: str, deadline: float = 2.0) -> str | None:
    """The model that answered one short chat completion at ``url`` (None: none did)."""
    listed = ep.models(url, deadline=deadline)
    if not listed:
        return None
    body = {"model": listed[0], "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "stream": False}
    try:
        r = request("POST", f"{url}/v1/chat/completions", body=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json", **ep.headers()},
                    deadline=deadline)
    except OutsideError:
        return None
    return listed[0] if r.status == 200 else None


class Client:
    """Asks every ``EVERY_S`` seconds; ``seen``: (time, the model that answered or None)."""

    def __init__(self, endpoints: list[str]):
        self.endpoints = endpoints
        self.seen: list[tuple[float, str | None]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            got = next((m for m in map(answered_by, self.endpoints) if m), None)
            self.seen.append((t, got))
            self.stop.wait(max(0.0, EVERY_S - (time.monotonic() - t)))

    def __enter__(self) -> Client:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)

    def downtime(self, old: str, new: str) -> float | None:
        """From the old model's last good answer to the new model's first after it."""
        first_new = next((i for i, (_, m) in enumerate(self.seen) if m == new), None)
        if first_new is None:
            return None
        last_old = next((t for t, m in reversed(self.seen[:first_new]) if m == old), None)
        return None if last_old is None else self.seen[first_new][0] - last_old

    def answered_throughout(self, model: str) -> bool:
        return bool(self.seen) and all(m == model for _, m in self.seen)


def loaded_recipe(into: Path, name: str = NEW) -> str:
    """An owner's recipe in ``into``: recipe ``name`` whose engines load for ``LOAD_S``."""
    import shutil

    import yaml

    from sparkdeploy.core.files import write_text_atomic
    from sparkdeploy.profile import recipes

    src = next(d for d in recipes.directories() if (d / f"{name}.yaml").is_file())
    data = yaml.safe_load((src / f"{name}.yaml").read_text())
    for e in data["sparkdeploy"]["engines"]:
        e.setdefault("env", {})["SPARKDEPLOY_STANDIN_STARTUP_S"] = str(LOAD_S)
    cfg = data["sparkdeploy"]["about"]["config"]
    into.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / cfg, into / cfg)
    out = f"{name}-loads-{LOAD_S}s"
    write_text_atomic(into / f"{out}.yaml", yaml.safe_dump(data, sort_keys=False))
    return out


def swapped(state: Path, recipe: str, old: str, new: str, *extra: str) -> tuple[float, float]:
    """(downtime, bring-up) of ``serve.swap --recipe recipe`` from model ``old`` to ``new``."""
    endpoints = urls(load(PROFILE, state)) + urls(load(PROFILE, state, recipe=NEW))
    with Client(endpoints) as client:
        _say(f"serve.swap --recipe {recipe}")
        r = inv(state, "serve.swap", "--recipe", recipe, *extra)
    _must(r, "serve.swap")
    down, took = client.downtime(old, new), bringup_s(r.stdout)
    if down is None or not took:
        raise RuntimeError(f"no downtime ({down}) or no bring-up ({took}) measured")
    _say(f"downtime {down:.1f} s, bring-up {took:.1f} s")
    return down, took


def _must(r: subprocess.CompletedProcess, what: str) -> None:
    if r.returncode != 0:
        raise RuntimeError(f"{what} exited {r.returncode}: {r.stdout[-2000:]} {r.stderr[-1000:]}")


def run() -> dict[str, float]:
    from sparkdeploy.lab import layout, lifecycle

    STATE.mkdir(parents=True, exist_ok=True)
    old, new = load(PROFILE, STATE), load(PROFILE, STATE, recipe=NEW)
    try:
        _say("deploy.all of the lab profile (the old model)")
        _must(inv(STATE, "deploy.all"), "deploy.all")
        a, b = old.profile.model.repo, new.profile.model.repo
        down, took = swapped(STATE, NEW, a, b)
        _must(inv(STATE, "serve.swap", "--recipe", str(old.profile.recipe)), "serve.swap back")
        slow = loaded_recipe(STATE / "recipes")
        down_l, took_l = swapped(STATE, slow, a, b, "--recipes", str(STATE / "recipes"))
        _say(f"a cold deploy.all of {NEW} next")
        _must(inv(STATE, "deploy.rollback", "--recipe", NEW, "--purge", "--yes"), "rollback")
        _must(inv(STATE, "deploy.rollback", "--purge", "--yes"), "rollback")
        lifecycle.up(nodes=2, flavor=layout.DEFAULT_DOCKERD)  # the lab's images, purged, back
        t0 = time.monotonic()
        _must(inv(STATE, "deploy.all", "--recipe", NEW), "deploy.all --recipe")
        cold = time.monotonic() - t0
    finally:
        inv(STATE, "deploy.rollback", "--recipe", NEW, "--purge", "--yes")
        inv(STATE, "deploy.rollback", "--purge", "--yes")
        lifecycle.up(nodes=2, flavor=layout.DEFAULT_DOCKERD)
    return {"downtime_s": round(down, 2), "bringup_s": took,
            "downtime_over_bringup": round(down / took, 3),
            "loaded.downtime_s": round(down_l, 2), "loaded.bringup_s": took_l,
            "loaded.downtime_over_bringup": round(down_l / took_l, 3),
            "cold_deploy_s": round(cold, 1), "downtime_over_cold_deploy": round(down / cold, 3)}
