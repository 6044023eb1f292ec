"""`inv model.*`: download the weights on the head, verify them, sync them to the workers.

model.download and model.sync each hold a lock of their own (not the deployment's), so the
sync can run beside the download and send each file as soon as the head has verified it."""

from invoke import Collection

from sparkdeploy.tasks import _flags as flags
from sparkdeploy.tasks._common import run_step
from sparkdeploy.tasks._flags import task


@task(default=True, help={"nodes": "the node to download on (default: the head)",
                          "node": "deprecated: --nodes", "profile": "profile file"})
def download(c, nodes=None, profile=None, node=None):
    """Download the profile's weights on the head, verified; a re-run fetches only what is
    missing. The token comes from HF_TOKEN or the hub login and reaches the node by stdin."""
    flag, picked = flags.nodes(nodes, node=node)
    if picked is not None and (picked == "all" or len(flags.name_list(flag, picked)) != 1):
        raise flags.usage(flag, f"downloads on one node, not {picked!r}")
    run_step(c, "model.download", node=picked, flag=flag, profile=profile, lock=False)


@task(help={"nodes": "node(s): NAME[,NAME...] or all (default: all)", "node": "deprecated: --nodes",
            "repair": "re-fetch (head) or re-send (workers) only the files that differ",
            "profile": "profile file"})
def verify(c, nodes=None, repair=False, profile=None, node=None):
    """Check every file's size and sha256 against the hub's metadata (cached for offline use)."""
    flag, picked = flags.nodes(nodes, node=node)
    run_step(c, "model.verify", node=picked, flag=flag, repair=repair, profile=profile,
             lock=repair)


@task(help={"to": "worker(s): NAME[,NAME...] or all (default: all)", "nodes": "the same as --to",
            "profile": "profile file"})
def sync(c, to=None, profile=None, nodes=None):
    """Copy the weights to the workers over the fast link as the head completes each file."""
    flag, picked = flags.nodes(nodes, to=to)
    run_step(c, "model.sync", to=picked or "all", flag=flag, profile=profile, lock=False)


@task(help={"profile": "profile file"})
def fit(c, profile=None):
    """Check that each node's share of the weights, plus the engine's reserve, and the engine's
    memory fraction fit the memory the node reports (before downloading; exit 1 when not)."""
    run_step(c, "model.fit", profile=profile, lock=False)


ns = Collection("model", download, verify, sync, fit)
