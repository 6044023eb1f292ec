"""Small node-side helpers every step shares: the docker CLI argv, JSON probes, staging a file
on a node, the node's architecture.

A node that cannot be reached raises ``NodeUnreachable`` (from ``Host.run``; re-exported here);
a node that answers but cannot do what is asked raises ``HostError``."""

from __future__ import annotations

import base64
import hashlib
import json
import shlex
from pathlib import Path
from typing import Any

from sparkdeploy.hosts import Host, HostError, NodeUnreachable

__all__ = ["ARCH", "SCRIPTS", "HostError", "NodeUnreachable", "docker", "inspect_image",
           "listed_tags", "node_arch", "shell", "stage", "stage_script"]

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
STAGE_DIR = "/tmp/sparkdeploy-stage"

ARCH = {"aarch64": "arm64", "arm64": "arm64", "x86_64": "amd64", "amd64": "amd64"}


def docker(host: Host, *args: str) -> list[str]:
    """The docker CLI on a node, always against the profile's socket for that node."""
    return ["docker", "-H", f"unix://{host.node.docker_socket}", *args]


def inspect_image(host: Host, ref: str) -> dict[str, Any] | None:
    """``docker image inspect`` as a dict, or None when the node does not have the image."""
    r = host.run(docker(host, "image", "inspect", "--format", "{{json .}}", ref), change=False)
    if r.exit_code != 0:
        return None
    return json.loads(r.stdout)


def listed_tags(host: Host) -> set[str]:
    """Every ``repo:tag`` the node's engine lists (an incomplete image is not listed)."""
    r = host.run(docker(host, "image", "ls", "--format", "{{.Repository}}:{{.Tag}}"), change=False)
    return {ln.strip() for ln in r.stdout.splitlines() if ln.strip()} if r.ok else set()


def node_arch(host: Host) -> str:
    r = host.run(["uname", "-m"], change=False)
    if not r.ok:
        raise HostError(f"{host.name}: uname -m failed: {r.one_line_error()}")
    return ARCH.get(r.stdout.strip(), r.stdout.strip())


def stage(host: Host, name: str, content: str) -> str:
    """Put ``content`` on the node under a content-addressed path and return that path.

    Staging is scratch space under /tmp, not deployment state: it runs in dry runs too so that
    read-only probes can use it."""
    digest = hashlib.sha256(content.encode()).hexdigest()[:16]
    path = f"{STAGE_DIR}/{digest}/{name}"
    # The content travels base64-encoded in argv (scripts and configs are small): invoke feeds
    # a command's stdin one byte per poll, far too slow for files.
    script = ('test -s "$1" || { mkdir -p "$(dirname "$1")" && printf %s "$2" | base64 -d > "$1.part" '
              '&& mv "$1.part" "$1"; }')
    encoded = base64.b64encode(content.encode()).decode()
    r = host.run(["sh", "-c", script, "sh", path, encoded], change=False)
    if not r.ok:
        raise HostError(f"{host.name}: cannot stage {name}: {r.one_line_error()}")
    return path


def stage_script(host: Host, name: str) -> str:
    return stage(host, name, (SCRIPTS / name).read_text())


def shell(*argvs: list[str]) -> str:
    """A shell pipeline of argv lists, every word quoted."""
    return " | ".join(shlex.join(a) for a in argvs)

