"""The deployed OpenAI-compatible endpoint, seen from the controller: where it is (``url``: the
``Endpoint`` record ``serve.up`` wrote, else the profile's ``endpoint``), and the readiness
probes (port open, ``/health``, ``/v1/models``, one streamed chat completion).

Requests go straight to the endpoint (no proxy from the environment: one must not stand
between the controller and a node on its own network), each within a deadline for the whole
request (``outside.request``), its JSON read into a type. The API key, when set, is
``SPARKDEPLOY_API_KEY`` in the controller's environment and travels only in the
Authorization header.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from sparkdeploy.core.outside import ModelList, OutsideError, loads, request
from sparkdeploy.core.records import Endpoint, Records
from sparkdeploy.engines.base import API_KEY_ENV
from sparkdeploy.node.hosts import Host


def api_key() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


def headers() -> dict[str, str]:
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def controller_address(host: Host) -> str:
    """The address the controller reaches a node at: its ssh alias resolved as ssh would
    (``ssh -G``: ssh_config ``HostName``), 127.0.0.1 for this machine."""
    if host.node.local:
        return "127.0.0.1"
    return host.ssh_view().get("hostname") or host.node.ssh or host.name


def engine_url(host: Host, port: int) -> str:
    """An engine's own address as the controller reaches it: the node's address, the port."""
    return f"http://{controller_address(host)}:{port}"


def port_open(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def health(url: str, deadline: float = 5.0) -> bool:
    try:
        return request("GET", f"{url}/health", headers=headers(), deadline=deadline).status == 200
    except OutsideError:
        return False


def models(url: str, deadline: float = 5.0) -> list[str]:
    """The model ids ``/v1/models`` lists ([] when it does not answer, or not as it should)."""
    try:
        r = request("GET", f"{url}/v1/models", headers=headers(), deadline=deadline)
        return [m.id for m in r.json(ModelList, f"{url}/v1/models").data] if r.status == 200 else []
    except OutsideError:
        return []


class _Delta(BaseModel):
    content: str | None = None
    reasoning_content: str | None = None


class _Choice(BaseModel):
    delta: _Delta = _Delta()


class _Chunk(BaseModel):
    choices: list[_Choice] = []


def stream_chat(url: str, model: str, max_tokens: int = 8, deadline: float = 120,
                on_first: Callable[[], None] | None = None) -> str:
    """One streamed chat completion, all of it within ``deadline``; the text (content or
    reasoning) it returned ('' if none, or when a chunk is not what one should be).
    ``on_first`` is called when the first bytes carrying content (or reasoning) arrive."""
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": max_tokens, "stream": True}
    try:
        r = request("POST", f"{url}/v1/chat/completions", body=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json", **headers()},
                    deadline=deadline, max_body=1024 * 1024,
                    on_data=_first_content(on_first) if on_first else None)
    except OutsideError:
        return ""
    if r.status != 200:
        return ""
    text = []
    for line in r.body.decode(errors="replace").splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            chunk = loads(_Chunk, line[6:], "a stream chunk")
        except OutsideError:
            return ""
        text += [c.delta.content or c.delta.reasoning_content or "" for c in chunk.choices]
    return "".join(text)


_CONTENT = re.compile(rb'"(?:reasoning_)?content"\s*:\s*"[^"]')
"""A chunk's non-empty content or reasoning (the opening chunk's ``"content": ""`` is not)."""


def _first_content(on_first: Callable[[], None]) -> Callable[[bytes], None]:
    seen = bytearray()
    done = False

    def data(chunk: bytes) -> None:
        nonlocal done
        if done:
            return
        seen.extend(chunk)
        if _CONTENT.search(seen):
            done = True
            on_first()
        else:
            del seen[:-256]  # a match split across reads is still found

    return data


def recorded(records: Records) -> Endpoint | None:
    """What ``serve.up`` recorded (url, engine, model), or None before it has."""
    return records.read(Endpoint)


def url(dep: Any) -> str | None:
    """The endpoint to talk to: the one ``serve.up`` recorded, else the profile's."""
    rec = recorded(dep.records)
    return rec.url if rec else dep.profile.endpoint
