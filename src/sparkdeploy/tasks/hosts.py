"""`inv hosts.*`: which nodes answer, and whose host keys we trust."""

from invoke import Collection

from sparkdeploy.tasks._common import run_step
from sparkdeploy.tasks._flags import task


@task(default=True, help={"node": "only this node", "profile": "profile file"})
def check(c, node=None, profile=None):
    """Report which nodes are reachable."""
    run_step(c, "hosts.check", node=node, profile=profile, lock=False)


@task(help={"node": "only this node", "yes": "add without asking", "profile": "profile file"})
def trust(c, node=None, yes=False, profile=None):
    """Fetch each node's host key, show its fingerprint, add it to known_hosts when confirmed."""

    def confirm(name: str, fingerprint: str) -> bool:
        if yes:
            return True
        answer = input(f"{name}: {fingerprint}\n  trust this host key? [y/N] ")
        return answer.strip().lower() in ("y", "yes")

    run_step(c, "hosts.trust", node=node, confirm=confirm, profile=profile, live=False)


ns = Collection("hosts", check, trust)
