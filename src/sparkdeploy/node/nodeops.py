"""Small node-side helpers every step shares: the docker CLI argv, JSON probes, staging a file
on a node, the node's architecture, and ``run_helper``: the one way a step runs a node helper
(staged, checked against its sha256, its ``progress k=v ...`` lines read, its JSON answer typed).

A node that cannot be reached raises ``NodeUnreachable`` (from ``Host.run``; re-exported here);
a node that answers but cannot do what is asked raises ``HostError``."""

from __future__ import annotations

import base64
import hashlib
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel

from sparkdeploy.core.outside import OutsideError, last_line, parsed
from sparkdeploy.core.packaged import helper
from sparkdeploy.node.hosts import Feed, Host, HostError, NodeUnreachable

T = TypeVar("T", bound=BaseModel)

__all__ = ["ARCH", "HostError", "NodeUnreachable", "docker", "inspect_image",
           "listed_tags", "tagged", "node_arch", "free_space", "stage", "stage_script", "staged_files",
           "check_staged", "verified", "watched",
           "HelperFailed", "run_helper", "parse_progress", "parse_event", "parse_report", "helper_error", "NODE_STATE",
           "read_node_file", "write_node_file"]

ARCH = {"aarch64": "arm64", "arm64": "arm64", "x86_64": "amd64", "amd64": "amd64"}


def docker(host: Host, *args: str) -> list[str]:
    """The docker CLI on a node, always against the profile's socket for that node."""
    return ["docker", "-H", f"unix://{host.node.docker_socket}", *args]


def inspect_image(host: Host, ref: str) -> dict[str, Any] | None:
    """``docker image inspect`` as a dict, or None when the node does not have the image."""
    r = host.run(docker(host, "image", "inspect", "--format", "{{json .}}", ref), change=False)
    if r.exit_code != 0:
        return None
    return parsed(r.stdout, f"{host.name}: docker image inspect {ref}")


