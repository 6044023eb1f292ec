"""`inv profile.check`: validate the profile and print it resolved, touching no node."""

import yaml
from invoke import Collection

from sparkdeploy.tasks._common import load
from sparkdeploy.tasks._flags import task


@task(default=True, help={"profile": "profile file (default: sparkdeploy.profile)"})
def check(c, profile=None):
    """Validate the profile and print it with every default filled in."""
    dep = load(c, profile)
    p = dep.profile
    print(f"# {dep.profile_path}: valid profile {p.name!r}: head {p.head.name}, "
          f"workers {', '.join(n.name for n in p.workers) or 'none'}, "
          f"{sum(n.gpus for n in p.nodes)} GPU(s), engines {', '.join(e.name for e in p.engines)}")
    print(yaml.safe_dump({"sparkdeploy": p.model_dump(mode="json")}, sort_keys=False), end="")


ns = Collection("profile", check)
