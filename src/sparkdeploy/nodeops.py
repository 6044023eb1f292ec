"""Small node-side helpers every step shares: the docker CLI argv, JSON probes, staging a file
on a node, the node's architecture.

A node that cannot be reached raises ``NodeUnreachable`` (from ``Host.run``; re-exported here);
a node that answers but cannot do what is asked raises ``HostError``."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shlex
from typing import Any

from sparkdeploy.hosts import Host, HostError, NodeUnreachable
from sparkdeploy.packaged import helper

__all__ = ["ARCH", "HostError", "NodeUnreachable", "docker", "inspect_image",
           "listed_tags", "node_arch", "free_space", "stage", "stage_script", "check_staged", "verified"]

ARCH = {"aarch64": "arm64", "arm64": "arm64", "x86_64": "amd64", "amd64": "amd64"}


def docker(host: Host, *args: str) -> list[str]:
    """The docker CLI on a node, always against the profile's socket for that node."""
    return ["docker", "-H", f"unix://{host.node.docker_socket}", *args]


def inspect_image(host: Host, ref: str) -> dict[str, Any] | None:
    """``docker image inspect`` as a dict, or None when the node does not have the image."""
    r = host.run(docker(host, "image", "inspect", "--format", "{{json .}}", ref), change=False)
    if r.exit_code != 0:
        return None
    return json.loads(r.stdout)


def listed_tags(host: Host) -> set[str]:
    """Every ``repo:tag`` the node's engine lists (an incomplete image is not listed)."""
    r = host.run(docker(host, "image", "ls", "--format", "{{.Repository}}:{{.Tag}}"), change=False)
    return {ln.strip() for ln in r.stdout.splitlines() if ln.strip()} if r.ok else set()


def free_space(host: Host, path: str) -> tuple[int, str] | None:
    """(free bytes, mount point) of the filesystem that holds (or will hold) ``path``."""
    script = 'p="$1"; while [ ! -e "$p" ]; do p=$(dirname "$p"); done; df -P -B1 -- "$p"'
    r = host.run(["sh", "-c", script, "sh", path], change=False)
    rows = r.stdout.strip().splitlines() if r.ok else []
    if len(rows) < 2:
        return None
    cols = rows[-1].split()
    return int(cols[3]), cols[-1]


def node_arch(host: Host) -> str:
    r = host.run(["uname", "-m"], change=False)
    if not r.ok:
        raise HostError(f"{host.name}: uname -m failed: {r.one_line_error()}")
    return ARCH.get(r.stdout.strip(), r.stdout.strip())


# The node's stage directory: private to the deploying user (created 0700, then checked: a
# directory, not a link, owned by us, mode 0700; anything else is refused, never reused).
# A staged file lives under its full sha256 and is re-checked against it before it is reused.
_STAGE_SH = r"""set -eu
umask 077
d="$4/sparkdeploy-stage-$(id -u)"
mkdir -m 700 "$d" 2>/dev/null || :
if [ -L "$d" ] || [ ! -d "$d" ] || [ "$(stat -c '%u %a' "$d")" != "$(id -u) 700" ]; then
  got=$(stat -c '%u %a' "$d" 2>/dev/null || echo '?')
  echo "$d is not a private directory (owner uid and mode: $got); remove it" >&2
  exit 3
fi
f="$d/$1/$2"
if ! { [ -f "$f" ] && printf '%s  %s\n' "$1" "$f" | sha256sum -c --status; }; then
  mkdir -p "$(dirname "$f")"
  t="$f.part.$$"  # this writer's own: two steps may stage the same helper at once
  printf %s "$3" | base64 -d > "$t"
  printf '%s  %s\n' "$1" "$t" | sha256sum -c --status || { rm -f "$t"; echo "$2 arrived corrupt" >&2; exit 4; }
  mv -f "$t" "$f"
fi
printf '%s\n' "$f"
"""
STAGE_BASE = "/tmp"
_DIGEST_RE = re.compile(r"/([0-9a-f]{64})/")


def stage(host: Host, name: str, content: str) -> str:
    """Put ``content`` on the node in its private stage directory, under the content's sha256,
    and return the path the node reports.

    Staging is scratch space, not deployment state: it runs in dry runs too so that read-only
    probes can use it. Run a staged helper through ``verified`` (or ``check_staged``)."""
    data = content.encode()
    digest = hashlib.sha256(data).hexdigest()
    # The content travels base64-encoded in argv (scripts and configs are small), so that
    # staging needs no stdin of its own.
    encoded = base64.b64encode(data).decode()
    r = host.run(["sh", "-c", _STAGE_SH, "sh", digest, name, encoded, STAGE_BASE], change=False)
    path = r.stdout.strip()
    if not r.ok or not path.endswith(f"/{digest}/{name}"):
        raise HostError(f"{host.name}: cannot stage {name}: {r.one_line_error()}")
    return path


def stage_script(host: Host, name: str) -> str:
    return stage(host, name, helper(name).read_text())


def check_staged(path: str) -> str:
    """A shell snippet that exits 97 unless the staged file still matches its sha256."""
    m = _DIGEST_RE.search(path)
    if not m:
        raise ValueError(f"not a staged path: {path}")
    line = f"{m.group(1)}  {path}\\n"
    return (f"printf {shlex.quote(line)} | sha256sum -c --status || "
            f"{{ echo {shlex.quote(path + ' differs from its sha256: not run')} >&2; exit 97; }}")


def verified(paths: list[str], argv: list[str]) -> list[str]:
    """``argv`` run only when every staged file in ``paths`` still matches its sha256."""
    checks = "; ".join(check_staged(p) for p in paths)
    return ["sh", "-c", f'{checks}; exec "$@"', "sh", *argv]

