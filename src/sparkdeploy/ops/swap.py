"""What ``serve.swap`` reads and keeps on the nodes, below its steps: the memory the serving
engine's containers hold (``held``), the swap's phase on the head (``read_phase``,
``write_phase``), the other models' directories a prune would remove (``model_dirs``), and the
new model's coherence check (``coherent``).

Memory held: ``docker stats --no-stream`` of the serving engine's containers, its ``MemUsage``
column (the container cgroup's ``memory.current`` less its inactive file cache, as docker's CLI
computes it: docker/cli ``cli/command/container/stats_helpers.go``, ``calculateMemUsageUnixNoCache``).
On a GB10 the GPU's memory is the node's (unified); what the engine holds there is what the
cgroup is charged with, so the figure that comes back once the engine stops is this one.

The phase record lives on the head (``NODE_RECORD``), not only under the controller's state dir:
a controller killed in the cut-over leaves the nodes saying which models were swapped, from
what, and how far it got, and any controller holding the profile completes or rolls back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from pydantic import BaseModel

from sparkdeploy.bench.client import BenchError, Settings, Target
from sparkdeploy.bench.gate import check
from sparkdeploy.core.outside import OutsideError, loads
from sparkdeploy.node import endpoint as ep
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host
from sparkdeploy.node.nodeops import NodeUnreachable, docker
from sparkdeploy.ops.serve import drop_previous, put_file
from sparkdeploy.ops.serve_containers import ours, serving
from sparkdeploy.profile.config import ProfileError, load_profile

NODE_RECORD = "/var/lib/sparkdeploy-node/swap.json"
PREPARE, CUT_OVER, DONE, ROLLED_BACK = "prepare", "cut-over", "done", "rolled-back"

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9.]+)\s*([A-Za-z]+)\s*$")


def parse_size(text: str) -> int | None:
    """docker's ``1.5GiB`` / ``512MiB`` / ``0B`` in bytes (None when it is no such figure)."""
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        return None
    try:
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    except ValueError:
        return None


STATS = ("stats", "--no-stream", "--format", "{{.Name}}\t{{.MemUsage}}")


def held(host: Host, names: list[str]) -> int:
    """Bytes the containers ``names`` hold on the node now (``docker stats``' memory usage, the
    part before `` / ``); 0 for none. Raises NodeUnreachable."""
    if not names:
        return 0
    r = host.run(docker(host, *STATS, *names), change=False, timeout=60)
    total = 0
    for line in r.stdout.splitlines() if r.ok else []:
        name, _, usage = line.partition("\t")
        size = parse_size(usage.split("/")[0]) if name in names else None
        total += size or 0
    return total


# --- the phase, on the head ------------------------------------------------------------------

class Phase(BaseModel):
    """How far a swap got, as the head keeps it."""

    phase: str
    deployment: str = ""
    """The profile's name (the deployment label its containers carry)."""
    from_model: str
    to_model: str
    from_recipe: str | None = None
    """The recipe the old deployment was (None: the profile's own model part)."""
    to_recipe: str | None = None
    from_path: str | None = None
    to_path: str | None = None
    """Both models' directories: ``model.prune`` leaves them while a swap is under way."""
    engine: str | None = None
    """The engine the new one was asked for (``--engine``)."""
    from_engine: str | None = None
    """The engine the old one served with (brought back with it)."""
    persisted: bool = False
    """The old one ran under systemd units: the new one is persisted once it passed."""
    why: str = ""
    at: str = ""


def read_phase(head: Host, deployment: str | None = None) -> Phase | None:
    """The head's swap record (None: no swap ever, a record that is none, or one of another
    deployment than ``deployment``)."""
    try:
        r = head.run(["cat", "--", NODE_RECORD], change=False, sudo=True)
    except NodeUnreachable:
        return None
    if not r.ok:
        return None
    try:
        rec = loads(Phase, r.stdout, f"{head.name}: {NODE_RECORD}")
    except OutsideError:
        return None
    return None if deployment and rec.deployment and rec.deployment != deployment else rec


def write_phase(head: Host, phase: Phase) -> None:
    if put_file(head, NODE_RECORD, phase.model_dump_json(indent=1) + "\n", "0644"):
        drop_previous(head, [NODE_RECORD])


# --- the other models on a node --------------------------------------------------------------

DU = ('for d in "$1"/*/; do [ -f "$d/config.json" ] && du -s -B1 --time --time-style=+%s -- '
      '"$d"; done; true')
"""Each directory under the models' home that holds a model (its ``config.json``): nothing
else there is ever listed, so never pruned."""


@dataclass(frozen=True)
class ModelDir:
    """One model's directory on a node: its bytes and when a file in it last changed."""

    path: str
    bytes: int
    mtime: int


