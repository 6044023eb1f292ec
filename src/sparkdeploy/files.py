"""Writing a file (or a directory) whole or not at all: the one place that renames into place."""

from __future__ import annotations

import filecmp
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def write_atomic(path: Path, write: Callable[[Path], None], mode: int | None = None) -> None:
    """Call ``write(tmp)`` for a temporary file next to ``path``, then rename it over ``path``
    (with ``mode`` set first, when given): a failure leaves no half-written file behind."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + path.suffix, dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str, mode: int | None = None) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text), mode)


def write_if_changed(path: Path, text: str, mode: int | None = 0o644) -> bool:
    """``path`` holds ``text`` (and ``mode``, when given) afterwards; True if it was written."""
    try:
        if path.read_text() == text:
            if mode is not None and (path.stat().st_mode & 0o777) != mode:
                os.chmod(path, mode)
            return False
    except (OSError, UnicodeDecodeError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text, mode)
    return True


def copy_if_changed(src: Path, dst: Path, mode: int) -> bool:
    """``dst`` is a copy of ``src`` with ``mode`` afterwards; True if it was copied."""
    if dst.exists() and filecmp.cmp(src, dst, shallow=False):
        return False
    write_atomic(dst, lambda tmp: shutil.copyfile(src, tmp), mode)
    return True


def replace_dir(target: Path, build: Callable[[Path], T]) -> T:
    """Call ``build(tmp)`` for a fresh directory next to ``target``, then put it in the place of
    ``target`` (an old ``target`` goes): a failure leaves ``target`` as it was."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        tmp.chmod(0o755)  # as a directory made by mkdir would be
        out = build(tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        return out
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def move_in(src: Path | str, dst: Path) -> None:
    """Rename ``src``, made whole beside ``dst`` (same filesystem), over ``dst``: for what a
    tool writes itself (a download, an archive, an unpacked tree) under a name its owner
    cleans up after a crash."""
    os.replace(src, dst)
