"""A filtered `docker save` archive loads on a peer that already has the base image (real engines).

Needs from the `lab` fixture: two nodes whose engines both hold ``layout.BASE_IMAGE`` with the
same layers, each engine reachable from the controller (``sparkdeploy.lab.dockerd.docker``) and the
peer's `docker load` reachable over ``lab.ssh_argv`` (its sessions' DOCKER_HOST names its engine).
The peer must use the classic image store (the containerd store gets whole archives: FACTS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from sparkdeploy.core.packaged import helper
from sparkdeploy.lab import layout
from sparkdeploy.lab.dockerd import docker

pytestmark = pytest.mark.lab

FILTER = helper("save_filter.py")


def _inspect(node: str, ref: str) -> dict:
    cp = subprocess.run(docker(node, "image", "inspect", ref), capture_output=True, text=True, timeout=60, check=True)
    return json.loads(cp.stdout)[0]


def test_partial_archive_loads_on_a_peer_with_the_base(lab, tmp_path):
    head, peer = lab.nodes[0], lab.nodes[1]
    tag = f"sparkdeploy-lab/filtered:{uuid.uuid4().hex[:8]}"
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "extra.bin").write_bytes(b"sparkdeploy" * 10000)
    (ctx / "Dockerfile").write_text(f"FROM {layout.BASE_IMAGE}\nCOPY extra.bin /extra.bin\n")
    subprocess.run(
        docker(head, "build", "-q", "-t", tag, str(ctx)),
        check=True,
        capture_output=True,
        timeout=600,
        env={**os.environ, "DOCKER_BUILDKIT": "0"},
    )
    try:
        src = _inspect(head, tag)
        base_on_peer = _inspect(peer, layout.BASE_IMAGE)
        layers = src["RootFS"]["Layers"]
        have = base_on_peer["RootFS"]["Layers"]
        assert layers[: len(have)] == have
        stats = tmp_path / "stats.json"
        save = subprocess.Popen(docker(head, "save", tag), stdout=subprocess.PIPE)
        filt = subprocess.Popen(
            [
                sys.executable,
                str(FILTER),
                "--layers",
                ",".join(layers),
                "--stats",
                str(stats),
                "--quiet",
                *[a for d in have for a in ("--have", d)],
            ],
            stdin=save.stdout,
            stdout=subprocess.PIPE,
        )
        save.stdout.close()
        load = subprocess.run(
            lab.ssh_argv(peer, "docker load"), stdin=filt.stdout, capture_output=True, text=True, timeout=600
        )
        filt.stdout.close()
        assert save.wait(timeout=60) == 0
        assert filt.wait(timeout=60) == 0
        assert load.returncode == 0, load.stderr
        report = json.loads(stats.read_text())
        assert report["layout"] in ("oci", "legacy")
        assert sorted(d["diff_id"] for d in report["dropped"]) == sorted(set(have))
        assert report["missed"] == [] and report["errors"] == []
        # what was sent is about the new layer, not the base
        assert report["bytes_out"] < report["bytes_dropped"]
        got = _inspect(peer, tag)
        assert got["Id"] == src["Id"]
        assert got["RootFS"]["Layers"] == layers
        listed = subprocess.run(
            docker(peer, "images", "--format", "{{.Repository}}:{{.Tag}}"), capture_output=True, text=True, check=True
        ).stdout.split()
        assert tag in listed
    finally:
        for node in (head, peer):
            subprocess.run(docker(node, "rmi", "-f", tag), capture_output=True, timeout=120)
