"""Work side by side: the one place threads are pooled.

``each(fn, items)`` runs ``fn`` over ``items`` at once and gives the results in order (the
first exception is raised once all have ended); ``together(f, g)`` is that for a few calls;
``pool(n)`` is the executor itself, for work submitted as it comes (the deploy graph, the
streams of a sync)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="sparkdeploy")


def each(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    items = list(items)
    if len(items) <= 1:
        return [fn(x) for x in items]
    with pool(len(items)) as p:
        futs = [p.submit(fn, x) for x in items]
        return [f.result() for f in futs]


def together(*calls: Callable[[], Any]) -> list[Any]:
    """Each of ``calls`` at once; their results in order."""
    return each(lambda call: call(), calls)
