"""Reachability and host keys. Host keys are only ever added after the user confirms them."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from invoke import Context

from sparkdeploy.core.fingerprint import Fingerprint
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host
from sparkdeploy.ops.hosts import probe_hosts
from sparkdeploy.profile.config import SshSettings
from sparkdeploy.steps.registry import StepContext, step

STEP_CHECK = "hosts.check"
STEP_TRUST = "hosts.trust"


@step(STEP_CHECK, fingerprint=Fingerprint("nodes", "ssh"))
def check(ctx: StepContext, node: str | None = None) -> None:
    """Which nodes answer over ssh (or are this machine)."""
    dep = ctx.dep

    def one(host: Host) -> None:
        r = host.run(["true"], change=False, timeout=dep.profile.ssh.connect_timeout + 10)
        if r.ok:
            how = "this machine" if host.node.local else f"ssh {host.node.ssh}"
            ctx.ok(f"reachable ({how}, {r.duration * 1000:.0f} ms)", host.name)
        else:
            ctx.failed(f"answers, but `true` failed: {r.one_line_error()}", host.name)

    ctx.each(dep.select(node), one)


@dataclass
class Target:
    host: str
    port: int

    @property
    def known_hosts_name(self) -> str:
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"


def resolve(host: Host) -> Target:
    """Where ssh really connects for a node's alias (``ssh -G`` applies the profile's
    ssh_config)."""
    view = host.ssh_view()
    alias = host.node.ssh or host.name
    return Target(view.get("hostname") or alias, int(view.get("port") or 22))


def known_hosts_file(dep: Deployment) -> Path:
    p = dep.profile.ssh.known_hosts
    return Path(os.path.expanduser(p or "~/.ssh/known_hosts"))


def ssh_known_hosts(host: Host) -> Path:
    """The known_hosts file ssh itself checks for the node's alias (``ssh -G``: the ssh_config's
    ``UserKnownHostsFile``, else ``~/.ssh/known_hosts``)."""
    files = host.ssh_view().get("userknownhostsfile", "").split()
    return Path(os.path.expanduser(files[0] if files else "~/.ssh/known_hosts"))


@step(STEP_TRUST)
def trust(ctx: StepContext, node: str | None = None,
          confirm: Callable[[str, str], bool] | None = None) -> None:
    """Scan each node's host key, show its fingerprint, add it when ``confirm`` says yes
    (without ``confirm``, nothing is added)."""
    kh = known_hosts_file(ctx.dep)
    for host in ctx.dep.select(node):
        _trust_one(ctx, host, kh, confirm)


def trust_aliases(ctx: StepContext, nodes: list[tuple[str, str]], ssh: SshSettings,
                  runner: Context | None = None,
                  confirm: Callable[[str, str], bool] | None = None) -> None:
    """``hosts.trust`` without a profile: the nodes by their ssh aliases, each key added to the
    known_hosts file ssh checks for that alias."""
    for host in probe_hosts(nodes, ssh, runner, ctx.events):
        _trust_one(ctx, host, ssh_known_hosts(host), confirm)


def _trust_one(ctx: StepContext, host: Host, kh: Path,
               confirm: Callable[[str, str], bool] | None) -> None:
    if host.node.local:
        ctx.ok("this machine: no host key needed", host.name)
        return
    t = resolve(host)
    if kh.exists():
        known = host.run(["ssh-keygen", "-F", t.known_hosts_name, "-f", str(kh)],
                         change=False, here=True)
        if known.ok and known.stdout.strip():
            ctx.ok(f"{t.known_hosts_name} already in {kh}", host.name)
            return
    scan = host.run(["ssh-keyscan", "-T", "5", "-p", str(t.port), "-t", "ed25519", "--",
                     t.host], change=False, here=True, timeout=30)
    keys = [ln for ln in scan.stdout.splitlines() if ln and not ln.startswith("#")]
    if not keys:
        ctx.failed(f"no host key from {t.known_hosts_name}: "
                   f"{scan.stderr.strip() or 'no answer'}", host.name)
        return
    fp = host.run(["ssh-keygen", "-l", "-f", "-"], input="\n".join(keys) + "\n",
                  change=False, here=True).stdout.strip()
    if host.dry:
        ctx.would(f"ask to add {fp} to {kh}", host.name)
    elif confirm is None or not confirm(host.name, fp):
        ctx.skipped(f"not confirmed: {fp}", host.name)
    else:
        kh.parent.mkdir(parents=True, exist_ok=True)
        with open(kh, "a") as f:
            f.write("\n".join(keys) + "\n")
        ctx.changed(f"added {fp} to {kh}", host.name, fingerprint=fp)
