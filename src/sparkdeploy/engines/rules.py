"""The words an engine kind's diagnosis rules are written in (``Kind.diagnosis``): a pattern
guarded by cheap keys, a rule giving a failure class with its priority and one line of why.
``sparkdeploy.diagnose`` runs every kind's rules with its own over an engine's logs."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Pat:
    """A regular expression guarded by cheap keys: it is tried only on a line whose lowercase text
    contains one of ``keys`` (logs run to hundreds of thousands of lines; most match nothing)."""

    regex: re.Pattern
    keys: tuple[str, ...]

    def search(self, line: str, low: str | None = None) -> bool:
        low = line.lower() if low is None else low
        return any(k in low for k in self.keys) and self.regex.search(line) is not None


def pat(regex: str, *keys: str, icase: bool = True) -> Pat:
    return Pat(re.compile(regex, re.IGNORECASE if icase else 0), keys)


@dataclass(frozen=True)
class Rule:
    """A line matching ``pattern`` is evidence of ``cls`` at ``priority`` (higher wins).

    ``context``: the rule holds only when this also matches one of the ``window`` lines before
    (a bare ``KeyError`` is a model type only inside transformers' config lookup).
    ``void_after``: the rule does not hold when this matches a later line of the same log
    (NCCL finding no RDMA device is harmless once NCCL init completed).
    """

    cls: str
    priority: int
    pattern: Pat
    why: str
    context: Pat | None = None
    window: int = 12
    void_after: Pat | None = None

READY = pat(r"Application startup complete|The server is fired up and ready to roll|Uvicorn running on",
            "startup complete", "ready to roll", "uvicorn running")
"""What the engines print once their API serves (a failure seen before it may be void after)."""
