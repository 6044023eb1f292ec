"""Files on the controller: written whole or not at all (the one place that renames into
place), read only when regular and bounded, named only under their root."""

from __future__ import annotations

import filecmp
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TypeVar

from sparkdeploy.core.checks import control_char
from sparkdeploy.core.errors import RunError, UsageError

T = TypeVar("T")


def write_atomic(path: Path, write: Callable[[Path], object], mode: int | None = None) -> None:
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


class InputError(UsageError, ValueError):
    """A file that cannot be read as an input; ``str()`` is one line naming it."""


class OutputError(RunError):
    """An output file that could not be written; ``str()`` is one line naming it."""


def write_output(path: Path, text: str) -> None:
    """``write_text_atomic`` for a file the user asked for: ``OutputError`` when it fails."""
    try:
        write_text_atomic(path, text)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None


class Escape(UsageError, ValueError):
    """A name that would leave its root (absolute, ``..``, a symlink out, a control character)."""


MB = 1024 * 1024


def read_input(path: str | Path, *, limit: int, what: str = "file") -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    A FIFO, a device, a socket or a directory is refused without blocking (the file is opened
    non-blocking and checked before any read); so is a file larger than ``limit``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise InputError(f"{path}: is a directory, not a {what}")
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{path}: not a regular file (a FIFO, a device or a socket), "
                             f"not a {what}")
        if st.st_size > limit:
            raise InputError(f"{path}: {st.st_size} bytes, more than a {what} may hold "
                             f"({limit} bytes)")
        chunks, got = [], 0
        while got <= limit:
            b = os.read(fd, min(MB, limit + 1 - got))
            if not b:
                break
            chunks.append(b)
            got += len(b)
        if got > limit:
            raise InputError(f"{path}: more than a {what} may hold ({limit} bytes)")
        return b"".join(chunks)
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)


def under(root: str | Path, name: str) -> Path:
    """``root / name``, refused (``Escape``) unless it stays under ``root``: ``name`` is
    relative, has no empty, ``.`` or ``..`` part and no control character, and no symlink on
    the way leads out of ``root``."""
    root = Path(root)
    parts = PurePosixPath(name).parts
    if (not name or name.startswith("/") or control_char(name) is not None
            or any(p in ("", ".", "..") for p in name.split("/"))):
        raise Escape(f"{name!r} is not a name under {root}")
    full = root.joinpath(*parts)
    real_root = root.resolve()
    real = full.resolve()
    if real_root not in real.parents:
        raise Escape(f"{name!r} leads out of {root} (to {real})")
    return full
