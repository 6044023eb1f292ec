"""`inv cluster.discover`: a profile from nothing but SSH aliases (no profile needed)."""

from __future__ import annotations

from pathlib import Path

from invoke import Collection

from sparkdeploy.core import checks
from sparkdeploy.core.outcomes import Result
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.discover import node_name
from sparkdeploy.profile.config import SshSettings, read_recipe
from sparkdeploy.profile.recipes import directories
from sparkdeploy.steps.cluster import STEP
from sparkdeploy.steps.registry import run_one
from sparkdeploy.tasks import _flags as flags
from sparkdeploy.tasks._common import drive
from sparkdeploy.tasks._flags import task


def nodes_flag(value: str | None) -> list[tuple[str, str]]:
    """``--nodes a,b``: (node name, ssh alias) per alias, the first the head."""
    aliases = flags.name_list("--nodes", value)
    if not aliases:
        raise flags.usage("--nodes", "required: ALIAS[,ALIAS...] (ssh aliases; the first is the head)")
    out: list[tuple[str, str]] = []
    for a in aliases:
        name = flags.parsed("--nodes", a, node_name)
        if any(n == name for n, _ in out):
            raise flags.usage("--nodes", f"{a!r} names the node {name!r} twice")
        out.append((name, a))
    return out


def ssh_flag(value: str | None) -> SshSettings:
    """``--ssh-config F``: an existing file, as an absolute path ssh takes."""
    if value is None:
        return SshSettings()
    path = flags.input_file("--ssh-config", value).resolve()
    return SshSettings(config=flags.parsed("--ssh-config", str(path), checks.ssh_path))


def _show(dep: Deployment | None, results: list[Result]) -> None:
    text = next((r.details["profile"] for r in results if "profile" in r.details), None)
    if text is not None:
        print(text, end="", flush=True)


@task(default=True, help={"nodes": "ssh aliases, the first the head: spark1,spark2",
            "ssh_config": "an ssh_config file the aliases resolve in (default: ssh's own)",
            "write": "write the profile to this file (default: print it)",
            "interface": "the fast link's interface, when more than one qualifies",
            "recipe": "the profile deploys this recipe (`inv recipe.list`)",
            "recipes": "an owner's recipe directory (DIR[,DIR...]), looked up first"})
def discover(c, nodes=None, ssh_config=None, write=None, interface=None, recipe=None,
             recipes=None):
    """Read each node over SSH (architecture, GPUs, memory, disk, Docker, privilege, rsync,
    python3, the fast-link candidates), pick the fast link, print or write a profile that
    extends the seed deployment profile."""
    pairs = nodes_flag(nodes)
    ssh = ssh_flag(ssh_config)
    target = flags.output_file("--write", write)
    iface = None if interface is None else flags.parsed("--interface", interface, checks.interface)
    dirs = tuple(flags.name_list("--recipes", recipes))
    command = f"inv cluster.discover --nodes {','.join(a for _, a in pairs)}"
    if recipe is not None:
        command += f" --recipe {recipe}"

    def work(dep, events):
        if recipe is not None:  # an unknown recipe: one line, exit 2, before any node is read
            read_recipe(recipe, directories(list(dirs)))
        return run_one(None, STEP, events=events, nodes=pairs, ssh=ssh, runner=c,
                       interface=iface, write=Path(target) if target else None,
                       command=command, recipe=recipe, recipes=dirs)

    drive(c, STEP, work, deployment="none", show=_show)


ns = Collection("cluster", discover)
