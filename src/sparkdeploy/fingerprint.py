"""Fingerprints: a profile slice (and facts) as flat ``{key: value}``, compared key by key.

The deploy plan keeps one per step on the controller (``runner``); the engine containers carry
one on the nodes (``labels``): its digest, and a digest per key, so that a controller that never
saw the deployment can still say which keys of its profile differ from what a node runs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping/list as ``{"a.b[0].c": leaf}`` (JSON-comparable leaves)."""
    out: dict[str, Any] = {}
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            out.update(flat(v, f"{prefix}[{i}]"))
        if not value:
            out[prefix] = []
    else:
        out[prefix] = value if isinstance(value, str | int | float | bool | None) else str(value)
    return out


def diff_keys(old: dict[str, Any] | None, new: dict[str, Any] | None) -> list[str]:
    """Keys whose value differs between two fingerprints (added and removed keys too)."""
    old, new = old or {}, new or {}
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def _sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def digest(fp: dict[str, Any]) -> str:
    """One short digest of a whole fingerprint (16 hex digits)."""
    return _sha(fp)[:16]


def key_digests(fp: dict[str, Any]) -> dict[str, str]:
    """{key: a digest of its value (8 hex digits)}: enough to tell which keys changed."""
    return {k: _sha(v)[:8] for k, v in sorted(fp.items())}


def differing(recorded: dict[str, str], fp: dict[str, Any]) -> list[str]:
    """The keys of ``fp`` whose value differs from what ``key_digests`` recorded (and keys only
    one side has)."""
    return diff_keys(recorded, key_digests(fp))
