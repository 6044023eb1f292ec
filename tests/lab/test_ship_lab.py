"""image.ship on the lab's three dockerd flavours and across the two image stores: a full ship,
then a delta whose bytes follow the missing layer (read from the source's store), and a ship
killed midway that leaves nothing tagged, running or listening, and completes on a re-run.

The images are small ones built here on the head (the lab base plus layers of random bytes);
the module puts the default dockerd back and leaves each node as lab.up left it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkdeploy.core.outcomes import Status
from sparkdeploy.lab import layout, lifecycle
from sparkdeploy.node.deployment import load
from sparkdeploy.node.nodeops import docker, inspect_image, listed_tags
from sparkdeploy.steps import ship

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "configs" / "lab.yaml"
BASE = "sparkdeploy-test/ship-base:1"
DELTA = "sparkdeploy-test/ship-delta:1"
BIG = "sparkdeploy-test/ship-big:1"
PEER = "spark2"


@pytest.fixture(scope="module")
def dep(lab, tmp_path_factory):
    d = load(PROFILE, tmp_path_factory.mktemp("state"))
    yield d
    results = lifecycle.up(nodes=len(lab.nodes), flavor=layout.DEFAULT_DOCKERD)
    assert not [r for r in results if r.failed], [r.why for r in results if r.failed]
    for node in ("spark1", PEER):
        forget(d, node, BIG, DELTA, BASE)
    [base] = ship.ship(d, PEER, layout.BASE_IMAGE)
    assert not base.failed, base.why


def forget(dep, node: str, *refs: str, everything: bool = False) -> None:
    h = dep.host(node)
    h.run(docker(h, "image", "rm", "-f", *refs))
    h.run(docker(h, "image", "prune", "-f", *(["-a"] if everything else [])))


def build(dep, tag: str, base: str, megabytes: int) -> dict:
    """``tag`` on the head: ``base`` plus one layer of random bytes."""
    h = dep.host("spark1")
    if (info := inspect_image(h, tag)) is not None:
        return info
    dockerfile = f"FROM {base}\nRUN head -c {megabytes * 1000 * 1000} /dev/urandom > /{megabytes}.bin\n"
    r = h.run(docker(h, "build", "-q", "-t", tag, "-"), input=dockerfile, timeout=600)
    assert r.ok, r.stderr
    return inspect_image(h, tag)


def rx_bytes(dep, node: str) -> int:
    iface = dep.profile.node(node).link.interface
    out = subprocess.run(["ip", "-n", f"lab-{node}", "-j", "-s", "link", "show", "dev", iface],
                         capture_output=True, text=True, check=True).stdout
    return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])


def same_image(dep, ref: str, containerd: bool) -> None:
    src, got = inspect_image(dep.host("spark1"), ref), inspect_image(dep.host(PEER), ref)
    assert got is not None, f"{PEER} has no {ref}"
    assert got["RootFS"]["Layers"] == src["RootFS"]["Layers"]
    if not containerd:
        assert got["Id"] == src["Id"]
    assert ref in listed_tags(dep.host(PEER))


def ship_processes(dep) -> list[str]:
    """Processes of a ship still running anywhere on this machine (every lab node's are here):
    a staged helper, the source's master connection to the peer, or a load into the peer's
    engine."""
    load = f"unix://{dep.profile.node(PEER).docker_socket} load"
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        staged = "sparkdeploy-stage-" in cmd and ("layer_export.py" in cmd or "save_filter.py" in cmd)
        master = "sparkdeploy-ship." in cmd  # the source's ssh master connection to the peer
        if state != "Z" and (staged or master or load in cmd):
            found.append(f"{pid}: {cmd}")
    return found


def listening(node: str) -> set[str]:
    out = subprocess.run(["nsenter", f"--net=/var/run/netns/lab-{node}", "ss", "-Hltnu"],
                         capture_output=True, text=True, check=True).stdout
    return {" ".join(line.split()[:5]) for line in out.splitlines()}


def peer_load_started(dep) -> bool:
    load = f"unix://{dep.profile.node(PEER).docker_socket} load"
    return any(load in p for p in ship_processes(dep))


def unpacking(dep, flavor: str) -> list[str]:
    """What the peer's load left half-done: a classic load's ``docker-import-*`` unpack dirs in
    Docker's tmp; a containerd import's ingests in containerd's content store."""
    if flavor.endswith("containerd"):
        root = layout.node_dir(PEER) / layout.PRIVATE_MOUNTS[layout.CONTAINERD_ROOT]
        ingest = root / "io.containerd.content.v1.content" / "ingest"
        return [p.name for p in ingest.iterdir()] if ingest.exists() else []
    root = dep.host(PEER).run(docker(dep.host(PEER), "info", "--format", "{{.DockerRootDir}}"))
    tmp = Path(root.stdout.strip()) / "tmp"  # where the peer's load unpacked what it got
    return [p.name for p in tmp.iterdir() if p.name.startswith("docker-import-")] if tmp.exists() else []


@pytest.mark.parametrize("flavor", ["docker26", "docker26,containerd"])
def test_a_ship_killed_midway_leaves_nothing_and_a_rerun_completes(dep, tmp_path, flavor):
    if lifecycle.lab_facts().get("dockerd") != flavor:
        results = lifecycle.up(nodes=2, flavor=flavor)
        assert not [r for r in results if r.failed], [r.why for r in results if r.failed]
    build(dep, BASE, layout.BASE_IMAGE, 20)
    big = build(dep, BIG, BASE, 300)
    forget(dep, PEER, BIG)
    [base] = ship.ship(dep, PEER, BASE)
    assert not base.failed, base.why
    before = {n: listening(n) for n in ("spark1", PEER)}
    env = {**os.environ, "INVOKE_SPARKDEPLOY_PROFILE": str(PROFILE),
           "INVOKE_SPARKDEPLOY_STATE_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "image.ship", "--to", PEER, "--image",
                             BIG], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not peer_load_started(dep) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the ship ended before it could be killed"
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)  # the controller and its ssh clients, midway
    proc.wait(30)
    deadline = time.monotonic() + 30
    while ship_processes(dep) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ship_processes(dep) == []
    assert BIG not in listed_tags(dep.host(PEER))
    assert {n: listening(n) for n in ("spark1", PEER)} == before
    # the peer's dockerd cancels the import when its client dies; on a loaded 2-core machine a
    # containerd store took over 30 s to drop the ingest
    deadline = time.monotonic() + 120
    while unpacking(dep, flavor) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert unpacking(dep, flavor) == []
    [rerun] = ship.ship(dep, PEER, BIG)
    assert rerun.status is Status.CHANGED, rerun.why
    assert rerun.details["mode"] == "partial" and rerun.details["via"] == "store", (
        rerun.why + "\n" + dep.host(PEER).run(["sh", "-c", "ctr -n moby content ls; docker image ls -a"]).stdout)
    assert inspect_image(dep.host(PEER), BIG)["RootFS"] == big["RootFS"]
    forget(dep, PEER, BIG)
    forget(dep, "spark1", BIG)


