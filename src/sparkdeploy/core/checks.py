"""Value checks shared by the profile schema and the task flags.

Each check returns the value it accepts or raises ``ValueError`` with the reason (no key or
flag name: the caller adds it), so that a profile key and a task flag holding the same kind
of value are held to the same rule.
"""

from __future__ import annotations

import ipaddress
import re
import unicodedata
from urllib.parse import urlsplit

# Bounds shared by the profile's bench section and bench.run's flags: beyond them a run would
# exhaust the controller (threads, memory) or never end, not measure anything.
MAX_CONCURRENCY = 4096
MAX_REQUESTS = 10**6
MAX_WARMUP = 10**4
MAX_TOKENS = 10**6
"""Prompt or output length in tokens (no served context is longer)."""
RATE_RANGE = (1e-3, 1e4)
"""Poisson arrival rates, requests per second (one per 1000 s .. 10000 a second)."""


NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
"""Node and engine names: one DNS label, lower case (also a safe path segment, container name
and image tag component)."""

_HOST_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                      r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")
_USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")


def name(v: str) -> str:
    if not NAME_RE.fullmatch(v):
        raise ValueError(f"{v!r} is not a safe name (lower-case letters, digits and '-', "
                         "starting and ending with a letter or digit, at most 63)")
    return v


def hostname(v: str) -> bool:
    """A DNS host name or an IP address (no brackets)."""
    try:
        ipaddress.ip_address(v)
        return True
    except ValueError:
        return len(v) <= 253 and bool(_HOST_RE.fullmatch(v))


def ssh_alias(v: str) -> str:
    """An ssh destination: ``[user@]host`` in host-name characters, never read as an option."""
    user, at, host = v.rpartition("@")
    if v.startswith("-"):
        raise ValueError(f"{v!r} starts with '-' (ssh would read it as an option)")
    if (at and not _USER_RE.fullmatch(user)) or not hostname(host):
        raise ValueError(f"{v!r} is not an ssh alias ([user@]host, host-name characters only)")
    return v


def http_url(v: str) -> str:
    """An absolute http(s) URL with a host and a valid port, and no credentials (a URL reaches
    node command lines, the journal and image histories)."""
    no_control(v)
    try:
        u = urlsplit(v)
        port = u.port  # raises ValueError when out of range or not a number
    except ValueError as e:
        raise ValueError(f"{v!r} is not a URL ({e})") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"{v!r} is not an http(s) URL with a host")
    if not hostname(u.hostname):  # no resolver takes it (an empty label, a label too long ...)
        raise ValueError(f"{v!r}: {u.hostname!r} is not a host name or an IP address")
    if port == 0:
        raise ValueError(f"{v!r}: port 0 is out of range (1..65535)")
    if any(ch.isspace() for ch in v):
        raise ValueError(f"{v!r} contains white space")
    if "@" in u.netloc:
        raise ValueError("must not carry credentials (user:password@): a URL reaches command "
                         "lines, logs and image histories")
    return v


_IMAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")
_IFACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,31}$")
_PATH_RE = re.compile(r"^/[A-Za-z0-9_./+@-]*$")


_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


def image_ref(v: str) -> str:
    """An image reference as docker takes it positionally (``repo[:tag][@digest]``); a digest
    is ``sha256:`` and 64 lowercase hex digits (docker refuses any other form)."""
    if not _IMAGE_RE.fullmatch(v):
        raise ValueError(f"{v!r} is not an image reference (repo[:tag][@digest], no leading '-')")
    name, at, digest = v.partition("@")
    if at and (not name or not _DIGEST_RE.fullmatch(digest)):
        raise ValueError(f"{v!r} has a malformed digest: a pin is repo[:tag]@sha256:<64 lowercase "
                         "hex digits>")
    return v


def interface(v: str) -> str:
    """A network interface or RDMA device name."""
    if not _IFACE_RE.fullmatch(v):
        raise ValueError(f"{v!r} is not an interface name")
    return v


def abs_path(v: str) -> str:
    """An absolute path in plain characters (no spaces, quotes, ':' or shell syntax)."""
    if not _PATH_RE.fullmatch(v) or "/../" in v + "/":
        raise ValueError(f"{v!r} is not a plain absolute path")
    return v


def control_char(v: str) -> str | None:
    """The first control character in ``v`` (a newline, a tab, an escape, DEL, a C1 code,
    a Unicode line or paragraph separator), or None."""
    for ch in v:
        if ch in "\u2028\u2029" or unicodedata.category(ch) == "Cc":
            return ch
    return None


