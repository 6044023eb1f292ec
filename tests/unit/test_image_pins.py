"""Pinned images: the digest image.probe records, the refusal of serve.up and deploy.all when a
candidate's tag names another image since, digest pins in a profile, the derivative's labels."""

import json
import shlex
import subprocess
import sys

import pytest

from sparkdeploy.core import labels as lbl
from sparkdeploy.core.records import ImageDecision
from sparkdeploy.ops import image as image_ops
from sparkdeploy.profile.config import load_profile
from sparkdeploy.profile.overlays import ProfileError
from sparkdeploy.run import plan as plans
from sparkdeploy.steps import images, serve
from tests.unit.fakes import WALL, FakeContext, deployment
from tests.unit.profiles import ROOT, SEED, seed_data, write_profile

SGLANG = "scitrera/dgx-spark-sglang:0.5.10rc0"
VLLM = "hellohal2064/vllm-qwen3.5-gb10"
AAA = "sha256:" + "a" * 64
BBB = "sha256:" + "b" * 64
ID1 = "sha256:" + "1" * 64
ID2 = "sha256:" + "2" * 64


def info(image_id, *repo_digests):
    return {"Id": image_id, "Architecture": "arm64", "Os": "linux", "RepoDigests": list(repo_digests)}


def report(engine, version, ok, reasons=(), nccl=None):
    return {"packages": {"transformers": "4.57.1", engine: version},
            "config": {"ok": False, "model_type": "qwen3_5_moe"},
            "engines": {engine: {"installed": True, "version": version, "model_files": {"x": True},
                                 "ok": ok, "reasons": list(reasons)}},
            "nccl": nccl}


NCCL_BOTH = {"loads": "wheel", "path": "/usr/local/lib/python3.12/dist-packages/nvidia/nccl/lib/libnccl.so.2",
             "version": "2.28.9", "why": "torch's RPATH ...",
             "wheel": {"package": "nvidia-nccl-cu13", "version": "2.28.9"},
             "system": {"path": "/usr/lib/aarch64-linux-gnu/libnccl.so.2", "version": "2.27.7"}}


class Head(FakeContext):
    """spark1 answering ``docker image inspect REF`` from ``images`` (absent: exit 1); any other
    command fails the test (nothing may stop, start or be pulled)."""

    def __init__(self, images_now, dry=False):
        super().__init__(dry=dry)
        self._set("images_now", images_now)

    def answer(self, alias, argv, stdin, command, kw):
        assert alias == "spark1" and argv[3:6] == ["image", "inspect", "--format"], command
        got = self.images_now.get(argv[-1])
        if got is None:
            return self.result(command, 1, stderr=f"Error: No such image: {argv[-1]}")
        return self.result(command, stdout=json.dumps(got))


def decided(tmp_path, ctx, dry=False):
    """A deployment whose image.probe decided on the sglang candidate (pulled: repo digest AAA)
    and the vLLM one (built here: no repo digest, ID2)."""
    dep = deployment(SEED, tmp_path / "state", ctx, dry=dry)
    dep.wall = lambda: WALL
    rows = [images.judge(dep, SGLANG, "sglang", "arm64",
                         info(ID1, f"scitrera/dgx-spark-sglang@{AAA}"),
                         report("sglang", "0.5.10rc0", False,
                                ["transformers 4.57.1 cannot parse model_type qwen3_5_moe"], NCCL_BOTH),
                         None),
            images.judge(dep, VLLM, "vllm", "arm64", info(ID2), report("vllm", "0.17.1", True), None)]
    images.write_record(dep, images.decide(dep, "spark1", "arm64", "hub", rows))
    return dep


def test_the_record_carries_each_candidates_digest_and_nccl(tmp_path):
    dep = decided(tmp_path, Head({}))
    rec = image_ops.decision(dep)
    by = {c.image: c for c in rec.candidates}
    assert (by[SGLANG].digest, by[SGLANG].image_id) == (AAA, ID1)  # from a registry
    assert (by[VLLM].digest, by[VLLM].image_id) == (ID2, ID2)  # no repo digest: its ID
    assert by[SGLANG].nccl["loads"] == "wheel"
    assert rec.chosen.digest == AAA and rec.engines["vllm-ray"].digest == ID2
    md = dep.records.path(ImageDecision, suffix=".md").read_text()
    assert (f"| {SGLANG} | sglang | 0.5.10rc0 | 4.57.1 | yes | no | linux/arm64 | needs-layer | {AAA} "
            "| loads the nvidia-nccl-cu13 wheel's 2.28.9 (also libnccl2 2.27.7) |") in md


