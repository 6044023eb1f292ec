"""The one redactor: every output (the terminal, the journal, records, a bench's JSON and HTML)
goes through ``redact`` before it is shown or written, as data, never as the text made of it.

A value is hidden by what it is, not by how the text around it looks:

- the value of a secret-named key (``HF_TOKEN``, ``api_key``, ``rsync_password``: a name that
  ends in one of the words of a secret, ``is_secret_name``) in a mapping;
- in a list of arguments, the value of a secret flag (``--api-key X``, ``--hf-token=X``; what
  follows a switch such as ``--allow-credentials`` is the next flag, not a value);
- in a string, the values that are secrets whatever surrounds them: an HF token (``hf_...``), a
  URL's credentials (``scheme://user:***@``), an ``Authorization`` value (``Bearer ***``), and,
  word by word on one line (a command line, a log line), ``KEY=value`` and ``--flag value`` for a
  secret name and a quoted ``"KEY": "value"``.

A boolean or a number under a secret-looking name is no secret (``token_to_image: true``)."""

from __future__ import annotations

import re
from typing import Any

REDACTED = "***"
_WORD = r"(?:api[_-]?key|token|secret|password|passwd)"
_SECRET_NAME = re.compile(r"(?:" + _WORD + r"|(?:^|[^A-Za-z0-9])(?:key|credentials?))$", re.I)
_NAME = r"[\w-]*" + _WORD + r"(?![\w-])"
"""A secret name in running text: one that ends in one of the words."""
_FORMS: list[tuple[re.Pattern[str], str]] = [
    # an HF token anywhere
    (re.compile(r"\bhf_[A-Za-z0-9]{8,}\b"), REDACTED),
    # a URL's credentials: scheme://user:password@ -> user:***@, scheme://token@ -> ***@
    (re.compile(r"\b([a-z][a-z0-9+.-]*://)([^\s/@:]+):[^\s/]*@", re.I), rf"\1\2:{REDACTED}@"),
    (re.compile(r"\b([a-z][a-z0-9+.-]*://)[^\s/@:]+@", re.I), rf"\1{REDACTED}@"),
    # an Authorization value
    (re.compile(r"\b(Bearer|Basic)[ \t]+[A-Za-z0-9._~+/=-]+", re.I), rf"\1 {REDACTED}"),
    # a quoted key and its quoted value (JSON, a Python repr): "HF_TOKEN": "..."
    (re.compile(r"""(["'])(""" + _NAME + r""")\1([ \t]*:[ \t]*)(["'])(?:\\.|(?!\4).)*\4""", re.I),
     rf"\1\2\1\3\4{REDACTED}\4"),
    # a flag and its value on the same line: --api-key X, --api-key=X, --hf-token 'X'
    (re.compile(r"""(--?""" + _NAME + r""")(=|[ \t]+)('[^'\n]*'|"[^"\n]*"|[^\s'"-][^\s'"]*)""", re.I),
     rf"\1\2{REDACTED}"),
    # KEY=value (an environment assignment)
    (re.compile(r"""\b(\w*""" + _WORD + r"""(?![A-Za-z0-9]))=('[^'\n]*'|"[^"\n]*"|\S+)""", re.I),
     rf"\1={REDACTED}"),
]


def is_secret_name(name: str) -> bool:
    """A key, variable or flag whose value is a secret: its name ends in a word of a secret
    (``HF_TOKEN``, ``S3_ACCESS_KEY``, ``--api-key``, ``CREDENTIALS``; not ``MAX_TOKENS``,
    ``KEYBOARD``, ``token_to_image``, ``HF_TOKEN_PATH``)."""
    return bool(_SECRET_NAME.search(name.lstrip("-")))


def secret_flag(arg: str) -> str | None:
    """The flag of ``arg`` when it is a flag that carries a secret (``--api-key``,
    ``--hf-token=X``), else None."""
    if not arg.startswith("-"):
        return None
    flag = arg.split("=", 1)[0]
    return flag if is_secret_name(flag) else None


def redact(value: Any) -> Any:
    """``value`` (parsed JSON or YAML, a list of arguments, a string) with every secret in it
    shown as ``***``, at any depth; the same shape back (a tuple comes back a list)."""
    if isinstance(value, dict):
        return {k: REDACTED if _secret_entry(k, v) else redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return _redact_args(list(value))
    if isinstance(value, str):
        for form, replacement in _FORMS:
            value = form.sub(replacement, value)
        return value
    return value


def _secret_entry(k: Any, v: Any) -> bool:
    """A mapping's entry whose value is a secret: a secret name (a record's lowercase ``key``,
    a lookup key such as the link's twin key, aside) over a value that can be one."""
    return (isinstance(k, str) and k != "key" and is_secret_name(k) and v is not None
            and not isinstance(v, (bool, int, float)))


def _redact_args(items: list[Any]) -> list[Any]:
    out: list[Any] = []
    after_flag = False
    for a in items:
        if after_flag and isinstance(a, str) and not a.startswith("-"):
            out.append(REDACTED)  # a switch (``--allow-credentials``) is followed by a flag
            after_flag = False
            continue
        flag = secret_flag(a) if isinstance(a, str) else None
        if flag is not None and flag != a:
            out.append(f"{flag}={REDACTED}")
        else:
            out.append(redact(a))
        after_flag = flag is not None and flag == a
    return out
