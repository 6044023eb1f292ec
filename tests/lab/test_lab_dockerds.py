"""`lab.up --dockerd`: bookworm's Docker 20.10 and Docker 26 on the containerd image store.

Each case switches every node's dockerd, checks it over ssh, and the module puts the default
dockerd back afterwards (data roots are kept per flavor, so the switch back is quick).
"""

from __future__ import annotations

import json

import pytest

from sparkdeploy.lab import layout, lifecycle

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def restore_default_dockerd(lab):
    yield lab
    results = lifecycle.up(nodes=len(lab.nodes), flavor=layout.DEFAULT_DOCKERD)
    assert not [r for r in results if r.failed], [r.why for r in results if r.failed]


@pytest.mark.parametrize(("flavor", "version", "store"), [
    ("classic20", "20.10.", None),
    ("containerd", "26.", "io.containerd.snapshotter.v1"),
])
def test_dockerd_flavor_runs_the_base_image_on_every_node(restore_default_dockerd, flavor,
                                                          version, store):
    lab = restore_default_dockerd
    results = lifecycle.up(nodes=len(lab.nodes), flavor=flavor)
    assert not [r for r in results if r.failed], [r.why for r in results if r.failed]
    for node in lab.nodes:
        info = json.loads(lab.ssh(node, ["docker", "info", "--format", "{{json .}}"]).stdout)
        assert info["ServerVersion"].startswith(version)
        assert dict(info.get("DriverStatus") or []).get("driver-type") == store
        listed = lab.ssh(node, ["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"])
        assert layout.BASE_IMAGE in listed.stdout.split()
        out = lab.ssh(node, ["docker", "run", "--rm", "--network", "host", layout.BASE_IMAGE,
                             "python3", "-c", "print('ok')"])
        assert out.stdout.strip() == "ok"
