"""`inv hosts.*`: which nodes answer, and whose host keys we trust."""

from invoke import Collection

from sparkdeploy.steps.hosts import trust_aliases
from sparkdeploy.steps.registry import run_one
from sparkdeploy.tasks import _flags as flags
from sparkdeploy.tasks._common import drive, run_step
from sparkdeploy.tasks._flags import task, usage
from sparkdeploy.tasks.cluster import nodes_flag, ssh_flag


@task(default=True, help={"nodes": "only these nodes: NAME[,NAME...] (default: every node)",
                          "node": "deprecated: --nodes", "profile": "profile file"})
def check(c, nodes=None, profile=None, node=None):
    """Report which nodes are reachable."""
    flag, picked = flags.nodes(nodes, node=node)
    run_step(c, "hosts.check", node=picked, flag=flag, profile=profile, lock=False)


@task(help={"nodes": "with --profile: only these of its nodes; without: these ssh aliases "
                     "(spark1,spark2), before cluster.discover",
            "node": "deprecated: --nodes NAME --profile FILE", "yes": "add without asking",
            "profile": "profile file",
            "ssh_config": "without a profile: an ssh_config file the aliases resolve in"})
def trust(c, nodes=None, yes=False, profile=None, node=None, ssh_config=None):
    """Fetch each node's host key, show its fingerprint, add it to known_hosts when confirmed
    (the profile's nodes, or the ssh aliases --nodes names when no --profile is given, into the
    file ssh checks)."""

    def confirm(name: str, fingerprint: str) -> bool:
        if yes:
            return True
        answer = input(f"{name}: {fingerprint}\n  trust this host key? [y/N] ")
        return answer.strip().lower() in ("y", "yes")

    if nodes is None or profile is not None:
        if ssh_config is not None:
            raise usage("--ssh-config", "only with --nodes (a profile names its own ssh_config)")
        flag, picked = flags.nodes(nodes, node=node)
        run_step(c, "hosts.trust", node=picked, flag=flag, confirm=confirm, profile=profile,
                 live=False, then=" --profile FILE")
        return
    if node is not None:
        raise usage("--nodes", "the same as --node: give one of them")
    pairs, ssh = nodes_flag(nodes), ssh_flag(ssh_config)
    drive(c, "hosts.trust", lambda dep, events: run_one(
        None, "hosts.trust", pairs, ssh, events=events, body=trust_aliases, runner=c,
        confirm=confirm), deployment="none", live=False)


ns = Collection("hosts", check, trust)
