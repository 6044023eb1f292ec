"""The engines' flag manifests (``data/engine-flags/<engine>-<version>.json``, made by ``nox -s
engine_flags``) and the check of a command line against one.

A flag is checked as spelled, in full: the engines accept a unique prefix (``allow_abbrev``)
and refuse it the day another flag shares it, so a prefix counts as unknown here. Every problem
is one line (``FlagError``)::

    --mem-fraction-statik: not a flag of sglang 0.5.10; did you mean --mem-fraction-static?
"""

from __future__ import annotations

import difflib
import json
import re
from functools import cache
from pathlib import Path

from packaging.version import Version

from sparkdeploy.core.errors import UsageError
from sparkdeploy.core.redaction import is_secret_name

DIR = Path(__file__).resolve().parents[1] / "data" / "engine-flags"


class FlagError(UsageError):
    """A flag, a manifest or an engine version that cannot be checked: one line."""


def manifest_version(version: str) -> str:
    """The version whose manifest checks ``version``: that version exactly, less a local build
    label (``0.32.0+cpu`` is vLLM 0.32.0 built for the CPU: the same parser). A release
    candidate is not its release: ``0.5.10rc0`` reads ``sglang-0.5.10rc0.json`` (the release
    added 7 option strings and dropped 5 of the rc's: docs/engine-flags.md)."""
    return version.split("+", 1)[0]


@cache
def manifest(engine: str, version: str, root: Path = DIR) -> dict:
    """The manifest of ``engine`` ``version``; FlagError when there is none or it is not one."""
    path = root / f"{engine}-{manifest_version(version)}.json"
    if not path.is_file():
        raise FlagError(f"no flag manifest for {engine} {version}: make one with "
                        f"`nox -s engine_flags -- {engine}=={version}`")
    try:
        data = json.loads(path.read_text())
        options = {f: o for o in data["options"] for f in o["flags"]}
        if not all(isinstance(o["takes_value"], bool) for o in options.values()):
            raise TypeError("takes_value")
    except (ValueError, KeyError, TypeError) as e:
        raise FlagError(f"{path.name}: not a flag manifest ({type(e).__name__}: {e})") from None
    return {**data, "by_flag": options}


def check_args(engine: str, version: str, args: list[str], root: Path = DIR) -> None:
    """Every ``--flag`` of ``args`` is one of the engine version's, with a value when it takes
    one, none when it is a switch, and a value among its choices."""
    m = manifest(engine, version, root)
    flags = m["by_flag"]
    what = f"{engine} {manifest_version(version)}"
    words = bool(m.get("positionals"))
    i, switch = 0, None
    while i < len(args):
        a = args[i]
        i += 1
        if not a.startswith("-") or a == "-" or _number(a):
            if switch and not words:
                raise FlagError(f"{switch}: a switch of {what}, it takes no value ({a!r})")
            continue
        switch = None
        name, eq, value = a.partition("=")
        opt = flags.get(name)
        if opt is None:
            near = closest(name, list(flags))
            raise FlagError(f"{name}: not a flag of {what}"
                            + (f"; did you mean {near[0]}?" if near else ""))
        if not opt["takes_value"]:
            if eq:
                raise FlagError(f"{name}: a switch of {what}, it takes no value ({value!r})")
            switch = name
            continue
        if not eq:
            if i >= len(args) or (args[i].startswith("-") and not _number(args[i])):
                if opt.get("nargs") in ("?", "*"):
                    continue
                raise FlagError(f"{name}: takes a value in {what}")
            value = args[i]
            i += 1
        choices = opt.get("choices")
        if choices and value not in [str(c) for c in choices]:
            raise FlagError(f"{name} {value}: not one of {', '.join(map(str, choices))} "
                            f"({what})")


def carries_secret(engine: str, flag: str, root: Path = DIR) -> bool:
    """Whether ``flag`` of ``engine`` carries a secret: its name says so (``--api-key``,
    ``--hf-token``: ``redaction.is_secret_name``) and it takes a value in the engine's manifests
    (a switch such as vLLM's ``--allow-credentials`` carries none); a flag no manifest knows is
    judged by its name alone."""
    if not is_secret_name(flag):
        return False
    known = [manifest(engine, v, root)["by_flag"].get(flag) for v in versions(engine, root)]
    found = [o for o in known if o is not None]
    return not found or any(o["takes_value"] for o in found)


def versions(engine: str, root: Path = DIR) -> list[str]:
    """The versions of ``engine`` with a manifest, oldest first."""
    found = [f.stem.removeprefix(f"{engine}-") for f in root.glob(f"{engine}-*.json")]
    return sorted(found, key=Version)  # by PEP 440: 0.5.4 < 0.5.10rc0 < 0.5.10


def check_args_any(engine: str, args: list[str], why: str, root: Path = DIR) -> str:
    """``args`` against every manifest of ``engine`` (the version is not known: ``why``): they
    pass when one version accepts them all; else the newest version's refusal, naming the
    others. Returns the version that accepted them. ``FlagError`` when there is no manifest."""
    known = versions(engine, root)
    if not known:
        raise FlagError(f"no flag manifest for {engine}: make one with "
                        f"`nox -s engine_flags -- {engine}==VERSION`")
    refused: FlagError | None = None
    for v in reversed(known):
        try:
            check_args(engine, v, args, root)
            return v
        except FlagError as e:
            refused = refused or e
    others = ", ".join(known[:-1])
    raise FlagError(f"{refused} ({f'nor of {engine} {others}; ' if others else ''}{why})")


def closest(name: str, flags: list[str]) -> list[str]:
    """The real flag ``name`` most likely means: the shortest it is a prefix of (what the engine
    reads it as today), else the closest spelling."""
    longer = sorted((f for f in flags if f.startswith(name) and f.startswith("--")), key=len)
    return longer[:1] or difflib.get_close_matches(name, flags, n=1)


def _number(a: str) -> bool:
    return bool(re.fullmatch(r"-[0-9.]+", a))
