"""Nodes reached before a profile exists (by name and ssh alias): shared by ``hosts.trust`` and
``cluster.discover``."""

from __future__ import annotations

from invoke import Context

from sparkdeploy.core.events import EventSink
from sparkdeploy.node.hosts import Host
from sparkdeploy.profile.config import Node, SshSettings


def probe_hosts(nodes: list[tuple[str, str]], ssh: SshSettings, runner: Context | None,
                events: EventSink) -> list[Host]:
    """A ``Host`` per (name, ssh alias), the first the head, before any profile exists: its node
    has no link yet (nothing that runs without a profile reads one); host keys are checked as
    for any node."""
    return [Host(Node.model_construct(name=name, role="head" if i == 0 else "worker", ssh=alias,
                                      link=None), ssh, runner, None, events)
            for i, (name, alias) in enumerate(nodes)]
