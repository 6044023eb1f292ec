"""sparkdeploy's node-side helper for ``cluster.discover`` (standard library only).

Subcommands (each prints one JSON object on stdout):

  facts --model-path PATH --link LINK_NODE_PY --memory MEMORY_NODE_PY
      Everything a profile needs of this node and a deployment depends on, in one read:
      - ``machine``: ``uname -m`` (``platform.machine()``);
      - ``memory``: ``memory_node.py``'s answer (the GPUs nvidia-smi lists, their names, the
        memory they can use: ``/proc/meminfo`` on a GB10, whose nvidia-smi shows ``[N/A]``);
      - ``disk``: the free bytes of the filesystem that holds (or will hold) the model path,
        and its mount point;
      - ``docker``: the socket the SSH session's ``docker`` uses (``$DOCKER_HOST`` when it
        names a unix socket, else ``/var/run/docker.sock``), and ``docker info``'s server
        version, storage driver, image store (``containerd`` when the driver-type is
        ``io.containerd.snapshotter.v1``, else ``classic``) and runtimes (``nvidia`` among
        them or not);
      - ``privilege``: root, or whether ``sudo -n true`` works (``password`` when sudo asks
        for one);
      - ``tools``: where ``rsync``, ``python3``, ``nvidia-smi`` and ``docker`` are (null: absent);
      - ``link``: ``link_node.py``'s facts (interfaces, RDMA devices, twins, ibdev2netdev).
      The two other helpers are loaded from the paths given (staged beside this one).

  answers --from ADDR [--port N] [--timeout S] ADDR...
      Whether each address answers from this node's address ADDR: a TCP connection to port N
      (22) with ADDR as its source; an accepted connection or a refusal (a RST) both mean the
      peer's address answered, a timeout or an unreachable network mean it did not. (A ping
      that needs no ``ping`` installed.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import socket
import sys

try:  # in the package (the controller, the tests)
    from . import protocol
except ImportError:  # a script: protocol.py beside it (a checkout) or a directory up (staged on a node)
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [_here, os.path.dirname(_here)]
    import protocol  # type: ignore[import-not-found, no-redef]

VERSION = 1
DEFAULT_SOCKET = "/var/run/docker.sock"
SNAPSHOTTER = "io.containerd.snapshotter.v1"


def load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"error: cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def last(text: str, fallback: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else fallback


# --- disk ------------------------------------------------------------------------------------


def disk(path: str) -> dict:
    """Free bytes where ``path`` is (or will be): its closest existing ancestor's filesystem."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != "/":
        p = os.path.dirname(p)
    try:
        st = os.statvfs(p)
    except OSError as e:
        return {"path": path, "probed": p, "free": None, "mount": None, "why": e.strerror}
    mount = os.path.realpath(p)
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    return {"path": path, "probed": p, "free": st.f_bavail * st.f_frsize, "mount": mount,
            "why": ""}


# --- docker ----------------------------------------------------------------------------------


def docker_socket(env: dict) -> tuple[str, str]:
    """(socket path, where it was read): ``$DOCKER_HOST`` (unix://) or the default."""
    host = env.get("DOCKER_HOST", "")
    if host.startswith("unix://"):
        return host[len("unix://"):], "$DOCKER_HOST of the SSH session"
    return DEFAULT_SOCKET, "the default socket"


def judge_docker(info: dict) -> dict:
    """What ``docker info --format '{{json .}}'`` says a deployment depends on."""
    status = info.get("DriverStatus") or []
    driver_type = next((v for k, v in (s for s in status if isinstance(s, list) and len(s) == 2)
                        if k == "driver-type"), None)
    runtimes = sorted((info.get("Runtimes") or {}).keys())
    return {"version": info.get("ServerVersion"), "driver": info.get("Driver"),
            "store": "containerd" if driver_type == SNAPSHOTTER else "classic",
            "runtimes": runtimes, "default_runtime": info.get("DefaultRuntime"),
            "nvidia_runtime": "nvidia" in runtimes}


def docker(env: dict) -> dict:
    sock, source = docker_socket(env)
    base: dict[str, object] = {"socket": sock, "socket_from": source, "version": None, "driver": None,
            "store": None, "runtimes": [], "default_runtime": None, "nvidia_runtime": False,
            "why": ""}
    if not shutil.which("docker"):
        return {**base, "why": "docker: not installed"}
    rc, out, err = protocol.run(["docker", "-H", f"unix://{sock}", "info", "--format", "{{json .}}"])
    try:
        info = json.loads(out) if out.strip() else {}
    except ValueError:
        info = {}
    if not isinstance(info, dict) or not info.get("ServerVersion"):
        errors = info.get("ServerErrors") if isinstance(info, dict) else None
        why = errors[-1] if errors else last(err, f"docker info: exit code {rc}")
        return {**base, "why": why}
    return {**base, **judge_docker(info)}


# --- privilege -------------------------------------------------------------------------------


def privilege() -> dict:
    if os.geteuid() == 0:
        return {"root": True, "sudo": "not needed", "why": ""}
    if not shutil.which("sudo"):
        return {"root": False, "sudo": "absent", "why": "sudo: not installed"}
    rc, _, err = protocol.run(["sudo", "-n", "true"], timeout=15)
    if rc == 0:
        return {"root": False, "sudo": "ok", "why": ""}
    if "password is required" in err or "a terminal is required" in err:
        return {"root": False, "sudo": "password", "why": last(err, "a password is required")}
    return {"root": False, "sudo": "denied", "why": last(err, f"sudo -n true: exit code {rc}")}


def facts(model_path: str, link_node, memory_node) -> dict:
    return {"version": VERSION, "machine": platform.machine(),
            "python": platform.python_version(),
            "user": os.environ.get("USER") or os.environ.get("LOGNAME") or str(os.geteuid()),
            "privilege": privilege(),
            "tools": {t: shutil.which(t) for t in ("rsync", "python3", "nvidia-smi", "docker")},
            "memory": memory_node.read_node(), "disk": disk(model_path),
            "docker": docker(dict(os.environ)), "link": link_node.facts()}


# --- answers ---------------------------------------------------------------------------------


def answers(source: str, addrs: list[str], port: int = 22, timeout: float = 3) -> dict:
    out = {}
    for addr in addrs:
        try:
            with socket.create_connection((addr, port), timeout=timeout,
                                          source_address=(source, 0)):
                out[addr] = {"answered": True, "how": f"port {port} accepted"}
        except ConnectionRefusedError:
            out[addr] = {"answered": True, "how": f"port {port} refused (the address answered)"}
        except TimeoutError:
            out[addr] = {"answered": False, "how": f"no answer in {timeout:g}s"}
        except OSError as e:
            out[addr] = {"answered": False, "how": e.strerror or str(e)}
    return {"version": VERSION, "from": source, "answers": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cluster_node.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("facts")
    f.add_argument("--model-path", required=True)
    f.add_argument("--link", required=True)
    f.add_argument("--memory", required=True)
    a = sub.add_parser("answers")
    a.add_argument("--from", dest="source", required=True)
    a.add_argument("--port", type=int, default=22)
    a.add_argument("--timeout", type=float, default=3)
    a.add_argument("addrs", nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "facts":
        answer = facts(args.model_path, load("link_node", args.link),
                       load("memory_node", args.memory))
    else:
        answer = answers(args.source, args.addrs, args.port, args.timeout)
    protocol.answer(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
