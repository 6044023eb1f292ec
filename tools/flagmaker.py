"""Make an engine version's flag manifest from its real parser (``nox -s engine_flags --
sglang==X vllm==Y``): ``python -m tools.flagmaker sglang==0.5.10rc0 ...``.

For each ``engine==version``: a scratch virtualenv outside the repository
(``~/.cache/sparkdeploy/engine-flags/<engine>-<version>/``, made once), the engine's wheel from
the package index without its dependencies, plus the few light packages it must import for
real (``LIGHT``: ``packaging``; for vLLM its pydantic and transformers side, about 760 MB); then the node-less helper
``helpers/engine_flags.py`` runs in it and builds the engine's own parser with the GPU stack and
every other missing package faked (FACTS: "The engines' own parsers, without a GPU"). The
manifest goes to ``src/sparkdeploy/data/engine-flags/<engine>-<version>.json``, by exact
version: a release candidate (``0.5.10rc0``) has its own, not its release's (``0.5.10``), whose
parser differs (``built_from`` and ``source`` say which wheel it was read from).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import venv
from pathlib import Path

from sparkdeploy import engines
from sparkdeploy.core.errors import UsageError
from sparkdeploy.core.files import write_text_atomic
from sparkdeploy.engines.flags import manifest_version

PKG = Path(engines.__file__).resolve().parents[1]
"""The package's directory (the checkout's ``src/sparkdeploy`` in an editable install)."""
HELPER = PKG / "helpers" / "engine_flags.py"
OUT = PKG / "data" / "engine-flags"
CACHE = Path.home() / ".cache" / "sparkdeploy" / "engine-flags"
FORMAT = 1
LIGHT = {name: k.flag_packages for name, k in engines.software().items()}
"""What each engine's parser needs installed for real (``Kind.flag_packages``)."""
_SPEC = re.compile(rf"^({'|'.join(map(re.escape, LIGHT))})==([0-9]+(?:\.[0-9]+)*)((?:rc|a|b)[0-9]+)?$")


class FlagMakerError(UsageError):
    """One line for the user."""


def parse_spec(spec: str) -> tuple[str, str]:
    m = _SPEC.match(spec)
    if not m:
        raise FlagMakerError(f"{spec}: not ENGINE==VERSION with ENGINE {' or '.join(LIGHT)}")
    return m.group(1), m.group(2) + (m.group(3) or "")


def scratch_python(engine: str, version: str, cache: Path = CACHE) -> Path:
    """The scratch virtualenv's python with the engine's wheel (no dependencies) in it."""
    root = cache / f"{engine}-{version}"
    py = root / "bin" / "python"
    if not (root / ".ready").exists():
        venv.create(root, with_pip=True, clear=True)
        pip = [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        for argv in ([*pip, "--no-deps", f"{engine}=={version}"], [*pip, *LIGHT[engine]]):
            cp = subprocess.run(argv, capture_output=True, text=True)
            if cp.returncode != 0:
                raise FlagMakerError(f"pip install {engine}=={version}: "
                                     + (cp.stderr.strip().splitlines() or ["failed"])[-1])
        (root / ".ready").touch()
    return py


def manifest(engine: str, version: str, parser: dict) -> dict:
    note = (f"built from the release candidate {version}, its own parser (not its release's)"
            if re.search(r"(rc|a|b)[0-9]+$", version) else f"built from {engine} {version}")
    return {"format": FORMAT, "engine": engine, "version": manifest_version(version),
            "built_from": f"{engine}=={version}",
            "note": note,
            "source": f"the {engine} {version} wheel (PyPI): its own argument parser, read by "
                      f"`nox -s engine_flags -- {engine}=={version}`",
            **parser}


def make(spec: str, out: Path = OUT, cache: Path = CACHE) -> Path:
    engine, version = parse_spec(spec)
    py = scratch_python(engine, version, cache)
    cp = subprocess.run([str(py), str(HELPER), engine, "--fake-missing"], capture_output=True,
                        text=True, cwd=str(cache))
    if cp.returncode != 0:
        raise FlagMakerError((cp.stderr.strip().splitlines() or [f"{HELPER.name} failed"])[-1])
    parser = json.loads(cp.stdout.strip().splitlines()[-1])
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{engine}-{manifest_version(version)}.json"
    write_text_atomic(path, json.dumps(manifest(engine, version, parser), indent=1,
                                       sort_keys=True) + "\n", mode=0o644)
    return path


def main(argv: list[str] | None = None) -> int:
    specs = list(sys.argv[1:] if argv is None else argv)
    if not specs:
        print("usage: nox -s engine_flags -- sglang==X vllm==Y", file=sys.stderr)
        return 2
    try:
        for spec in specs:
            path = make(spec)
            data = json.loads(path.read_text())
            print(f"{spec}: {path.name}: {len(data['options'])} options, "
                  f"{sum(len(o['flags']) for o in data['options'])} option strings")
    except FlagMakerError as e:
        print(f"engine_flags: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
