"""The profiles the unit tests use: the seed's (``SEED``; ``seed_data()`` a fresh copy of its
YAML to change, ``write_profile`` to save a changed one) and configs/lab.yaml without the
machine's lab (``lab_profile_with_overlay``: lab.up writes the profile's generated parent, the
hub's and the index's addresses; a test gets its own). conftest.py has them as fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sparkdeploy.lab import internet, layout
from sparkdeploy.profile.config import with_recipe
from sparkdeploy.profile.overlays import load_merged

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "configs" / "qwen3.5-122b-a10b-fp8.yaml"


def seed_data() -> dict[str, Any]:
    """The seed profile laid over its recipe, as one standalone profile (a test may change it)."""
    body = with_recipe(load_merged(SEED)).body
    body.pop("recipe", None)
    body.setdefault("endpoint", None)  # the seed says `endpoint: null`
    return {"sparkdeploy": body}


def write_profile(tmp_path: Path, data: dict[str, Any] | str, name: str = "p.yaml") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def lab_profile_with_overlay(tmp_path: Path, controller: str = "10.77.0.1") -> Path:
    """configs/lab.yaml as shipped, its generated parent swapped for one lab.up would write."""
    overlay = tmp_path / "lab" / "profile.yaml"
    overlay.parent.mkdir(parents=True)
    overlay.write_text(internet.profile_overlay(controller))
    cfg = tmp_path / "configs"
    cfg.mkdir()
    (cfg / SEED.name).write_text(SEED.read_text())
    text = (ROOT / "configs" / "lab.yaml").read_text()
    assert str(layout.PROFILE_OVERLAY) in text
    (cfg / "lab.yaml").write_text(text.replace(str(layout.PROFILE_OVERLAY), str(overlay)))
    return cfg / "lab.yaml"
