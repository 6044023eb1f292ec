"""Profile files that extend other profile files (``extends:``), merged with provenance.

A profile file may say ``extends: <file>`` (or a list of files), each path absolute or
relative to the file that names it. The parents are merged in order, then the file itself on
top of them:

- mappings merge key by key;
- lists (and every other value) replace what the parent had;
- a key set to null in an extending file removes the key (in a file that extends nothing, null
  is just null);
- validation runs on the merged result (``config.load_profile``), and an error names the file
  that set the bad value: every key path remembers the file it came from.

A missing parent or a cycle is one line naming the file whose ``extends`` is wrong.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sparkdeploy.core.errors import UsageError
from sparkdeploy.core.files import MB, InputError, read_input

KeyPath = tuple[str | int, ...]
"""A key path inside the profile body (below ``sparkdeploy:``): ``("nodes", 0, "role")``."""

class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


REMOVED = _Marker("removed")
"""An ``Override``'s ``value`` when the extending file removed the key (null)."""
UNSET = _Marker("unset")
"""An ``Override``'s ``was`` when no parent had the key."""

TOP_KEYS = ("sparkdeploy", "extends")


class ProfileError(UsageError):
    """A profile that cannot be used; ``str()`` is the one line to show the user."""


@dataclass(frozen=True)
class Override:
    """A value an extending file set where a parent already had one (or removed it)."""

    path: KeyPath
    file: str
    value: Any
    was: Any
    was_file: str | None


@dataclass
class Merged:
    """The merged profile body, where each key path came from, and what was overridden."""

    body: dict[str, Any]
    files: list[str]
    """Every file read, parents before the files extending them; the profile itself last."""
    origin: dict[KeyPath, str] = field(default_factory=dict)
    overrides: list[Override] = field(default_factory=list)

    @property
    def top(self) -> str:
        return self.files[-1]

    def file_of(self, path: KeyPath) -> str:
        """The file that set ``path``, or the closest enclosing key that was set by one."""
        for n in range(len(path), -1, -1):
            if path[:n] in self.origin:
                return self.origin[path[:n]]
        return self.top


def dotted(path: KeyPath) -> str:
    """``("nodes", 0, "role")`` -> ``sparkdeploy.nodes[0].role``."""
    out = "sparkdeploy"
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


_PART = re.compile(r"\.([^.\[\]]+)|\[(\d+)\]")


def parse_dotted(key: str) -> KeyPath:
    """The inverse of ``dotted`` (``sparkdeploy.`` prefix optional)."""
    key = key.removeprefix("sparkdeploy")
    return tuple(int(i) if i else name for name, i in _PART.findall(key))


# --- reading one file -------------------------------------------------------------------

MAX_BYTES = MB
"""A profile file is at most this big (the seed is a few KB)."""
MAX_DEPTH = 32
"""Mappings and lists nest at most this deep (the schema needs 5)."""


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without aliases (``*name``: an alias bomb expands a small file into
    billions of nodes), with bounded nesting and without duplicate keys."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed in a profile (use extends:)",
                self.peek_event().start_mark)
        depth = getattr(self, "_depth", 0)
        if depth >= MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
        self._depth = depth + 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth = depth

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for k, _ in node.value:
            key = self.construct_object(k, deep=deep)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (the second would silently win)",
                        k.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read(path: Path, label: str) -> dict[str, Any]:
    if not path.exists():
        raise ProfileError(f"{label}: no such profile file")
    try:
        text = read_input(path, limit=MAX_BYTES, what="profile file").decode("utf-8")
    except InputError as e:
        raise ProfileError(str(e).replace(str(path), label, 1)) from None
    except UnicodeDecodeError as e:
        raise ProfileError(f"{label}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                           f"{e.start})") from None
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader, aliases refused)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ProfileError(f"{label}: invalid YAML: {where}{problem}") from None
    if data is None:
        raise ProfileError(f"{label}: the file is empty")
    if not isinstance(data, dict):
        raise ProfileError(
            f"{label}: must be a mapping with one key 'sparkdeploy', not a {type(data).__name__}")
    if "sparkdeploy" not in data:
        raise ProfileError(f"{label}: sparkdeploy: required top-level key is missing")
    others = sorted(str(k) for k in data if k not in TOP_KEYS)
    if others:
        raise ProfileError(f"{label}: {others[0]}: unknown top-level key "
                           "(only 'sparkdeploy', and 'extends')")
    if not isinstance(data["sparkdeploy"], dict):
        raise ProfileError(f"{label}: sparkdeploy: must be a mapping")
    return data


