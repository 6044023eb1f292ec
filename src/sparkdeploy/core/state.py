"""The controller's state dir: the run journal and the run lock (its records: ``sparkdeploy.core.records``)."""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sparkdeploy.core.errors import RunError
from sparkdeploy.core.redaction import redact


class LockHeld(RunError):
    pass


class StateDir:
    """One directory on the controller holding everything sparkdeploy remembers."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def problem(self) -> str | None:
        """Why this path cannot be the state dir (it, or a directory above it, exists and is
        not a directory), or None: checked once, before a task touches it."""
        for p in (self.path, *self.path.parents):
            if p.exists() or p.is_symlink():
                if p.is_dir():
                    return None
                kind = "a regular file" if p.is_file() else "not a directory"
                return (f"{p}: is {kind}, not a directory" if p == self.path
                        else f"{p} (above {self.path}): is {kind}, not a directory")
        return None

    def ensure(self) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        return self.path

    # -- journal ---------------------------------------------------------------------------
    @property
    def journal_path(self) -> Path:
        return self.path / "journal.jsonl"

    def journal(self, entry: dict[str, Any]) -> None:
        """Append one command record; secrets are redacted before anything is written."""
        self.ensure()
        entry = redact(dict(entry))
        for key in ("stdout", "stderr"):
            if key in entry and isinstance(entry[key], str):
                entry[key] = entry[key][-2000:]
        entry.setdefault("ts", time.time())
        line = json.dumps(entry, sort_keys=True)
        with open(self.journal_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    # -- lock -------------------------------------------------------------------------------
    @contextmanager
    def lock(self, what: str = "sparkdeploy", name: str = "lock") -> Iterator[None]:
        """Hold the deployment lock; a second concurrent run fails at once, naming the holder.

        ``name``: another lock file, for work that may run beside the rest (model.sync runs
        while model.download does)."""
        self.ensure()
        p = self.path / name
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another run"
                raise LockHeld(f"{p} is held by {holder}; wait for it or stop it") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} ({what})".encode(), 0)
            try:
                yield
            finally:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
