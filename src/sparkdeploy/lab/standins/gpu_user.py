#!/usr/bin/env python3
"""Lab only: be a process that holds the stand-in GPU until it is stopped.

    python3 gpu_user.py NAME [SECONDS]

Registers this process as a GPU user (writes $SPARKDEPLOY_STANDIN_ROOT/gpu-users/<pid>
holding NAME and the process start time, which the nvidia-smi stand-in lists while the process
lives), then sleeps (forever unless SECONDS is given). SIGTERM/SIGINT/SIGHUP unregister and
exit 0; after a SIGKILL the stale entry is ignored because the PID is dead.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(os.environ.get("SPARKDEPLOY_STANDIN_ROOT") or "/var/lib/sparkdeploy-node/standins")


def _starttime(pid: int) -> str:
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return data[data.rindex(")") + 2 :].split()[19]


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print("usage: gpu_user.py NAME [SECONDS]", file=sys.stderr)
        return 2
    name = argv[0]
    seconds = float(argv[1]) if len(argv) > 1 else None
    users = ROOT / "gpu-users"
    users.mkdir(parents=True, exist_ok=True)
    entry = users / str(os.getpid())
    tmp = users / f".{os.getpid()}.tmp"
    tmp.write_text(f"{name}\n{_starttime(os.getpid())}\n")
    os.replace(tmp, entry)

    def leave(signum, frame):  # noqa: ARG001
        try:
            entry.unlink()
        except FileNotFoundError:
            pass
        os._exit(0)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, leave)
    deadline = None if seconds is None else time.monotonic() + seconds
    while deadline is None or time.monotonic() < deadline:
        time.sleep(3600 if deadline is None else max(0.0, min(3600, deadline - time.monotonic())))
    leave(None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
