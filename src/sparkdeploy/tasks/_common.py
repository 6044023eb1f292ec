"""What every task shares: load the deployment (errors become one-line exits), render results."""

from __future__ import annotations

import sys
from collections.abc import Iterable

from invoke import Context
from invoke.exceptions import Exit

from sparkdeploy.config import ProfileError
from sparkdeploy.deployment import Deployment, from_context
from sparkdeploy.hosts import HostError
from sparkdeploy.results import Result, Status
from sparkdeploy.state import LockHeld

_STYLE = {Status.OK: "green", Status.CHANGED: "yellow", Status.SKIPPED: "cyan",
          Status.FAILED: "bold red"}


def load(c: Context, profile: str | None = None) -> Deployment:
    try:
        return from_context(c, profile)
    except ProfileError as e:
        raise Exit(str(e), code=2) from None


def render(results: Iterable[Result], title: str | None = None) -> None:
    """A rich table on a terminal, plain lines otherwise; exit 1 if any step failed."""
    results = list(results)
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, show_lines=False)
        for col in ("status", "step", "node", "why"):
            table.add_column(col, overflow="fold")
        for r in results:
            table.add_row(f"[{_STYLE[r.status]}]{r.status}[/]", r.step, r.node or "-", r.why)
        Console().print(table)
    else:
        for r in results:
            print(f"{r.status.value:<8} {r.step:<20} {r.node or '-':<10} {r.why}", flush=True)
    bad = [r for r in results if r.failed]
    if bad:
        raise Exit(f"{len(bad)} step(s) failed", code=1)


def run_step(c: Context, fn, *args, profile: str | None = None, lock: bool = True, title=None,
             **kwargs) -> list[Result]:
    """Load the deployment, hold the lock (unless dry or read-only), run the step, render."""
    dep = load(c, profile)
    try:
        if lock and not dep.dry:
            with dep.state.lock(title or getattr(fn, "__name__", "step")):
                results = fn(dep, *args, **kwargs)
        else:
            results = fn(dep, *args, **kwargs)
    except (HostError, LockHeld, ProfileError) as e:
        raise Exit(str(e), code=1) from None
    render(results, title)
    return results