FLAVORS = ["docker26", "classic20", "containerd", "containerd,docker26", "docker26,containerd"]
"""Both nodes on each flavour, then a containerd-store source to a classic peer and back."""


@pytest.mark.parametrize("flavor", FLAVORS)
def test_full_then_delta_ship(dep, flavor):
    """Each store on each end: the full ship and the 5 MB delta are read from the source's store
    (a classic one's layer store, a containerd one's content store) into the peer's load (an OCI
    layout for a containerd-store peer, naming the blobs it holds); the delta's bytes on the
    peer's link follow its one missing layer, and the peer lists the tag with the same layers."""
    if lifecycle.lab_facts().get("dockerd") != flavor:
        results = lifecycle.up(nodes=2, flavor=flavor)
        assert not [r for r in results if r.failed], [r.why for r in results if r.failed]
    assert lifecycle.lab_facts()["dockerd"] == flavor
    containerd = "containerd" in flavor  # an image's ID is not its config digest on one end
    build(dep, BASE, layout.BASE_IMAGE, 20)
    build(dep, DELTA, BASE, 5)
    base_layers = inspect_image(dep.host("spark1"), BASE)["RootFS"]["Layers"]
    # full: the peer holds none of the image's layers
    forget(dep, PEER, DELTA, BASE, layout.BASE_IMAGE, everything=True)
    [full] = ship.ship(dep, PEER, BASE)
    assert full.status is Status.CHANGED, full.why
    assert full.details["mode"] == "full" and full.details["via"] == "store", full.why
    assert "the peer has none of its layers" in full.why, full.why
    same_image(dep, BASE, containerd)
    # delta: the peer has every layer but the top one
    rx = rx_bytes(dep, PEER)
    [part] = ship.ship(dep, PEER, DELTA)
    received = rx_bytes(dep, PEER) - rx
    assert part.status is Status.CHANGED, part.why
    same_image(dep, DELTA, containerd)
    assert part.details["mode"] == "partial" and part.details["via"] == "store", part.why
    assert part.details["layers_skipped"] == len(base_layers)
    store = "content" if flavor.startswith("containerd") else "layer"
    assert f"read from spark1's {store} store" in part.why
    # the 5 MB layer (its tar or blob: random bytes keep their size) and ssh's framing; not the
    # 200 MB below it
    assert 5e6 < received < 5e6 * 1.1 + 2e6, received
    assert part.details["bytes_out"] < 5e6 * 1.01 + 10e3
    [again] = ship.ship(dep, PEER, DELTA)
    assert again.status is Status.OK, again.why
    forget(dep, PEER, DELTA, BASE)
    forget(dep, "spark1", DELTA, BASE)
    [back] = ship.ship(dep, PEER, layout.BASE_IMAGE)
    assert not back.failed, back.why
