"""Put the stand-ins (``systemctl``, ``nvidia-smi``, ...) on a node's PATH.

The node sees its private backing dir at ``/opt/sparkdeploy-lab``; ``bin/`` there is first on
PATH for sshd sessions (``SetEnv PATH=...``). Files are copied (not linked), so the lab keeps
working when the checkout that made it goes away. If ``sparkdeploy.lab.standins`` provides
``install(root: Path, node: str) -> list[str]`` it decides what goes where; otherwise every
file in that package without a suffix is an executable for ``bin/``, and the package itself is
copied flat to ``lib/`` (``/opt/sparkdeploy-lab/lib/gpu_user.py``).
"""

from __future__ import annotations

from pathlib import Path

from sparkdeploy.core.files import copy_if_changed
from sparkdeploy.lab import layout


def backing(node: str) -> Path:
    return layout.node_dir(node) / layout.PRIVATE_MOUNTS[layout.STANDIN_DIR]


def install(node: str) -> str:
    """Return what changed in one line, or '' when already up to date."""
    root = backing(node)
    (root / "bin").mkdir(parents=True, exist_ok=True)
    try:
        from sparkdeploy.lab import standins
    except ImportError:
        return ""
    hook = getattr(standins, "install", None)
    if callable(hook):
        did = hook(root, node) or []
        return ("installed " + ", ".join(did)) if did else ""
    src = Path(standins.__file__).parent
    did = []
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.suffix and not f.name.startswith((".", "_")):
            if copy_if_changed(f, root / "bin" / f.name, 0o755):
                did.append(f.name)
    lib = root / "lib"
    lib.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.glob("*.py")):
        if copy_if_changed(f, lib / f.name, 0o644):
            did.append(f"lib/{f.name}")
    return ("installed " + ", ".join(did)) if did else ""
