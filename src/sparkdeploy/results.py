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


def ok(step: str, why: str, node: str | None = None, **details: Any) -> Result:
    return Result(step, Status.OK, why, node, details)


def changed(step: str, why: str, node: str | None = None, **details: Any) -> Result:
    return Result(step, Status.CHANGED, why, node, details)


def skipped(step: str, why: str, node: str | None = None, **details: Any) -> Result:
    return Result(step, Status.SKIPPED, why, node, details)


def failed(step: str, why: str, node: str | None = None, **details: Any) -> Result:
    return Result(step, Status.FAILED, why, node, details)
