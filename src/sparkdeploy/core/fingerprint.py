"""Fingerprints: a profile slice (and facts) as flat ``{key: value}``, compared key by key.

A step declares its own with ``@step(..., fingerprint=Fingerprint(...))`` (``steps/registry.py``):
the profile sections its outcome depends on, the keys it derives on the controller, and the keys
it must ask the nodes for, each part named in the declaration. The deploy plan keeps one per step
on the controller (``runner``); the engine containers carry one on the nodes (``labels``): its
digest, and a digest per key, so that a controller that never saw the deployment can still say
which keys of its profile differ from what a node runs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparkdeploy.node.deployment import Deployment

Keys = Callable[["Deployment"], dict[str, Any]]
"""A part of a fingerprint: ``fn(dep) -> {key: value}``, flat."""


class Fingerprint:
    """What a step's outcome depends on, declared with the step: the profile's top-level
    ``sections`` (flattened: ``engines[0].args[1]``), then ``also`` (keys derived on the
    controller, from the profile and the records under the state dir: the chosen image by
    tag), then ``asks`` (keys only a node can answer, read through ``dep.facts``: an image's ID
    from the node's ``docker image ls``, the head's unit states). A fingerprint with no
    ``asks`` runs no command on any node.

    ``Fingerprint("engines", "nodes", also=served_image, asks=served_image_id)``."""

    def __init__(self, *sections: str, also: Keys | None = None, asks: Keys | None = None):
        self.sections = sections
        self.also = also
        self.asks = asks

    @property
    def asks_nodes(self) -> bool:
        """Whether taking it runs commands on nodes (once per node per run: ``dep.facts``)."""
        return self.asks is not None

    def local(self, dep: Deployment) -> dict[str, Any]:
        """The part taken on the controller alone: the sections, then ``also``."""
        out: dict[str, Any] = {}
        if self.sections:
            data = dep.profile.model_dump(mode="json")
            out.update(flat({k: data.get(k) for k in self.sections}))
        if self.also is not None:
            out.update(self.also(dep))
        return out

    def __call__(self, dep: Deployment) -> dict[str, Any]:
        """The whole fingerprint: ``local``, then what ``asks`` reads from the nodes."""
        out = self.local(dep)
        if self.asks is not None:
            out.update(self.asks(dep))
        return out

    def __repr__(self) -> str:
        parts = [repr(s) for s in self.sections]
        parts += [f"{k}={getattr(f, '__name__', f)}" for k, f in (("also", self.also), ("asks", self.asks))
                  if f is not None]
        return f"Fingerprint({', '.join(parts)})"


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


def head(dep: Deployment) -> dict[str, Any]:
    """``{"head": name}``: for a step whose work is on the head (another head is other work)."""
    return {"head": dep.profile.head.name}


def workers(dep: Deployment) -> dict[str, Any]:
    """``{"workers": [name, ...]}``: for a step whose work is on the workers."""
    return {"workers": [n.name for n in dep.profile.workers]}
