"""Task flags, checked before any work starts: a bad value exits 2 with one line naming the flag.

Every task takes its flags as strings (or None) and turns them into values here, so that invoke's
own type conversion (which raises a traceback on ``--timeout abc``) never runs, and every flag of
one kind (a count, a duration, a URL, an output file, node names) follows one rule.

Output files are checked up front (the directory must exist: missing directories are refused,
never created) and written whole or not at all (``sparkdeploy.core.files.write_atomic``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

from invoke import Task
from invoke import task as _invoke_task
from invoke.exceptions import Exit

from sparkdeploy.core import checks


def usage(flag: str, why: str) -> Exit:
    """The one-line usage error for ``flag`` (exit status 2)."""
    return Exit(f"{flag}: {why}", code=2)


class FlagTask(Task):
    """A task whose automatic short flags never take ``-h`` (which stays help everywhere)."""

    def arg_opts(self, name, default, taken_names):
        return super().arg_opts(name, default, taken_names | {"h"})


task = partial(_invoke_task, klass=FlagTask)
"""``@task`` for every sparkdeploy task (``-h`` is always help)."""


def integer(flag: str, value, *, default: int | None = None, min: int | None = None,
            max: int | None = None) -> int | None:
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        raise usage(flag, f"must be an integer, not {value!r}")
    try:
        v = int(str(value).strip())
    except ValueError:
        raise usage(flag, f"must be an integer, not {value!r}") from None
    if min is not None and v < min:
        raise usage(flag, f"must be >= {min}, not {v}")
    if max is not None and v > max:
        raise usage(flag, f"must be <= {max}, not {v}")
    return v


def number(flag: str, value, *, default: float | None = None, gt: float | None = None,
           min: float | None = None, max: float | None = None) -> float | None:
    if value is None or value == "":
        return default
    try:
        v = float(str(value).strip())
    except ValueError:
        raise usage(flag, f"must be a number, not {value!r}") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise usage(flag, f"must be a finite number, not {value!r}")
    if gt is not None and v <= gt:
        raise usage(flag, f"must be > {gt:g}, not {v:g}")
    if min is not None and v < min:
        raise usage(flag, f"must be >= {min:g}, not {v:g}")
    if max is not None and v > max:
        raise usage(flag, f"must be <= {max:g}, not {v:g}")
    return v


def choice(flag: str, value, allowed: Iterable[str]):
    allowed = list(allowed)
    if value is not None and value not in allowed:
        raise usage(flag, f"must be {' or '.join(allowed)}, not {value!r}")
    return value


def parsed(flag: str, value, parse: Callable, errors: tuple[type[Exception], ...] = (ValueError,)):
    """``parse(value)``; its ``errors`` (``ValueError`` by default) become a usage error."""
    try:
        return parse(value)
    except errors as e:
        raise usage(flag, str(e)) from None


def url(flag: str, value: str | None) -> str | None:
    return None if value is None else parsed(flag, value, checks.http_url)


def output_file(flag: str, value: str | None) -> Path | None:
    """An output path that can be written: its directory exists and takes a new file, and the
    path is not a directory. Checked by creating (and removing) a temporary file next to it."""
    if value is None or value == "":
        return None
    path = Path(value)
    if path.is_dir():
        raise usage(flag, f"{path} is a directory")
    parent = path.parent
    if not parent.is_dir():
        raise usage(flag, f"directory {parent} does not exist (create it first)")
    if path.exists() and not path.is_file():
        raise usage(flag, f"{path} is not a regular file")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    except OSError as e:
        raise usage(flag, f"cannot write in {parent}: {e.strerror}") from None
    os.close(fd)
    os.unlink(probe)
    return path


def input_file(flag: str, value: str) -> Path:
    path = Path(value)
    if not path.exists():
        raise usage(flag, f"{path}: no such file")
    if path.is_dir():
        raise usage(flag, f"{path}: is a directory")
    if not path.is_file():
        raise usage(flag, f"{path}: not a regular file (a FIFO, a device or a socket)")
    return path


def name_list(flag: str, value: str | None) -> list[str]:
    """``a,b`` as names (spaces around a name are dropped); an empty name (``a,,b``, ``,``) or
    one holding a control character is a usage error. None: no names."""
    if value is None:
        return []
    names = [n.strip(" ") for n in str(value).split(",")]
    for n in names:
        if not n:
            raise usage(flag, f"an empty name in {value!r} (NAME[,NAME...])")
        if checks.control_char(n) is not None:
            raise usage(flag, f"{n!r} holds a control character")
    return names


def node_names(flag: str, value: str | None, known: Iterable[str], *, allow_all: bool = True,
               what: str = "node") -> None:
    """Every name in ``value`` (``a,b`` or ``all``) must be one of ``known`` (the profile's
    nodes, or its workers: ``what``)."""
    known = list(known)
    if value is None or (allow_all and value == "all"):
        return
    for n in name_list(flag, value):
        if n not in known:
            raise usage(flag, f"no {what} named {n!r} ({what}s: {', '.join(known) or 'none'}"
                        + (", or all)" if allow_all else ")"))


NODES = "--nodes"
"""The one flag that selects nodes: ``--nodes a,b`` (or ``all``)."""


def nodes(value: str | None, **old: str | None) -> tuple[str, str | None]:
    """(the flag given, its value) for a task's node selection: ``--nodes``, or one of the
    task's other spellings ``old`` by parameter name (``node=`` for ``--node``, deprecated;
    ``to=`` for ``--to``, a destination). Two of them at once is a usage error."""
    given = [(NODES, value), *((f"--{k.replace('_', '-')}", v) for k, v in old.items())]
    given = [(f, v) for f, v in given if v is not None]
    if len(given) > 1:
        raise usage(given[0][0], f"the same as {given[1][0]}: give one of them")
    return given[0] if given else (NODES, None)


def deprecated(flag: str, value: str, then: str = "") -> None:
    """The one line a deprecated spelling of ``--nodes`` prints (on stderr, once the names are
    known good): what to use instead (``then``: what else that takes)."""
    print(f"{flag} is deprecated and goes in the next release: use --nodes {value}{then}",
          file=sys.stderr, flush=True)
