"""What steps share, per domain, below the steps: the containers and units of a served engine,
its bring-up and watch, the model's metadata and transfers, the chosen image, the node's units
and GPU.

A module here never imports ``sparkdeploy.steps`` (the registry included), ``runner`` or
``tasks``: a step calls into ops, never the other way. Code here that reports as part of a
running step takes that step's context as a ``Ctx``: what ``StepContext`` offers, by shape."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from sparkdeploy.core.outcomes import Result
    from sparkdeploy.node.deployment import Deployment
    from sparkdeploy.node.hosts import Host, NodeUnreachable

T = TypeVar("T")


class Ctx(Protocol):
    """The running step's context (``steps.registry.StepContext``), as ops code reports through it."""

    name: str
    results: list[Result]

    @property
    def dep(self) -> Deployment: ...

    @property
    def dry(self) -> bool: ...

    def report(self, result: Result) -> Result: ...

    def ok(self, why: str, node: str | None = None, **details: Any) -> Result: ...

    def changed(self, why: str, node: str | None = None, **details: Any) -> Result: ...

    def skipped(self, why: str, node: str | None = None, **details: Any) -> Result: ...

    def failed(self, why: str, node: str | None = None, **details: Any) -> Result: ...

    def would(self, what: str, node: str | None = None, **details: Any) -> Result: ...

    def supersede(self, results: Iterable[Result]) -> None: ...

    def unreachable(self, e: NodeUnreachable, **details: Any) -> Result: ...

    def progress(self, node: str | None, done: float, total: float | None = None,
                 unit: str = "B", note: str = "") -> None: ...

    def log(self, node: str | None, text: str) -> None: ...

    def each(self, hosts: Iterable[Host], fn: Callable[[Host], T], *,
             parallel: bool = False) -> list[T | None]: ...
