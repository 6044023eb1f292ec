"""Lab faults: ``inv lab.fault NAME`` forces a failure the stand-ins then show, until
``inv lab.fault none`` clears it (it lasts across ``lab.up``; ``lab.down`` removes it with the
rest of the lab's data).

Two sorts. ``FAULTS`` are read by the engine stand-ins when they start (``sglang-hang``,
``oom-at-load``), or on every request (``garbage``: nonsense answers, ``/health`` still 200).
``ACTIONS`` act at once on the engine containers running on one node
(``--nodes``, default: the last worker): ``rank-wedged`` SIGSTOPs every process of them (a rank
that is alive and serves nothing: ``ps`` shows state T, the head's streams stall while its
``/health`` answers), ``rank-exit`` SIGKILLs their engine process (the container exits 137).
The PIDs the lab stopped are kept in the record, and ``lab.fault none`` continues them (only
those, and only while they are still stopped). ``memory-small`` makes the node report little
memory (``lab.memory_fault``: a crafted ``/proc/meminfo`` bound in its mount namespace), until
``lab.fault none`` unmounts it.

The record is ``<lab>/faults.json``; each node gets a copy in its stand-ins' container view
(``/opt/sparkdeploy-lab/container/faults.json`` on the node), which the NVIDIA container
runtime stand-in mounts read-only at ``/run/sparkdeploy-lab`` in every GPU container: the
engine stand-ins read it there, and the steps never see it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from sparkdeploy.core.files import write_if_changed
from sparkdeploy.core.labels import ENGINE as LABEL_ENGINE
from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.helpers import serve_watchdog as wd
from sparkdeploy.lab import dockerd, layout, link_faults, memory_fault

FAULTS: dict[str, str] = {
    "sglang-hang": "SGLang's ranks hang after `CustomAllreduce is disabled ...` even when every "
                   "rank advertises its fast-link address",
    "oom-at-load": "every engine stand-in runs out of GPU memory while it loads the weights "
                   "(torch.OutOfMemoryError: CUDA out of memory, exit 1)",
    "engine-hang": "every engine stand-in serving the model --model names hangs at init (its "
                   "distributed-init line, then silence: the port never opens); other models "
                   "start as ever",
    "vllm-wrong-address": "vLLM's headless workers advertise 127.0.1.1 (VLLM_HOST_IP as `hostname "
                          "-i` gives it on a stock node): the head never reaches their message "
                          "queues and waits after loading the weights",
    "garbage": "every engine stand-in answers nonsense (the same token again and again) while "
               "/health stays 200, as a stale image did (spark-arena's blog); bench's coherence "
               "gate refuses to measure it",
}
AT_ONCE = frozenset({"garbage"})
"""FAULTS the engine stand-ins read on every request: they show in engines already serving."""
ACTIONS: dict[str, str] = {
    "rank-wedged": "every process of the node's engine containers SIGSTOPped (state T)",
    "rank-exit": "the engine process of the node's engine containers SIGKILLed (exit 137)",
    memory_fault.NAME: memory_fault.WHAT,
    **link_faults.LINK_FAULTS,
}
RECORD = layout.LAB_DIR / "faults.json"
VIEW = "container"
"""The node's container view: a subdirectory of its stand-ins dir (``/opt/sparkdeploy-lab``)."""
CONTAINER_VIEW = "/run/sparkdeploy-lab"


def current(record: Path | None = None) -> list[str]:
    try:
        data = json.loads((record or RECORD).read_text())
    except (OSError, ValueError):
        return []
    return sorted(str(f) for f in data.get("faults", []) if f in FAULTS) if isinstance(data, dict) else []


def models(record: Path | None = None) -> list[str]:
    """The models ``engine-hang`` names (``--model``), while it is set."""
    try:
        data = json.loads((record or RECORD).read_text())
    except (OSError, ValueError):
        return []
    got = data.get("hang_models") if isinstance(data, dict) else None
    return sorted(str(m) for m in got) if isinstance(got, list) and "engine-hang" in current(record) \
        else []


def view_dir(node: str) -> Path:
    return layout.node_dir(node) / layout.PRIVATE_MOUNTS[layout.STANDIN_DIR] / VIEW


def _write(path: Path, names: list[str], stopped: dict[str, list[int]] | None = None,
           hang: list[str] | None = None) -> bool:
    data: dict = {"faults": names}
    if stopped:
        data["stopped"] = stopped
    if hang and "engine-hang" in names:
        data["hang_models"] = hang
    return write_if_changed(path, json.dumps(data, indent=1) + "\n", 0o644)


def sync_node(node: str, record: Path | None = None) -> bool:
    """The node's copy equals the record; True if it changed."""
    return _write(view_dir(node) / "faults.json", current(record), hang=models(record))


def nodes() -> list[str]:
    if not layout.NODES_DIR.is_dir():
        return []
    return sorted((p.name for p in layout.NODES_DIR.iterdir() if p.is_dir()), key=lambda s: (len(s), s))


def _stopped(record: Path) -> dict[str, list[int]]:
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    got = data.get("stopped") if isinstance(data, dict) else None
    return {str(k): [int(p) for p in v if isinstance(p, int)] for k, v in got.items()
            if isinstance(v, list)} if isinstance(got, dict) else {}