def tagged(ref: str) -> str:
    """The name Docker lists a reference under (``:latest`` when it names no tag)."""
    return ref if ":" in ref.rsplit("/", 1)[-1] else f"{ref}:latest"


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
put() {  # put SHA256 PATH BASE64: the file at PATH unless it is there already, whole
  if ! { [ -f "$2" ] && printf '%s  %s\n' "$1" "$2" | sha256sum -c --status; }; then
    mkdir -p "$(dirname "$2")"
    t="$2.part.$$"  # this writer's own: two steps may stage the same helper at once
    printf %s "$3" | base64 -d > "$t"
    printf '%s  %s\n' "$1" "$t" | sha256sum -c --status || { rm -f "$t"; echo "${2##*/} arrived corrupt" >&2; exit 4; }
    mv -f "$t" "$2"
  fi
}
if [ $# -gt 4 ]; then put "$5" "$d/$5/$6" "$7"; d="$d/$5"; fi  # a helper's protocol.py, a level up
f="$d/$1/$2"
put "$1" "$f" "$3"
printf '%s\n' "$f"
"""
STAGE_BASE = "/tmp"
_DIGEST_RE = re.compile(r"/([0-9a-f]{64})(?=/)")
PROTOCOL = "protocol.py"
"""What every helper imports, staged one directory above it (``helpers/protocol.py``)."""


def stage(host: Host, name: str, content: str, protocol: str | None = None) -> str:
    """Put ``content`` on the node in its private stage directory, under the content's sha256,
    and return the path the node reports; with ``protocol`` (a helper's), that is staged too
    and the content goes one directory below it (``<its sha256>/<content's sha256>/name``).

    Staging is scratch space, not deployment state: it runs in dry runs too so that read-only
    probes can use it. Run a staged helper through ``verified`` (or ``check_staged``)."""
    data = content.encode()
    digest = hashlib.sha256(data).hexdigest()
    # The content travels base64-encoded in argv (scripts and configs are small), so that
    # staging needs no stdin of its own; the protocol rides in the same round trip.
    encoded = base64.b64encode(data).decode()
    also: list[str] = []
    if protocol is not None:
        raw = protocol.encode()
        also = [hashlib.sha256(raw).hexdigest(), PROTOCOL, base64.b64encode(raw).decode()]
    r = host.run(["sh", "-c", _STAGE_SH, "sh", digest, name, encoded, STAGE_BASE, *also], change=False)
    path = r.stdout.strip()
    if not r.ok or not path.endswith(f"/{digest}/{name}"):
        raise HostError(f"{host.name}: cannot stage {name}: {r.one_line_error()}")
    return path


def stage_script(host: Host, name: str) -> str:
    """The helper ``name`` staged on the node with the protocol it imports (one round trip)."""
    return stage(host, name, helper(name).read_text(), helper(PROTOCOL).read_text())


def staged_files(path: str) -> list[str]:
    """The staged files a staged ``path`` stands for: itself, and the protocol staged a
    directory above it when it is a helper."""
    digests = list(_DIGEST_RE.finditer(path))
    if not digests:
        raise ValueError(f"not a staged path: {path}")
    return [path] + [f"{path[:m.end()]}/{PROTOCOL}" for m in digests[-2:-1]]


_WATCHED_SH = """exec 3<&0 </dev/null 4>&2 2>/dev/null
set -m
"$@" 2>&4 3<&- 4>&- & j=$!
{ cat <&3 >/dev/null 2>&1; kill -TERM -- "-$j" 2>/dev/null; } & w=$!
set +m
wait "$j"; s=$?
kill -- "-$w" 2>/dev/null
exit "$s"
"""


def watched(argv: Sequence[str]) -> list[str]:
    """``argv`` run on a node for as long as its stdin stays open (run it with a ``Feed``): the
    end of stdin (this controller, or its connection, gone) ends ``argv`` and every process it
    started (their own process group), so nothing of it runs on after the controller. The
    shell's own words (job control's "[1]+ Exit 3" notices) go nowhere; ``argv``'s stderr is
    the command's."""
    return ["bash", "-c", _WATCHED_SH, "watched", *argv]


def check_staged(path: str) -> str:
    """A shell snippet that exits 97 unless the staged file (and the protocol staged with it)
    still matches its sha256."""
    checks = []
    for p in staged_files(path):
        line = f"{_DIGEST_RE.findall(p)[-1]}  {p}\\n"
        checks.append(f"printf {shlex.quote(line)} | sha256sum -c --status || "
                      f"{{ echo {shlex.quote(p + ' differs from its sha256: not run')} >&2; exit 97; }}")
    return "; ".join(checks)


def verified(paths: list[str], argv: list[str]) -> list[str]:
    """``argv`` run only when every staged file in ``paths`` still matches its sha256."""
    checks = "; ".join(check_staged(p) for p in paths)
    return ["sh", "-c", f'{checks}; exec "$@"', "sh", *argv]



# --- the node's own records ----------------------------------------------------------------------
# What must outlive the controller that made it (the units services.stop stopped, the persisted
# units' specs, the watchdog's restarts) lives on the node, under NODE_STATE, readable by
# anyone (no secret goes there), written by root through stdin, atomically.

NODE_STATE = "/var/lib/sparkdeploy-node"


def read_node_file(host: Host, path: str, sudo: bool = False) -> str | None:
    """A file of the node's records (None when there is none; ``sudo``: one only root reads)."""
    r = host.run(["cat", "--", path], change=False, sudo=sudo)
    if r.ok:
        return r.stdout
    if "No such file" in r.stderr:
        return None
    raise HostError(f"{host.name}: cannot read {path}: {r.one_line_error()}")


def write_node_file(host: Host, path: str, content: str | None) -> None:
    """Write ``content`` at ``path`` on the node (through stdin, never argv; a reader sees the
    old file or the new one), or remove the file when ``content`` is None."""
    if content is not None:
        host.put_file(path, content, private=False)
        return
    r = host.run(["rm", "-f", "--", path], sudo=True)
    if not r.ok:
        raise HostError(f"{host.name}: cannot write {path}: {r.one_line_error()}")


# --- running a node helper ----------------------------------------------------------------------
# Every helper speaks one dialect (``helpers/protocol.py`` says it and writes it) on stdout:
# ``progress k=v ...`` lines (``bytes`` done, ``total`` expected, counts in digits, other keys
# free text without spaces), ``<kind> {json}`` event lines from a helper that streams what it
# sees, and last its answer, one JSON object; on stderr ``error: ...`` lines say why it failed
# (and other words for a log). The one exception, a helper whose stdout is a data stream (the
# ship's), says its progress and answer on stderr. This module is the one place that reads
# them: ``parse_progress``, ``parse_event``, ``parse_report``.

class HelperFailed(HostError):
    """A node helper that failed, or answered what its type does not accept (one line); its
    stderr kept for a caller that tells one failure from another."""

    def __init__(self, why: str, stderr: str = "") -> None:
        super().__init__(why)
        self.stderr = stderr


def parse_progress(line: str) -> dict[str, str] | None:
    """A helper's ``progress k=v ...`` line (its counts are digits), else None."""
    if not line.startswith("progress "):
        return None
    out = dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)
    counts = ("bytes", "total", "files", "of", "out")
    return out if all(out[k].isdigit() for k in counts if k in out) else None


def helper_error(stderr: str, fallback: str) -> str:
    """Why a helper failed: its last ``error:`` line, else its last line that is not progress."""
    errs = [ln[len("error: "):] for ln in stderr.splitlines() if ln.startswith("error: ")]
    if errs:
        return errs[-1]
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip() and not ln.startswith("progress ")]
    return lines[-1] if lines else fallback


