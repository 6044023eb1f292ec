"""cluster.discover on the lab's real nodes (sshd, dockerd, the stand-ins' nvidia-smi and RoCE
sysfs, the bridged fast link), from nothing but the ssh aliases: the profile it writes is the
lab profile's nodes. And hosts.trust --nodes, for an ssh_config whose known_hosts is empty."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkdeploy.profile.config import load_profile

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[2]


def inv(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    # no profile anywhere: not in the environment, and the default is this checkout's seed
    env = {k: v for k, v in os.environ.items() if not k.startswith("INVOKE_SPARKDEPLOY_")}
    env["INVOKE_SPARKDEPLOY_STATE_DIR"] = str(tmp_path / "state")
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)


def node_view(path: Path) -> list[tuple]:
    return [(n.name, n.role, n.ssh, n.gpus, n.link.interface, n.link.address, n.link.hcas,
             n.docker_socket, n.privilege, n.arch) for n in load_profile(path).nodes]


def test_discover_writes_the_lab_profiles_nodes_from_the_aliases(lab, tmp_path):
    target = tmp_path / "mine.yaml"
    r = inv(tmp_path, "cluster.discover", "--ssh-config", lab.ssh_config,
            "--nodes", "spark1,spark2", "--write", str(target))
    assert r.returncode == 0, r.stdout + r.stderr
    assert node_view(target) == node_view(REPO / "configs" / "lab.yaml")
    assert load_profile(target).ssh.config == lab.ssh_config
    assert "fast link: 10.77.1.0/24 (spark1 enp1s0f0np0 10.77.1.1/24, spark2 enp1s0f0np0 " \
           "10.77.1.2/24) (every peer answered the head on it)" in r.stdout
    # the profile check of the written file, as a user runs it
    check = inv(tmp_path, "profile.check", "--profile", str(target))
    assert check.returncode == 0, check.stdout + check.stderr

    dry = inv(tmp_path, "--dry", "cluster.discover", "--ssh-config", lab.ssh_config,
              "--nodes", "spark1,spark2", "--write", str(tmp_path / "other.yaml"))
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert f"would write {tmp_path / 'other.yaml'}" in dry.stdout
    assert not (tmp_path / "other.yaml").exists()


def test_an_unknown_host_key_then_hosts_trust_by_alias(lab, tmp_path):
    known = tmp_path / "known_hosts"
    cfg = tmp_path / "ssh_config"
    cfg.write_text(Path(lab.ssh_config).read_text().replace(lab.known_hosts, str(known)))
    r = inv(tmp_path, "cluster.discover", "--ssh-config", str(cfg), "--nodes", "spark1,spark2")
    assert r.returncode == 1
    hint = f"its host key is not known here: run `inv hosts.trust --nodes spark1,spark2 " \
           f"--ssh-config {cfg}` first"
    assert r.stdout.count(hint) == 2, r.stdout

    trusted = inv(tmp_path, "hosts.trust", "--nodes", "spark1,spark2", "--ssh-config", str(cfg),
                  "--yes")
    assert trusted.returncode == 0, trusted.stdout + trusted.stderr
    lab_keys = Path(lab.known_hosts).read_text()
    assert [ln.split()[2] in lab_keys for ln in known.read_text().splitlines()] == [True, True]
    again = inv(tmp_path, "cluster.discover", "--ssh-config", str(cfg), "--nodes", "spark1,spark2")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "  - name: spark2   # from the ssh alias spark2" in again.stdout
