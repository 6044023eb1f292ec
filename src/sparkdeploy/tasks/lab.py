"""`inv lab.*`: the rehearsal lab (Linux, root): simulated Spark nodes on this machine."""

from invoke import Collection, task
from invoke.exceptions import Exit

from sparkdeploy.lab import layout, lifecycle
from sparkdeploy.tasks._common import render


@task(help={"nodes": "how many nodes (spark1..sparkN; default 2)",
            "engine": "docker26 (default), classic20 (bookworm's 20.10) or containerd "
                      "(Docker 26 on the containerd image store)"})
def up(c, nodes=2, engine=layout.DEFAULT_ENGINE):
    """Bring the lab up, or check it is up (idempotent; says what changed)."""
    if engine not in layout.ENGINES:
        raise Exit(f"--engine: must be one of {', '.join(layout.ENGINES)}, not {engine!r}")
    render(lifecycle.up(nodes=int(nodes), engine_name=engine), "lab.up")


@task(default=True)
def status(c):
    """Show the lab's nodes, addresses, daemons and images per node."""
    render(lifecycle.status(), "lab.status")


@task
def down(c):
    """Stop what the lab started and remove its namespaces, links, mounts and data (keeps caches)."""
    render(lifecycle.down(), "lab.down")


ns = Collection("lab", up, status, down)
