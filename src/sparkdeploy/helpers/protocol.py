"""What every sparkdeploy node helper shares (standard library only; Python 3.8 or newer).

The dialect a helper speaks, read by the controller's ``nodeops`` (its one parser):

- on stdout, ``progress k=v ...`` lines while it works (``progress``: ``bytes`` done, ``total``
  expected, counts in digits, other values free text without spaces), ``<kind> {json}`` event
  lines from a helper that streams what it sees (``event``: the model receiver's ``state``,
  ``ready``, ``file``), and last its report: one JSON object (``answer``);
- on stderr, why it failed: an ``error: ...`` line and a non-zero exit (``fail``), and any other
  words for a log (``say``).

The one exception: a helper whose stdout IS a data stream (the ship's ``layer_export.py`` and
``save_filter.py``, piped into ``docker load`` on the peer) says its progress lines and, last,
its report on stderr (``stream=sys.stderr``); the controller reads them with the same parser.

It is also the helpers' one toolkit: ``write_atomic`` (the one way a helper replaces a file),
``Deadline`` (the one deadline a helper's loop keeps) and ``retry`` (the one retry).

On a node this file is staged one directory above each helper (``nodeops.stage_script``: the
helper lives in ``<stage>/<sha256 of this file>/<sha256 of the helper>/<helper>``) and is
checked against its sha256 before any helper runs; in a checkout it sits beside them. The
persisted supervisor (``serve_unit.py``, ``serve_watchdog.py``) has its copy beside it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
"""A content digest as Docker writes it (a diff ID, a config or blob digest)."""

_lock = threading.Lock()  # one line at a time from a helper's threads


def is_digest(value: object) -> bool:
    """``value`` is a ``sha256:<64 hex>`` digest (the name check of every layer a helper reads)."""
    return isinstance(value, str) and DIGEST_RE.match(value) is not None


def chain_ids(layers):
    """Chain IDs of an ordered list of diff IDs (the classic store's layer keys)."""
    out = []
    for diff in layers:
        if not out:
            out.append(diff)
        else:
            out.append("sha256:" + hashlib.sha256((out[-1] + " " + diff).encode()).hexdigest())
    return out


def say(text: str, stream=None) -> None:
    """One line on stderr (or ``stream``), whole even when threads write at once."""
    out = stream or sys.stderr
    with _lock:
        out.write(text + "\n")
        out.flush()


def progress(stream=None, **counts: object) -> None:
    """One ``progress k=v ...`` line (values hold no space) on stdout (or ``stream``)."""
    say("progress " + " ".join(f"{k}={str(v).replace(' ', '_')}" for k, v in counts.items()),
        stream or sys.stdout)


def event(kind: str, data: object) -> None:
    """One ``<kind> {json}`` event line on stdout: what a streaming helper saw, as it sees it."""
    say(f"{kind} {json.dumps(data, sort_keys=True)}", sys.stdout)


def fail(why: str, code: int = 1) -> int:
    """Say why the helper failed (``error: why`` on stderr); the exit code to return."""
    say(f"error: {why}")
    return code


def answer(report: object, stream=None) -> None:
    """The helper's report: one JSON object, the last line of stdout (``stream``: the data
    stream helpers' stderr)."""
    say(json.dumps(report, sort_keys=True), stream or sys.stdout)


def run(argv: list[str], timeout: float = 30) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a node tool; a missing or hung tool is an exit code too."""
    try:
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                            stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return 127, "", f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"{argv[0]}: no answer in {timeout:g}s"
    except OSError as e:
        return 126, "", f"{argv[0]}: {e.strerror}"
    return cp.returncode, cp.stdout, cp.stderr


def read(path: str) -> str | None:
    """A small file's text, stripped (None when it cannot be read)."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


# --- the toolkit: one atomic write, one deadline, one retry ----------------------------------


def write_atomic(path: str, text: str, mode: int | None = None) -> None:
    """``text`` into ``path``, whole or not at all: a part file of this process beside it,
    renamed over it (a reader sees the old file or the new one), with ``mode`` set first when
    given. OSError when it cannot, the part file gone."""
    part = f"{path}.part.{os.getpid()}"
    try:
        with open(part, "w", encoding="utf-8") as out:
            out.write(text)
        if mode is not None:
            os.chmod(part, mode)
        os.replace(part, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(part)
        raise


class Deadline:
    """``seconds`` from now on ``clock`` (the monotonic clock): what is ``left()`` of it, and
    whether it has ``passed()``."""

    def __init__(self, seconds: float, clock=time.monotonic):
        self.clock = clock
        self.end = clock() + seconds

    def left(self) -> float:
        return max(self.end - self.clock(), 0.0)

    def passed(self) -> bool:
        return self.clock() > self.end


def retry(attempt, *, errors=(Exception,), tries: int | None = None,
          deadline: Deadline | None = None, pause=lambda n: 0.0, on_error=None,
          sleep=time.sleep):
    """``attempt()`` again while it raises one of ``errors``: at most ``tries`` times, or
    until ``deadline`` has passed; ``on_error(n, error)`` is told of the n-th failure, then
    ``pause(n)`` seconds pass before the next try. What ``attempt()`` returns, or its last
    error once no try is left (any other error at once)."""
    n = 0
    while True:
        n += 1
        try:
            return attempt()
        except errors as e:
            if on_error is not None:
                on_error(n, e)
            if (tries is not None and n >= tries) or (deadline is not None and deadline.passed()):
                raise
        sleep(pause(n))
