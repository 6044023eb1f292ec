"""What comes from outside the controller (an endpoint, a hub, a node helper, a file given on
the command line) is data: read within a deadline and a size, and validated into a type
before anything acts on it; when it does not fit, one line naming where it came from.

- ``request``: one HTTP request with a deadline for the whole of it (connect, headers and
  body: a server that accepts and never answers, or trickles bytes, ends it on time) and a
  bound on the body's size. A watchdog shuts the socket at the deadline, so no read can
  outlive it.
- ``validated`` / ``loads``: a pydantic type from outside data, ``OutsideError`` otherwise;
  ``parsed``: JSON whose shape its reader checks itself (a tool's own: docker's, iperf3's).
- ``HubName``: a file name a hub listed, safe to join under the model dir and to put on a
  command line after ``--``.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, Field, ValidationError

from sparkdeploy.core.errors import RunError

MAX_BODY = 16 * 1024 * 1024
"""The most a JSON answer may hold (a hub's file list of a large repo is well under 1 MB)."""


class OutsideError(RunError):
    """Outside data that cannot be used: ``str()`` is the one line, naming where it came from."""


def name_problem(name: str) -> str | None:
    """Why ``name`` (a file name from a hub or a metadata cache) is not safe inside the model
    dir and on a command line, or None. The node helper checks the same again."""
    if not name or len(name) > 1024:
        return "not a non-empty name of at most 1024 characters"
    if name.startswith(("/", "-")):
        return "starts with / or -"
    if any(ord(ch) < 32 or ord(ch) == 127 or ch == "\\" for ch in name):
        return "holds a control character or a backslash"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "has an empty, . or .. component"
    return None


def _hub_name(name: str) -> str:
    why = name_problem(name)
    if why:
        raise ValueError(f"file name {name!r:.120} refused: {why}")
    return name


HubName = Annotated[str, AfterValidator(_hub_name)]

T = TypeVar("T", bound=BaseModel)


class ListedModel(BaseModel):
    id: str = Field(min_length=1, max_length=512, pattern=r"^[^\x00-\x1f\x7f]+$")
    """The served model's name: it goes into requests, tables and plot titles (no control
    character)."""


class ModelList(BaseModel):
    """What an OpenAI-compatible ``/v1/models`` says (the rest of it is ignored)."""

    data: list[ListedModel] = Field(min_length=1)


def validated(cls: type[T], data: Any, where: str) -> T:
    """``data`` as a ``cls``; ``OutsideError("where: field: what is wrong")`` otherwise."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        msg = str(err.get("ctx", {}).get("error") or err["msg"])
        if err["type"] == "model_type":  # pydantic names its class: say what JSON was wanted
            msg = f"not a JSON object ({type(err.get('input')).__name__})"
        raise OutsideError(f"{where}: {loc + ': ' if loc else ''}{msg}") from None


def parsed(text: str | bytes, where: str) -> Any:
    """JSON text as it is, for a reader that checks its shape itself (a tool's own JSON: docker's,
    iperf3's); ``OutsideError("where: not JSON (...)")`` when it is not JSON. The one place
    outside data is parsed (``loads`` types it too)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise OutsideError(f"{where}: not JSON ({str(e).splitlines()[0][:80]})") from None


def loads(cls: type[T], text: str | bytes, where: str) -> T:
    """JSON text as a ``cls`` (one line naming ``where`` when it is not JSON or does not fit)."""
    return validated(cls, parsed(text, where), where)


def last_line(cls: type[T], text: str, where: str) -> T:
    """The last line a node helper printed, read as ``cls`` (one line naming ``where``)."""
    lines = text.strip().splitlines()
    if not lines:
        raise OutsideError(f"{where}: no answer")
    return loads(cls, lines[-1], where)


@dataclass
class Response:
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self, cls: type[T], where: str) -> T:
        return loads(cls, self.body, where)


class Watch:
    """What a ``watchdog`` saw: ``fired`` once it shut the socket, ``why`` (``"deadline"`` or
    ``"idle"``); ``touch()`` says progress was made (the idle clock starts again)."""

    def __init__(self, seconds: float, idle: float | None):
        self.fired = threading.Event()
        self.why: str | None = None
        self.end = time.monotonic() + max(0.0, seconds)
        self.idle = idle
        self.last = time.monotonic()
        self.done = threading.Event()

    def touch(self) -> None:
        self.last = time.monotonic()

    def is_set(self) -> bool:
        return self.fired.is_set()

    def _due(self) -> tuple[float, str]:
        if self.idle is not None and self.last + self.idle < self.end:
            return self.last + self.idle, "idle"
        return self.end, "deadline"

    def _run(self, sock: socket.socket | None) -> None:
        while True:
            due, why = self._due()
            left = due - time.monotonic()
            if left <= 0:
                break
            if self.done.wait(left):
                return
        self.why = why
        self.fired.set()
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@contextmanager
def watchdog(sock: socket.socket | None, seconds: float,
             idle: float | None = None) -> Iterator[Watch]:
    """Shut ``sock`` down after ``seconds`` unless the block ends first, or (``idle``) when
    ``idle`` seconds pass without a ``touch()``: every read and write on it then ends at once.
    A server that trickles bytes without making progress is cut off by ``idle``, which a
    socket timeout (seconds without a byte) never does."""
    watch = Watch(seconds, idle)
    thread = threading.Thread(target=watch._run, args=(sock,), daemon=True, name="watchdog")
    thread.start()
    try:
        yield watch
    finally:
        watch.done.set()


def request(method: str, url: str, *, headers: dict[str, str] | None = None,
            body: bytes | None = None, deadline: float = 30.0,
            max_body: int = MAX_BODY, on_data: Callable[[bytes], None] | None = None) -> Response:
    """One HTTP(S) request, all of it within ``deadline`` seconds, its body at most
    ``max_body`` bytes; ``OutsideError`` naming the URL otherwise (or when it cannot be
    reached). Never a proxy from the environment: the controller talks to its nodes and the
    profile's hub directly. ``on_data`` sees each piece of the body as it arrives."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise OutsideError(f"{url}: not an http(s) URL")
    end = time.monotonic() + deadline
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = cls(u.hostname, u.port, timeout=deadline)
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    try:
        try:
            conn.connect()
        except (OSError, ValueError) as e:  # ValueError: a host name no resolver takes (idna)
            raise OutsideError(f"cannot reach {url}: {e}") from None
        with watchdog(conn.sock, end - time.monotonic()) as fired:
            try:
                conn.request(method, path, body=body, headers=headers or {})
                resp = conn.getresponse()
                chunks, size = [], 0
                while True:
                    data = resp.read1(65536)
                    if not data:
                        break
                    size += len(data)
                    if size > max_body:
                        raise OutsideError(f"{url}: answer larger than {max_body} bytes")
                    chunks.append(data)
                    if on_data:
                        on_data(data)
            except (OSError, http.client.HTTPException, ValueError) as e:
                if fired.is_set() or time.monotonic() >= end:
                    raise OutsideError(f"{url}: no whole answer within {deadline:g}s") from None
                raise OutsideError(f"{url}: {type(e).__name__}: {e}".rstrip(": ")) from None
            if fired.is_set():
                raise OutsideError(f"{url}: no whole answer within {deadline:g}s")
        return Response(resp.status, b"".join(chunks),
                        {k.lower(): v for k, v in resp.getheaders()})
    finally:
        conn.close()


__all__ = ["HubName", "MAX_BODY", "ListedModel", "ModelList", "OutsideError", "Response",
           "last_line", "loads", "name_problem", "parsed",
           "request", "validated", "Watch", "watchdog"]