def engine_pids(node: str, tree: bool = True) -> dict[str, list[int]]:
    """{container: PIDs} of the node's running engine containers (the engine process and, with
    ``tree``, every process under it): host PIDs, the lab's nodes share this machine's."""
    ps = subprocess.run(dockerd.docker(node, "ps", "--filter", f"label={LABEL_ENGINE}",
                                       "--format", "{{.Names}}"),
                        capture_output=True, text=True, timeout=30)
    out: dict[str, list[int]] = {}
    for name in ps.stdout.split():
        r = subprocess.run(dockerd.docker(node, "inspect", "--format", "{{.State.Pid}}", name),
                           capture_output=True, text=True, timeout=30)
        pid = int(r.stdout.strip()) if r.stdout.strip().isdigit() else 0
        if pid > 0:
            out[name] = sorted(wd.process_tree(pid)) if tree else [pid]
    return out


def act(name: str, node: str, record: Path | None = None) -> list[Result]:
    """One of ACTIONS on ``node``'s engine containers now."""
    record = record or RECORD
    pids = engine_pids(node, tree=name == "rank-wedged")
    if not pids:
        return [Result("lab.fault", Status.FAILED, f"{node}: no engine container running")]
    sig = signal.SIGSTOP if name == "rank-wedged" else signal.SIGKILL
    hit = []
    for ps in pids.values():
        for p in ps:
            try:
                os.kill(p, sig)
                hit.append(p)
            except ProcessLookupError:
                continue
    if name == "rank-wedged":
        stopped = _stopped(record)
        stopped[node] = sorted(set(stopped.get(node, [])) | set(hit))
        _write(record, current(record), stopped, models(record))
    return [Result("lab.fault", Status.CHANGED, f"{name} on {node}: {ACTIONS[name]} ({', '.join(pids)}: "
                    f"{len(hit)} process(es))", node, {"pids": hit})]


def _continue(record: Path) -> list[int]:
    """SIGCONT to the PIDs the lab stopped that are still stopped; they leave the record."""
    done = []
    for pids in _stopped(record).values():
        for p in pids:
            st = wd.proc_stat(p)
            if st is not None and st[0] in ("T", "t"):
                os.kill(p, signal.SIGCONT)
                done.append(p)
    return done


def set_fault(name: str, record: Path | None = None, node: str | None = None,
              model: str | None = None) -> list[Result]:
    """``name`` one of FAULTS (added to the record; ``engine-hang`` for ``model``, added to
    those it names), one of ACTIONS (on ``node``: default the last node), or ``none`` (clears
    every fault, continues what the lab stopped)."""
    record = record or RECORD
    if (name == "engine-hang") != (model is not None):
        return [Result("lab.fault", Status.FAILED, "--model: engine-hang needs the model (a hub "
                       "repo, as the profile's model.repo) and no other fault takes it")]
    if name == memory_fault.NAME:
        return memory_fault.apply(node or (nodes() or ["spark2"])[-1])
    if name in link_faults.LINK_FAULTS:
        return link_faults.inject(name, node or (nodes() or ["spark2"])[-1])
    if name in ACTIONS:
        return act(name, node or (nodes() or ["spark2"])[-1], record)
    if name != "none" and name not in FAULTS:
        return [Result("lab.fault", Status.FAILED, f"NAME: unknown fault {name!r} (one of none, "
                                    f"{', '.join([*FAULTS, *ACTIONS])})")]
    before = current(record)
    want = [] if name == "none" else sorted(set(before) | {name})
    resumed = _continue(record) if name == "none" else []
    unbound = memory_fault.clear(nodes()) if name == "none" else []
    healed = {x: h for x in nodes() if (h := link_faults.heal(x))} if name == "none" else {}
    hang = [] if name == "none" else sorted(set(models(record)) | ({model} if model else set()))
    did = _write(record, want, {} if name == "none" else _stopped(record), hang) or bool(resumed)
    synced = [x for x in nodes() if sync_node(x, record)]
    what = ", ".join(f"{w} ({', '.join(hang)})" if w == "engine-hang" else w for w in want) or "none"
    why = (f"faults now: {what}" + (f" (nodes updated: {', '.join(synced)})" if synced else "")
           + ("" if nodes() else "; no lab nodes yet: lab.up applies it")
           + (f"; continued {len(resumed)} stopped process(es)" if resumed else "")
           + (f"; {memory_fault.NAME} undone on {', '.join(unbound)}" if unbound else "")
           + "".join(f"; {x}'s link restored: {', '.join(h)}" for x, h in healed.items()))
    if name in AT_ONCE:
        why += f". {name}: {FAULTS[name]}. It shows at once, in engines already serving too"
    elif name != "none":
        why += (f". {name}: {FAULTS[name]}. It shows in engines started from now on; one "
                "already serving keeps serving (`inv serve.down` first, and the next "
                "deploy.all starts the engines again)")
    return [Result("lab.fault", Status.CHANGED if did or synced or unbound or healed else Status.OK, why,
                   None, {"faults": want})]
