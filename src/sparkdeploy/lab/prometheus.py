"""Prometheus on the lab's nodes: Debian's own ``prometheus`` package, as an owner installs it on
a Spark (``apt install prometheus``), unpacked under the cache (the machine's own packages and
services are untouched: installing the package would start a Prometheus on this machine) and put
on every node's PATH, where ``metrics.up`` finds it (``command -v prometheus``)."""

from __future__ import annotations

import os
from pathlib import Path

from sparkdeploy.lab import layout
from sparkdeploy.lab.dockerd import unpack
from sparkdeploy.lab.proc import run

SUITE = "bookworm"
DIR = layout.CACHE_DIR / "prometheus"
BINARY = DIR / "usr" / "bin" / "prometheus"


def ensure_cached() -> tuple[bool, str]:
    """Debian's ``prometheus`` unpacked under the cache; (changed, why)."""
    if BINARY.exists():
        return False, f"{BINARY} cached"
    deb = unpack(SUITE, "prometheus", DIR)
    ver = run([str(BINARY), "--version"], check=False).stdout.splitlines()[:1]
    return True, f"unpacked {deb.name} ({' '.join(ver) or 'no version line'})"


def install(node_root: os.PathLike) -> bool:
    """``bin/prometheus`` in a node's stand-ins directory (first on the node's PATH), pointing
    at the cached binary; True when it changed."""
    link = Path(node_root) / "bin" / "prometheus"
    if link.is_symlink() and os.readlink(link) == str(BINARY):
        return False
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.exists() or link.is_symlink():
        link.unlink()
    link.symlink_to(BINARY)
    return True
