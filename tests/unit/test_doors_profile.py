"""The profile's doors: every string has a type that says where it may go, every number is
finite and bounded, and the file itself is a bounded regular YAML file without aliases."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sparkdeploy.core.files import Escape, InputError, read_input, under
from sparkdeploy.core.records import PlanMemory, RecordError, Records
from sparkdeploy.core.state import StateDir
from sparkdeploy.profile.config import ProfileError, load_profile
from tests.unit.profiles import ROOT, seed_data

INJECTED = "x\nExecStartPre=/bin/sh -c 'touch /tmp/pwned'"


def at(d: dict, path: str, value) -> dict:
    """``d`` with ``value`` set at the dotted ``path`` below ``sparkdeploy`` (``a.0.b``)."""
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = d["sparkdeploy"]
    for k in parents:
        node = node.setdefault(k, {}) if isinstance(k, str) else node[k]
    node[last] = value
    return d


def key(path: str) -> str:
    out = "sparkdeploy"
    for p in path.split("."):
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


# (key below sparkdeploy, bad value, what the one line says after "file: key: ")
BAD = [
    # the deployment's name: unit files, state-dir paths, container labels
    ("name", INJECTED, "is not a safe name"),
    ("name", "../../etc/cron.d/x", "is not a safe name"),
    ("name", "a/b", "is not a safe name"),
    ("name", "..", "is not a safe name"),
    ("name", "x\r", "is not a safe name"),
    ("name", "", "is not a safe name"),
    ("name", "x" * 129, "is not a safe name"),
    # node names: a trailing newline is not the end of the name
    ("nodes.0.name", "spark1\n", "is not a safe name"),
    ("engines.0.name", "sglang\n", "is not a safe name"),
    ("nodes.0.docker_socket", "/var/run/docker.sock\n", "is not a plain absolute path"),
    ("nodes.0.link.interface", "enp1s0f0np0\n", "is not an interface name"),
    ("nodes.0.ssh", "spark1\n", "is not an ssh alias"),
    # ssh option values
    ("ssh.known_hosts", "/tmp/a /tmp/b", "is not a plain file path"),
    ("ssh.known_hosts", "-oProxyCommand=x", "is not a plain file path"),
    ("ssh.config", "/etc/ssh/x\n", "is not a plain file path"),
    ("ssh.control_persist", "10m -oProxyCommand=x", "is not an ssh time"),
    ("ssh.control_persist", "yes\nProxyCommand x", "is not an ssh time"),
    # a requirement
    ("images.layer.requirement", "transformers @ https://evil.example/t.whl", "a requirement on a release only"),
    ("images.layer.requirement", "transformers>=5; python_version>'3'", "a requirement on a release only"),
    ("images.layer.requirement", "transformers>=5 && curl x", "is not a PEP 508 requirement"),
    ("images.layer.requirement", "transformers>=5\nRUN x", "contains a control character"),
    # the Dockerfile: a relative path under the project, nothing else on the controller
    ("images.layer.dockerfile", "/etc/shadow", "is not a plain relative path"),
    ("images.layer.dockerfile", "docker/../../../etc/shadow", "is not a plain relative path"),
    ("images.layer.dockerfile", "pyproject.toml", "is not under the project's docker/ directory"),
    # URLs carry no credentials
    ("model.index_url", "https://user:pass@pypi.example/simple", "must not carry credentials"),
    ("model.endpoint", "https://hf_abcdefgh@hub.example", "must not carry credentials"),
    ("endpoint", "http://u:p@spark1:8000", "must not carry credentials"),
    ("model.endpoint", "https://hub.example/\n", "contains a control character"),
    # IPv6 on the link is refused (the addresses built from it take IPv4)
    ("nodes.1.link.address", "fd00::2", "IPv6 link addresses are not supported"),
    # paths on the node and patterns
    ("model.venv", "~/venv x", "is not a plain absolute path (or ~/...)"),
    ("model.venv", "relative/venv", "is not a plain absolute path (or ~/...)"),
    ("model.allow_patterns", ["-rf"], "is not a file pattern"),
    ("model.revision", "--upload", "is not of the form"),
    ("model.repo", "../x", "is not of the form"),
    ("model.repo", "Qwen/..", "is not of the form"),
    ("model.revision", "main\n", "is not of the form"),
    ("services.stop.spark1", ["-.service"], "is not a systemd unit name"),
    ("services.stop.spark1", ["a.service; reboot"], "is not a systemd unit name"),
    ("images.rules.sglang.model_files", ["../x.py"], "is not a plain relative path"),
    ("images.rules.sglang.min_version", "0.5.9; x", "is not of the form"),
    ("engines.0.args", ["--x", "a\nb"], "contains a control character"),
    ("engines.1.env.RAY_memory_monitor_refresh_ms", "0\nX=1", "contains a control character"),
    # numbers: finite, within bounds
    ("bench.baseline_decode_tok_s", float("nan"), "must be a finite number, not nan"),
    ("bench.baseline_decode_tok_s", float("inf"), "must be a finite number, not inf"),
    ("services.gpu_free_timeout_s", float("inf"), "must be a finite number, not inf"),
    ("serve.ready_timeout_s", float("nan"), "must be a finite number, not nan"),
    ("serve.stall_s", 1e12, "is out of range"),
    ("model.sync.bwlimit_mb_s", float("inf"), "must be a finite number, not inf"),
    ("bench.requests", 10**9, "is out of range"),
    ("ssh.connect_timeout", 10**6, "is out of range"),
]


def _id(text: str) -> str:
    """A test id that can be named on a command line (no brackets, quotes or escapes)."""
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text)[:60]


@pytest.mark.parametrize("path,value,says", BAD, ids=[_id(f"{b[0]}={b[1]!r}") for b in BAD])
def test_bad_profile_string_is_one_line_naming_the_key(tmp_path, path, value, says):
    p = tmp_path / "x.yaml"
    p.write_text(yaml.safe_dump(at(seed_data(), path, value)))
    before = sorted(tmp_path.iterdir())
    with pytest.raises(ProfileError) as e:
        load_profile(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: {key(path)}"), msg
    assert says in msg
    assert "\n" not in msg and "\r" not in msg
    assert sorted(tmp_path.iterdir()) == before


def _check(profile: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(ROOT), "profile.check"],
                          cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], "INVOKE_SPARKDEPLOY_PROFILE": str(profile),
                               "INVOKE_SPARKDEPLOY_STATE_DIR": str(cwd / "state")})


def test_profile_check_refuses_a_name_carrying_a_unit_directive(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text(yaml.safe_dump(at(seed_data(), "name", INJECTED)))
    r = _check(p, tmp_path)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"{p}: sparkdeploy.name: ")
    assert "Traceback" not in r.stdout + r.stderr
    assert not (tmp_path / "state").exists()


def test_profile_check_refuses_the_injection_from_an_extends_parent(tmp_path):
    parent = tmp_path / "parent.yaml"
    parent.write_text(yaml.safe_dump(at(seed_data(), "name", INJECTED)))
    top = tmp_path / "top.yaml"
    top.write_text(yaml.safe_dump({"extends": "parent.yaml", "sparkdeploy": {"bench": {"warmup": 0}}}))
    r = _check(top, tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == (f"{parent}: sparkdeploy.name: {INJECTED!r} is not a safe name "
                                "(letters, digits, '.', '_' and '-', starting and ending with a "
                                f"letter or digit, at most 128) (via {top})")


def test_profile_check_refuses_a_name_that_escapes_the_state_dir(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text(yaml.safe_dump(at(seed_data(), "name", "../../outside")))
    r = _check(p, tmp_path)
    assert r.returncode == 2 and "sparkdeploy.name: '../../outside' is not a safe name" in r.stderr


# --- the file itself ---------------------------------------------------------------------


def _bomb() -> str:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\nsparkdeploy: {name: *a8}\n"


FILES = [
    ("alias-bomb", lambda p: p.write_text(_bomb()),
     "invalid YAML: line 2, column 10: aliases (*name) are not allowed in a profile (use extends:)"),
    ("deep-nesting", lambda p: p.write_text("sparkdeploy: " + "[" * 50_000 + "]" * 50_000 + "\n"),
     "invalid YAML: line 1, column 45: nested deeper than 32 levels"),
    ("too-big", lambda p: p.write_text("sparkdeploy: {}\n#" + "x" * (1 << 20) + "\n"),
     f"{(1 << 20) + 18} bytes, more than a profile file may hold (1048576 bytes)"),
    ("duplicate-key", lambda p: p.write_text("sparkdeploy:\n  name: a\n  bench: {}\n  name: b\n"),
     "invalid YAML: line 4, column 3: duplicate key 'name' (the second would silently win)"),
    ("fifo", lambda p: os.mkfifo(p),
     "not a regular file (a FIFO, a device or a socket), not a profile file"),
]


@pytest.mark.parametrize("make,says", [f[1:] for f in FILES], ids=[f[0] for f in FILES])
def test_bad_profile_file_is_one_line(tmp_path, make, says):
    p = tmp_path / "x.yaml"
    make(p)
    with pytest.raises(ProfileError) as e:
        load_profile(p)
    assert str(e.value) == f"{p}: {says}"


def test_a_device_as_profile_is_refused_without_reading_it():
    with pytest.raises(ProfileError) as e:
        load_profile("/dev/zero")
    assert str(e.value) == "/dev/zero: not a regular file (a FIFO, a device or a socket), not a profile file"


def test_a_fifo_as_profile_through_inv_is_exit_2_not_a_hang(tmp_path):
    p = tmp_path / "x.yaml"
    os.mkfifo(p)
    r = _check(p, tmp_path)
    assert (r.returncode, r.stderr.strip()) == (
        2, f"{p}: not a regular file (a FIFO, a device or a socket), not a profile file")


def test_read_input_reads_a_file_that_grows_past_its_limit_in_bounded_form(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(b"a" * 10)
    assert read_input(p, limit=10) == b"a" * 10
    p.write_bytes(b"a" * 11)
    with pytest.raises(InputError, match=r"11 bytes, more than a file may hold \(10 bytes\)"):
        read_input(p, limit=10)


# --- names under their root ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["../x.json", "/etc/x.json", "services/../../x", "a//b", "./a",
                                  "runs/deploy-x\n.json", ""])
def test_under_refuses_a_name_that_leaves_its_root(tmp_path, name):
    with pytest.raises(Escape):
        under(tmp_path / "state", name)


def test_under_refuses_a_symlink_out_of_the_root(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "services").symlink_to(tmp_path)
    with pytest.raises(Escape, match="leads out of"):
        under(tmp_path / "state", "services/x.json")


def test_under_accepts_a_name_below_the_root(tmp_path):
    assert under(tmp_path, "runs/deploy-x.json") == tmp_path / "runs" / "deploy-x.json"


def test_state_dir_writes_nothing_outside_itself(tmp_path):
    records = Records(StateDir(tmp_path / "state"), "p")
    with pytest.raises(RecordError, match="bad record name"):
        records.write(PlanMemory(steps={}), "deploy-../../../x")
    with pytest.raises(RecordError, match="bad record name"):
        records.remove(PlanMemory, "..")
    assert sorted(p.name for p in tmp_path.rglob("*")) == []
