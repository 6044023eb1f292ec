"""Serving engines: one module per engine kind (``sglang``, ``vllm``, ``vllm_ray``), each a
``Kind`` (``engines/base.py``) holding everything about it, found here through ``KINDS``; and
``launch``, which turns the profile into an engine's per-node container specs (``Launch``).

Adding a kind is one module with its ``KIND``, one line in ``KINDS`` (docs/architecture.md)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from sparkdeploy.core import labels
from sparkdeploy.engines import sglang, vllm, vllm_ray
from sparkdeploy.engines.base import (
    ContainerSpec,
    EngineError,
    ImageRule,
    Kind,
    Launch,
    NodeFacts,
    Stage,
    pinned,
)

if TYPE_CHECKING:
    from sparkdeploy.profile.config import Engine, Profile

KINDS: dict[str, Kind] = {k.name: k for k in (sglang.KIND, vllm.KIND, vllm_ray.KIND)}
"""Every engine kind by its name (``engines[].kind``), in the order the profile's error names
them."""


def kind(name: str) -> Kind:
    """The kind called ``name`` (the profile validated it: one of ``KINDS``)."""
    return KINDS[name]


def software() -> dict[str, Kind]:
    """Every serving software (``Kind.software``) with the first kind that runs it: whose image
    rule, flag manifests and probe are that software's."""
    out: dict[str, Kind] = {}
    for k in KINDS.values():
        out.setdefault(k.software, k)
    return out


def launch(profile: Profile, engine: Engine, facts: dict[str, NodeFacts],
           api_key: bool = False, image_id: str | None = None,
           image_digest: str | None = None) -> Launch:
    """The containers ``engine`` runs on the profile's nodes, in start order, each labelled
    with what it is (``labels.engine_labels``; ``image_id``: the image's ID on the nodes;
    ``image_digest``: the digest image.probe decided on for it). An image pinned by digest
    runs by ``image_id`` (what the pin resolved to on the head): the workers got it by
    ``docker load``, which keeps no repo digest, so the pin resolves on the head only."""
    lau = kind(engine.kind).build(profile, engine, facts, api_key)
    fp = labels.engine_fingerprint(profile, engine)

    by_id = image_id if image_id and pinned(engine.image) else None

    def labelled(c: ContainerSpec) -> ContainerSpec:
        return replace(c, image=by_id or c.image, labels=tuple(sorted(labels.engine_labels(
            deployment=profile.name, engine=engine.name, kind=engine.kind, role=c.role,
            rank=c.rank, port=lau.port, fingerprint=fp, image_id=image_id,
            image_digest=image_digest, recipe=profile.recipe,
            placement=profile.placement.model_dump_json() if profile.placement else None).items())))

    return replace(lau, stages=tuple(replace(s, containers=tuple(map(labelled, s.containers)))
                                     for s in lau.stages))


__all__ = ["KINDS", "ContainerSpec", "EngineError", "ImageRule", "Kind", "Launch", "NodeFacts", "Stage",
           "kind", "launch", "software"]
