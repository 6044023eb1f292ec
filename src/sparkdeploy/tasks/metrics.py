"""`inv metrics.*`: Prometheus on the head and an exporter on every node, around what serves."""

from invoke import Collection

from sparkdeploy.tasks._common import run_step
from sparkdeploy.tasks._flags import task

_P = {"profile": "profile file (default: sparkdeploy.profile)"}


@task(default=True, help=_P)
def up(c, profile=None):
    """Start (or bring in line) Prometheus and the exporters; ends with `metrics: URL`."""
    run_step(c, "metrics.up", profile=profile)


@task(help=_P)
def down(c, profile=None):
    """Stop and remove the metrics units on every node (what Prometheus kept stays)."""
    run_step(c, "metrics.down", profile=profile)


ns = Collection("metrics", up, down)
