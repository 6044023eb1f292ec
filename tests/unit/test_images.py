import json
import shlex

import pytest
import yaml

from sparkdeploy.core.records import ImageDecision
from sparkdeploy.ops.image import decision
from sparkdeploy.profile.config import load_profile
from sparkdeploy.steps import images, ship
from tests.unit.fakes import WALL, FakeContext, deployment
from tests.unit.profiles import SEED, seed_data


@pytest.fixture
def dep(tmp_path, seed_path, seed_profile):
    d = deployment(seed_path, tmp_path / "state", profile=seed_profile)
    d.wall = lambda: WALL
    return d


def test_probe_argv_is_exact(dep):
    head = dep.host("spark1")
    argv = images.probe_argv(dep, head, "scitrera/dgx-spark-sglang:0.5.10rc0", "/s/probe_image.py", "/s/model")
    assert shlex.join(argv) == (
        "docker -H unix:///var/run/docker.sock run --rm --network none "
        "--label=org.sparkdeploy.deployment=qwen3.5-122b-a10b-fp8 --label=org.sparkdeploy.role=probe "
        "--label=org.sparkdeploy.started=2026-11-30T00:53:20Z "
        "--label=org.sparkdeploy.started.by=image.probe "
        "-e HF_HUB_OFFLINE=1 -e TRANSFORMERS_OFFLINE=1 "
        "-v /s/probe_image.py:/sparkdeploy/probe_image.py:ro -v /s/model:/sparkdeploy/model:ro "
        "--entrypoint python3 scitrera/dgx-spark-sglang:0.5.10rc0 /sparkdeploy/probe_image.py "
        "--model-dir /sparkdeploy/model "
        "--model-file sglang=sglang/srt/models/qwen3_5.py --model-file sglang=sglang/srt/models/qwen3_5_mtp.py "
        "--min-version sglang=0.5.9 --require-config sglang "
        "--model-file vllm=vllm/model_executor/models/qwen3_5.py "
        "--model-file vllm=vllm/model_executor/models/qwen3_5_mtp.py --min-version vllm=0.17.0")


def report(engine, version, files, tf, config_ok, ok, reasons):
    return {"packages": {"transformers": tf, engine: version},
            "config": {"ok": config_ok, "model_type": "qwen3_5_moe"},
            "engines": {engine: {"installed": version is not None, "version": version,
                                 "model_files": files, "ok": ok, "reasons": reasons}}}


INFO = {"Id": "sha256:aa", "Architecture": "arm64", "Os": "linux"}


def test_judge_rejects_old_sglang(dep):
    r = report("sglang", "0.5.4", {"sglang/srt/models/qwen3_5.py": False}, "4.57.1", False, False,
               ["sglang 0.5.4 is below the minimum 0.5.9", "sglang lacks sglang/srt/models/qwen3_5.py",
                "transformers 4.57.1 cannot parse model_type qwen3_5_moe"])
    row = images.judge(dep, "lmsysorg/sglang:spark", "sglang", "arm64", INFO, r, None)
    assert row["verdict"] == "rejected"
    assert "lacks sglang/srt/models/qwen3_5.py" in row["why"]


def test_judge_needs_layer_when_only_transformers_fails(dep):
    r = report("sglang", "0.5.10rc0", {"sglang/srt/models/qwen3_5.py": True}, "4.57.1", False, False,
               ["transformers 4.57.1 cannot parse model_type qwen3_5_moe"])
    row = images.judge(dep, "scitrera/dgx-spark-sglang:0.5.10rc0", "sglang", "arm64", INFO, r, None)
    assert row["verdict"] == "needs-layer"
    assert row["why"].endswith("fixed by the layer transformers>=5 -> sparkdeploy/sglang-qwen3.5:latest")


def test_judge_platform_mismatch_rejects(dep):
    r = report("vllm", "0.17.1", {"vllm/model_executor/models/qwen3_5.py": True}, "4.57.1", False, True, [])
    row = images.judge(dep, "hellohal2064/vllm-qwen3.5-gb10", "vllm", "arm64",
                       {**INFO, "Architecture": "amd64"}, r, None)
    assert row["verdict"] == "rejected"
    assert row["why"] == "image is linux/amd64, spark1 is linux/arm64"


