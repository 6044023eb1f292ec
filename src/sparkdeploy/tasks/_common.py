"""What every task shares: load the deployment (errors become one-line exits), render results."""

from __future__ import annotations

from collections.abc import Iterable

from invoke import Context
from invoke.exceptions import Exit

from sparkdeploy.config import ProfileError
from sparkdeploy.deployment import Deployment, from_context
from sparkdeploy.events import describe, rendering
from sparkdeploy.hosts import HostError
from sparkdeploy.nodeops import NodeUnreachable
from sparkdeploy.results import Result
from sparkdeploy.state import LockHeld
from sparkdeploy.tasks._flags import node_names


def load(c: Context, profile: str | None = None) -> Deployment:
    try:
        return from_context(c, profile)
    except ProfileError as e:
        raise Exit(str(e), code=2) from None


def summarize(results: Iterable[Result]) -> None:
    """Exit 1 naming how many results failed (the results themselves were already shown)."""
    bad = [r for r in results if r.failed]
    if bad:
        raise Exit(f"{len(bad)} step(s) failed", code=1)


def render(results: Iterable[Result], title: str | None = None) -> None:
    """Show results not streamed (plain lines), then exit 1 if any failed."""
    results = list(results)
    for r in results:
        print(describe(r), flush=True)
    summarize(results)


def run_step(c: Context, fn, *args, profile: str | None = None, lock: bool = True, title=None,
             nodes: tuple[str, str | None] | None = None, **kwargs) -> list[Result]:
    """Load the deployment, hold the lock (unless dry or read-only), run the step with its
    event stream rendered as it happens (live on a terminal, plain lines otherwise).

    ``nodes=("--node", value)``: the flag's node names are checked against the profile first
    (an unknown name is a usage error, exit 2)."""
    dep = load(c, profile)
    if nodes is not None:
        node_names(nodes[0], nodes[1], dep.hosts)
    with rendering(dep.events):
        try:
            if lock and not dep.dry:
                with dep.state.lock(title or getattr(fn, "__name__", "step")):
                    results = fn(dep, *args, **kwargs)
            else:
                results = fn(dep, *args, **kwargs)
            for r in results:
                if not dep.events.seen(r):
                    dep.events.emit(r)
        except (HostError, LockHeld, ProfileError, NodeUnreachable) as e:
            raise Exit(str(e), code=1) from None
    summarize(results)
    return results
