"""Serving engines: each turns the profile into per-node container specs (``Launch``)."""

from __future__ import annotations

from dataclasses import replace

from sparkdeploy import labels
from sparkdeploy.config import Engine, Profile
from sparkdeploy.engines import sglang, vllm, vllm_ray
from sparkdeploy.engines.base import ContainerSpec, EngineError, Launch, NodeFacts, Stage
from sparkdeploy.ops.image import pinned

BUILDERS = {"sglang": sglang.build, "vllm": vllm.build, "vllm-ray": vllm_ray.build}


def launch(profile: Profile, engine: Engine, facts: dict[str, NodeFacts],
           api_key: bool = False, image_id: str | None = None,
           image_digest: str | None = None) -> Launch:
    """The containers ``engine`` runs on the profile's nodes, in start order, each labelled
    with what it is (``labels.engine_labels``; ``image_id``: the image's ID on the nodes;
    ``image_digest``: the digest image.probe decided on for it). An image pinned by digest
    runs by ``image_id`` (what the pin resolved to on the head): the workers got it by
    ``docker load``, which keeps no repo digest, so the pin resolves on the head only."""
    lau = BUILDERS[engine.kind](profile, engine, facts, api_key)
    fp = labels.engine_fingerprint(profile, engine)

    by_id = image_id if image_id and pinned(engine.image) else None

    def labelled(c: ContainerSpec) -> ContainerSpec:
        return replace(c, image=by_id or c.image, labels=tuple(sorted(labels.engine_labels(
            deployment=profile.name, engine=engine.name, kind=engine.kind, role=c.role,
            rank=c.rank, port=lau.port, fingerprint=fp, image_id=image_id,
            image_digest=image_digest).items())))

    return replace(lau, stages=tuple(replace(s, containers=tuple(map(labelled, s.containers)))
                                     for s in lau.stages))


__all__ = ["ContainerSpec", "EngineError", "Launch", "NodeFacts", "Stage", "launch"]