def test_judge_viable_and_decision(dep):
    v = images.judge(dep, "hellohal2064/vllm-qwen3.5-gb10", "vllm", "arm64", INFO,
                     report("vllm", "0.17.1", {"x": True}, "4.57.1", False, True, []), None)
    n = images.judge(dep, "scitrera/dgx-spark-sglang:0.5.10rc0", "sglang", "arm64", INFO,
                     report("sglang", "0.5.10rc0", {"x": True}, "4.57.1", False, False,
                            ["transformers 4.57.1 cannot parse model_type qwen3_5_moe"]), None)
    m = images.judge(dep, "lmsysorg/sglang:spark", "sglang", "arm64", None, None, "pull failed: no registry")
    assert v["verdict"] == "viable" and m["verdict"] == "missing"
    rec = images.decide(dep, "spark1", "arm64", "hub", [m, n, v])
    assert rec["chosen"] == {"engine": "sglang", "kind": "sglang", "image": "scitrera/dgx-spark-sglang:0.5.10rc0",
                             "digest": "sha256:aa", "needs_layer": True,
                             "serve_image": "sparkdeploy/sglang-qwen3.5:latest"}
    assert rec["engines"]["vllm-ray"]["serve_image"] == "hellohal2064/vllm-qwen3.5-gb10"
    assert rec["engines"]["vllm-ray"]["kind"] == "vllm-ray"  # judged by the vllm software's rule
    images.write_record(dep, rec)
    md = dep.records.path(ImageDecision, suffix=".md").read_text()
    assert "- `lmsysorg/sglang:spark` (sglang): missing: pull failed: no registry" in md


PAGE = """<html><body>
<a href="/f/transformers-4.57.1-py3-none-any.whl#sha256=1">transformers-4.57.1-py3-none-any.whl</a>
<a href="/f/transformers-5.2.0-py3-none-any.whl#sha256=2">transformers-5.2.0-py3-none-any.whl</a>
<a href="/f/transformers-5.23.0-py3-none-any.whl#sha256=3">transformers-5.23.0-py3-none-any.whl</a>
<a href="/f/transformers-5.24.0rc1-py3-none-any.whl#sha256=4">transformers-5.24.0rc1-py3-none-any.whl</a>
<a href="/f/transformers-5.23.0.tar.gz#sha256=5">transformers-5.23.0.tar.gz</a>
</body></html>"""


def test_resolve_requirement_picks_newest_final():
    seen = []
    v = images.resolve_requirement("transformers>=5", "http://index/simple/",
                                   get=lambda u: seen.append(u) or PAGE)
    assert v == "5.23.0"
    assert seen == ["http://index/simple/transformers/"]
    assert images.resolve_requirement("transformers<5", "http://i/simple", get=lambda u: PAGE) == "4.57.1"
    with pytest.raises(images.ResolveError, match="satisfies transformers>=6"):
        images.resolve_requirement("transformers>=6", "http://i/simple", get=lambda u: PAGE)


def test_legacy_dockerfile_drops_mounts():
    text = "RUN --mount=type=secret,id=pipconf \\\n    --mount=type=secret,id=pip_ca \\\n    set -eu\n"
    assert images.legacy_dockerfile(text) == "RUN \\\n    \\\n    set -eu\n"


def test_index_url_with_credentials_is_refused(tmp_path):
    from sparkdeploy.profile.config import ProfileError

    p = tmp_path / "p.yaml"
    data = seed_data()
    data["sparkdeploy"]["images"]["layer"]["index_url"] = "https://user:pw@example.org/simple"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match="images.layer.index_url: must not carry credentials"):
        load_profile(p)


def test_have_prefix_follows_the_chain():
    assert ship.have_prefix(["a", "b", "c"], [["a", "b"]]) == 2
    assert ship.have_prefix(["a", "b", "c"], [["b", "c"]]) == 0
    assert ship.have_prefix(["a", "b", "c"], [["a", "c"]]) == 1
    # a and b are both there, but not as one chain: only a can be skipped
    assert ship.have_prefix(["a", "b", "c"], [["a"], ["x", "b"]]) == 1
    assert ship.have_prefix(["a", "b", "c"], [["a"], ["a", "b", "c", "d"]]) == 3
    assert ship.have_prefix(["a", "b"], []) == 0


