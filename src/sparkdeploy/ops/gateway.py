"""The gateway on the head (``helpers/gateway.py``): one endpoint in front of every model placed
on the cluster, a systemd unit ``sparkdeploy-gateway.service`` (``serve.gateway`` writes and
(re)starts it, ``serve.down`` removes it).

On the head, under ``/var/lib/sparkdeploy-node/gateway/``: ``gateway.py`` and ``config.json``
(mode 0600: where it listens, each model's engine, and, when the deployment has an API key, the
key's SHA-256; the key itself is never written on a node).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from sparkdeploy.node import endpoint as ep
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host
from sparkdeploy.node.nodeops import NODE_STATE
from sparkdeploy.ops.serve_containers import UNIT_DIR, unit_files

NODE_DIR = f"{NODE_STATE}/gateway"
UNIT = "sparkdeploy-gateway.service"
PROGRAM = "gateway.py"
"""The gateway (``sparkdeploy/helpers/``, standard library only: the head's python3 runs it)."""
PROGRAM_FILE = f"{NODE_DIR}/{PROGRAM}"
CONFIG_FILE = f"{NODE_DIR}/config.json"
PYTHON = "/usr/bin/python3"


@dataclass(frozen=True)
class Backend:
    """One model behind the gateway: its engine as the head reaches it."""

    model: str
    url: str
    deployment: str


def backend_url(dep: Deployment, node: str, port: int) -> str:
    """An engine's address as the gateway on the head reaches it: the head's own on loopback,
    another node's at the address the controller reaches it by."""
    if node == dep.profile.head.name:
        return f"http://127.0.0.1:{port}"
    return ep.engine_url(dep.host(node), port)


def url(dep: Deployment) -> str:
    """The gateway's address as the controller (and an owner's client) reaches it."""
    return ep.engine_url(dep.host(dep.profile.head.name), dep.profile.gateway.port)


def config_json(dep: Deployment, backends: list[Backend], api_key: str | None) -> str:
    """``config.json``: the listening address, each model's engine (routed before the engine
    answers ``/v1/models``), the key's digest."""
    doc: dict[str, object] = {
        "listen": f"0.0.0.0:{dep.profile.gateway.port}",
        "backends": [{"url": b.url, "models": [b.model]} for b in backends]}
    if api_key:
        doc["api_key_sha256"] = hashlib.sha256(api_key.encode()).hexdigest()
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def start_argv() -> list[str]:
    return [PYTHON, PROGRAM_FILE, f"--config={CONFIG_FILE}"]


def remove(host: Host) -> bool:
    """Stop and remove the gateway's unit and files on the node; whether it was there."""
    if not unit_files(host, [UNIT]):
        return False
    host.run(["systemctl", "stop", "--", UNIT], sudo=True, timeout=60)
    host.run(["rm", "-f", "--", f"{UNIT_DIR}/{UNIT}", CONFIG_FILE, PROGRAM_FILE], sudo=True)
    host.run(["systemctl", "daemon-reload"], sudo=True)
    return True
