"""`inv services.*`: stop what holds the GPUs, check, and put it back."""

from invoke import Collection

from sparkdeploy.tasks._common import run_step
from sparkdeploy.tasks._flags import task


@task(default=True, help={"node": "only this node (default: every node with services)",
                          "profile": "profile file (default: sparkdeploy.profile)"})
def stop(c, node=None, profile=None):
    """Stop the profile's units in order, then wait until the GPU is free."""
    run_step(c, "services.stop", node=node, profile=profile)


@task(help={"node": "only this node", "profile": "profile file"})
def restore(c, node=None, profile=None):
    """Start the units `stop` recorded, in reverse order, then forget them."""
    run_step(c, "services.restore", node=node, profile=profile)


@task(help={"node": "only this node", "profile": "profile file"})
def status(c, node=None, profile=None):
    """Show each node's units and the processes on its GPU."""
    run_step(c, "services.status", node=node, profile=profile, lock=False)


ns = Collection("services", stop, restore, status)