def parse_report(result: type[T], text: str, where: str) -> T:
    """A helper's report (one line of JSON) as ``result``; HelperFailed (one line naming
    ``where``) when it is not JSON or does not fit."""
    try:
        return last_line(result, text, where)
    except OutsideError as e:
        raise HelperFailed(str(e)) from None


def parse_event(line: str, kinds: Mapping[str, type[BaseModel]], where: str) -> tuple[str, BaseModel] | None:
    """A helper's ``<kind> {json}`` event line as (kind, its ``kinds[kind]``), None when the line
    is no event of ``kinds``; HelperFailed (one line naming ``where: kind``) when it does not fit."""
    kind, _, rest = line.partition(" ")
    if kind not in kinds:
        return None
    return kind, parse_report(kinds[kind], rest, f"{where}: {kind}")


def run_helper(host: Host, name: str, args: Sequence[str], *, result: type[T], where: str,
               also: Sequence[str] = (), script: str | None = None,
               wrap: Callable[[str], list[str]] | None = None, input: str | Feed | None = None,
               timeout: float = 300, change: bool = False,
               on_progress: Callable[[dict[str, str]], None] | None = None,
               on_line: Callable[[str], None] | None = None, answers_failing: bool = False,
               sudo: bool = False, events: Mapping[str, type[BaseModel]] | None = None,
               on_event: Callable[[str, BaseModel | HelperFailed], None] | None = None) -> T:
    """Run the helper ``name`` on ``host`` with ``args`` and return its answer as ``result``.

    The helper is staged (``script``: staged already) and runs only while it and the staged
    files ``also`` match their sha256; ``wrap`` builds the argv from the staged path when the
    helper does not run as ``python3 <helper> args`` (in a container, in a virtualenv).
    ``on_progress`` receives each progress line, ``on_line`` each stderr line. A failure
    or an answer that does not fit raises ``HelperFailed("<where>: why")``; ``answers_failing``:
    the helper answers even when it exits non-zero (a partial result), read then too;
    ``sudo``: as root where the node's privilege is sudo (it writes under the node's state dir).

    The streaming form: ``input`` a ``Feed`` (stdin fed while the helper runs, its end the
    helper's end), ``on_progress`` called as each progress line comes, and ``on_event`` with
    each ``<kind> {json}`` line of ``events`` read as its type (or the HelperFailed that says,
    in one line, why it does not fit); the report is still the one typed answer returned."""
    path = script or stage_script(host, name)
    argv = wrap(path) if wrap else ["python3", path, *args]

    kinds = events or {}

    def on_stdout(line: str) -> None:
        p = parse_progress(line)
        if p is not None:
            if on_progress:
                on_progress(p)
            return
        try:
            ev = parse_event(line, kinds, where) if kinds else None
        except HelperFailed as e:
            if on_event:
                on_event(line.partition(" ")[0], e)
            return
        if ev is not None and on_event:
            on_event(*ev)

    r = host.run(verified([path, *also], argv), change=change, input=input, timeout=timeout,
                 on_stdout=on_stdout if on_progress or kinds else None,
                 on_stderr=on_line, sudo=sudo)
    answered = r.stdout.strip().splitlines()[-1:] if answers_failing and r.exit_code > 0 else []
    if not r.ok and not (answered and answered[0].startswith("{")):
        raise HelperFailed(f"{where}: {helper_error(r.stderr, r.one_line_error())}", r.stderr)
    try:
        return parse_report(result, r.stdout, where)
    except HelperFailed as e:
        raise HelperFailed(str(e), r.stderr) from None
