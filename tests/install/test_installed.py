"""The package as ``pip install .`` (not editable) installs it, used outside a checkout: what
``nox -s install_check`` runs (not part of ``tests``: it needs that install, not the checkout's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import sparkdeploy

SOURCES = Path(__file__).resolve().parents[2] / "src"  # the checkout's package, not to be used


def sparkdeploy_cmd(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("sparkdeploy")
    return subprocess.run([str(exe), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_package_imported_is_the_installed_one_not_the_checkout():
    where = Path(sparkdeploy.__file__).resolve()
    assert SOURCES not in where.parents and "site-packages" in where.parts


def test_list_names_every_namespace(tmp_path):
    r = sparkdeploy_cmd(tmp_path, "--list")
    assert r.returncode == 0, r.stderr
    for task in ("deploy.all (deploy)", "profile.seed", "image.build", "model.verify", "lab.up"):
        assert task in r.stdout


def test_dry_deploy_all_on_the_packaged_seed_plans_and_writes_nothing(tmp_path):
    seed = Path(sparkdeploy_cmd(tmp_path, "profile.seed").stdout.strip())
    assert seed.is_file() and seed.name == "qwen3.5-122b-a10b-fp8.yaml"
    assert SOURCES not in seed.resolve().parents and "site-packages" in seed.parts
    r = sparkdeploy_cmd(tmp_path, "--dry", "deploy.all", "--profile", str(seed))
    out = r.stdout + r.stderr
    # no Spark answers here: the steps that need one fail, each in one line, none crashes
    assert r.returncode in (0, 1), out
    assert "Traceback" not in out and "No such file" not in out
    assert "[spark1] would run: sudo -n systemctl stop vllm-proxy.service" in r.stdout
    assert "record: none (dry run)" in r.stdout
    assert list(tmp_path.iterdir()) == []


def test_the_default_profile_outside_a_checkout_is_one_line_naming_the_seed_task(tmp_path):
    r = sparkdeploy_cmd(tmp_path, "--dry", "deploy.all")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "configs/qwen3.5-122b-a10b-fp8.yaml: no such profile file (the default, for a checkout; "
        "else pass --profile FILE: `sparkdeploy profile.seed` prints the seed's)"]
