"""What every task shares: load the deployment (errors become one-line exits), run a registered
step with its event stream rendered as it happens."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

from invoke import Context
from invoke.exceptions import Exit

from sparkdeploy.config import ProfileError
from sparkdeploy.deployment import Deployment, from_context
from sparkdeploy.events import EventSink, describe, rendering
from sparkdeploy.hosts import HostError
from sparkdeploy.records import RecordError
from sparkdeploy.results import Result
from sparkdeploy.state import LockHeld
from sparkdeploy.steps.registry import StepContext, run_one
from sparkdeploy.tasks._flags import node_names, usage
from sparkdeploy.wait import WaitTimeout


def load(c: Context, profile: str | None = None) -> Deployment:
    try:
        return from_context(c, profile)
    except ProfileError as e:
        raise Exit(str(e), code=2) from None


def summarize(results: Iterable[Result]) -> None:
    """Exit 1 naming how many results failed and were not superseded (the results themselves
    were already shown)."""
    bad = [r for r in results if r.failed and not r.superseded]
    if bad:
        raise Exit(f"{len(bad)} step(s) failed", code=1)


def render(results: Iterable[Result], title: str | None = None) -> None:
    """Show results not streamed (plain lines), then exit 1 if any failed."""
    results = list(results)
    for r in results:
        print(describe(r), flush=True)
    summarize(results)


def run_step(c: Context, name: str, *, profile: str | None = None, lock: bool = True,
             show: Callable[[Deployment, list[Result]], None] | None = None,
             live: bool = True, first: tuple[str, ...] = (), **options: Any) -> list[Result]:
    """Run the registered step ``name`` with ``options``: load the deployment, hold the lock
    (unless dry or read-only), render the event stream as it happens (live on a terminal,
    plain lines otherwise; ``live=False`` for a step that asks questions), then
    ``show(dep, results)`` (a table) and exit 1 on a failure. ``first``: steps (of those
    ``name`` needs) run before it, without options; a failure there and ``name`` does not run.

    A bad profile or node name (``node=``/``to=`` options, named as their flag) exits 2;
    a node that cannot be reached, a held lock, a wait that ran out or a broken record exits 1;
    each with one line."""
    dep = load(c, profile)
    # node-name flags: an unknown name is a usage error; --to names the head's peers (workers)
    if "node" in options:
        node_names("--node", options["node"], dep.hosts)
    if "to" in options:
        node_names("--to", options["to"], [n.name for n in dep.profile.workers], what="worker")
    engines = [e.name for e in dep.profile.engines]
    if options.get("engine") is not None and options["engine"] not in engines:
        raise usage("--engine", f"no engine named {options['engine']!r} (engines: {', '.join(engines)})")
    with rendering(dep.events, live=live):
        try:
            if lock and not dep.dry:
                with dep.state.lock(name):
                    results = _run_after(dep, first, name, options)
            else:
                results = _run_after(dep, first, name, options)
        except ProfileError as e:
            raise Exit(str(e), code=2) from None
        except (HostError, LockHeld, WaitTimeout, RecordError) as e:
            raise Exit(str(e), code=1) from None
    if show is not None:
        show(dep, results)
    summarize(results)
    return results


def _run_after(dep: Deployment, first: tuple[str, ...], name: str,
               options: dict[str, Any]) -> list[Result]:
    results: list[Result] = []
    for before in first:
        results += run_one(dep, before)
        if any(r.failed and not r.superseded for r in results):
            return results
    return results + run_one(dep, name, **options)


def stream(name: str, fn: Callable[..., None], *args: Any,
           show: Callable[[list[Result]], None] | None = None, live: bool = True,
           **kwargs: Any) -> list[Result]:
    """Run ``fn(ctx, *args, **kwargs)``, work that needs no deployment, reporting as ``name``
    through ``ctx`` with its event stream rendered as for a step; then ``show(results)`` and
    exit 1 on a failure."""
    ctx = StepContext(name, EventSink())
    with rendering(ctx.events, live=live):
        fn(ctx, *args, **kwargs)
    results = ctx.results
    if show is not None:
        show(results)
    summarize(results)
    return results


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """A table after a step's stream: rich on a terminal, tab-separated lines otherwise."""
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for col in header:
            t.add_column(col)
        for row in rows:
            t.add_row(*row)
        Console().print(t)
        return
    print("\t".join(header), flush=True)
    for row in rows:
        print("\t".join(row), flush=True)
