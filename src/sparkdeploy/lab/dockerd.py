"""Each node's Docker daemon (``dockerd``), in one of three flavors: Docker 26 from Debian
trixie (default), bookworm's 20.10, or Docker 26 on the containerd image store with its own
containerd daemon. ``docker(node, ...)`` is the lab's one docker CLI helper."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from collections.abc import Sequence
from pathlib import Path

from sparkdeploy.core.files import move_in
from sparkdeploy.core.wait import Stop, WaitTimeout, wait_for
from sparkdeploy.lab import layout
from sparkdeploy.lab.proc import LabError, alive, clean_stale_tmp, in_node, remove_tree, run, spawn

DOCKER26_DIR = layout.CACHE_DIR / "docker26"
DOCKER26_DOCKERD = DOCKER26_DIR / "usr" / "sbin" / "dockerd"
CLASSIC_DOCKERD = "/usr/sbin/dockerd"
SNAPSHOTTER_DRIVER = "io.containerd.snapshotter.v1"
NVIDIA_RUNTIME = f"{layout.STANDIN_DIR}/bin/nvidia-container-runtime"
RUNC_STANDIN = f"{layout.STANDIN_DIR}/runtime/runc"
"""runc behind the rlimit stand-in (standins/runc): first on dockerd's PATH, so every container
goes through it; also registered as ``lab-runc``, which names it in the recorded argv."""
"""The ``nvidia`` runtime stand-in (inside the node's mount namespace)."""


def debian_mirror(sources: Path = Path("/etc/apt/sources.list.d/debian.sources")) -> str:
    """The machine's configured Debian mirror (first ``URIs:`` of a suite without -security)."""
    try:
        text = sources.read_text()
    except OSError:
        text = ""
    for stanza in text.split("\n\n"):
        uris = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
        suites = re.search(r"^Suites:\s*(.+)$", stanza, re.M)
        if uris and suites and "security" not in suites.group(1):
            return uris.group(1).rstrip("/")
    legacy = Path("/etc/apt/sources.list")
    if legacy.exists():
        for line in legacy.read_text().splitlines():
            m = re.match(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+\S+", line)
            if m and "security" not in line:
                return m.group(1).rstrip("/")
    return "http://deb.debian.org/debian"


def _apt(suite: str) -> tuple[Path, list[str]]:
    """The suite's own apt setup under ``CACHE_DIR/apt-<suite>/`` (a sources list and lists dir
    of its own: the system's apt setup is untouched), its lists updated; (dir, apt options)."""
    cache = layout.CACHE_DIR / f"apt-{suite}"
    (cache / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (cache / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    src = cache / "sources.list"
    src.write_text(f"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
                   f"{debian_mirror()} {suite} main\n")
    opts = ["-o", f"Dir::Etc::SourceList={src}", "-o", "Dir::Etc::SourceParts=/nonexistent",
            "-o", f"Dir::State::Lists={cache / 'lists'}",
            "-o", f"Dir::Cache::Archives={cache / 'archives'}",
            "-o", "APT::Get::List-Cleanup=0"]
    run(["apt-get", *opts, "update"], timeout=600)
    return cache, opts


def apt_download(suite: str, packages: Sequence[str]) -> list[Path]:
    """Debian ``suite``'s current .deb of each package, in ``CACHE_DIR/apt-<suite>/`` (older
    downloads of those packages removed): the newest file of each, in ``packages``' order."""
    cache, opts = _apt(suite)
    for pkg in packages:
        for old in cache.glob(f"{pkg}_*.deb"):
            old.unlink()
    run(["apt-get", *opts, "download", *packages], cwd=cache, timeout=600)
    out = []
    for pkg in packages:
        debs = sorted(cache.glob(f"{pkg}_*.deb"))
        if not debs:
            raise LabError(f"apt-get download {pkg} ({suite}) left no .deb")
        out.append(debs[-1])
    return out


def apt_closure(suite: str, packages: Sequence[str], status: bytes) -> list[Path]:
    """The .debs that installing ``packages`` (no recommends) onto a system whose dpkg status
    is ``status`` needs: apt resolves against that status, downloads only, into a folder of
    its own per (suite, packages, status), kept: a second call asks no network."""
    key = hashlib.sha256(json.dumps([suite, list(packages)]).encode() + status).hexdigest()[:16]
    cache = layout.CACHE_DIR / f"apt-{suite}"
    out = cache / "closures" / key
    if (out / ".done").exists():
        return sorted(out.glob("*.deb"))
    cache, opts = _apt(suite)
    (out / "partial").mkdir(parents=True, exist_ok=True)
    (out / "status").write_bytes(status)
    opts = [o if not o.startswith("Dir::Cache::Archives=") else f"Dir::Cache::Archives={out}"
            for o in opts]
    run(["apt-get", *opts, "-o", f"Dir::State::status={out / 'status'}", "-o",
         "Debug::NoLocking=1", "install", "--download-only", "--no-install-recommends", "-y",
         *packages], timeout=900)
    debs = sorted(out.glob("*.deb"))
    if not debs:
        raise LabError(f"apt-get install --download-only {' '.join(packages)} ({suite}) left no .deb")
    (out / ".done").touch()
    return debs


def unpack(suite: str, package: str, into: Path) -> Path:
    """Debian ``suite``'s current .deb of ``package`` unpacked (``dpkg -x``) as ``into``, whole
    or not at all (built beside it, then moved in); the .deb."""
    [deb] = apt_download(suite, [package])
    clean_stale_tmp(into.parent, into.name)
    tmp = into.parent / f"{into.name}.{os.getpid()}.tmp"
    remove_tree(tmp)
    run(["dpkg", "-x", str(deb), str(tmp)])
    remove_tree(into)
    move_in(tmp, into)
    return deb


def ensure_docker26() -> tuple[bool, str]:
    """Docker 26's dockerd from trixie's ``docker.io``, unpacked under the cache.
    Returns (changed, why)."""
    if DOCKER26_DOCKERD.exists():
        return False, f"{DOCKER26_DOCKERD} cached"
    deb = unpack("trixie", "docker.io", DOCKER26_DIR)
    ver = run([str(DOCKER26_DOCKERD), "--version"], check=False).stdout.strip()
    return True, f"unpacked {deb.name} ({ver})"


def storage_driver(flavor: str) -> str:
    """overlay2 works inside a node's mount namespace on this machine's ext4 (measured:
    vfs would copy every layer fully); fall back to vfs where overlay is unavailable. With the
    containerd image store the flag names a containerd snapshotter (overlayfs, native)."""
    try:
        overlay = "overlay" in Path("/proc/filesystems").read_text()
    except OSError:
        overlay = False
    if flavor == "containerd":
        return "overlayfs" if overlay else "native"
    return "overlay2" if overlay else "vfs"


def flavor_dir(node: str, flavor: str) -> Path:
    return layout.node_dir(node) / "docker" / flavor


def containerd_argv(node: str, mntns: Path, netns: Path, flavor: str) -> list[str]:
    d = flavor_dir(node, flavor) / "containerd"
    return in_node(mntns, netns, ["containerd", "--config", str(d / "config.toml")])


def start_containerd(node: str, mntns: Path, netns: Path, flavor: str) -> dict:
    d = flavor_dir(node, flavor) / "containerd"
    (d / "state").mkdir(parents=True, exist_ok=True)
    # the node's own /run/containerd (a private mount), seen from here
    sock = (layout.node_dir(node) / layout.PRIVATE_MOUNTS[layout.CONTAINERD_RUN_DIR]
            / "containerd.sock")
    (d / "config.toml").write_text(
        "version = 2\n"
        f'root = "{layout.CONTAINERD_ROOT}"\n'
        f'state = "{d / "state"}"\n'
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
        "[grpc]\n"
        f'  address = "{containerd_socket(node, flavor)}"\n'
        "[ttrpc]\n"
        f'  address = "{containerd_socket(node, flavor)}.ttrpc"\n'
        "[debug]\n"
        f'  address = "{d / "debug.sock"}"\n'
    )
    rec = spawn(containerd_argv(node, mntns, netns, flavor),
                layout.node_dir(node) / "log" / "containerd.log", env=_env())
    rec["socket"] = str(sock)
    _wait_for_socket(sock, "containerd", node, rec)
    return rec


def containerd_socket(node: str, flavor: str) -> str:
    """containerd's socket as the node sees it (see layout.CONTAINERD_RUN_DIR)."""
    return f"{layout.CONTAINERD_RUN_DIR}/containerd.sock"


def dockerd_argv(node: str, mntns: Path, netns: Path, flavor: str) -> list[str]:
    """The exact command a node's dockerd runs with (compared with the recorded one)."""
    d = flavor_dir(node, flavor)
    binary = CLASSIC_DOCKERD if flavor == "classic20" else str(DOCKER26_DOCKERD)
    argv = [binary, "--config-file", str(d / "daemon.json"), "--data-root", str(d / "data"),
            "--exec-root", str(d / "exec"),
            "--pidfile", str(layout.node_dir(node) / "run" / "docker.pid"),
            "-H", f"unix://{layout.docker_socket(node)}",
            "--storage-driver", storage_driver(flavor),
            "--iptables=false", "--ip-masq=false", "--bridge=none",
            "--add-runtime", f"nvidia={NVIDIA_RUNTIME}", "--add-runtime", f"lab-runc={RUNC_STANDIN}"]
    if flavor == "containerd":
        argv += ["--containerd", containerd_socket(node, flavor)]
    return in_node(mntns, netns, argv)


def start_dockerd(node: str, mntns: Path, netns: Path, flavor: str) -> dict:
    d = flavor_dir(node, flavor)
    for sub in ("data", "exec"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (layout.node_dir(node) / "run").mkdir(parents=True, exist_ok=True)
    # the recorded dockerd is gone (checked by PID and start time); its pidfile may name a
    # zombie or a recycled PID, which dockerd would take for a running daemon
    (layout.node_dir(node) / "run" / "docker.pid").unlink(missing_ok=True)
    cfg: dict = {}
    if flavor == "containerd":
        cfg["features"] = {"containerd-snapshotter": True}
    (d / "daemon.json").write_text(json.dumps(cfg, indent=2) + "\n")
    sock = layout.docker_socket(node)
    rec = spawn(dockerd_argv(node, mntns, netns, flavor),
                layout.node_dir(node) / "log" / "dockerd.log", env=_env())
    rec["socket"] = sock
    rec["flavor"] = flavor
    _wait_for_socket(Path(sock), "dockerd", node, rec, timeout=60)
    return rec


def _env() -> dict[str, str]:
    # bookworm's containerd and runc first (trixie's runc needs a newer glibc)
    env = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TZ")}
    # the node's stand-ins last: nvidia-container-runtime-hook on dockerd's PATH is what makes
    # dockerd accept `docker run --gpus ...` (see standins/nvidia-container-runtime-hook)
    # and the rlimit stand-in's runc first (a Spark's dockerd may raise rlimits; this machine's
    # may not: see standins/runc)
    env["PATH"] = (f"{layout.STANDIN_DIR}/runtime:/usr/bin:/usr/sbin:/bin:/sbin:"
                   + str(DOCKER26_DIR / "usr" / "bin") + f":{layout.STANDIN_DIR}/bin")
    env["HOME"] = "/root"
    return env


def _socket_answers(sock: Path) -> bool:
    if not sock.exists():
        return False
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(str(sock))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _wait_for_socket(sock: Path, what: str, node: str, rec: dict, timeout: float = 30) -> None:

    def probe() -> bool:
        if _socket_answers(sock):
            return True
        if not alive(rec):
            raise Stop
        return False

    try:
        wait_for(probe, deadline=timeout, interval=0.2, what=f"{what} on {sock}")
        return
    except (WaitTimeout, Stop):
        pass
    tail = ""
    try:
        tail = Path(rec["log"]).read_text().strip().splitlines()[-1][:200]
    except (OSError, IndexError):
        pass
    raise LabError(f"{node}: {what} did not come up on {sock}: {tail}")


def url(node: str) -> str:
    """A node's dockerd for the docker CLI's ``-H`` and the docker SDK's ``base_url``."""
    return f"unix://{layout.docker_socket(node)}"


def docker(node: str, *args: str) -> list[str]:
    """argv for the docker CLI against a node's dockerd (from the controller)."""
    return ["docker", "-H", url(node), *args]


def info(node: str) -> dict | None:
    cp = run(docker(node, "info", "--format", "{{json .}}"), check=False, timeout=30)
    if cp.returncode != 0:
        return None
    try:
        return json.loads(cp.stdout)
    except ValueError:
        return None
