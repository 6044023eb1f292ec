"""The lab fault ``memory-small``: one node reports little memory through what the memory
helper really reads there.

The lab's nodes share this machine's kernel, and their nvidia-smi stand-in answers ``[N/A]``
for memory as a GB10's does, so the helper reads the node's ``/proc/meminfo``. The fault binds
a crafted copy of it (this machine's, with ``MemAvailable`` and ``MemFree`` cut to
``SMALL_KIB``) over ``/proc/meminfo`` inside that node's mount namespace only (``nsenter
--mount=<node mntns> mount --bind``): every process of that node (sshd and what it runs)
reads the small figure, this machine and the other nodes do not. ``clear`` unmounts it on every
node where it is mounted. It lasts until ``inv lab.fault none`` or ``lab.down``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from sparkdeploy.core.files import write_if_changed
from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.lab import layout

NAME = "memory-small"
WHAT = ("the node's /proc/meminfo shows MemAvailable 1.0 GiB (a crafted copy bound over it in "
        "the node's mount namespace): its memory helper reports 1.0 GiB usable")
MEMINFO = "/proc/meminfo"
SMALL_KIB = 1024 * 1024
FILE = "meminfo-small"


def crafted(text: str, small_kib: int = SMALL_KIB) -> str:
    """``/proc/meminfo``'s ``text`` with MemAvailable and MemFree at ``small_kib`` kB."""
    out = []
    for line in text.splitlines():
        name = line.split(":", 1)[0].strip()
        if name in ("MemAvailable", "MemFree"):
            line = f"{name + ':':<16}{small_kib:>8} kB"
        out.append(line)
    return "\n".join(out) + "\n"


def _ns(node: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", f"--mount={layout.mntns_path(node)}", *argv],
                          capture_output=True, text=True, timeout=30)


def mounted(node: str) -> bool:
    """Whether ``/proc/meminfo`` is a mount point in ``node``'s mount namespace."""
    r = _ns(node, "cat", "/proc/self/mountinfo")
    return any(len(f := ln.split()) > 4 and f[4] == MEMINFO for ln in r.stdout.splitlines())


def apply(node: str) -> list[Result]:
    """Bind the crafted meminfo over ``node``'s ``/proc/meminfo`` (once)."""
    if not layout.mntns_path(node).exists():
        return [Result("lab.fault", Status.FAILED, f"{node}: no such lab node (no mount namespace)", node)]
    if mounted(node):
        return [Result("lab.fault", Status.OK, f"{NAME} on {node} already: {WHAT}", node)]
    src = layout.node_dir(node) / FILE
    write_if_changed(src, crafted(Path(MEMINFO).read_text()), 0o644)
    r = _ns(node, "mount", "--bind", str(src), MEMINFO)
    if r.returncode != 0:
        return [Result("lab.fault", Status.FAILED, f"{node}: mount --bind {src} {MEMINFO}: "
                                    f"{r.stderr.strip() or r.returncode}", node)]
    return [Result("lab.fault", Status.CHANGED, f"{NAME} on {node}: {WHAT}; `inv lab.fault none` restores it", node)]


def clear(nodes: list[str]) -> list[str]:
    """Unmount the crafted meminfo wherever it is bound; the nodes where it was."""
    done = []
    for node in nodes:
        if layout.mntns_path(node).exists() and mounted(node):
            _ns(node, "umount", MEMINFO)
            done.append(node)
    return done