S = "/tmp/sparkdeploy-stage-0/" + "a" * 64
L = "/tmp/sparkdeploy-stage-0/" + "b" * 64
H = "/tmp/sparkdeploy-stage-0/" + "c" * 64


def test_ship_pipeline_argv(dep):
    src, peer = dep.host("spark1"), dep.host("spark2")
    argv = ship.pipeline(src, peer, "img:1", f"{S}/save_filter.py", f"{L}/layers.json",
                         f"{H}/have.json", "none")
    assert argv[:2] == ["bash", "-c"]
    checks = "".join(
        f"printf '{d * 64}  {p}\\n' | sha256sum -c --status || "
        f"{{ echo '{p} differs from its sha256: not run' >&2; exit 97; }}; "
        for d, p in (("a", f"{S}/save_filter.py"), ("b", f"{L}/layers.json"), ("c", f"{H}/have.json")))
    assert argv[2] == checks + (
        f"set -o pipefail; docker -H unix:///var/run/docker.sock save img:1 | "
        f"python3 {S}/save_filter.py --layers-file {L}/layers.json --have-file {H}/have.json "
        "--progress 1 | "
        "ssh -o BatchMode=yes -o StrictHostKeyChecking=yes -- 192.168.100.11 "
        "'docker -H unix:///var/run/docker.sock load'")
    full = ship.pipeline(src, peer, "img:1", None, None, None, "zstd")
    assert full[2] == (
        "set -o pipefail; docker -H unix:///var/run/docker.sock save img:1 | zstd -q -T0 -3 -c | "
        "ssh -o BatchMode=yes -o StrictHostKeyChecking=yes -- 192.168.100.11 "
        "'zstd -q -d -c | docker -H unix:///var/run/docker.sock load'")


def test_filter_report_is_read_from_stderr():
    err = "progress bytes=1 out=1\n" + json.dumps({"bytes_in": 10, "bytes_out": 4}) + "\n"
    assert ship._report(err) == {"bytes_in": 10, "bytes_out": 4}


def test_build_output_goes_to_the_stream_as_log_lines_and_step_progress(dep):
    from sparkdeploy.core.events import Log, Progress
    from sparkdeploy.steps.registry import StepContext

    lines = ["Step 1/3 : ARG BASE_IMAGE", "", "Step 2/3 : FROM x", " ---> 1234",
             "Step 3/3 : RUN pip install"]
    log = images.BuildLog(StepContext("image.build", dep.events, dep), "spark1")
    with dep.events.collect() as got:
        for line in lines:
            log.line(line)
    tail = log.tail
    assert tail == ["Step 1/3 : ARG BASE_IMAGE", "Step 2/3 : FROM x", " ---> 1234",
                    "Step 3/3 : RUN pip install"]
    assert [e.text for e in got if isinstance(e, Log)] == tail
    assert [(e.done, e.total, e.unit, e.note) for e in got if isinstance(e, Progress)] == [
        (0, 3, "steps", "ARG BASE_IMAGE"), (1, 3, "steps", "FROM x"),
        (2, 3, "steps", "RUN pip install")]


def test_the_build_is_one_docker_build_on_the_head_with_its_context_on_stdin(dep):
    head = dep.host("spark1")
    argv = images.build_argv(head, "sd/layer:1", {"BASE_IMAGE": "a b", "PIP_INDEX_URL": "-x"}, True)
    assert argv == ["sh", "-c", 'base64 -d | DOCKER_BUILDKIT=0 "$@" 1>&2', "sh",
                    "docker", "-H", "unix:///var/run/docker.sock", "build", "--tag=sd/layer:1",
                    "--build-arg=BASE_IMAGE=a b", "--build-arg=PIP_INDEX_URL=-x",
                    "--network=host", "--rm", "--force-rm", "--no-cache", "-"]
    assert "--no-cache" not in images.build_argv(head, "t", {}, False)


