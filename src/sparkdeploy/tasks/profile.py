"""`inv profile.check`: validate the profile (its engines' flags against the engines' flag
manifests, ``ops.engine_check``) and print it resolved, touching no node (its
secrets, such as an engine env's ``HF_TOKEN``, shown as ``***``: ``redaction.redact``);
`profile.seed`: where the seed profile the package ships is."""

import json

import yaml
from invoke import Collection

from sparkdeploy.core import packaged
from sparkdeploy.core.outcomes import Result
from sparkdeploy.core.redaction import REDACTED, is_secret_name, redact
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.ops.engine_check import check_flags
from sparkdeploy.profile.config import load_layered
from sparkdeploy.profile.overlays import REMOVED, UNSET, Merged, dotted
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
        secret = is_secret_name(str(o.path[-1])) if o.path else False
        was = "unset" if o.was is UNSET else f"{_shown(o.was, secret)} from {o.was_file}"
        lines.append(f"#   {dotted(o.path)} = {_shown(o.value, secret)} ({o.file}; was {was})")
    return lines


def _shown(v, secret: bool) -> str:
    """A value as the listing shows it: a secret (a secret-named key's value, or one under such
    a key) as ``***``."""
    if secret and v is not REMOVED and v is not UNSET and v is not None:
        return REDACTED
    return _short(v if v is REMOVED or v is UNSET else redact(v))


@task(default=True, help={"profile": "profile file (default: sparkdeploy.profile)"})
def check(c, profile=None):
    """Validate the profile (every engine's flags too, against the real engine's: exit 2 naming
    one it lacks) and print it with every default filled in (and, for a profile that extends
    others, which values each file overrides)."""
    def show(dep: Deployment | None, results: list[Result]) -> None:
        assert dep is not None
        p = dep.profile
        _, merged = load_layered(dep.profile_path)
        print(f"# {dep.profile_path}: valid profile {p.name!r}: head {p.head.name}, "
              f"workers {', '.join(n.name for n in p.workers) or 'none'}, "
              f"{sum(n.gpus for n in p.nodes)} GPU(s), engines {', '.join(e.name for e in p.engines)}")
        for line in override_lines(merged):
            print(line)
        # a secret in the profile (an engine env's HF_TOKEN) is used, never shown
        shown = redact({"sparkdeploy": p.model_dump(mode="json")})
        print(yaml.safe_dump(shown, sort_keys=False), end="")

    drive(c, "profile.check", lambda dep, events: [], profile=profile, lock=False, show=show,
          prepare=check_flags)


@task
def seed(c):
    """Print the path of the seed profile sparkdeploy ships (extend it, or copy it to start)."""
    print(packaged.data(packaged.SEED_PROFILE))


ns = Collection("profile", check, seed)
