"""`inv services.*`: stop what holds the GPUs, check, and put it back."""

from invoke import Collection

from sparkdeploy.tasks import _flags as flags
from sparkdeploy.tasks._common import run_step
from sparkdeploy.tasks._flags import task

_NODES = {"nodes": "only these nodes: NAME[,NAME...] (default: every node with services)",
          "node": "deprecated: --nodes", "profile": "profile file (default: sparkdeploy.profile)"}


@task(default=True, help=_NODES)
def stop(c, nodes=None, profile=None, node=None):
    """Stop the profile's units in order, then wait until the GPU is free."""
    flag, picked = flags.nodes(nodes, node=node)
    run_step(c, "services.stop", node=picked, flag=flag, profile=profile)


@task(help=_NODES)
def restore(c, nodes=None, profile=None, node=None):
    """Start the units `stop` recorded, in reverse order, then forget them."""
    flag, picked = flags.nodes(nodes, node=node)
    run_step(c, "services.restore", node=picked, flag=flag, profile=profile)


@task(help=_NODES)
def status(c, nodes=None, profile=None, node=None):
    """Show each node's units and the processes on its GPU."""
    flag, picked = flags.nodes(nodes, node=node)
    run_step(c, "services.status", node=picked, flag=flag, profile=profile, lock=False)


ns = Collection("services", stop, restore, status)
