"""The image ``image.probe`` chose, as its decision record says: shared by ``image.ship``, the
deploy plan's fingerprints and ``deploy.purge``."""

from __future__ import annotations

from typing import Any

from sparkdeploy.deployment import Deployment
from sparkdeploy.engines.base import pinned as pinned  # where the serve steps and the ship read it
from sparkdeploy.hosts import Host
from sparkdeploy.nodeops import inspect_image
from sparkdeploy.records import ImageDecision

STEP_BUILD = "image.build"


def decision(dep: Deployment) -> ImageDecision | None:
    """What image.probe last decided (None before it has)."""
    return dep.records.read(ImageDecision)


def chosen_image(dep: Deployment) -> str | None:
    """The image the decision record says to serve, if image.probe chose one."""
    rec = decision(dep)
    return rec.chosen.serve_image if rec and rec.chosen else None


def chosen(dep: Deployment) -> dict[str, Any]:
    """The image ``image.probe`` chose ({} before it has chosen one)."""
    rec = decision(dep)
    return rec.chosen.model_dump() if rec and rec.chosen else {}


def engine_digest(dep: Deployment, engine: str) -> str | None:
    """The digest image.probe decided on for the candidate engine ``engine`` serves from (the
    engine containers' ``org.sparkdeploy.image.digest`` label)."""
    rec = decision(dep)
    chosen = rec.engines.get(engine) if rec else None
    return chosen.digest if chosen else None


def repo_of(ref: str) -> str:
    """The repository of a reference (``repo[:tag][@digest]`` -> ``repo``)."""
    name = ref.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


def digest_of(info: dict[str, Any], ref: str) -> str:
    """What an image is, by content: its repo digest (``RepoDigests`` of ``docker image
    inspect``, the manifest digest a registry served it under) when it came from ``ref``'s
    repository, else its image ID (built or loaded here: no registry names it)."""
    repo = repo_of(ref)
    for rd in info.get("RepoDigests") or []:
        name, _, digest = str(rd).partition("@")
        if name == repo and digest:
            return digest
    return str(info.get("Id") or "")


def same_image(info: dict[str, Any], ref: str, digest: str | None, image_id: str | None) -> bool:
    """Whether the image ``info`` (what ``ref`` resolves to now) is the one recorded as
    ``digest`` / ``image_id``: the same ID, or the same repo digest (a loaded copy has no repo
    digest; a containerd store's ID is the manifest digest)."""
    if image_id and info.get("Id") == image_id:
        return True
    return bool(digest) and digest in (digest_of(info, ref), info.get("Id"))


def moved(dep: Deployment, head: Host | None = None, refs: list[str] | None = None) -> list[str]:
    """One line per candidate whose tag resolves on the head to another image than the one
    ``image.probe`` decided on (only those ``refs`` when given); [] before any decision and
    for a candidate that was missing then or is missing now (the probe, the build and the
    ship report those)."""
    rec = decision(dep)
    if rec is None:
        return []
    head = head or dep.host(dep.profile.head.name)
    out = []
    for cand in rec.candidates:
        if (refs is not None and cand.image not in refs) or not (cand.digest or cand.image_id):
            continue
        info = inspect_image(head, cand.image)
        if info is None or same_image(info, cand.image, cand.digest, cand.image_id):
            continue
        out.append(f"{cand.image} was {cand.digest or cand.image_id} when decided, is "
                   f"{digest_of(info, cand.image)} now; run image.probe to accept it")
    return out
