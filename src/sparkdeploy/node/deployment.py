"""A deployment: the validated profile, one ``Host`` per node, the state dir, dry-run flag."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from invoke import Context

from sparkdeploy.core.events import EventSink
from sparkdeploy.core.records import Records
from sparkdeploy.core.state import StateDir
from sparkdeploy.node.facts import Facts
from sparkdeploy.node.hosts import Host
from sparkdeploy.profile.config import Profile, ProfileError, load_profile

DEFAULTS = {"profile": "configs/qwen3.5-122b-a10b-fp8.yaml", "state_dir": ".sparkdeploy"}
"""invoke's ``sparkdeploy.*`` settings as the task collection sets them (its configuration);
``invoke.yaml``, ``INVOKE_SPARKDEPLOY_PROFILE`` / ``_STATE_DIR``, ``inv -f FILE`` and a task's
``--profile`` override them. Read from the context's config, never restated."""


@dataclass
class Deployment:
    profile: Profile
    profile_path: str
    state: StateDir
    hosts: dict[str, Host]
    dry: bool = False
    sleep: Callable[[float], None] = field(default=time.sleep)
    clock: Callable[[], float] = field(default=time.monotonic)
    """The one clock of a deployment (steps' durations, waits, the hosts' journal)."""
    wall: Callable[[], float] = field(default=time.time)
    """The time of day, for what is stamped on the nodes (when a container started)."""
    events: EventSink = field(default_factory=EventSink)
    """The one event stream of this deployment (steps' results and progress through their
    ``StepContext``, hosts' echo)."""
    facts: Facts = field(init=False)
    """What this run knows of its nodes (gathered once per node, forgotten on a change)."""

    def __post_init__(self) -> None:
        for h in self.hosts.values():
            h.events = self.events
            h.clock = self.clock
        self.facts = Facts(self.hosts)
        self.events.listeners.append(self.facts.heard)

    @property
    def records(self) -> Records:
        return Records(self.state, self.profile.name)

    def host(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise ProfileError(
                f"{self.profile_path}: no node named {name!r} (nodes: {', '.join(self.hosts)})"
            ) from None

    def select(self, names: str | None) -> list[Host]:
        """``None`` -> every node; ``"spark1,spark2"`` or ``"all"`` -> those nodes."""
        if not names or names == "all":
            return list(self.hosts.values())
        return [self.host(n.strip()) for n in names.split(",") if n.strip()]


def from_context(ctx: Context, profile: str | None = None, recipe: str | None = None,
                 recipe_dirs: tuple[str, ...] = ()) -> Deployment:
    """Build a deployment from invoke's config (explicit ``profile`` wins over config;
    ``recipe``: that recipe's model part instead of the profile's)."""
    cfg = {**DEFAULTS, **(ctx.config.get("sparkdeploy") or {})}
    path = profile or cfg["profile"]
    if not path:
        raise ProfileError("no profile: set sparkdeploy.profile in invoke.yaml or "
                           "INVOKE_SPARKDEPLOY_PROFILE=configs/X.yaml")
    if path == DEFAULTS["profile"] and not Path(path).exists():
        raise ProfileError(f"{path}: no such profile file (the default, for a checkout; else pass "
                           "--profile FILE: `sparkdeploy profile.seed` prints the seed's)")
    return load(path, state_dir(ctx), ctx, recipe, recipe_dirs)


def state_dir(ctx: Context) -> Path:
    """The state dir invoke's config names (``sparkdeploy.state_dir``)."""
    return Path((ctx.config.get("sparkdeploy") or {}).get("state_dir") or DEFAULTS["state_dir"])


def load(profile: str | Path, state_dir: str | Path, ctx: Context | None = None,
         recipe: str | None = None, recipe_dirs: tuple[str, ...] = ()) -> Deployment:
    """A deployment outside invoke (benchmarks, tests): a fresh quiet Context by default."""
    ctx = ctx or Context()
    prof = load_profile(profile, recipe, recipe_dirs)
    state = StateDir(Path(state_dir))
    hosts = {n.name: Host(n, prof.ssh, ctx, state) for n in prof.nodes}
    return Deployment(prof, str(profile), state, hosts, dry=bool(ctx.config.run.dry))
