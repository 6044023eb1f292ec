"""`inv lab.*`: the rehearsal lab (Linux, root): simulated Spark nodes on this machine."""

import sys

from invoke import Collection
from invoke.exceptions import Exit

from sparkdeploy.lab import faults, layout, lifecycle
from sparkdeploy.tasks import _flags as flags
from sparkdeploy.tasks._common import render
from sparkdeploy.tasks._flags import task


@task(help={"nodes": "how many nodes (spark1..sparkN; default 2)",
            "seed_worker": "also give the workers the derivative's base image (delta-ship tests)",
            "engine": "docker26 (default), classic20 (bookworm's 20.10) or containerd "
                      "(Docker 26 on the containerd image store)"})
def up(c, nodes=None, engine=layout.DEFAULT_ENGINE, seed_worker=False):
    """Bring the lab up, or check it is up (idempotent; says what changed)."""
    nodes = flags.integer("--nodes", nodes, default=2, min=1, max=9)
    if engine not in layout.ENGINES:
        raise Exit(f"--engine: must be one of {', '.join(layout.ENGINES)}, not {engine!r}", code=2)
    if not sys.stdout.isatty():
        render(lifecycle.up(nodes=int(nodes), engine_name=engine, seed_worker=seed_worker), "lab.up")
        return
    from rich.console import Console

    with Console().status("lab.up: starting") as board:
        results = lifecycle.up(nodes=int(nodes), engine_name=engine, seed_worker=seed_worker,
                               progress=lambda r: board.update(
            f"lab.up: {r.step} {r.node or ''} {r.status}: {r.why[:60]}"))
    render(results, "lab.up")


@task(default=True)
def status(c):
    """Show the lab's nodes, addresses, daemons and images per node."""
    render(lifecycle.status(), "lab.status")


@task
def down(c):
    """Stop what the lab started and remove its namespaces, links, mounts and data (keeps caches)."""
    render(lifecycle.down(), "lab.down")


@task(help={"name": "sglang-hang (SGLang's ranks hang in init even when all is right), "
                    "or none to clear every fault"})
def fault(c, name):
    """Force a failure the lab's stand-ins show until `inv lab.fault none` (lasts across lab.up)."""
    if name != "none" and name not in faults.FAULTS:
        raise flags.usage("NAME", f"unknown fault {name!r} (one of none, {', '.join(faults.FAULTS)})")
    render(faults.set_fault(name), "lab.fault")


ns = Collection("lab", up, status, down, fault)