def model_dirs(host: Host, parent: str) -> dict[str, ModelDir]:
    """{directory: ModelDir} of each model directory under ``parent`` on the node (the
    models' home; one holding a ``config.json``), from GNU du (``--time``: the newest
    modification time of anything in it)."""
    r = host.run(["sh", "-c", DU, "sh", parent.rstrip("/") or "/"], change=False, sudo=True,
                 timeout=600)
    out: dict[str, ModelDir] = {}
    for line in r.stdout.splitlines() if r.ok else []:
        size, _, rest = line.partition("\t")
        when, _, path = rest.partition("\t")
        if size.isdigit() and when.isdigit() and path:
            out[path.rstrip("/")] = ModelDir(path.rstrip("/"), int(size), int(when))
    return out


def to_prune(dirs: dict[str, ModelDir], protect: list[str], keep: int) -> list[ModelDir]:
    """What ``model.prune`` removes of ``dirs``: all but the ``protect``ed ones (the serving
    model's, a swap's new one) and the ``keep`` most recently written of the others."""
    kept = {p.rstrip("/") for p in protect}
    others = sorted((d for d in dirs.values() if d.path not in kept),
                    key=lambda d: (-d.mtime, d.path))
    return sorted(others[keep:], key=lambda d: d.path)


# --- coherence -------------------------------------------------------------------------------


def coherent(url: str, want: str, deadline: float = 60.0,
             gates: tuple[tuple[str, tuple[tuple[str, str], ...], int, str], ...] = ()) -> str | None:
    """Why the endpoint does not serve ``want`` coherently (None: it does): ``/v1/models`` lists
    it, and the bench's coherence gate (``bench.gate``: fixed prompts with checkable answers, or
    the answers ``want``'s recipe recorded, in ``gates``) comes back right from that model."""
    listed = ep.models(url, deadline=min(deadline, 30.0))
    if want not in listed:
        return f"/v1/models lists {', '.join(listed) or 'nothing'}, not {want}"
    try:
        check(Target.parse(url), Settings(model=want, input_tokens=1, output_tokens=1,
                                          timeout=deadline, deadline=deadline, gates=gates))
    except BenchError as e:
        return str(e)
    return None


def shared_dir(old: Any, new: Any) -> str | None:
    """Why the new model (``model`` of its profile) cannot go where ``old``'s is (None: it
    can): another repo or revision in the same directory, or in one inside the other, would
    overwrite the weights the old model comes back from. Recipes put each model in
    ``/srv/models/<the repo's name>`` (``recipes.MODELS_DIR``): two repos of one name from two
    owners meet there unless a recipe says ``model.path``."""
    if (old.repo, old.revision) == (new.repo, new.revision):
        return None
    a, b = PurePosixPath(old.path), PurePosixPath(new.path)
    if a == b or a in b.parents or b in a.parents:
        return (f"model.path: {new.repo}@{new.revision} would go to {new.path}, which holds "
                f"{old.repo}@{old.revision} ({old.path}): give the recipe its own model.path")
    return None


# --- the two deployments ---------------------------------------------------------------------

def serving_url(dep: Deployment) -> tuple[str, str] | None:
    """(engine, endpoint) of the engine of ``dep`` the nodes serve as its profile says."""
    for eng in dep.profile.engines:
        try:
            got = serving(dep, eng)
        except NodeUnreachable:
            return None
        if got.url:
            return eng.name, got.url
    return None


def beside(new: Deployment, recipe: str | None, dirs: tuple[str, ...] = ()) -> Deployment:
    """The deployment of the same profile file with ``recipe``'s model part (None: the
    profile's own), on ``new``'s hosts, state dir, clock and event stream."""
    prof = load_profile(new.profile_path, recipe, dirs)
    return Deployment(prof, new.profile_path, new.state, new.hosts, dry=new.dry,
                      sleep=new.sleep, clock=new.clock, wall=new.wall, events=new.events)


def old_deployment(new: Deployment, dirs: tuple[str, ...] = ()) -> tuple[Deployment, str | None]:
    """(the deployment the nodes serve now, its recipe): the one the head's swap record says
    (the last swap's new model when it ended, else its old one), the recipe the head's running
    engine containers carry (``labels.RECIPE``: a ``deploy.all --recipe``), else the profile's
    own; the first of these the nodes serve as its profile says, else the first."""
    head = new.host(new.profile.head.name)
    rec = read_phase(head, new.profile.name)
    picks: list[str | None] = []
    if rec is not None:
        picks.append(rec.to_recipe if rec.phase == DONE else rec.from_recipe)
    labelled = [c.recipe for c in ours(head, new.profile.name) if c.running and c.recipe]
    picks += labelled
    picks.append(None)
    cands = []
    for r in dict.fromkeys(picks):
        try:
            cands.append((beside(new, r, dirs), r))
        except ProfileError:
            if r not in labelled:
                raise
            # a recipe another controller deployed from its own recipe directories: not ours
    return next(((d, r) for d, r in cands if serving_url(d) is not None), cands[0])


def under_way(head: Host, deployment: str) -> list[str]:
    """Both models' directories of a swap the head's record says is under way ([] when none)."""
    rec = read_phase(head, deployment)
    if rec is None or rec.phase not in (PREPARE, CUT_OVER):
        return []
    return [p for p in (rec.from_path, rec.to_path) if p]
