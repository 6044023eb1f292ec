"""`inv model.*`: download the weights on the head, verify them, sync them to the workers."""

from invoke import Collection

from sparkdeploy.steps import model as model_step
from sparkdeploy.steps import model_sync
from sparkdeploy.tasks._common import run_step
from sparkdeploy.tasks._flags import task


def _own_lock(fn, name):
    """model.download and model.sync run side by side (the sync is pipelined behind the
    download): each holds a lock of its own rather than the deployment's."""

    def locked(dep, *args):
        if dep.dry:
            return fn(dep, *args)
        with dep.state.lock(name, name=f"{name}.lock"):
            return fn(dep, *args)

    return locked


@task(default=True, help={"node": "the node to download on (default: the head)",
                          "profile": "profile file"})
def download(c, node=None, profile=None):
    """Download the profile's weights on the head, verified; a re-run fetches only what is
    missing. The token comes from HF_TOKEN or the hub login and reaches the node by stdin."""
    run_step(c, _own_lock(model_step.download, "model.download"), node, profile=profile, lock=False,
             title="model.download")


@task(help={"node": "node(s): NAME[,NAME...] or all (default: all)",
            "repair": "re-fetch (head) or re-send (workers) only the files that differ",
            "profile": "profile file"})
def verify(c, node=None, repair=False, profile=None):
    """Check every file's size and sha256 against the hub's metadata (cached for offline use)."""
    run_step(c, model_step.verify, node, repair, profile=profile, lock=repair, title="model.verify")


@task(help={"to": "worker(s): NAME[,NAME...] or all", "profile": "profile file"})
def sync(c, to="all", profile=None):
    """Copy the weights to the workers over the fast link as the head completes each file."""
    run_step(c, _own_lock(model_sync.sync, "model.sync"), to, profile=profile, lock=False,
             title="model.sync")


ns = Collection("model", download, verify, sync)