def _parents(data: dict[str, Any], label: str) -> list[str]:
    ext = data.get("extends")
    if ext is None:
        return []
    items = [ext] if isinstance(ext, str) else ext
    if not isinstance(items, list) or not items or not all(
            isinstance(x, str) and x.strip() for x in items):
        raise ProfileError(f"{label}: extends: must be a file path or a list of file paths")
    return items


def _parent_label(child_label: str, ref: str) -> str:
    if os.path.isabs(ref):
        return ref
    return os.path.normpath(os.path.join(os.path.dirname(child_label), ref))


# --- merging ------------------------------------------------------------------------------


def _origins(value: Any, label: str, path: KeyPath = ()) -> dict[KeyPath, str]:
    """Every key path in ``value`` (list items too) -> ``label``."""
    out = {path: label} if path else {}
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(_origins(v, label, path + (k,)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.update(_origins(v, label, path + (i,)))
    return out


def _merge(into: Merged, body: dict[str, Any], origin: dict[KeyPath, str], label: str,
           base: dict[str, Any] | None = None, path: KeyPath = (), first: bool = False) -> None:
    """Lay ``body`` (whose key paths came from ``origin``) over ``into.body``; record what it
    overrides (and, unless it is the ``first`` layer, what it adds)."""
    base = into.body if base is None else base
    for k, v in body.items():
        p = path + (k,)
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(into, v, origin, label, base[k], p, first)
            continue
        by = origin.get(p, label)
        if k in base or (not first and v is not None):
            into.overrides.append(Override(
                p, by, REMOVED if v is None else copy.deepcopy(v),
                copy.deepcopy(base[k]) if k in base else UNSET, into.origin.get(p)))
        n = len(p)
        for q in [q for q in into.origin if q[:n] == p]:
            del into.origin[q]
        if v is None and not first:
            base.pop(k, None)
            into.origin[p] = by  # who removed it (a "required key is missing" names them)
        else:
            base[k] = copy.deepcopy(v)
            into.origin.update({q: f for q, f in origin.items() if q[:n] == p})
            into.origin[p] = by


def _load(path: Path, label: str, stack: list[tuple[Path, str]]) -> Merged:
    real = path.resolve()
    if any(real == r for r, _ in stack):
        chain = " -> ".join([lbl for _, lbl in stack] + [label])
        raise ProfileError(f"{stack[-1][1]}: extends: cycle: {chain}")
    data = _read(path, label)
    own = data["sparkdeploy"]
    refs = _parents(data, label)
    if not refs:
        return Merged(copy.deepcopy(own), [label], _origins(own, label))
    parents = []
    for ref in refs:
        parent = Path(ref) if os.path.isabs(ref) else path.parent / ref
        if not parent.exists():
            raise ProfileError(f"{label}: extends: {ref}: no such profile file")
        parents.append(_load(parent, _parent_label(label, ref), stack + [(real, label)]))
    return layered(parents + [Merged(copy.deepcopy(own), [label], _origins(own, label))])


def layered(layers: list[Merged]) -> Merged:
    """``layers`` merged in order, each over the ones before it (as a file over the files it
    extends): their files, provenance and overrides kept."""
    out = Merged(body={}, files=[])
    for m in layers:
        first = not out.files
        out.files += [f for f in m.files if f not in out.files]
        out.overrides += m.overrides
        _merge(out, m.body, m.origin, m.top, first=first)
    return out


def load_merged(path: str | Path) -> Merged:
    """Read a profile file and everything it extends; merge; raise ``ProfileError`` (one line)."""
    return _load(Path(path), str(path), [])
