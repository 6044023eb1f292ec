"""The image ``image.probe`` chose, as its decision record says: shared by ``image.ship``, the
deploy plan's fingerprints and ``deploy.purge``."""

from __future__ import annotations

from typing import Any

from sparkdeploy.deployment import Deployment
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