def test_the_decision_record_carries_who_and_when_and_ship_reads_it(dep):
    rec = images.decide(dep, "spark1", "arm64", "hub", [
        images.judge(dep, "hellohal2064/vllm-qwen3.5-gb10", "vllm", "arm64", INFO,
                     report("vllm", "0.17.1", {"x": True}, "4.57.1", False, True, []), None)])
    assert ship.default_image(dep) == dep.profile.engines[0].image  # no record yet
    images.write_record(dep, rec)
    got = decision(dep)
    assert (got.made.name, got.made.step, got.made.profile) == ("image-probe", "image.probe",
                                                                dep.profile.name)
    assert got.chosen.serve_image == "hellohal2064/vllm-qwen3.5-gb10"
    assert ship.default_image(dep) == "hellohal2064/vllm-qwen3.5-gb10"
    md = dep.records.path(ImageDecision, suffix=".md").read_text()
    assert ("| hellohal2064/vllm-qwen3.5-gb10 | vllm | 0.17.1 | 4.57.1 | yes | no | linux/arm64 | viable "
            "| sha256:aa | - |") in md


PAGE_53 = PAGE.replace("transformers-5.2.0-", "transformers-5.3.0-")


def test_resolve_requirement_together_with_the_engine_declaration():
    get = lambda u: PAGE_53  # noqa: E731
    assert images.resolve_requirement("transformers>=5", "http://i/simple", get=get,
                                      constraint="==5.3.0") == "5.3.0"
    assert images.resolve_requirement("transformers>=5", "http://i/simple", get=get,
                                      constraint=">=4.51,<5.10") == "5.3.0"
    with pytest.raises(images.ResolveError) as e:
        images.resolve_requirement("transformers>=5", "http://i/simple", get=get, constraint="==4.57.1")
    assert str(e.value) == ("no release of transformers on http://i/simple satisfies transformers>=5 "
                            "and transformers==4.57.1")


class BuildCtx(__import__("invoke").Context):
    """A head for image.build in a dry run: the base image, staging, the probe's answer."""

    def __init__(self, declares):
        from invoke import Config

        super().__init__(Config(overrides={"run": {"dry": True}}))
        self._set("declares", declares)
        self._set("probes", [])
        self._set("listed", [])

    def run(self, command, **kw):
        from invoke import Result

        argv = shlex.split(shlex.split(command)[-1])
        out = ""
        if argv[:2] == ["sh", "-c"] and len(argv) > 6 and argv[4] != "docker":
            out = f"/tmp/sparkdeploy-stage-0/{argv[4]}/{argv[5]}\n"  # staging
        elif argv[:2] == ["sh", "-c"]:  # the probe, behind its sha256 check
            run = argv[argv.index("run"):]
            self.probes.append(run)
            spec = {} if self.declares is None else {"transformers": self.declares}
            out = json.dumps({"engines": {"sglang": {"installed": True, "version": "0.5.10rc0",
                                                     "requires": spec}}})
        elif "inspect" in argv:
            out = json.dumps({"Id": "sha256:" + "b" * 64, "RootFS": {"Layers": []}})
        elif "ls" in argv:
            self.listed.append(argv)
            out = ""
        else:
            raise AssertionError(argv)
        return Result(stdout=out, stderr="", exited=0, command=command)


@pytest.fixture
def build_dep(tmp_path, monkeypatch):
    import functools

    monkeypatch.setattr(images, "resolve_requirement",
                        functools.partial(images.resolve_requirement, get=lambda u: PAGE_53))

    def make(declares, override=False):
        prof = load_profile(SEED)
        if override:
            layer = prof.images.layer.model_copy(update={"override_engine_requirement": True})
            prof = prof.model_copy(update={"images": prof.images.model_copy(update={"layer": layer})})
        ctx = BuildCtx(declares)
        return deployment(SEED, tmp_path / "state", ctx, dry=True, profile=prof), ctx
    return make