def no_control(v: str) -> str:
    """Refuse a control character (a newline would start a new line in a unit file, an
    env file or a log)."""
    ch = control_char(v)
    if ch is not None:
        raise ValueError(f"{v!r} contains a control character ({ch!r})")
    return v


_NAME_OF_PROFILE_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,126}[A-Za-z0-9])?")


def profile_name(v: str) -> str:
    """The deployment's name: part of unit descriptions, state-dir file names, container
    labels. Letters, digits, '.', '_' and '-', starting and ending with a letter or digit."""
    if not _NAME_OF_PROFILE_RE.fullmatch(v):
        raise ValueError(f"{v!r} is not a safe name (letters, digits, '.', '_' and '-', starting "
                         "and ending with a letter or digit, at most 128)")
    return v


_REL_RE = re.compile(r"[A-Za-z0-9_+@=][A-Za-z0-9_./+@=-]*")


def relative_path(v: str) -> str:
    """A relative path in plain characters that stays where it is joined (no '..', no
    absolute path, no leading '-')."""
    parts = v.split("/")
    if not _REL_RE.fullmatch(v) or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{v!r} is not a plain relative path (no '..', no leading '/' or '-', "
                         "no empty part)")
    return v


def project_dockerfile(v: str) -> str:
    """A Dockerfile of the project's: ``docker/<file>``."""
    if not v.startswith("docker/"):
        raise ValueError(f"{v!r} is not under the project's docker/ directory")
    return v


_CTRL_PATH_RE = re.compile(r"(~/|/)?[A-Za-z0-9_.+@=][A-Za-z0-9_./+@=~-]*")


def ssh_path(v: str) -> str:
    """A file path ssh reads from an option (``-F``, ``UserKnownHostsFile=``): plain characters,
    no white space (ssh splits there), no leading '-', absolute, ``~/`` or relative."""
    if not _CTRL_PATH_RE.fullmatch(v) or "/../" in f"/{v}/":
        raise ValueError(f"{v!r} is not a plain file path (letters, digits, '_./+@=~-'; no white "
                         "space, no '..', no leading '-')")
    return v


def node_path(v: str) -> str:
    """A path on a node: absolute, or ``~/...`` (the SSH user's home there)."""
    rest = v[1:] if v.startswith("~/") else v
    try:
        abs_path(rest)
    except ValueError:
        raise ValueError(f"{v!r} is not a plain absolute path (or ~/...)") from None
    return v


_PERSIST_RE = re.compile(r"yes|no|(?:[0-9]+[sSmMhHdDwW]?)+")


def ssh_time(v: str) -> str:
    """An ssh time value (``ControlPersist``): yes, no, or a time like 10m, 1h30m, 600."""
    if not _PERSIST_RE.fullmatch(v):
        raise ValueError(f"{v!r} is not an ssh time (yes, no, or like 600, 10m, 1h30m)")
    return v


def requirement(v: str) -> str:
    """A PEP 508 requirement on a named release (no URL, no environment marker)."""
    from packaging.requirements import InvalidRequirement, Requirement

    no_control(v)
    try:
        req = Requirement(v)
    except InvalidRequirement as e:
        raise ValueError(f"{v!r} is not a PEP 508 requirement ({str(e).splitlines()[0]})") from None
    if req.url or req.marker:
        raise ValueError(f"{v!r}: a requirement on a release only (no '@ URL', no '; marker')")
    return v


_UNIT_RE = re.compile(r"[A-Za-z0-9_:.\\@-]+\.(?:service|socket|target|timer|mount|path|scope|slice)")


def unit(v: str) -> str:
    """A systemd unit name (``vllm-proxy.service``), never read as an option."""
    if v.startswith("-") or not _UNIT_RE.fullmatch(v):
        raise ValueError(f"{v!r} is not a systemd unit name (like name.service)")
    return v


def pattern(v: str) -> str:
    """A file name pattern (``*.safetensors``): no control character, no leading '-' or '/'."""
    no_control(v)
    if not v or v.startswith(("-", "/")):
        raise ValueError(f"{v!r} is not a file pattern (no leading '-' or '/')")
    return v


def link_address(v: str) -> str:
    """An IPv4 address on the fast link (IPv6 is refused: the rsync, SGLang and Ray addresses
    sparkdeploy builds take IPv4 only)."""
    try:
        ip = ipaddress.ip_address(v)
    except ValueError:
        raise ValueError(f"not an IP address: {v!r}") from None
    if ip.version != 4:
        raise ValueError(f"{v!r}: IPv6 link addresses are not supported, give the IPv4 address")
    return v
