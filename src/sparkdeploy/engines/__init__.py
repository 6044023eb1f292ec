"""Serving engines: each turns the profile into per-node container specs (``Launch``)."""

from __future__ import annotations

from sparkdeploy.config import Engine, Profile
from sparkdeploy.engines import sglang, vllm, vllm_ray
from sparkdeploy.engines.base import ContainerSpec, EngineError, Launch, NodeFacts, Stage

BUILDERS = {"sglang": sglang.build, "vllm": vllm.build, "vllm-ray": vllm_ray.build}


def launch(profile: Profile, engine: Engine, facts: dict[str, NodeFacts],
           api_key: bool = False) -> Launch:
    """The containers ``engine`` runs on the profile's nodes, in start order."""
    return BUILDERS[engine.kind](profile, engine, facts, api_key)


__all__ = ["ContainerSpec", "EngineError", "Launch", "NodeFacts", "Stage", "launch"]
