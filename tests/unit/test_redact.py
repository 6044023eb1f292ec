"""Redaction: one function for every form a secret takes in a command, a log or a record."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from sparkdeploy.state import REDACTED, StateDir, redact, redact_argv

SECRETS = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._~+=-",
                  min_size=8, max_size=40).filter(lambda s: not s.startswith(("-", ".")))

FORMS = [
    "https://user:{s}@hub.example/x",
    "git+https://{s}@pypi.example/simple",
    "curl -H 'Authorization: Bearer {s}' http://x",
    "Authorization: Basic {s}",
    '{{"HF_TOKEN": "{s}", "n": 1}}',
    "{{'api_key': '{s}'}}",
    '{{"rsync_password":"{s}"}}',
    "--api-key {s} --port 8000",
    "--api-key={s}",
    "--hf-token '{s}'",
    "HF_TOKEN={s} python3 x",
    "env SPARKDEPLOY_API_KEY={s}",
    "RSYNC_PASSWORD=\"{s}\"",
]


@pytest.mark.parametrize("form", FORMS)
@given(secret=SECRETS)
def test_every_form_hides_the_secret(form, secret):
    assume(secret not in form)  # a secret drawn as part of the text around it ("SPARKDEP")
    text = form.format(s=secret)
    out = redact(text)
    assert secret not in out
    assert REDACTED in out
    assert redact(out) == out  # redacting twice changes nothing


@given(secret=st.text(alphabet="abcdefXYZ0123456789", min_size=8, max_size=40))
def test_an_hf_token_is_hidden_anywhere(secret):
    assert redact(f"error: token hf_{secret} rejected") == f"error: token {REDACTED} rejected"


PLAIN = ["--max-tokens 256 --input-tokens 512", "output_tokens=256", '{"max_tokens": 16}',
         "--token-file /run/secrets/x", "http://spark1:8000/v1/models", "ssh spark1 -- ls",
         "HF_TOKEN_PATH=/x"]


@pytest.mark.parametrize("text", PLAIN)
def test_what_is_no_secret_is_left_alone(text):
    assert redact(text) == text


@given(secret=SECRETS)
def test_argv_hides_the_value_after_a_secret_flag(secret):
    argv = ["sglang", "--api-key", secret, "--max-tokens", "5", "--hf-token", secret]
    assert redact_argv(argv) == ["sglang", "--api-key", REDACTED, "--max-tokens", "5",
                                 "--hf-token", REDACTED]


def test_the_journal_hides_every_form(tmp_path):
    state = StateDir(tmp_path)
    state.journal({"argv": ["x", "--api-key", "k3y-value-1", "https://u:p4ss-word@h/"],
                   "stderr": 'Bearer abcdefgh123 {"HF_TOKEN": "hf_value_2"}'})
    line = (tmp_path / "journal.jsonl").read_text()
    for secret in ("k3y-value-1", "p4ss-word", "abcdefgh123", "hf_value_2"):
        assert secret not in line
    assert json.loads(line)["argv"] == ["x", "--api-key", REDACTED, f"https://u:{REDACTED}@h/"]
