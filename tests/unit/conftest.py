"""What the unit tests share, as fixtures: one fake clock, the seed profile (its path, its YAML
to change, the profile loaded) and the lab profile (with an overlay of its own, never this
machine's lab). The fakes themselves are in ``fakes.py``, the profiles in ``profiles.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sparkdeploy.profile.config import Profile, load_profile
from tests.unit.fakes import FakeClock
from tests.unit.profiles import SEED, lab_profile_with_overlay, seed_data


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def seed_path() -> Path:
    return SEED


@pytest.fixture
def seed_yaml() -> dict[str, Any]:
    """The seed profile's YAML, parsed afresh for this test to change."""
    return seed_data()


@pytest.fixture
def seed_profile() -> Profile:
    return load_profile(SEED)


@pytest.fixture
def lab_profile_path(tmp_path: Path) -> Path:
    return lab_profile_with_overlay(tmp_path / "lab-profile")
