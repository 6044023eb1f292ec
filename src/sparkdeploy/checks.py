"""Value checks shared by the profile schema and the task flags.

Each check returns the value it accepts or raises ``ValueError`` with the reason (no key or
flag name: the caller adds it), so that a profile key and a task flag holding the same kind
of value are held to the same rule.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
"""Node and engine names: one DNS label, lower case (also a safe path segment, container name
and image tag component)."""

_HOST_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                      r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")
_USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")


def name(v: str) -> str:
    if not NAME_RE.match(v):
        raise ValueError(f"{v!r} is not a safe name (lower-case letters, digits and '-', "
                         "starting and ending with a letter or digit, at most 63)")
    return v


def hostname(v: str) -> bool:
    """A DNS host name or an IP address (no brackets)."""
    try:
        ipaddress.ip_address(v)
        return True
    except ValueError:
        return len(v) <= 253 and bool(_HOST_RE.match(v))


def ssh_alias(v: str) -> str:
    """An ssh destination: ``[user@]host`` in host-name characters, never read as an option."""
    user, at, host = v.rpartition("@")
    if v.startswith("-"):
        raise ValueError(f"{v!r} starts with '-' (ssh would read it as an option)")
    if (at and not _USER_RE.match(user)) or not hostname(host):
        raise ValueError(f"{v!r} is not an ssh alias ([user@]host, host-name characters only)")
    return v


def http_url(v: str) -> str:
    """An absolute http(s) URL with a host and a valid port."""
    try:
        u = urlsplit(v)
        port = u.port  # raises ValueError when out of range or not a number
    except ValueError as e:
        raise ValueError(f"{v!r} is not a URL ({e})") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"{v!r} is not an http(s) URL with a host")
    if port == 0:
        raise ValueError(f"{v!r}: port 0 is out of range (1..65535)")
    if any(ch.isspace() for ch in v):
        raise ValueError(f"{v!r} contains white space")
    return v


def no_credentials(v: str) -> str:
    if "@" in urlsplit(v).netloc:
        raise ValueError("must not carry credentials (they would land in the image history)")
    return v


_IMAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")
_IFACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,31}$")
_PATH_RE = re.compile(r"^/[A-Za-z0-9_./+@-]*$")


def image_ref(v: str) -> str:
    """An image reference as docker takes it positionally (``repo[:tag][@digest]``)."""
    if not _IMAGE_RE.match(v):
        raise ValueError(f"{v!r} is not an image reference (repo[:tag][@digest], no leading '-')")
    return v


def interface(v: str) -> str:
    """A network interface or RDMA device name."""
    if not _IFACE_RE.match(v):
        raise ValueError(f"{v!r} is not an interface name")
    return v


def abs_path(v: str) -> str:
    """An absolute path in plain characters (no spaces, quotes, ':' or shell syntax)."""
    if not _PATH_RE.match(v) or "/../" in v + "/":
        raise ValueError(f"{v!r} is not a plain absolute path")
    return v
