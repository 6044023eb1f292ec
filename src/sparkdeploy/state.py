"""The controller's state dir: the run journal and the run lock (its records: ``sparkdeploy.records``)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sparkdeploy.errors import RunError

REDACTED = "***"
_WORD = r"(?:api[_-]?key|token|secret|password|passwd)"
"""What names a secret: a key or flag whose name ends in one of these (``HF_TOKEN``,
``--api-key``, ``"rsync_password"``; ``max_tokens`` does not)."""
_FORMS: list[tuple[re.Pattern[str], str]] = [
    # an HF token anywhere
    (re.compile(r"\bhf_[A-Za-z0-9]{8,}\b"), REDACTED),
    # a URL's credentials: scheme://user:password@ -> user:***@, scheme://token@ -> ***@
    (re.compile(r"\b([a-z][a-z0-9+.-]*://)([^\s/@:]+):[^\s/]*@", re.I), rf"\1\2:{REDACTED}@"),
    (re.compile(r"\b([a-z][a-z0-9+.-]*://)[^\s/@:]+@", re.I), rf"\1{REDACTED}@"),
    # an Authorization value
    (re.compile(r"\b(Bearer|Basic)\s+[A-Za-z0-9._~+/=-]+", re.I), rf"\1 {REDACTED}"),
    # a quoted key and its quoted value (JSON, a Python repr): "HF_TOKEN": "..."
    (re.compile(r"""(["'])([\w-]*""" + _WORD + r"""(?![A-Za-z0-9]))\1(\s*:\s*)(["'])(?:\\.|(?!\4).)*\4""",
                re.I), rf"\1\2\1\3\4{REDACTED}\4"),
    # a flag and its value: --api-key X, --api-key=X, --hf-token 'X'
    (re.compile(r"""(--?[\w-]*""" + _WORD + r"""(?![\w-]))(=|\s+)('[^']*'|"[^"]*"|[^\s'"]+)""", re.I),
     rf"\1\2{REDACTED}"),
    # KEY=value (an environment assignment)
    (re.compile(r"""\b(\w*""" + _WORD + r"""(?![A-Za-z0-9]))=('[^']*'|"[^"]*"|\S+)""", re.I),
     rf"\1={REDACTED}"),
]
_SECRET_FLAG = re.compile(r"--?[\w-]*" + _WORD, re.I)


_SECRET_NAME = re.compile(_WORD + r"(?![A-Za-z0-9])|(?:^|_)(?:key|credentials?)(?![A-Za-z0-9])",
                          re.I)


def is_secret_name(name: str) -> bool:
    """A variable whose value is a secret: its name holds one of the words above, or a ``KEY``
    or ``CREDENTIALS`` part (``HF_TOKEN``, ``S3_ACCESS_KEY``; not ``MAX_TOKENS``, ``KEYBOARD``)."""
    return bool(_SECRET_NAME.search(name))


def redact(text: str) -> str:
    """Hide what looks like a secret: HF tokens anywhere, a URL's credentials, Bearer/Basic
    values, quoted ``"KEY": "value"`` and ``KEY=value`` for secret keys, ``--secret-flag value``."""
    for form, replacement in _FORMS:
        text = form.sub(replacement, text)
    return text


def redact_values(data: Any) -> Any:
    """``data`` (parsed JSON or YAML) with the value of every secret-named key
    (``is_secret_name``: an engine env's ``HF_TOKEN``) shown as ``***``, at any depth."""
    if isinstance(data, dict):
        return {k: REDACTED if isinstance(k, str) and is_secret_name(k) and v is not None
                else redact_values(v) for k, v in data.items()}
    if isinstance(data, list):
        return [redact_values(v) for v in data]
    return data


def redact_argv(argv: Iterable[str]) -> list[str]:
    """Each argument redacted, and the argument after a secret flag (``--api-key X``)."""
    out: list[str] = []
    for a in argv:
        out.append(REDACTED if out and _SECRET_FLAG.fullmatch(out[-1]) else redact(a))
    return out


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
        entry = dict(entry)
        if "argv" in entry:
            entry["argv"] = redact_argv(entry["argv"])
        for key in ("stdout", "stderr"):
            if key in entry and isinstance(entry[key], str):
                entry[key] = redact(entry[key])[-2000:]
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