def test_a_repo_digest_of_another_repository_is_not_the_candidates():
    assert image_ops.digest_of(info(ID1, f"other/repo@{AAA}"), SGLANG) == ID1
    assert image_ops.digest_of(info(ID1, f"scitrera/dgx-spark-sglang@{AAA}"), SGLANG) == AAA
    assert image_ops.digest_of(info(ID1, f"localhost:5000/x@{BBB}"), f"localhost:5000/x:1@{BBB}") == BBB
    assert image_ops.repo_of("localhost:5000/a/b:1@" + AAA) == "localhost:5000/a/b"


@pytest.mark.parametrize("now", [
    info(ID1, f"scitrera/dgx-spark-sglang@{AAA}"),  # unchanged
    info(ID1),  # the same image, loaded here: no repo digest, same ID
    info(ID2 + "0", f"scitrera/dgx-spark-sglang@{AAA}"),  # containerd store: another ID, same digest
])
def test_the_same_image_is_not_refused(tmp_path, now):
    dep = decided(tmp_path, Head({SGLANG: now, VLLM: info(ID2)}))
    assert image_ops.moved(dep) == []
    assert plans.refusal(dep) is None


MOVED = (f"{SGLANG} was {AAA} when decided, is {BBB} now; run image.probe to accept it")


def test_a_moved_tag_is_one_line(tmp_path):
    dep = decided(tmp_path, Head({SGLANG: info(ID2, f"scitrera/dgx-spark-sglang@{BBB}"),
                                  VLLM: info(ID1)}))
    assert image_ops.moved(dep) == [
        MOVED, f"{VLLM} was {ID2} when decided, is {ID1} now; run image.probe to accept it"]


def test_no_decision_or_a_missing_image_is_not_a_refusal(tmp_path):
    dep = deployment(SEED, tmp_path / "state", Head({}))
    assert image_ops.moved(dep) == []  # never probed
    dep = decided(tmp_path, Head({}))
    assert image_ops.moved(dep) == []  # gone from the head: the probe and the ship say so


def test_serve_up_refuses_before_anything_stops(tmp_path):
    ctx = Head({SGLANG: info(ID2, f"scitrera/dgx-spark-sglang@{BBB}"), VLLM: info(ID2)})
    dep = decided(tmp_path, ctx)
    [r] = serve.up(dep)
    assert (r.status, r.node, r.why) == ("failed", "spark1", MOVED)
    # the only commands: one inspect per candidate the decision names (no ps, no stop, no run)
    assert [argv[-1] for _, argv in ctx.calls] == [SGLANG, VLLM]


def test_deploy_all_refuses_in_a_dry_run_too(tmp_path):
    dep = decided(tmp_path, Head({SGLANG: info(ID2, f"scitrera/dgx-spark-sglang@{BBB}"),
                                  VLLM: info(ID2)}, dry=True), dry=True)
    assert plans.refusal(dep) == MOVED


