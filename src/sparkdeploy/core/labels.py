"""The labels on what sparkdeploy starts and builds on a node, in one namespace
(``org.sparkdeploy.``), and how a node's containers are read back by them.

The nodes hold the deployment's state; a controller's state dir is only a cache. Every container
sparkdeploy starts carries the deployment (the profile's name) and when and by what it started;
an engine container also says which engine (name and kind), its role and rank, the image ID it
runs, the port its API listens on (the head's endpoint) and a fingerprint of what it runs (the
profile's slice for that engine: its entry, the nodes, the model's path and name). Any
controller holding the profile reads them back (``ps_args`` + ``parse_ps``: one ``docker ps``),
so ``serve.status``, ``serve.down``, ``serve.logs``, ``serve.up`` (already serving?) and
``deploy.all`` work from any clone, and a busy GPU is named by the container holding it.

The fingerprint travels as a digest of the whole slice and a digest per key (so a controller
can name the keys that differ); an engine ``env`` variable whose name says it is a secret is
never part of it.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from sparkdeploy.core.fingerprint import differing, digest, flat, key_digests
from sparkdeploy.core.outside import OutsideError, parsed
from sparkdeploy.core.redaction import is_secret_name

NS = "org.sparkdeploy"

# on containers
DEPLOYMENT = f"{NS}.deployment"
"""The profile's ``name``: every container of a deployment carries it."""
ROLE = f"{NS}.role"
"""``head``, ``worker``/``workerN``, ``api`` (engines); ``download``, ``probe`` (the others)."""
STARTED = f"{NS}.started"
"""When it was started (UTC, ISO 8601)."""
STARTED_BY = f"{NS}.started.by"
"""What started it: a step (``serve.up``) or a persisted unit (``sparkdeploy-<engine>.service``)."""
ENGINE = f"{NS}.engine"
ENGINE_KIND = f"{NS}.engine.kind"
RANK = f"{NS}.rank"
IMAGE_ID = f"{NS}.image.id"
IMAGE_DIGEST = f"{NS}.image.digest"
"""The digest ``image.probe`` decided on for the engine's image (its repo digest, else its ID)."""
PORT = f"{NS}.port"
"""The engine's API port: the endpoint is this port on the head."""
RECIPE = f"{NS}.recipe"
"""The recipe the deployment's model part came from (``deploy.all --recipe``, a swap's new one,
the profile's ``recipe:``): how a controller knows which model serves (``ops.swap``)."""
PLACEMENT = f"{NS}.placement"
"""On a model ``serve.add`` placed beside the profile's deployment: its ``config.Placement`` as JSON
(the deployment beside which, the recipe, the nodes, the ports' offset, the memory fraction), so
any controller derives the same deployment again (``ops.placement``)."""
FINGERPRINT = f"{NS}.fingerprint"
FINGERPRINT_KEYS = f"{NS}.fingerprint.keys"

# on images (image.build)
BASE_ID = f"{NS}.base.id"
BASE_DIGEST = f"{NS}.base.digest"
"""The base's repo digest when it came from a registry, else its ID (``ops.image.digest_of``)."""
NCCL = f"{NS}.nccl"
"""``image`` (the NCCL the base image's torch loads) or ``system`` (the layer made it libnccl2)."""
TRANSFORMERS = f"{NS}.transformers.version"
DOCKERFILE = f"{NS}.dockerfile.sha256"
REQUIREMENT = f"{NS}.transformers.requirement"
ENGINE_REQUIRES = f"{NS}.engine.requires"

READ = (DEPLOYMENT, ENGINE, ENGINE_KIND, ROLE, RANK, IMAGE_ID, PORT, STARTED, STARTED_BY,
        FINGERPRINT, FINGERPRINT_KEYS, RECIPE, PLACEMENT)
"""The labels ``ps_args`` reads, in this order after the container's ID, name, state, status."""


def args(labels: dict[str, str]) -> list[str]:
    """``docker run`` arguments for ``labels`` (one ``--label=k=v`` each: never read as a
    flag), in a stable order."""
    return [f"--label={k}={v}" for k, v in sorted(labels.items())]


