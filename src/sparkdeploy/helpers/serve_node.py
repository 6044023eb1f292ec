"""sparkdeploy's node-side helper for serving (standard library only).

Subcommands (each prints one JSON object on stdout):

  facts --iface IF --addr A [--hca H ...] [--port P ...] [--model DIR] [--peer ADDR ...]
      What ``serve.up`` checks before it starts anything on this node:
      - the fast-link interface: exists, up, its IPv4 addresses, MTU (``ip -j addr``);
      - the RoCE v2 GID index of address A on the HCAs (``/sys/class/infiniband/<hca>/ports/1/
        gids/N`` holding A as an IPv4-mapped GID and ``gid_attrs/types/N`` = ``RoCE v2``),
        and whether ``/dev/infiniband`` exists;
      - which of the ports something listens on (``/proc/net/tcp``, ``tcp6``), with the
        process when it can be found;
      - whether the weights are there: ``config.json`` and every shard the safetensors index
        names (or at least one ``*.safetensors``), none empty;
      - whether each peer answers on the fast link from address A (a TCP connection to its
        port 22 that is accepted or refused proves the path; a timeout does not).
  connect --addr A --port P [--source S] [--timeout T]
      Whether a TCP connection to A:P is accepted (``{"open": true}``).
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import os
import socket
import subprocess
import sys

try:  # in the package (the controller, the tests)
    from . import protocol
except ImportError:  # a script: protocol.py beside it (a checkout) or a directory up (staged on a node)
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [_here, os.path.dirname(_here)]
    import protocol  # type: ignore[import-not-found, no-redef]

IB = "/sys/class/infiniband"


def iface_facts(iface: str) -> dict:
    """From ``ip -j addr`` (the caller's network namespace; /sys/class/net shows the namespace
    that mounted /sys, which is not always the caller's)."""
    try:
        cp = subprocess.run(["ip", "-j", "addr", "show", "dev", iface], capture_output=True,
                            text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"exists": False, "up": False, "addrs": [], "mtu": None, "why": str(e)}
    try:
        info = json.loads(cp.stdout)[0] if cp.returncode == 0 else None
    except (ValueError, IndexError):
        info = None
    if not info:
        return {"exists": False, "up": False, "addrs": [], "mtu": None}
    oper = str(info.get("operstate", "UNKNOWN")).lower()
    flags = info.get("flags") or []
    up = oper == "up" or (oper == "unknown" and "UP" in flags and "LOWER_UP" in flags)
    addrs = [a["local"] for a in info.get("addr_info") or [] if a.get("family") == "inet"]
    return {"exists": True, "up": up, "operstate": oper, "addrs": addrs, "mtu": info.get("mtu")}


def gid_facts(hcas: list[str], addr: str, iface: str) -> dict:
    want = ipaddress.ip_address(addr)
    seen = []
    found: list[dict] = []
    for hca in hcas:
        gids = f"{IB}/{hca}/ports/1/gids"
        if not os.path.isdir(gids):
            seen.append(f"{hca}: absent")
            continue
        names = sorted((n for n in os.listdir(gids) if n.isdigit()), key=int)
        for n in names:
            gid = protocol.read(f"{gids}/{n}")
            kind = protocol.read(f"{IB}/{hca}/ports/1/gid_attrs/types/{n}")
            if not gid or kind is None or kind.strip() != "RoCE v2":
                continue
            try:
                mapped = ipaddress.IPv6Address(gid).ipv4_mapped
            except ValueError:
                continue
            if mapped == want:
                ndev = protocol.read(f"{IB}/{hca}/ports/1/gid_attrs/ndevs/{n}")
                found.append({"hca": hca, "index": int(n), "ndev": ndev})
        if not any(f["hca"] == hca for f in found):
            seen.append(f"{hca}: no RoCE v2 GID for {addr}")
    found.sort(key=lambda f: (f["ndev"] != iface, hcas.index(f["hca"])))
    best = found[0] if found else None
    return {"index": best["index"] if best else None, "hca": best["hca"] if best else None,
            "all": found, "why": "; ".join(seen)}


def _listeners() -> dict[int, str]:
    """{port: socket inode} for every listening TCP socket (IPv4 and IPv6)."""
    out: dict[int, str] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == "0A":
                        out.setdefault(int(cols[1].rsplit(":", 1)[1], 16), cols[9])
        except OSError:
            continue
    return out


def _owner(inode: str) -> str | None:
    target = f"socket:[{inode}]"
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    comm = protocol.read(f"/proc/{pid}/comm") or "?"
                    return f"pid {pid} {comm}"
        except OSError:
            continue
    return None


def port_facts(ports: list[int]) -> dict:
    listening = _listeners()
    out = {}
    for p in ports:
        if p in listening:
            out[str(p)] = {"free": False, "owner": _owner(listening[p])}
        else:
            out[str(p)] = {"free": True}
    return out


def model_facts(path: str) -> dict:
    if not os.path.isdir(path):
        return {"present": False, "why": f"{path} does not exist"}
    missing = []
    if not os.path.isfile(os.path.join(path, "config.json")):
        missing.append("config.json")
    index = os.path.join(path, "model.safetensors.index.json")
    shards: list[str] = []
    if os.path.isfile(index):
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        except (OSError, ValueError):
            missing.append("model.safetensors.index.json (unreadable)")
    else:
        shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not shards:
            missing.append("*.safetensors")
    for s in shards:
        full = os.path.join(path, s)
        if not os.path.isfile(full) or os.path.getsize(full) == 0:
            missing.append(s)
    why = ""
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        why = "missing or empty: " + ", ".join(missing[:3]) + more
    return {"present": not missing, "shards": len(shards), "missing": missing, "why": why}


def connect(addr: str, port: int, source: str | None = None, timeout: float = 3.0) -> dict:
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        if source:
            s.bind((source, 0))
        s.connect((addr, port))
        return {"open": True, "reachable": True}
    except ConnectionRefusedError:
        return {"open": False, "reachable": True, "why": "connection refused"}
    except OSError as e:
        why = "timed out" if isinstance(e, socket.timeout) else (
            e.strerror or errno.errorcode.get(e.errno or 0, str(e)))
        return {"open": False, "reachable": False, "why": why}
    finally:
        s.close()


def cmd_facts(a: argparse.Namespace) -> int:
    out = {
        "iface": iface_facts(a.iface),
        "gid": gid_facts(a.hca, a.addr, a.iface),
        "rdma_devices": os.path.isdir("/dev/infiniband"),
        "ports": port_facts(a.port),
        "peers": {p: connect(p, 22, a.addr) for p in a.peer},
    }
    if a.model:
        out["model"] = model_facts(a.model)
    protocol.answer(out)
    return 0


def cmd_connect(a: argparse.Namespace) -> int:
    protocol.answer(connect(a.addr, a.port, a.source, a.timeout))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="serve_node.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("facts")
    f.add_argument("--iface", required=True)
    f.add_argument("--addr", required=True)
    f.add_argument("--hca", action="append", default=[])
    f.add_argument("--port", action="append", type=int, default=[])
    f.add_argument("--model")
    f.add_argument("--peer", action="append", default=[])
    c = sub.add_parser("connect")
    c.add_argument("--addr", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--source")
    c.add_argument("--timeout", type=float, default=3.0)
    a = p.parse_args(argv)
    return cmd_facts(a) if a.cmd == "facts" else cmd_connect(a)


if __name__ == "__main__":
    sys.exit(main())
