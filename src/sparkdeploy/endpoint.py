"""The deployed OpenAI-compatible endpoint, seen from the controller: where it is (recorded by
``serve.up``), and the readiness probes (port open, ``/health``, ``/v1/models``, one streamed
chat completion).

Requests go straight to the endpoint (``trust_env=False``): a proxy from the environment must
not stand between the controller and a node on its own network. The API key, when set, is
``SPARKDEPLOY_API_KEY`` in the controller's environment and travels only in the
Authorization header.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from typing import Any

import requests

from sparkdeploy.engines.base import API_KEY_ENV

RECORD = "endpoint"


def api_key() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


def session() -> requests.Session:
    s = requests.Session()
    s.trust_env = False
    key = api_key()
    if key:
        s.headers["Authorization"] = f"Bearer {key}"
    return s


def controller_address(node: Any, ssh_config: str | None) -> str:
    """The address the controller reaches a node at: its ssh alias resolved as ssh would
    (``ssh -G``: ssh_config ``HostName``), 127.0.0.1 for this machine."""
    if node.ssh is None:
        return "127.0.0.1"
    argv = ["ssh", *(["-F", ssh_config] if ssh_config else []), "-G", "--", node.ssh]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return node.ssh
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value.strip():
            return value.strip()
    return node.ssh


def port_open(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def health(http: requests.Session, url: str) -> bool:
    try:
        return http.get(f"{url}/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def models(http: requests.Session, url: str) -> list[str]:
    try:
        r = http.get(f"{url}/v1/models", timeout=5)
        if r.status_code != 200:
            return []
        return [m.get("id", "") for m in r.json().get("data") or []]
    except (requests.RequestException, ValueError):
        return []


def stream_chat(http: requests.Session, url: str, model: str, max_tokens: int = 8,
                timeout: float = 120) -> str:
    """One streamed chat completion; the text (content or reasoning) it returned ('' if none)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": max_tokens, "stream": True}
    text = []
    try:
        with http.post(f"{url}/v1/chat/completions", json=body, stream=True,
                       timeout=(5, timeout)) as r:
            if r.status_code != 200:
                return ""
            for line in r.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                try:
                    chunk = json.loads(line[6:])
                except ValueError:
                    continue
                for ch in chunk.get("choices") or []:
                    d = ch.get("delta") or {}
                    text.append(d.get("content") or d.get("reasoning_content") or "")
    except requests.RequestException:
        return ""
    return "".join(text)


def recorded(records: Any) -> dict[str, Any] | None:
    """What ``serve.up`` recorded: ``{"url", "engine", "model", ...}`` or None."""
    return records.data(RECORD)
