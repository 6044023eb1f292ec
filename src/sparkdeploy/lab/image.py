"""The lab base image: a debootstrap'd bookworm with Python 3, cached as a tarball,
imported once and loaded into every node's dockerd (same image ID everywhere)."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile

from sparkdeploy.core.files import move_in
from sparkdeploy.lab import layout
from sparkdeploy.lab.dockerd import debian_mirror, docker
from sparkdeploy.lab.proc import LabError, clean_stale_tmp, remove_tree, run

BASE_TAR = layout.CACHE_DIR / "base-bookworm.tar"
INCLUDE = "python3,python3-venv,python3-pip"


def ensure_base_tarball() -> tuple[bool, str]:
    if BASE_TAR.exists() and BASE_TAR.stat().st_size > 0:
        return False, f"{BASE_TAR} cached ({BASE_TAR.stat().st_size // 2**20} MB)"
    layout.CACHE_DIR.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(layout.CACHE_DIR, "rootfs-bookworm")
    clean_stale_tmp(layout.CACHE_DIR, "base-bookworm.tar")
    rootfs = layout.CACHE_DIR / f"rootfs-bookworm.{os.getpid()}.tmp"
    remove_tree(rootfs)
    run(["debootstrap", "--variant=minbase", f"--include={INCLUDE}", "bookworm", str(rootfs),
         debian_mirror()], timeout=1200)
    # no apt lists or caches in the image; a lab hostname
    run(["rm", "-rf", str(rootfs / "var/cache/apt/archives"), str(rootfs / "var/lib/apt/lists")])
    (rootfs / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)
    (rootfs / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
    tmp = layout.CACHE_DIR / f"base-bookworm.tar.{os.getpid()}.tmp"
    run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(tmp), "."], timeout=600)
    move_in(tmp, BASE_TAR)
    remove_tree(rootfs)
    return True, f"debootstrap bookworm -> {BASE_TAR} ({BASE_TAR.stat().st_size // 2**20} MB)"


def image_id(node: str, ref: str = layout.BASE_IMAGE) -> str | None:
    cp = run(docker(node, "image", "inspect", "--format", "{{json .}}", ref), check=False,
             timeout=60)
    if cp.returncode != 0:
        return None
    data = json.loads(cp.stdout)
    labels = (data.get("Config") or {}).get("Labels") or {}
    if labels.get(layout.STANDIN_LABEL) != "true":
        return None
    return data.get("Id")


def listed(node: str, ref: str = layout.BASE_IMAGE) -> bool:
    cp = run(docker(node, "images", "--format", "{{.Repository}}:{{.Tag}}"), check=False)
    return ref in cp.stdout.split()


def import_into(node: str) -> str:
    """``docker import`` the cached tarball into one node's dockerd; return the image ID."""
    with open(BASE_TAR, "rb") as fh:
        cp = subprocess.run(
            docker(node, "import", "-c", f"LABEL {layout.STANDIN_LABEL}=true",
                   "-c", 'CMD ["/bin/bash"]', "-c", "ENV LANG=C.UTF-8",
                   "-m", "sparkdeploy lab base (debootstrap bookworm minbase + python3)",
                   "-", layout.BASE_IMAGE),
            stdin=fh, capture_output=True, text=True, timeout=600)
    if cp.returncode != 0:
        raise LabError(f"{node}: docker import failed: {cp.stderr.strip()[-200:]}")
    iid = image_id(node)
    if not iid:
        raise LabError(f"{node}: {layout.BASE_IMAGE} not found after import")
    return iid


def copy_image(src: str, dst: str, ref: str = layout.BASE_IMAGE) -> None:
    """``docker save`` on one node's dockerd piped into ``docker load`` on another's dockerd."""
    save = subprocess.Popen(docker(src, "save", ref), stdout=subprocess.PIPE)
    assert save.stdout is not None  # stdout=PIPE
    load = subprocess.run(docker(dst, "load", "-q"), stdin=save.stdout, capture_output=True,
                          text=True, timeout=600)
    save.stdout.close()
    rc = save.wait()
    if rc != 0 or load.returncode != 0:
        raise LabError(f"copying {ref} {src} -> {dst} failed: {load.stderr.strip()[-200:]}")


def ensure_base_image(nodes: list[str]) -> dict[str, str]:
    """Per node: 'ok' or 'changed (...)'. The first node imports; the others load its save."""
    out: dict[str, str] = {}
    first = nodes[0]
    have = {n: image_id(n) for n in nodes}
    if have[first] and listed(first):
        ref_id = have[first]
        out[first] = "ok"
    else:
        ref_id = import_into(first)
        out[first] = "changed: imported"
    for n in nodes[1:]:
        if have[n] and listed(n) and (have[n] == ref_id or _same_layers(first, n)):
            out[n] = "ok"
            continue
        copy_image(first, n)
        out[n] = f"changed: loaded from {first}"
    return out


def _same_layers(a: str, b: str) -> bool:
    def layers(n: str) -> list[str]:
        cp = run(docker(n, "image", "inspect", "--format", "{{json .RootFS.Layers}}",
                        layout.BASE_IMAGE), check=False)
        return json.loads(cp.stdout) if cp.returncode == 0 else []
    la = layers(a)
    return bool(la) and la == layers(b)


def images(node: str) -> list[str]:
    cp = run(docker(node, "images", "--format", "{{.Repository}}:{{.Tag}} {{.ID}} {{.Size}}"),
             check=False, timeout=30)
    return [ln for ln in cp.stdout.splitlines() if ln.strip()] if cp.returncode == 0 else []


def base_status() -> bytes:
    """The base image's dpkg status (what its packages are), read from the cached tarball."""
    with tarfile.open(BASE_TAR) as tar:
        f = tar.extractfile("./var/lib/dpkg/status")
        if f is None:
            raise LabError(f"{BASE_TAR}: no var/lib/dpkg/status")
        return f.read()
