"""Lab faults: ``inv lab.fault NAME`` forces a failure the stand-ins then show, until
``inv lab.fault none`` clears it (it lasts across ``lab.up``; ``lab.down`` removes it with the
rest of the lab's data).

The record is ``<lab>/faults.json``; each node gets a copy in its stand-ins' container view
(``/opt/sparkdeploy-lab/container/faults.json`` on the node), which the NVIDIA container
runtime stand-in mounts read-only at ``/run/sparkdeploy-lab`` in every GPU container: the
engine stand-ins read it there, and the steps never see it.
"""

from __future__ import annotations

import json
from pathlib import Path

from sparkdeploy.files import write_if_changed
from sparkdeploy.lab import layout
from sparkdeploy.results import Result, changed, failed, ok

FAULTS: dict[str, str] = {
    "sglang-hang": "SGLang's ranks hang after `CustomAllreduce is disabled ...` even when every "
                   "rank advertises its fast-link address",
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


def view_dir(node: str) -> Path:
    return layout.node_dir(node) / layout.PRIVATE_MOUNTS[layout.STANDIN_DIR] / VIEW


def _write(path: Path, names: list[str]) -> bool:
    return write_if_changed(path, json.dumps({"faults": names}, indent=1) + "\n", 0o644)


def sync_node(node: str, record: Path | None = None) -> bool:
    """The node's copy equals the record; True if it changed."""
    return _write(view_dir(node) / "faults.json", current(record))


def nodes() -> list[str]:
    if not layout.NODES_DIR.is_dir():
        return []
    return sorted((p.name for p in layout.NODES_DIR.iterdir() if p.is_dir()), key=lambda s: (len(s), s))


def set_fault(name: str, record: Path | None = None) -> list[Result]:
    """``name`` one of FAULTS (added to the record) or ``none`` (clears every fault)."""
    record = record or RECORD
    if name != "none" and name not in FAULTS:
        return [failed("lab.fault", f"NAME: unknown fault {name!r} (one of none, {', '.join(FAULTS)})")]
    before = current(record)
    want = [] if name == "none" else sorted(set(before) | {name})
    did = _write(record, want)
    synced = [x for x in nodes() if sync_node(x, record)]
    what = ", ".join(want) or "none"
    why = (f"faults now: {what}" + (f" (nodes updated: {', '.join(synced)})" if synced else "")
           + ("" if nodes() else "; no lab nodes yet: lab.up applies it"))
    if name != "none":
        why += (f". {name}: {FAULTS[name]}. It shows in engines started from now on; one "
                "already serving keeps serving (`inv serve.down` first, and the next "
                "deploy.all starts the engines again)")
    return [(changed if did or synced else ok)("lab.fault", why, faults=want)]
