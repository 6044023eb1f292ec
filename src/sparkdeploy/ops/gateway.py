"""The gateway on the head (``helpers/gateway.py``): one endpoint in front of every model placed
on the cluster, a systemd unit ``sparkdeploy-gateway.service`` (``serve.gateway`` writes and
(re)starts it, ``serve.down`` removes it).

On the head, under ``/var/lib/sparkdeploy-node/gateway/``: ``gateway.py`` with ``protocol.py``
beside it, ``config.json`` (mode 0600: where it listens, each model's engine, a model on demand's
unit and what it takes, and, when the deployment has an API key, the key's SHA-256; the key
itself is never written on a node), and ``loads.json``, the gateway's record of the loads and
evictions of models on demand (``on_demand`` reads it for ``serve.status``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from sparkdeploy.core.outside import OutsideError, parsed
from sparkdeploy.node import endpoint as ep
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host
from sparkdeploy.node.nodeops import NODE_STATE, read_node_file
from sparkdeploy.ops.serve_containers import UNIT_DIR, active, unit_files

NODE_DIR = f"{NODE_STATE}/gateway"
UNIT = "sparkdeploy-gateway.service"
PROGRAM = "gateway.py"
"""The gateway (``sparkdeploy/helpers/``, standard library only: the head's python3 runs it)."""
PROGRAM_FILE = f"{NODE_DIR}/{PROGRAM}"
TOOLKIT_FILE = f"{NODE_DIR}/protocol.py"
"""The helpers' toolkit beside it (``helpers/protocol.py``: its record's atomic write, its
deadlines)."""
CONFIG_FILE = f"{NODE_DIR}/config.json"
RECORD_FILE = f"{NODE_DIR}/loads.json"
"""The gateway's record of the loads and evictions of models on demand (a JSON list)."""
PYTHON = "/usr/bin/python3"


@dataclass(frozen=True)
class Load:
    """A model on demand as the gateway loads it: its unit on the head, the memory it takes."""

    unit: str
    need: int


@dataclass(frozen=True)
class OnDemand:
    """The models on demand ({deployment: Load}) and what they may hold together (bytes)."""

    loads: dict[str, Load]
    budget: int | None

    def get(self, deployment: str) -> Load | None:
        return self.loads.get(deployment)


@dataclass(frozen=True)
class Backend:
    """One model behind the gateway: its engine as the head reaches it."""

    model: str
    url: str
    deployment: str
    load: Load | None = None
    """Set for a model on demand."""


def backend_url(dep: Deployment, node: str, port: int) -> str:
    """An engine's address as the gateway on the head reaches it: the head's own on loopback,
    another node's at the address the controller reaches it by."""
    if node == dep.profile.head.name:
        return f"http://127.0.0.1:{port}"
    return ep.engine_url(dep.host(node), port)


def url(dep: Deployment) -> str:
    """The gateway's address as the controller (and an owner's client) reaches it."""
    return ep.engine_url(dep.host(dep.profile.head.name), dep.profile.gateway.port)


def config_json(dep: Deployment, backends: list[Backend], api_key: str | None,
                budget: int | None = None) -> str:
    """``config.json``: the listening address, each model's engine (routed before the engine
    answers ``/v1/models``; a model on demand's unit and what it takes), the key's digest, and
    how models on demand are loaded (``budget``: what they may hold together, bytes)."""
    g = dep.profile.gateway
    doc: dict[str, object] = {
        "listen": f"0.0.0.0:{g.port}",
        "backends": [{"url": b.url, "models": [b.model],
                      **({"on_demand": {"unit": b.load.unit, "need_bytes": b.load.need}}
                         if b.load else {})} for b in backends]}
    if any(b.load for b in backends):
        doc["on_demand"] = {"budget_bytes": budget, "wait_s": g.wait_s, "load_s": g.load_s,
                            "record": RECORD_FILE}
    if api_key:
        doc["api_key_sha256"] = hashlib.sha256(api_key.encode()).hexdigest()
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


@dataclass(frozen=True)
class Demand:
    """A model on demand as the head says: its unit, loaded or not, its loads and evictions."""

    model: str
    unit: str
    loaded: bool
    events: tuple[dict, ...]
    """Its entries in the gateway's record, oldest first."""

    def line(self) -> str:
        loads = [e for e in self.events if e.get("event") == "load"]
        evicted = [e for e in self.events if e.get("event") == "evict"]
        failed = [e for e in self.events if e.get("event") == "load-failed"]
        out = f"{self.model} on demand ({self.unit}): {'loaded' if self.loaded else 'not loaded'}"
        out += f"; {len(loads)} load(s), {len(evicted)} eviction(s)"
        if loads:
            out += f"; last load at {loads[-1].get('at')} in {loads[-1].get('seconds')} s"
        if evicted:
            out += f"; last evicted at {evicted[-1].get('at')} for {evicted[-1].get('for')}"
        if failed:
            out += f"; last failed load at {failed[-1].get('at')}: {failed[-1].get('why')}"
        return out


def _node_file(host: Host, path: str, what: str) -> object:
    """The JSON in one of the gateway's files on the head (None: none, or not JSON)."""
    text = read_node_file(host, path, sudo=True)  # its config is root's alone
    try:
        return parsed(text, what) if text is not None else None
    except OutsideError:
        return None


def on_demand(host: Host) -> list[Demand]:
    """The gateway's models on demand on the head (its config), each with its unit's state and
    its entries in the gateway's record of loads and evictions."""
    doc = _node_file(host, CONFIG_FILE, "the gateway's config")
    rec = _node_file(host, RECORD_FILE, "the gateway's record")
    events = [e for e in rec if isinstance(e, dict)] if isinstance(rec, list) else []
    units: dict[str, str] = {}
    for b in (doc.get("backends") if isinstance(doc, dict) else None) or []:
        od = b.get("on_demand") if isinstance(b, dict) else None
        models = b.get("models") if isinstance(b, dict) else None
        if isinstance(od, dict) and isinstance(od.get("unit"), str) and isinstance(models, list):
            units.update({m: od["unit"] for m in models if isinstance(m, str)})
    up = set(active(host, sorted(set(units.values()))))
    return [Demand(m, u, u in up, tuple(e for e in events if e.get("model") == m))
            for m, u in units.items()]


def start_argv() -> list[str]:
    """``-B``: no ``__pycache__`` beside it (its toolkit is imported), nothing left when it goes."""
    return [PYTHON, "-B", PROGRAM_FILE, f"--config={CONFIG_FILE}"]


def remove(host: Host) -> bool:
    """Stop and remove the gateway's unit and files on the node; whether it was there."""
    if not unit_files(host, [UNIT]):
        return False
    host.run(["systemctl", "stop", "--", UNIT], sudo=True, timeout=60)
    host.run(["rm", "-f", "--", f"{UNIT_DIR}/{UNIT}", CONFIG_FILE, PROGRAM_FILE, TOOLKIT_FILE,
              RECORD_FILE], sudo=True)
    host.run(["systemctl", "daemon-reload"], sudo=True)
    return True
