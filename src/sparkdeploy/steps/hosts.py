"""Reachability and host keys. Host keys are only ever added after the user confirms them."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sparkdeploy.deployment import Deployment
from sparkdeploy.hosts import Host, NodeUnreachable
from sparkdeploy.results import Result, changed, failed, ok, skipped
from sparkdeploy.steps.registry import step

STEP_CHECK = "hosts.check"
STEP_TRUST = "hosts.trust"


@step(STEP_CHECK)
def check(dep: Deployment, node: str | None = None) -> list[Result]:
    """Which nodes answer over ssh (or are this machine)."""
    results = []
    for host in dep.select(node):
        try:
            r = host.run(["true"], change=False, timeout=dep.profile.ssh.connect_timeout + 10)
        except NodeUnreachable as e:
            results.append(dep.report(e.as_result(STEP_CHECK)))
            continue
        if r.ok:
            how = "this machine" if host.node.local else f"ssh {host.node.ssh}"
            res = ok(STEP_CHECK, f"reachable ({how}, {r.duration * 1000:.0f} ms)", host.name)
        else:
            res = failed(STEP_CHECK, f"answers, but `true` failed: {r.one_line_error()}",
                         host.name)
        results.append(dep.report(res))
    return results


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


@step(STEP_TRUST)
def trust(dep: Deployment, node: str | None = None,
          confirm: Callable[[str, str], bool] | None = None) -> list[Result]:
    """Scan each node's host key, show its fingerprint, add it when ``confirm`` says yes
    (without ``confirm``, nothing is added)."""
    return [dep.report(r) for r in _trust(dep, node, confirm)]


def _trust(dep: Deployment, node: str | None,
           confirm: Callable[[str, str], bool] | None) -> Iterator[Result]:
    kh = known_hosts_file(dep)
    for host in dep.select(node):
        if host.node.local:
            yield ok(STEP_TRUST, "this machine: no host key needed", host.name)
            continue
        t = resolve(host)
        if kh.exists():
            known = host.run(["ssh-keygen", "-F", t.known_hosts_name, "-f", str(kh)],
                             change=False, here=True)
            if known.ok and known.stdout.strip():
                yield ok(STEP_TRUST, f"{t.known_hosts_name} already in {kh}", host.name)
                continue
        scan = host.run(["ssh-keyscan", "-T", "5", "-p", str(t.port), "-t", "ed25519", "--",
                         t.host], change=False, here=True, timeout=30)
        keys = [ln for ln in scan.stdout.splitlines() if ln and not ln.startswith("#")]
        if not keys:
            yield failed(STEP_TRUST, f"no host key from {t.known_hosts_name}: "
                         f"{scan.stderr.strip() or 'no answer'}", host.name)
            continue
        fp = host.run(["ssh-keygen", "-l", "-f", "-"], input="\n".join(keys) + "\n",
                      change=False, here=True).stdout.strip()
        if dep.dry:
            yield skipped(STEP_TRUST, f"would ask to add {fp} to {kh}", host.name)
            continue
        if confirm is None or not confirm(host.name, fp):
            yield skipped(STEP_TRUST, f"not confirmed: {fp}", host.name)
            continue
        kh.parent.mkdir(parents=True, exist_ok=True)
        with open(kh, "a") as f:
            f.write("\n".join(keys) + "\n")
        yield changed(STEP_TRUST, f"added {fp} to {kh}", host.name, fingerprint=fp)
