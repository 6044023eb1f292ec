"""The lab's machine-wide state: ``/var/lib/sparkdeploy/lab/state.json``, under a lock.

Written after every component, so a killed ``lab.up`` leaves a record that the next
``lab.up`` or ``lab.down`` (from any checkout) can use.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sparkdeploy.core.files import write_text_atomic
from sparkdeploy.lab import layout
from sparkdeploy.lab.proc import LabError

VERSION = 1


def empty() -> dict[str, Any]:
    return {"version": VERSION, "nodes": {}, "created_paths": [], "engine": None}


def load(path: Path = layout.STATE_FILE) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return empty()
    except (OSError, ValueError) as e:
        raise LabError(f"{path}: unreadable lab state ({e}); run lab.down to clear it") from None
    if data.get("version") != VERSION:
        raise LabError(f"{path}: lab state version {data.get('version')!r}, expected {VERSION}; "
                       "run lab.down with the checkout that made it")
    base = empty()
    base.update(data)
    return base


def save(data: dict[str, Any], path: Path = layout.STATE_FILE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


@contextmanager
def locked(path: Path = layout.LOCK_FILE) -> Iterator[None]:
    """One lab.up/lab.down at a time on this machine."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LabError(f"another lab.up or lab.down holds {path}") from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