def test_inv_deploy_all_dry_exits_1_with_the_line(tmp_path):
    """The task: the refusal is the one line on stderr and exit 1, before the plan is shown."""
    decided(tmp_path, Head({}))
    ssh = tmp_path / "bin" / "ssh"
    ssh.parent.mkdir()
    # every node command goes through ssh: the sglang candidate's tag names another image now
    moved = json.dumps(info(ID2, f"scitrera/dgx-spark-sglang@{BBB}"))
    ssh.write_text("#!/bin/sh\ncase \"$*\" in\n"
                   f"  *'image inspect'*{SGLANG}*) echo {shlex.quote(moved)};;\n"
                   "  *'image inspect'*) echo 'Error: No such image' >&2; exit 1;;\n"
                   "  *) exit 255;;\nesac\n")
    ssh.chmod(0o755)
    r = subprocess.run([sys.executable, "-m", "invoke", "--dry", "deploy.all"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={"PATH": f"{ssh.parent}:/usr/bin:/bin", "HOME": str(tmp_path),
                            "PYTHONPATH": str(ROOT / "src"),
                            "INVOKE_SPARKDEPLOY_PROFILE": str(SEED),
                            "INVOKE_SPARKDEPLOY_STATE_DIR": str(tmp_path / "state")})
    assert (r.returncode, r.stderr.strip()) == (1, MOVED), r.stdout + r.stderr
    assert "plan (" not in r.stdout


@pytest.mark.parametrize("where,key", [
    (lambda d: d["images"]["candidates"][1], "sparkdeploy.images.candidates[1].ref"),
    (lambda d: d["engines"][1], "sparkdeploy.engines[1].image"),
])
def test_a_malformed_digest_pin_is_one_line_naming_the_key(tmp_path, where, key):
    d = seed_data()
    field = "ref" if key.endswith("ref") else "image"
    where(d["sparkdeploy"])[field] = f"{SGLANG}@sha256:abc"
    p = write_profile(tmp_path, d)
    with pytest.raises(ProfileError) as e:
        load_profile(p)
    assert str(e.value) == (f"{p}: {key}: '{SGLANG}@sha256:abc' has a malformed digest: a pin is "
                            "repo[:tag]@sha256:<64 lowercase hex digits>")


def test_a_digest_pin_loads(tmp_path):
    d = seed_data()
    d["sparkdeploy"]["images"]["candidates"][2]["ref"] = f"{VLLM}@{AAA}"
    d["sparkdeploy"]["engines"][1]["image"] = f"{VLLM}:latest@{AAA}"
    prof = load_profile(write_profile(tmp_path, d))
    assert prof.images.candidates[2].ref == f"{VLLM}@{AAA}"


def test_engine_containers_carry_the_decided_digest(tmp_path):
    from sparkdeploy.engines import launch

    prof = load_profile(SEED)
    lau = launch(prof, prof.engines[0], {}, image_id=ID1, image_digest=AAA)
    for c in lau.containers:
        got = dict(c.labels)
        assert (got[lbl.IMAGE_ID], got[lbl.IMAGE_DIGEST]) == (ID1, AAA)


def test_a_pinned_engine_image_runs_by_the_id_it_resolved_to_on_the_head():
    from sparkdeploy.engines import launch

    prof = load_profile(SEED)
    eng = prof.engines[1].model_copy(update={"image": f"{VLLM}@{AAA}"})
    assert {c.image for c in launch(prof, eng, {}, image_id=ID1).containers} == {ID1}
    assert {c.image for c in launch(prof, eng, {}).containers} == {f"{VLLM}@{AAA}"}  # the draft
    tagged_eng = prof.engines[1]
    assert {c.image for c in launch(prof, tagged_eng, {}, image_id=ID1).containers} == {VLLM}


class Nodes(FakeContext):
    """``docker image inspect`` per node: {node: {ref or ID: info}}."""

    def __init__(self, held):
        super().__init__()
        self._set("held", held)

    def answer(self, alias, argv, stdin, command, kw):
        assert argv[3:6] == ["image", "inspect", "--format"], command
        got = self.held[alias].get(argv[-1])
        return (self.result(command, stdout=json.dumps(got)) if got
                else self.result(command, 1, stderr="Error: No such image"))


def test_the_preflight_looks_for_a_pinned_image_on_the_workers_by_the_heads_id(tmp_path):
    from sparkdeploy.ops import serve_preflight

    ref = f"{VLLM}@{AAA}"
    ctx = Nodes({"spark1": {ref: info(ID1, f"{VLLM}@{AAA}")}, "spark2": {ID1: info(ID1)}})
    dep = deployment(SEED, tmp_path / "state", ctx)
    pf = serve_preflight.Preflight(FakeStep(dep))
    serve_preflight._check_images(dep, ref, [dep.host("spark2"), dep.host("spark1")], pf)
    assert (pf.image_id, pf.ship_to, pf.problems) == (ID1, [], [])
    assert [(a, argv[-1]) for a, argv in ctx.calls] == [("spark1", ref), ("spark2", ID1)]


class FakeStep:
    """The little of a step context the preflight's image check uses."""

    def __init__(self, dep):
        self.dep, self.results = dep, []

    def failed(self, why, node=None, **details):
        from sparkdeploy.core.outcomes import Result, Status

        self.results.append(Result("serve.up", Status.FAILED, why, node, details))


def test_ship_checks_a_pinned_image_on_the_peer_by_id_and_diff_ids():
    from sparkdeploy.steps import ship

    class Peer:
        name = "spark2"

    src = {"Id": ID1, "RootFS": {"Layers": ["sha256:l1", "sha256:l2"]}}
    assert ship.verify(Peer(), ID1, src, True, {"Id": ID1, "RootFS": src["RootFS"]}, set()) is None
    assert ship.verify(Peer(), ID1, src, True, {"Id": ID2, "RootFS": src["RootFS"]}, set()) == (
        f"config digest differs: source {ID1}, spark2 {ID2}")
    assert ship.verify(Peer(), ID1, src, True, None, set()) == f"spark2 has no {ID1}"
    # a tag is still checked in the peer's list (an incomplete image is not listed)
    assert ship.verify(Peer(), VLLM, src, True, {"Id": ID1, "RootFS": src["RootFS"]}, set()) == (
        f"spark2 does not list {VLLM}:latest (an incomplete image?)")
