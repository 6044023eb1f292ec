"""The image ``image.probe`` chose, as its decision record says, and the ID an image has on a
node (one ``docker image ls`` per node per run): shared by ``image.ship``, the steps'
fingerprints, the deploy record and ``deploy.purge``."""

from __future__ import annotations

from typing import Any

from sparkdeploy.core.records import ImageDecision
from sparkdeploy.engines.base import pinned as pinned  # where the serve steps and the ship read it
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host
from sparkdeploy.node.nodeops import NodeUnreachable, docker, inspect_image, tagged

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


# --- the node facts the fingerprints read (``dep.facts``: once per node per run) ----------------

IMAGE_LIST = ("image", "ls", "--no-trunc", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}")


def _image_list(host: Host) -> dict[str, str] | None:
    """{repo:tag: image ID} of every tagged image on the node, in one command (None when the
    node cannot be reached)."""
    try:
        r = host.run(docker(host, *IMAGE_LIST), change=False)
    except NodeUnreachable:
        return None
    if not r.ok:
        return {}
    return dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)


def _inspected_id(host: Host, ref: str) -> str | None:
    try:
        info = inspect_image(host, ref)
    except NodeUnreachable:
        return None
    return info.get("Id") if info else None


def image_id(dep: Deployment, ref: str | None, node: str | None = None) -> str | None:
    """The ID of image ``ref`` on the head (or ``node``): by its tag in the node's image list,
    else (a digest, an ID, a name the list spells otherwise) by inspecting it; None if absent."""
    if not ref:
        return None
    node = node or dep.profile.head.name
    listed = dep.facts.get(node, "images", _image_list)
    if listed is None:
        return None
    return listed.get(tagged(ref)) or dep.facts.get(node, f"image {ref}",
                                                     lambda h: _inspected_id(h, ref))
