"""image.ship decisions against scripted engines: what is sent, when whole, when nothing."""

import json
import shlex

import pytest
from invoke import Config, Context
from invoke import Result as RunResult

from sparkdeploy.config import load_profile
from sparkdeploy.deployment import Deployment
from sparkdeploy.events import Progress
from sparkdeploy.hosts import Host
from sparkdeploy.results import Result, Status
from sparkdeploy.state import StateDir
from sparkdeploy.steps import ship
from tests.unit.test_profile import SEED

BASE = ["sha256:" + "1" * 64, "sha256:" + "2" * 64]
TOP = "sha256:" + "3" * 64
IMG = {"Id": "sha256:" + "c" * 64, "RootFS": {"Layers": BASE + [TOP]}, "Size": 3_000_000_000,
       "Architecture": "arm64", "Os": "linux"}
BASE_IMG = {"Id": "sha256:" + "b" * 64, "RootFS": {"Layers": BASE}, "Size": 2_000_000_000}


class Engine:
    def __init__(self, images=None, containerd=False, refuse_partial=False, free=10**12):
        self.images = dict(images or {})
        self.containerd = containerd
        self.refuse_partial = refuse_partial
        self.free = free


class Ctx(Context):
    """Answers docker/df commands per node; a transfer pipeline copies the image to the peer."""

    def __init__(self, engines):
        super().__init__(Config(overrides={"run": {"dry": False}}))
        self._set("engines", engines)
        self._set("pipelines", [])

    def run(self, command, **kw):
        full = shlex.split(command)
        alias, argv = full[-2], shlex.split(full[-1])
        assert full[-3] == "--"
        e = self.engines[alias]
        out, code, err = "", 0, ""
        if argv[:1] == ["docker"]:
            argv = argv[3:]
        if argv[:2] == ["image", "inspect"]:
            ref = argv[-1]
            if argv[3] == "{{json .RootFS.Layers}}":
                out = "".join(json.dumps(img["RootFS"]["Layers"]) + "\n"
                              for img in {id(v): v for v in e.images.values()}.values())
            elif ref in e.images:
                info = dict(e.images[ref])
                if e.containerd:
                    info["Id"] = "sha256:" + "f" * 64  # the manifest digest, not the config's
                out = json.dumps(info)
            else:
                code, err = 1, f"Error: No such image: {ref}"
        elif argv[:2] == ["image", "ls"] and "-q" in argv:
            out = "\n".join(sorted({v["Id"] for v in e.images.values()}))
        elif argv[:2] == ["image", "ls"]:
            out = "\n".join(r if ":" in r.rsplit("/", 1)[-1] else r + ":latest" for r in e.images)
        elif argv[:1] == ["info"]:
            status = ([["driver-type", "io.containerd.snapshotter.v1"]] if e.containerd
                      else [["Backing Filesystem", "extfs"]])
            out = json.dumps({"DriverStatus": status, "DockerRootDir": "/var/lib/docker"})
        elif argv[:1] == ["history"]:
            out = "0\n1000000000\n0\n1000000000\n1000000000\n"
        elif argv[:1] == ["df"]:
            out = f"Filesystem 1-blocks Used Available Capacity Mounted\n/dev/x 1 1 {e.free} 1% /\n"
        elif argv[:2] == ["sh", "-c"]:  # staging a helper: the node answers with its path
            digest, name = argv[4], argv[5]
            out = f"/tmp/sparkdeploy-stage-0/{digest}/{name}\n"
        elif argv[:2] == ["bash", "-c"]:
            script = argv[2]
            self.pipelines.append((alias, script))
            peer = next(n for n, en in self.engines.items()
                        if f" {ADDR[n]} " in script)
            partial = "save_filter.py" in script
            if partial and self.engines[peer].refuse_partial:
                code, err = 1, "Error processing tar file: unexpected EOF"
            else:
                if kw.get("err_stream") is not None and partial:
                    # save_filter's progress, as it arrives (split mid-line on purpose)
                    for chunk in ("progress bytes_in=1000000000 byt", "es_out=0\n",
                                  "progress bytes_in=3000000000 bytes_out=1000000000\n"):
                        kw["err_stream"].write(chunk)
                self.engines[peer].images["img:1"] = IMG
                err = json.dumps({"bytes_in": 3_000_000_000,
                                  "bytes_out": 1_000_000_000 if partial else 3_000_000_000})
        else:
            raise AssertionError(argv)
        return RunResult(stdout=out, stderr=err, exited=code, command=command)


ADDR = {"spark1": "192.168.100.10", "spark2": "192.168.100.11"}


@pytest.fixture
def make(tmp_path):
    def _make(peer_engine):
        ctx = Ctx({"spark1": Engine({"img:1": IMG, "base:1": BASE_IMG}), "spark2": peer_engine})
        prof = load_profile(SEED)
        state = StateDir(tmp_path)
        hosts = {n.name: Host(n, prof.ssh, ctx, state) for n in prof.nodes}
        return Deployment(prof, str(SEED), state, hosts), ctx
    return _make


def test_peer_with_the_base_gets_only_the_top_layer(make):
    dep, ctx = make(Engine({"base:1": BASE_IMG}))
    with dep.events.collect() as events:
        [res] = ship.ship(dep, "spark2", "img:1")
    # progress as the source reads the image, then the result, each once, on the stream
    assert [e for e in events if isinstance(e, Progress)] == [
        Progress("image.ship", "spark2", 1_000_000_000, 3_000_000_000, "B", "from spark1"),
        Progress("image.ship", "spark2", 3_000_000_000, 3_000_000_000, "B", "from spark1")]
    assert [e for e in events if isinstance(e, Result)] == [res]
    assert res.status is Status.CHANGED, res.why
    assert res.details["mode"] == "partial" and res.details["layers_skipped"] == 2
    [(alias, script)] = ctx.pipelines
    assert alias == "spark1" and "save_filter.py" in script and "--have-file" in script
    assert "1000 MB of 3000 MB" in res.why


def test_empty_peer_gets_the_whole_image_without_the_filter(make):
    dep, ctx = make(Engine())
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.details["mode"] == "full"
    assert "save_filter.py" not in ctx.pipelines[0][1]
    assert "(the peer has none of its layers)" in res.why


def test_peer_that_has_the_image_is_ok_and_nothing_is_sent(make):
    dep, ctx = make(Engine({"img:1": IMG}))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.OK
    assert ctx.pipelines == []


def test_containerd_peer_gets_the_whole_archive(make):
    dep, ctx = make(Engine({"base:1": BASE_IMG}, containerd=True))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED, res.why
    assert res.details["mode"] == "full"
    assert "containerd image store" in res.why
    assert "save_filter.py" not in ctx.pipelines[0][1]


def test_peer_refusing_the_partial_archive_gets_a_full_one(make):
    dep, ctx = make(Engine({"base:1": BASE_IMG}, refuse_partial=True))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED
    assert [("save_filter.py" in s) for _, s in ctx.pipelines] == [True, False]
    assert "the peer refused the partial archive" in res.why and "sent it whole" in res.why


def test_not_enough_disk_fails_before_sending(make):
    dep, ctx = make(Engine(free=10**9))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.FAILED
    assert res.why.startswith("spark2 has 1.0 GB free in /var/lib/docker, needs about 6.0 GB")
    assert ctx.pipelines == []


def test_missing_source_image_fails(make):
    dep, _ = make(Engine())
    [res] = ship.ship(dep, "spark2", "nope:1")
    assert res.status is Status.FAILED and res.why == "spark1 has no image nope:1"