def stamp(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def started(by: str, t: float) -> dict[str, str]:
    """The labels a container gets when it starts: when, and what started it."""
    return {STARTED: stamp(t), STARTED_BY: by}


def of_run(deployment: str, role: str, by: str, t: float) -> list[str]:
    """``docker run`` label arguments of a helper container (a download, a probe)."""
    return args({DEPLOYMENT: deployment, ROLE: role, **started(by, t)})


def engine_fingerprint(profile: Any, engine: Any) -> dict[str, Any]:
    """What an engine's containers run, as a flat fingerprint: the engine's profile entry, the
    nodes, the model's path, name and revision. Secret variables of its ``env`` are left out
    (their values, and even their names, stay off the nodes' command lines)."""
    eng = engine.model_dump(mode="json")
    eng["env"] = {k: v for k, v in (eng.get("env") or {}).items() if not is_secret_name(k)}
    nodes = [n.model_dump(mode="json") for n in profile.nodes]
    m = profile.model
    return flat({"engine": eng, "nodes": nodes,
                 "model": {"path": m.path, "repo": m.repo, "revision": m.revision}})


def engine_labels(*, deployment: str, engine: str, kind: str, role: str, rank: int, port: int,
                  fingerprint: dict[str, Any], image_id: str | None = None,
                  image_digest: str | None = None, recipe: str | None = None,
                  placement: str | None = None) -> dict[str, str]:
    """The labels of one engine container (``started`` adds when and by what)."""
    out = {DEPLOYMENT: deployment, ENGINE: engine, ENGINE_KIND: kind, ROLE: role,
           RANK: str(rank), PORT: str(port), FINGERPRINT: digest(fingerprint),
           FINGERPRINT_KEYS: json.dumps(key_digests(fingerprint), separators=(",", ":"))}
    if image_id:
        out[IMAGE_ID] = image_id
    if image_digest:
        out[IMAGE_DIGEST] = image_digest
    if recipe:
        out[RECIPE] = recipe
    if placement:
        out[PLACEMENT] = placement
    return out


# --- reading them back ------------------------------------------------------------------------

FORMAT = "[" + ",".join(["{{json .ID}}", "{{json .Names}}", "{{json .State}}",
                         "{{json .Status}}", *(f'{{{{json (.Label "{k}")}}}}' for k in READ)]) + "]"
"""One JSON array per container: any character in a label's value reads back as it was."""


def ps_args(deployment: str | None = None, engine: str | None = None, *,
            engines_only: bool = True) -> list[str]:
    """``docker ps`` arguments (after ``docker -H ...``) listing sparkdeploy's containers: of a
    deployment (None: of any), of one engine, engine containers only (``engines_only``)."""
    argv = ["ps", "--all", "--no-trunc",
            "--filter", f"label={DEPLOYMENT}" + (f"={deployment}" if deployment else "")]
    if engine:
        argv += ["--filter", f"label={ENGINE}={engine}"]
    elif engines_only:
        argv += ["--filter", f"label={ENGINE}"]
    return [*argv, "--format", FORMAT]


@dataclass(frozen=True)
class Container:
    """One of sparkdeploy's containers on a node, as its labels describe it."""

    id: str
    name: str
    state: str
    """docker's: ``running``, ``exited``, ``created``, ``restarting``, ``paused``, ``dead``."""
    status: str
    """docker's words (``Up 5 minutes``, ``Exited (1) 2 seconds ago``)."""
    deployment: str
    engine: str = ""
    kind: str = ""
    role: str = ""
    rank: int | None = None
    image_id: str = ""
    port: int | None = None
    started: str = ""
    started_by: str = ""
    fingerprint: str = ""
    fingerprint_keys: str = ""
    recipe: str = ""
    placement: str = ""
    """``PLACEMENT``'s JSON ('' on the profile's own deployment)."""

    @property
    def running(self) -> bool:
        return self.state == "running"

    def differs(self, fp: dict[str, Any]) -> list[str]:
        """The keys of ``fp`` (the profile now) that differ from what this container runs
        (['fingerprint'] when it carries no readable per-key record)."""
        if self.fingerprint == digest(fp):
            return []
        try:
            recorded = parsed(self.fingerprint_keys, "the container's fingerprint keys")
        except OutsideError:
            return ["fingerprint"]
        if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
            return ["fingerprint"]
        return differing(recorded, fp) or ["fingerprint"]


def _int(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def parse_ps(stdout: str) -> list[Container]:
    """``docker ps --format FORMAT`` output -> the containers (a line that is not such an
    array is left out: docker prints nothing else there)."""
    out = []
    for line in stdout.splitlines():
        try:
            row = parsed(line, "docker ps")
        except OutsideError:
            continue
        if not (isinstance(row, list) and len(row) == 4 + len(READ)
                and all(isinstance(x, str) for x in row)):
            continue
        cid, name, state, status = row[:4]
        lab = dict(zip(READ, row[4:], strict=True))
        out.append(Container(
            id=cid, name=name.split(",")[0], state=state, status=status,
            deployment=lab[DEPLOYMENT], engine=lab[ENGINE], kind=lab[ENGINE_KIND], role=lab[ROLE],
            rank=_int(lab[RANK]), image_id=lab[IMAGE_ID], port=_int(lab[PORT]),
            started=lab[STARTED], started_by=lab[STARTED_BY], fingerprint=lab[FINGERPRINT],
            fingerprint_keys=lab[FINGERPRINT_KEYS], recipe=lab[RECIPE],
            placement=lab[PLACEMENT]))
    return out
