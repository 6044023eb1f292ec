"""Lab part 2, the closed internet: the model hub and the package index on the management net.

Each test serves its own hub or index on the controller's management address (a free port),
so it proves the path a node really uses (node -> management network -> controller) whatever
lab.up itself runs on the default ports.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import uuid

import pytest

from sparkdeploy.lab import hub, layout, pkgindex

pytestmark = pytest.mark.lab


@pytest.fixture()
def six_index(lab, tmp_path):
    report = pkgindex.ensure_wheels(["six"], tmp_path / "wheels")
    assert report.files["six"]
    server = pkgindex.start_index(bind=lab.state["controller"], port=0,
                                  wheel_dir=tmp_path / "wheels")
    yield server
    server.stop()


def test_docker_build_on_the_head_installs_a_wheel_from_the_lab_index(lab, six_index):
    head = lab.nodes[0]
    tag = f"sparkdeploy-lab/index-test:{uuid.uuid4().hex[:8]}"
    dockerfile = (
        f"FROM {layout.BASE_IMAGE}\n"
        "ARG PIP_INDEX_URL\n"
        "ARG PIP_TRUSTED_HOST\n"
        "RUN python3 -m venv /opt/v && /opt/v/bin/pip install --no-cache-dir six\n"
    )
    build = ["docker", "build", "--network", "host"]
    for k, v in six_index.pip_env.items():  # PIP_INDEX_URL and PIP_TRUSTED_HOST (plain HTTP)
        build += ["--build-arg", f"{k}={v}"]
    build += ["-t", tag, "-"]
    done = subprocess.run(lab.ssh_argv(head, shlex.join(build)), input=dockerfile,
                          capture_output=True, text=True, timeout=600)
    try:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        out = lab.ssh(head, ["docker", "run", "--rm", "--network", "none", tag, "/opt/v/bin/python3", "-c",
                             "import six, json; print(json.dumps(six.__file__))"]).stdout
        assert json.loads(out.strip().splitlines()[-1]).startswith("/opt/v/lib/python3")
        # (method, path, status, client): the head's own address asked, over the management net
        head_addr = lab.state["node"][head]["mgmt_addr"]
        assert ("GET", "/simple/six/", 200, head_addr) in six_index.requests
        assert any(p.startswith("/files/six-") and s == 200 and c == head_addr
                   for _, p, s, c in six_index.requests)
    finally:
        lab.ssh(head, ["docker", "rmi", "-f", tag], check=False)


def test_snapshot_download_on_the_head_through_hf_endpoint(lab, tmp_path):
    """The head downloads the miniature model from the controller's hub into its own model dir,
    resuming once after the hub drops the connection mid-shard."""
    server = hub.start_hub(bind=lab.state["controller"], port=0, data_dir=tmp_path / "hub",
                           size_mb=24, shards=2)
    try:
        repo = server.state.repos[hub.REPO_ID]
        shard = sorted(p for p, f in repo.files.items() if f.lfs)[0]
        server.set_knobs(fault={"file": shard, "after_bytes": 11 * 1024 * 1024})
        name = f"lab-hub-test-{uuid.uuid4().hex[:8]}"
        target = f"{layout.MODEL_DIR}/{name}"
        # the controller's interpreter in the head's network namespace (the node's own root has no
        # huggingface_hub), writing to what backs the head's model dir
        local = layout.node_dir(lab.nodes[0]) / layout.PRIVATE_MOUNTS[layout.MODEL_DIR] / name
        script = (
            "import hashlib, json, os\n"
            "from huggingface_hub import snapshot_download\n"
            f"p = snapshot_download({hub.REPO_ID!r}, local_dir={str(local)!r})\n"
            "print(json.dumps({f: hashlib.sha256(open(os.path.join(p, f), 'rb').read())"
            ".hexdigest() for f in os.listdir(p) if os.path.isfile(os.path.join(p, f))}))\n"
        )
        env = {**os.environ, "HF_ENDPOINT": server.url, "HF_HUB_DISABLE_TELEMETRY": "1",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HOME": f"{local}/.hf_home"}
        done = subprocess.run(["ip", "netns", "exec", layout.netns_name(lab.nodes[0]),
                               sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        out = done.stdout
        # it went out from the head's management address
        assert {r["client"] for r in server.stats()["requests"]} == {lab.addr(lab.nodes[0], "mgmt")}
        got = json.loads(out.strip().splitlines()[-1])
        assert got == {p: hashlib.sha256((repo.root / p).read_bytes()).hexdigest()
                       for p in repo.files}
        assert {f.sha256 for f in repo.files.values() if f.lfs} <= set(got.values())
        stats = server.stats()
        assert [f["file"] for f in stats["faults_fired"]] == [shard]
        assert any(r["file"] == shard and r["status"] == 206 for r in stats["requests"])
        # only the head holds the files
        assert lab.ssh(lab.nodes[1], ["test", "-e", target], check=False).returncode == 1
        lab.ssh(lab.nodes[0], ["rm", "-rf", target])
    finally:
        server.stop()
