"""What the package ships beside its code, found through ``importlib.resources`` so that an
installed package finds it as a checkout does: the node-side helpers (``sparkdeploy/helpers/``),
the Dockerfiles and the seed profile (``sparkdeploy/data/``; the checkout's
``configs/`` links to the same seed file)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

SEED_PROFILE = "qwen3.5-122b-a10b-fp8.yaml"


def _file(package: str, name: str) -> Path:
    found = files(package) / name
    if not isinstance(found, Path):  # a zipped install: nodes and docker need real files
        raise RuntimeError(f"sparkdeploy must be installed as files, not zipped ({package}/{name})")
    return found


def helper(name: str) -> Path:
    """A node-side helper script, e.g. ``helper("save_filter.py")``."""
    return _file("sparkdeploy.helpers", name)


def data(name: str) -> Path:
    """A data file or directory: ``SEED_PROFILE``, ``docker`` (the Dockerfiles)."""
    return _file("sparkdeploy.data", name)
