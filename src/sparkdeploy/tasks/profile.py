"""`inv profile.check`: validate the profile and print it resolved, touching no node;
`profile.seed`: where the seed profile the package ships is."""

import json

import yaml
from invoke import Collection

from sparkdeploy import packaged
from sparkdeploy.config import load_layered
from sparkdeploy.deployment import Deployment
from sparkdeploy.overlays import REMOVED, UNSET, Merged, dotted
from sparkdeploy.results import Result
from sparkdeploy.tasks._common import drive
from sparkdeploy.tasks._flags import task


def _short(v) -> str:
    if v is REMOVED or v is UNSET:
        return repr(v)
    text = json.dumps(v, separators=(", ", ": "))
    if len(text) <= 70:
        return text
    if isinstance(v, list):
        return f"[{len(v)} items]"
    if isinstance(v, dict):
        return f"{{{len(v)} keys}}"
    return text[:67] + "..."


def override_lines(merged: Merged) -> list[str]:
    """One comment line per value an extending file set over (or added to) its parents."""
    if len(merged.files) < 2:
        return []
    lines = ["# files, base first: " + ", ".join(merged.files), "# overrides:"]
    for o in sorted(merged.overrides, key=lambda o: [str(x) for x in o.path]):
        was = "unset" if o.was is UNSET else f"{_short(o.was)} from {o.was_file}"
        lines.append(f"#   {dotted(o.path)} = {_short(o.value)} ({o.file}; was {was})")
    return lines


@task(default=True, help={"profile": "profile file (default: sparkdeploy.profile)"})
def check(c, profile=None):
    """Validate the profile and print it with every default filled in (and, for a profile
    that extends others, which values each file overrides)."""
    def show(dep: Deployment | None, results: list[Result]) -> None:
        assert dep is not None
        p = dep.profile
        _, merged = load_layered(dep.profile_path)
        print(f"# {dep.profile_path}: valid profile {p.name!r}: head {p.head.name}, "
              f"workers {', '.join(n.name for n in p.workers) or 'none'}, "
              f"{sum(n.gpus for n in p.nodes)} GPU(s), engines {', '.join(e.name for e in p.engines)}")
        for line in override_lines(merged):
            print(line)
        print(yaml.safe_dump({"sparkdeploy": p.model_dump(mode="json")}, sort_keys=False), end="")

    drive(c, "profile.check", lambda dep, events: [], profile=profile, lock=False, show=show)


@task
def seed(c):
    """Print the path of the seed profile sparkdeploy ships (extend it, or copy it to start)."""
    print(packaged.data(packaged.SEED_PROFILE))


ns = Collection("profile", check, seed)
