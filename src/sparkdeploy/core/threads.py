"""Work side by side: the one place threads are pooled.

``pool(n)`` is the executor: for work submitted as it comes (the deploy graph, the streams of
a sync), and for work known at once, ``with pool(len(items)) as p: list(p.map(fn, items))``:
the results in order, the first exception (in that order) raised once all have ended. A step
fans out over nodes with ``StepContext.each``, which is built on it; code without a step's
context, or whose next move needs every answer (an unreachable node stops it), maps over the
pool itself."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="sparkdeploy")
