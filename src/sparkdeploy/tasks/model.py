"""`inv model.*`: download the weights on the head, verify them, sync them to the workers.

model.download and model.sync each hold a lock of their own (not the deployment's), so the
sync can run beside the download and send each file as soon as the head has verified it."""

from invoke import Collection

from sparkdeploy.tasks._common import run_step
from sparkdeploy.tasks._flags import task


@task(default=True, help={"node": "the node to download on (default: the head)",
                          "profile": "profile file"})
def download(c, node=None, profile=None):
    """Download the profile's weights on the head, verified; a re-run fetches only what is
    missing. The token comes from HF_TOKEN or the hub login and reaches the node by stdin."""
    run_step(c, "model.download", node=node, profile=profile, lock=False)


@task(help={"node": "node(s): NAME[,NAME...] or all (default: all)",
            "repair": "re-fetch (head) or re-send (workers) only the files that differ",
            "profile": "profile file"})
def verify(c, node=None, repair=False, profile=None):
    """Check every file's size and sha256 against the hub's metadata (cached for offline use)."""
    run_step(c, "model.verify", node=node, repair=repair, profile=profile, lock=repair)


@task(help={"to": "worker(s): NAME[,NAME...] or all", "profile": "profile file"})
def sync(c, to="all", profile=None):
    """Copy the weights to the workers over the fast link as the head completes each file."""
    run_step(c, "model.sync", to=to, profile=profile, lock=False)


@task(help={"profile": "profile file"})
def fit(c, profile=None):
    """Check that each node's share of the weights, plus the engine's reserve, and the engine's
    memory fraction fit the memory the node reports (before downloading; exit 1 when not)."""
    run_step(c, "model.fit", profile=profile, lock=False)


ns = Collection("model", download, verify, sync, fit)
