"""`inv hosts.*`: which nodes answer, and whose host keys we trust."""

from invoke import Collection

from sparkdeploy.steps.hosts import trust_aliases
from sparkdeploy.steps.registry import run_one
from sparkdeploy.tasks._common import drive, run_step
from sparkdeploy.tasks._flags import task, usage
from sparkdeploy.tasks.cluster import nodes_flag, ssh_flag


@task(default=True, help={"node": "only this node", "profile": "profile file"})
def check(c, node=None, profile=None):
    """Report which nodes are reachable."""
    run_step(c, "hosts.check", node=node, profile=profile, lock=False)


@task(help={"node": "only this node", "yes": "add without asking", "profile": "profile file",
            "nodes": "no profile: these ssh aliases (spark1,spark2), before cluster.discover",
            "ssh_config": "with --nodes: an ssh_config file the aliases resolve in"})
def trust(c, node=None, yes=False, profile=None, nodes=None, ssh_config=None):
    """Fetch each node's host key, show its fingerprint, add it to known_hosts when confirmed
    (the profile's nodes, or with --nodes the aliases given, into the file ssh checks)."""

    def confirm(name: str, fingerprint: str) -> bool:
        if yes:
            return True
        answer = input(f"{name}: {fingerprint}\n  trust this host key? [y/N] ")
        return answer.strip().lower() in ("y", "yes")

    if nodes is None:
        if ssh_config is not None:
            raise usage("--ssh-config", "only with --nodes (a profile names its own ssh_config)")
        run_step(c, "hosts.trust", node=node, confirm=confirm, profile=profile, live=False)
        return
    if node is not None or profile is not None:
        raise usage("--nodes", "takes no profile: not with --node or --profile")
    pairs, ssh = nodes_flag(nodes), ssh_flag(ssh_config)
    drive(c, "hosts.trust", lambda dep, events: run_one(
        None, "hosts.trust", pairs, ssh, events=events, body=trust_aliases, runner=c,
        confirm=confirm), deployment="none", live=False)


ns = Collection("hosts", check, trust)
