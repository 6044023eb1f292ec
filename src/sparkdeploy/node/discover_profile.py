"""The profile ``cluster.discover`` writes: it ``extends:`` the seed deployment profile and holds
only what was read from the nodes, each value with a comment saying where it was read."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from sparkdeploy.core import packaged
from sparkdeploy.node.discover import End

_PLAIN = re.compile(r"[A-Za-z0-9_./@+-][A-Za-z0-9_./@:+-]*")


@dataclass(frozen=True)
class Found:
    """One node as the profile will say it, and where each value was read."""

    name: str
    alias: str
    role: str
    end: End
    gpus: int
    gpus_from: str
    docker_socket: str
    docker_from: str
    privilege: str
    privilege_from: str
    arch: str
    arch_from: str


def scalar(v: object) -> str:
    """``v`` as a YAML scalar: plain when it reads back as itself, else double-quoted."""
    text = str(v)
    if isinstance(v, int) or (_PLAIN.fullmatch(text) and yaml.safe_load(text) == text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def comment(text: str) -> str:
    """A comment's text on one line (a node's own words never break the file)."""
    return "".join(c if c.isprintable() else "?" for c in text)


def extends_for(target: Path | None) -> str:
    """How the profile names the seed: by its bare name when ``target``'s directory holds it
    (a checkout's ``configs/``), else by its absolute path."""
    seed = packaged.data(packaged.SEED_PROFILE)
    if target is not None:
        beside = target.parent / packaged.SEED_PROFILE
        if beside.exists() and os.path.samefile(beside, seed):
            return packaged.SEED_PROFILE
    return str(seed)


def _line(indent: int, key: str, value: str, why: str) -> str:
    return f"{' ' * indent}{key}: {value}   # {comment(why)}"


def node_lines(f: Found) -> list[str]:
    e = f.end
    hcas = "[" + ", ".join(scalar(h) for h in e.hcas) + "]"
    return [
        _line(4, "- name", scalar(f.name), f"from the ssh alias {f.alias}"),
        _line(6, "role", f.role, "the first of --nodes is the head" if f.role == "head"
              else "--nodes after the first"),
        _line(6, "ssh", scalar(f.alias), "--nodes"),
        "      link:",
        _line(8, "interface", scalar(e.interface),
              f"ip -j addr: up, MTU {e.mtu}, an RDMA device behind it "
              f"(/sys/class/infiniband/*/device/net), in {e.subnet} with every node"),
        _line(8, "address", scalar(e.address), f"ip -j addr: {e.interface}'s IPv4 "
              f"{e.address}/{e.prefix}" + ("" if f.role == "head"
                                            else "; answered the head over the link")),
        _line(8, "hcas", hcas, f"/sys/class/infiniband: the RoCE devices of {e.interface}'s "
              "port (its twins)"),
        _line(6, "gpus", str(f.gpus), f.gpus_from),
        _line(6, "docker_socket", scalar(f.docker_socket), f.docker_from),
        _line(6, "privilege", f.privilege, f.privilege_from),
        _line(6, "arch", f.arch, f.arch_from),
    ]


def render(nodes: list[Found], *, ssh_config: str | None, seed_nodes: list[str],
           target: Path | None, command: str, recipe: str | None = None,
           recipes: list[str] | None = None) -> str:
    """The profile's text. ``seed_nodes``: the nodes the seed's ``services.stop`` names (those
    not among ``nodes`` are removed: their units are the seed owner's). ``recipe``: the model
    part comes from that recipe instead of the seed's (``recipes``: owners' directories)."""
    names = [f.name for f in nodes]
    out = [f"# Written by `{comment(command)}`: only what was read from the nodes;",
           "# everything else comes from the seed deployment profile this extends.",
           f"extends: {scalar(extends_for(target))}   # the seed deployment profile",
           "sparkdeploy:"]
    if recipe:
        out.append(_line(2, "recipe", scalar(recipe), "--recipe: the model, images and engines"))
    if recipes:
        out.append(_line(2, "recipes", "[" + ", ".join(scalar(d) for d in recipes) + "]",
                         "--recipes: owners' recipe directories"))
    if ssh_config:
        out += ["  ssh:", _line(4, "config", scalar(ssh_config),
                                "--ssh-config: where the aliases resolve")]
    gone = [n for n in seed_nodes if n not in names]
    if gone:
        out += ["  services:", "    stop:"]
        out += [_line(6, scalar(n), "null", f"the seed's units to stop on {n}, a node this "
                      "profile does not have") for n in gone]
    out.append("  nodes:")
    for f in nodes:
        out += node_lines(f)
    return "\n".join(out) + "\n"
