"""The one task driver: every task loads its deployment, takes the lock, renders the event
stream, runs its work and turns errors into exit codes through ``drive``.

``drive`` is the only place an error becomes an exit status (``exits``): any
``sparkdeploy.core.errors.Error`` is its one line and its ``code`` (a bad profile, plan or input file
exits 2, a node that cannot be reached, a held lock, a wait that ran out or a broken record
exits 1). Every run ends with the recap (``recap``): per node, the
counts of ok/changed/skipped/failed results."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, TextIO

from invoke import Context
from invoke.exceptions import Exit

from sparkdeploy.core.errors import Error
from sparkdeploy.core.events import EventSink, printable, rendering
from sparkdeploy.core.outcomes import Result
from sparkdeploy.core.state import StateDir
from sparkdeploy.node.deployment import Deployment, from_context, state_dir
from sparkdeploy.profile.config import ProfileError
from sparkdeploy.steps.registry import run_one
from sparkdeploy.tasks._flags import NODES, deprecated, node_names, usage

Work = Callable[[Deployment | None, EventSink], list[Result]]
"""A task's work: ``work(dep, events) -> results`` (dep None for work without a profile), each
result already on ``events``; it runs steps only through ``run_one`` (``steps/registry.py``)."""

@contextmanager
def exits(name: str = "") -> Iterator[None]:
    """The one place an error becomes an exit: an ``Error``'s one line (after ``name: `` when
    given) and its ``code`` (a usage error 2, any other 1); anything else is a bug and keeps its
    traceback."""
    lead = f"{name}: " if name else ""
    try:
        yield
    except BrokenPipeError:
        # the reader went away (`inv profile.check | head -1`): nothing more to say, no traceback;
        # what is still buffered goes nowhere rather than failing again at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise Exit(code=1) from None
    except Error as e:
        raise Exit(f"{lead}{e}", code=e.code) from None


def failed_count(results: Iterable[Result]) -> str | None:
    """The default verdict: how many results failed and were not superseded, or None."""
    bad = [r for r in results if r.failed and not r.superseded]
    return f"{len(bad)} step(s) failed" if bad else None


def drive(c: Context, name: str, work: Work, *, profile: str | None = None,
          deployment: Literal["needed", "optional", "none"] = "needed", lock: bool = True,
          live: bool = True, prepare: Callable[[Deployment], None] | None = None,
          show: Callable[[Deployment | None, list[Result]], None] | None = None,
          verdict: Callable[[list[Result]], str | None] = failed_count,
          recipe: str | None = None, recipe_dirs: tuple[str, ...] = (),
          out: TextIO | None = None) -> list[Result]:
    """Run a task: load the deployment (``deployment``: "needed"; "optional": None when the
    profile cannot be loaded; "none": never read), ``prepare(dep)`` (checks of the task's flags
    against the profile, a plan shown before it runs), then ``work(dep, events)`` with its event
    stream rendered as it happens (live on a terminal, plain lines otherwise; ``live=False`` for
    work that asks questions) under the deployment's lock ``name`` (unless ``lock`` is False or
    the run is dry), then the recap (``recap``: per node, the counts of ok/changed/skipped/failed
    results), then ``show(dep, results)`` (tables, a record, a profile printed last so that it
    can be redirected to a file and cut from the end), and exit 1 with
    ``verdict(results)`` when it names a failure. Errors exit as ``exits`` says. ``recipe``:
    deploy that recipe's model part instead of the profile's (``recipe_dirs``: owners' recipes).
    ``out``: where the stream and the recap go (``sys.stderr`` for a task whose stdout is one
    JSON document)."""
    with exits():
        dep: Deployment | None = None
        if deployment != "none":
            # validated once, here: a state dir that is a file is one usage line, not a traceback
            why = StateDir(state_dir(c)).problem()
            if why:
                raise usage("sparkdeploy.state_dir", why)
            try:
                dep = load(c, profile, recipe, recipe_dirs)
            except ProfileError:
                if deployment == "needed" or recipe is not None:  # a recipe asked for is needed
                    raise
        if dep is not None and prepare is not None:
            prepare(dep)
        events = dep.events if dep is not None else EventSink()
        with rendering(events, out, live=live):
            if lock and dep is not None and not dep.dry:
                with dep.state.lock(name):
                    results = work(dep, events)
            else:
                results = work(dep, events)
        recap(results, out)
        if show is not None:
            show(dep, results)
        sys.stdout.flush()  # a reader that went away is a BrokenPipeError here, not at exit
    why = verdict(results)
    if why:
        raise Exit(why, code=1)
    return results


def load(c: Context, profile: str | None = None, recipe: str | None = None,
         recipe_dirs: tuple[str, ...] = ()) -> Deployment:
    """The deployment of invoke's config (``profile`` wins); a bad profile raises
    ``ProfileError`` (``drive`` makes it an exit)."""
    return from_context(c, profile, recipe, recipe_dirs)


def run_step(c: Context, name: str, *, profile: str | None = None, lock: bool = True,
             show: Callable[[Deployment, list[Result]], None] | None = None,
             live: bool = True, first: tuple[str, ...] = (), flag: str = NODES,
             then: str = "", recipe: str | None = None, recipe_dirs: tuple[str, ...] = (),
             after: tuple[str, ...] = (), **options: Any) -> list[Result]:
    """``drive`` the registered step ``name`` with ``options``. ``first``: steps (of those
    ``name`` needs) run before it, without options; a failure there and ``name`` does not run.
    A node name no node of the profile has (``node=``, or ``to=`` naming workers; ``flag`` is
    the flag the user gave them with) or an unknown ``engine=`` is a usage error (exit 2); ``after``:
    steps run once ``name`` succeeded, without options (``serve.up`` then ``metrics.up``); a
    deprecated spelling of ``--nodes`` says so in one line once the names are good (``then``:
    what else the new spelling takes). ``recipe``: the deployment of that recipe's model part
    (as ``deploy.all --recipe``)."""

    def prepare(dep: Deployment) -> None:
        # node-name flags: an unknown name is a usage error; to= names the head's peers (workers)
        if options.get("node") is not None:
            node_names(flag, options["node"], dep.hosts)
        if options.get("to") is not None:
            node_names(flag, options["to"], [n.name for n in dep.profile.workers], what="worker")
        selected = options.get("node", options.get("to"))
        if flag not in (NODES, "--to") and selected is not None:
            deprecated(flag, selected, then)
        engines = [e.name for e in dep.profile.engines]
        if options.get("engine") is not None and options["engine"] not in engines:
            raise usage("--engine", f"no engine named {options['engine']!r} "
                        f"(engines: {', '.join(engines)})")

    def work(dep: Deployment | None, events: EventSink) -> list[Result]:
        results: list[Result] = []
        for before in first:
            results += run_one(dep, before)
            if any(r.failed and not r.superseded for r in results):
                return results
        results += run_one(dep, name, **options)
        for then_step in after:
            if any(r.failed and not r.superseded for r in results):
                break
            results += run_one(dep, then_step)
        return results

    def shown(dep: Deployment | None, results: list[Result]) -> None:
        if show is not None and dep is not None:  # a step runs on a deployment
            show(dep, results)

    return drive(c, name, work, profile=profile, lock=lock, live=live, prepare=prepare,
                 show=shown, recipe=recipe, recipe_dirs=recipe_dirs)


def recap_lines(results: Iterable[Result]) -> list[str]:
    """The recap (Ansible's PLAY RECAP): per node, in the order each first reported, the
    counts of its ok/changed/skipped/failed results; ``-`` for results without a node, last.
    A failure the step recovered from (superseded: an engine it fell back from) is not
    counted, as it does not count for the exit status."""
    counts: dict[str | None, dict[str, int]] = {}
    for r in results:
        c = counts.setdefault(r.node, {"ok": 0, "changed": 0, "skipped": 0, "failed": 0})
        if not r.superseded:
            c[r.status.value] += 1
    if not counts:
        return []
    order = [n for n in counts if n is not None] + ([None] if None in counts else [])
    width = max([8, *(len(n) for n in order if n is not None)])
    lines = ["recap:"]
    for n in order:
        c = counts[n]
        lines.append(printable(f"  {n or '-':<{width}} ok={c['ok']:<3} changed={c['changed']:<3} "
                               f"skipped={c['skipped']:<3} failed={c['failed']}"))
    return lines


def recap(results: Iterable[Result], out: TextIO | None = None) -> None:
    """Print the recap after the results (plain lines, on a terminal and off it)."""
    for line in recap_lines(results):
        print(line, flush=True, file=out or sys.stdout)


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