def test_build_picks_what_the_base_engine_declares(build_dep):
    dep, ctx = build_dep("==5.3.0")
    [res] = images.build(dep)
    assert res.why == ("would build sparkdeploy/sglang-qwen3.5:latest = "
                       "scitrera/dgx-spark-sglang:0.5.10rc0 + transformers==5.3.0 "
                       "(sglang 0.5.10rc0: transformers==5.3.0)")
    assert ctx.probes[0][-3:] == ["/sparkdeploy/probe_image.py", "--engine", "sglang"]
    assert "--network" in ctx.probes[0] and "none" in ctx.probes[0]


def test_build_fails_in_one_line_when_nothing_satisfies_both(build_dep):
    dep, _ = build_dep("==4.57.1")
    [res] = images.build(dep)
    assert res.status.value == "failed"
    assert res.why == ("no release of transformers on https://pypi.org/simple satisfies "
                       "transformers>=5 and transformers==4.57.1, which sglang 0.5.10rc0 in "
                       "scitrera/dgx-spark-sglang:0.5.10rc0 declares "
                       "(images.layer.override_engine_requirement: true builds anyway)")


def test_build_override_resolves_the_requirement_alone_and_says_so(build_dep):
    dep, _ = build_dep("==4.57.1", override=True)
    [res] = images.build(dep)
    assert res.why.endswith("+ transformers==5.23.0 (sglang 0.5.10rc0: transformers==4.57.1 "
                            "(overridden by images.layer.override_engine_requirement))")


def test_build_without_a_declaration_resolves_the_requirement(build_dep):
    dep, _ = build_dep(None)
    [res] = images.build(dep)
    assert res.why.endswith("+ transformers==5.23.0 (none declared)")


def test_filter_report_skips_a_broken_json_line_after_it():
    assert ship._report('{"bytes_in": 10}\n{"cut off\n') == {"bytes_in": 10}
    assert ship._report("no report\n") == {}


def test_build_no_cache_says_so_and_looks_for_no_earlier_build(build_dep):
    dep, ctx = build_dep("==5.3.0")
    looked = []
    orig = images._find_built
    images._find_built = lambda *a: looked.append(a) or orig(*a)
    try:
        [res] = images.build(dep, no_cache=True)
        assert looked == []
        assert res.why.endswith("(sglang 0.5.10rc0: transformers==5.3.0) without docker's cache")
        [again] = images.build(dep)
        assert len(looked) == 1 and again.why.endswith("transformers==5.3.0)")
    finally:
        images._find_built = orig


def test_probe_refuses_a_head_whose_arch_is_not_the_profiles(tmp_path, seed_path):
    class Uname(FakeContext):
        def answer(self, alias, argv, stdin, command, kw):
            assert (alias, argv) == ("spark1", ["uname", "-m"]), command
            return self.result(command, stdout="x86_64\n")

    [r] = images.probe(deployment(seed_path, tmp_path / "state", Uname()))
    assert (r.status, r.node) == ("failed", "spark1")
    assert r.why == (f"spark1 is linux/amd64, the profile says arch: arm64 "
                     f"(fix nodes[].arch in {SEED})")


def test_build_with_the_system_nccl_says_so_and_finds_only_a_build_that_did(build_dep):
    dep, ctx = build_dep("==5.3.0")
    layer = dep.profile.images.layer.model_copy(update={"nccl": "system"})
    dep.profile = dep.profile.model_copy(update={"images": dep.profile.images.model_copy(
        update={"layer": layer})})
    [res] = images.build(dep)
    assert res.why.endswith("(sglang 0.5.10rc0: transformers==5.3.0) + the system NCCL")
    [ls] = ctx.listed
    assert "label=org.sparkdeploy.nccl=system" in ls
    assert f"label=org.sparkdeploy.base.id=sha256:{'b' * 64}" in ls


def test_the_dockerfile_links_the_wheels_nccl_to_libnccl2_and_labels_the_digest():
    from sparkdeploy.core import packaged

    text = (packaged.data("docker") / "transformers.Dockerfile").read_text()
    assert 'ln -s "${sys_nccl}" "${lib}"' in text
    assert "apt-get install -y --no-install-recommends libnccl2" in text
    assert 'org.sparkdeploy.base.digest="${BASE_IMAGE_DIGEST}"' in text
    assert 'org.sparkdeploy.nccl="${NCCL}"' in text
