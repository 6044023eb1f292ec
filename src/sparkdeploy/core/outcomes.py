"""What every step returns: a status, one line of why, and details for boards and records."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    OK = "ok"  # already so, nothing done
    CHANGED = "changed"  # the step changed something
    SKIPPED = "skipped"  # not applicable, or dry run
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


@dataclass
class Result:
    step: str
    status: Status
    why: str
    node: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    superseded: bool = field(default=False, compare=False)
    """A failure the step recovered from later (an engine it fell back from): shown as it
    happened, not counted against the step's outcome (``StepContext.supersede``)."""

    @property
    def failed(self) -> bool:
        return self.status is Status.FAILED

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "node": self.node,
            "status": self.status.value,
            "why": self.why,
            "details": self.details,
        }


def final(results: list[Result]) -> list[Result]:
    """The last result per (step, node), in the order each was last reported: a later result
    for the same target supersedes an earlier one (an engine that failed, then the fallback
    that serves). What a step's outcome (and a task's exit) is judged by."""
    last: dict[tuple[str, str | None], Result] = {}
    for x in results:
        last.pop((x.step, x.node), None)
        last[(x.step, x.node)] = x
    return list(last.values())

