"""What a run knows of its nodes: each fact (the images a node holds, the state of its units)
gathered once per node per run, through the node's ``Host``, and kept until a step reports a
change on that node (then the next look gathers it again).

The deploy plan's fingerprints read their facts here, so a fingerprint taken twice (a reuse
step's before and after) or by several steps asks each node once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.node.hosts import Host

T = TypeVar("T")


class Facts:
    """One run's snapshot of node facts, by (node, what)."""

    def __init__(self, hosts: Mapping[str, Host]):
        self._hosts = hosts
        self._known: dict[tuple[str, str], Any] = {}
        self._era: dict[str, int] = {}
        self._gathering: dict[tuple[str, str], threading.Lock] = {}
        self._lock = threading.Lock()  # never held while a command runs

    def get(self, node: str, what: str, gather: Callable[[Host], T]) -> T:
        """The fact ``what`` of ``node``: ``gather(host)`` the first time (once, however many
        threads ask at once), the same answer after that until the node is forgotten."""
        key = (node, what)
        with self._lock:
            if key in self._known:
                return self._known[key]
            busy = self._gathering.setdefault(key, threading.Lock())
        with busy:
            with self._lock:
                if key in self._known:
                    return self._known[key]
                era = self._era.get(node, 0)
            value = gather(self._hosts[node])
            with self._lock:
                if self._era.get(node, 0) == era:  # not forgotten while it was gathered
                    self._known[key] = value
            return value

    def forget(self, node: str | None) -> None:
        """Drop what is known of ``node`` (None: of every node)."""
        with self._lock:
            nodes = [node] if node is not None else list(self._hosts)
            for n in nodes:
                self._era[n] = self._era.get(n, 0) + 1
            for key in [k for k in self._known if k[0] in nodes]:
                del self._known[key]

    def heard(self, event: object) -> None:
        """An event listener: a step's ``changed`` result forgets its node (all, without one)."""
        if isinstance(event, Result) and event.status is Status.CHANGED:
            self.forget(event.node)
