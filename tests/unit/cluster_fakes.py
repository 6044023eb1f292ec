"""Sparks as ``cluster.discover`` meets them: each node's ``cluster_node.py`` runs unchanged on
what a real Spark shows (its sysfs and ``ip -j addr`` from ``link_fakes``, the GB10's recorded
``[N/A]`` nvidia-smi and ``/proc/meminfo``, a recorded ``docker info``), and the head's
``answers`` reaches a peer's address only when both ends are up in one subnet."""

from __future__ import annotations

import ipaddress
import json
import os
import tempfile
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path

from sparkdeploy.helpers import cluster_node as cn
from sparkdeploy.helpers import memory_node as mn
from tests.unit.fakes import FakeContext
from tests.unit.link_fakes import DATA, SparkView, facts_on, spark

MEMINFO = Path(__file__).parent / "data" / "memory" / "gb10-meminfo.txt"
DOCKER_INFO = DATA / "docker-info.json"
_ONE_AT_A_TIME = threading.Lock()
"""The nodes are read at once (threads), and each fake node patches the helper's module."""


@dataclass
class FakeSpark:
    view: SparkView
    machine: str = "aarch64"
    user: str = "owner"
    uid: int = 1000
    sudo: tuple[int, str] = (0, "")
    """What ``sudo -n true`` answers: (exit code, stderr)."""
    tools: dict[str, str | None] = field(default_factory=lambda: {
        "rsync": "/usr/bin/rsync", "python3": "/usr/bin/python3", "nvidia-smi": "/usr/bin/nvidia-smi",
        "docker": "/usr/bin/docker", "sudo": "/usr/bin/sudo"})
    env: dict[str, str] = field(default_factory=dict)
    docker_info: str = field(default_factory=lambda: DOCKER_INFO.read_text())
    gpus: int = 1
    host_key_known: bool = True
    cabled: bool = True
    reachable: bool = True
    python3: bool = True
    """False: its fast-link port is up but the cable leads nowhere (no probe reaches it)."""
    sysfs: Path | None = None

    def up_addresses(self) -> list[ipaddress.IPv4Interface]:
        return [ipaddress.ip_interface(a) for i in self.view.ifaces.values() if i.up for a in i.ipv4]


def spark_pair(tmp_path: Path, recorded: str = "ibdev2netdev-eugr.txt", prefix: str = "192.168.177",
               **kw) -> dict[str, FakeSpark]:
    """Two Sparks as the recorded ``ibdev2netdev`` shows, ``.11`` and ``.12`` on the first Up port."""
    out = {}
    for i, alias in enumerate(("spark1", "spark2")):
        view = spark(recorded)
        for iface in view.ifaces.values():
            if iface.ipv4:
                iface.ipv4 = [f"{prefix}.{11 + i}/24"]
        out[alias] = FakeSpark(view, sysfs=tmp_path / f"sys-{alias}", **kw)
    return out


def facts_answer(node: FakeSpark, model_path: str, monkeypatch) -> str:
    """What ``cluster_node.py facts`` prints on ``node``: the helper's own code, its node's tools
    answering as the node's would."""
    with _ONE_AT_A_TIME, monkeypatch.context() as m:
        node.sysfs.mkdir(parents=True, exist_ok=True)
        link = facts_on(node.view, Path(tempfile.mkdtemp(dir=node.sysfs)), m)  # as it is now
        gpu_rows = "".join(f"{i}, NVIDIA GB10, [N/A], [N/A]\n" for i in range(node.gpus))
        meminfo = node.sysfs.parent / f"meminfo-{node.sysfs.name}"
        meminfo.write_text(MEMINFO.read_text())
        m.setattr(mn, "MEMINFO", str(meminfo))

        def run(argv, timeout=30):  # the node's tools, as both helpers ask them (protocol.run)
            if argv[0] == "nvidia-smi":
                return 0, gpu_rows, ""
            if argv[:2] == ["sudo", "-n"]:
                return node.sudo[0], "", node.sudo[1]
            if argv[0] == "docker" and "info" in argv:
                return 0, node.docker_info, ""
            raise AssertionError(f"unexpected {argv}")

        m.setattr(cn.protocol, "run", run)
        m.setattr(cn.shutil, "which", lambda t: node.tools.get(t))
        m.setattr(cn.os, "geteuid", lambda: node.uid)
        m.setattr(cn.platform, "machine", lambda: node.machine)
        m.setattr(cn.os, "environ", {"USER": node.user, **node.env})
        answer = cn.facts(model_path, types.SimpleNamespace(facts=lambda: link), mn)
    return json.dumps(answer, sort_keys=True)


def answers_answer(nodes: dict[str, FakeSpark], source: str, addrs: list[str], monkeypatch) -> str:
    """What ``cluster_node.py answers`` prints on the node holding ``source``: an address
    answers when a node has it on an up interface in ``source``'s subnet."""
    mine = next(i for n in nodes.values() for i in n.up_addresses() if str(i.ip) == source)
    nets = [i for n in nodes.values() if n.cabled for i in n.up_addresses()]

    def connect(addr, timeout=None, source_address=None):
        assert source_address == (source, 0)
        if any(str(i.ip) == addr[0] and i.network == mine.network for i in nets):
            raise ConnectionRefusedError(111, "Connection refused")
        raise TimeoutError("timed out")

    with _ONE_AT_A_TIME, monkeypatch.context() as m:
        m.setattr(cn.socket, "create_connection", connect)
        return json.dumps(cn.answers(source, addrs))


class ClusterContext(FakeContext):
    """The controller's view of ``nodes`` (by ssh alias): staging, the helper's two
    subcommands, ssh's own failure for a node whose host key is unknown."""

    def __init__(self, nodes: dict[str, FakeSpark], monkeypatch, dry: bool = False):
        super().__init__(dry)
        self._set("nodes", nodes)
        self._set("mp", monkeypatch)

    def answer(self, alias, argv, stdin, command, kw):
        node = self.nodes[alias]
        if not node.host_key_known:
            return self.result(command, 255, "", "No ED25519 host key is known for 192.168.1.40 "
                               "and you have requested strict checking.\nHost key verification failed.")
        if not node.reachable:
            return self.result(command, 255, "", f"ssh: connect to host {alias} port 22: No route to host")
        if argv[:2] == ["sh", "-c"] and "base64 -d" in argv[2]:
            return self.result(command, 0, f"/tmp/sparkdeploy-stage-{node.uid}/{argv[4]}/{argv[5]}\n")
        if argv[:2] == ["sh", "-c"] and "python3" in argv and not node.python3:
            return self.result(command, 127, "", "sh: 1: exec: python3: not found")
        if argv[:2] == ["sh", "-c"] and "python3" in argv:
            args = argv[argv.index("python3") + 2:]
            if args[0] == "facts":
                return self.result(command, 0, facts_answer(
                    node, args[args.index("--model-path") + 1], self.mp) + "\n")
            if args[0] == "answers":
                return self.result(command, 0, answers_answer(self.nodes, args[2], args[3:], self.mp) + "\n")
        raise AssertionError(f"unexpected {alias}: {argv}")


def helper_args(ctx: ClusterContext, alias: str) -> list[list[str]]:
    """The helper argv each run of ``cluster_node.py`` had on ``alias`` (after its path)."""
    return [argv[argv.index("python3") + 2:] for a, argv in ctx.calls
            if a == alias and "python3" in argv and os.path.basename(argv[argv.index("python3") + 1])
            == "cluster_node.py"]

