"""Every command sparkdeploy generates, checked against the engines' flag manifests (made from
the real parsers by ``nox -s engine_flags``), and the one-line errors of the check."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sparkdeploy import engines
from sparkdeploy.engines import flags as ef
from sparkdeploy.engines import launch
from sparkdeploy.profile.config import load_profile
from tests.unit.conftest import SEED, seed_data

SRC = Path(__file__).resolve().parents[2] / "src"
SGLANG_VERSIONS = ("0.5.4", "0.5.10rc0", "0.5.10")  # the lab images' (lab/images.py), the seed's, the release


def _nodes(tmp_path, n: int):
    data = _nodes_data(n)
    p = tmp_path / f"p{n}.yaml"
    p.write_text(yaml.safe_dump(data))
    return load_profile(p)


def _nodes_data(n: int) -> dict:
    """The seed profile on ``n`` nodes (the second one's facts copied), its engines on TP=n."""
    data = seed_data()
    d = data["sparkdeploy"]
    first = d["nodes"][1]
    d["nodes"] = d["nodes"][:1]
    for i in range(n - 1):
        node = copy.deepcopy(first)
        node.update(name=f"spark{i + 2}", ssh=f"spark{i + 2}")
        node["link"]["address"] = f"192.168.100.{11 + i}"
        d["nodes"].append(node)
    for e in d["engines"]:
        e["tensor_parallel"] = n
    return data


def _sglang_args(argv: tuple[str, ...]) -> list[str]:
    assert argv[0] == "python3" and argv[1] in ("-m", "-c")
    return list(argv[3:])


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("version", SGLANG_VERSIONS)
@pytest.mark.parametrize("api_key", [False, True])
def test_every_sglang_command_sparkdeploy_generates_is_accepted_by_the_real_parser(tmp_path, n, version,
                                                                                  api_key):
    prof = _nodes(tmp_path, n)
    engines = [e for e in prof.engines if e.kind == "sglang"]
    assert engines
    for engine in engines:
        for c in launch(prof, engine, {}, api_key).containers:
            args = _sglang_args(c.argv) + (["--api-key", "k"] if api_key and c.rank == 0 else [])
            ef.check_args("sglang", version, args)  # raises on the first flag it refuses


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("version", ef.versions("vllm"))  # every manifest: a new one is a file
def test_every_vllm_command_sparkdeploy_generates_is_accepted_by_the_real_parser(tmp_path, n, version):
    prof = _nodes(tmp_path, n)
    checked = 0
    for engine in (e for e in prof.engines if e.software == "vllm"):
        for c in launch(prof, engine, {}, True).containers:
            if c.argv[:2] == ("vllm", "serve"):  # Ray's own containers run `ray start`
                ef.check_args("vllm", version, list(c.argv[2:]))
                checked += 1
    assert checked >= 2


@pytest.mark.parametrize("path", sorted(ef.DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_manifest_file_is_a_manifest_of_a_known_software_under_its_release(path):
    # a new engine version is this file and nothing else (docs/engine-flags.md)
    software, _, version = path.stem.partition("-")
    assert software in engines.software(), path.name
    data = ef.manifest(software, version)
    assert (data["engine"], data["version"]) == (software, version) == (software, ef.manifest_version(version))
    assert data["by_flag"] and version in ef.versions(software)


def test_vllm_refuses_a_flag_of_sglang_and_names_its_own():
    with pytest.raises(ef.FlagError, match=r"^--mem-fraction-static: not a flag of vllm 0.17.1"):
        ef.check_args("vllm", "0.17.1", ["/m", "--mem-fraction-static", "0.8"])


def test_a_misspelled_flag_is_one_line_with_the_closest_real_flag():
    with pytest.raises(ef.FlagError) as e:
        ef.check_args("sglang", "0.5.10rc0", ["--mem-fraction-statik", "0.85"])
    assert str(e.value) == ("--mem-fraction-statik: not a flag of sglang 0.5.10rc0; "
                            "did you mean --mem-fraction-static?")


def test_a_prefix_is_not_a_flag_though_the_engine_would_take_it_today():
    with pytest.raises(ef.FlagError, match=r"^--tp: not a flag of sglang 0.5.4; did you mean --tp-size\?$"):
        ef.check_args("sglang", "0.5.4", ["--tp", "2"])


def test_a_value_given_to_a_switch_is_refused_in_both_spellings():
    for args in (["--trust-remote-code", "true"], ["--trust-remote-code=true"]):
        with pytest.raises(ef.FlagError, match=r"^--trust-remote-code: a switch of sglang 0.5.10, "
                                               r"it takes no value \('true'\)$"):
            ef.check_args("sglang", "0.5.10", args)


def test_a_value_outside_the_choices_is_one_line():
    with pytest.raises(ef.FlagError, match=r"^--tokenizer-mode fast: not one of auto, slow \(sglang 0.5.10\)$"):
        ef.check_args("sglang", "0.5.10", ["--tokenizer-mode", "fast"])


def test_an_engine_version_without_a_manifest_says_how_to_make_one():
    with pytest.raises(ef.FlagError) as e:
        ef.check_args("sglang", "0.5.99", ["--port", "1"])
    assert str(e.value) == ("no flag manifest for sglang 0.5.99: make one with "
                            "`nox -s engine_flags -- sglang==0.5.99`")


def test_a_file_that_is_not_a_manifest_is_one_line(tmp_path):
    (tmp_path / "sglang-9.9.json").write_text(json.dumps({"options": [{"flags": ["--x"]}]}))
    with pytest.raises(ef.FlagError, match=r"^sglang-9.9.json: not a flag manifest \(KeyError"):
        ef.manifest("sglang", "9.9", tmp_path)


def test_the_manifests_hold_the_real_parsers_counts_and_say_where_they_come_from():
    new, rc, old = (ef.manifest("sglang", v) for v in ("0.5.10", "0.5.10rc0", "0.5.4"))
    assert [(len(m["options"]), len(m["by_flag"]), m["built_from"], m["version"]) for m in (new, rc, old)] == [
        (355, 367, "sglang==0.5.10", "0.5.10"),  # FACTS: "SGLang 0.5.10: 355 flags (367 spellings)"
        (354, 365, "sglang==0.5.10rc0", "0.5.10rc0"),
        (274, 283, "sglang==0.5.4", "0.5.4")]
    assert "release candidate 0.5.10rc0" in rc["note"] and "candidate" not in new["note"]
    assert "the sglang 0.5.10 wheel" in new["source"] and "the sglang 0.5.10rc0 wheel" in rc["source"]
    for m in (new, rc):
        assert m["allow_abbrev"] is True and m["prog"] == "sglang serve"
        assert {"--tp-size", "--tensor-parallel-size"} <= set(m["by_flag"]) and "--tp" not in m["by_flag"]


# the parsers of sglang 0.5.10 and its rc0 (server_args.py of each wheel): FACTS, "SGLang 0.5.10
# release vs its rc0"
ADDED_IN_0_5_10 = ["--enable-mfu-metrics", "--enforce-disable-flashinfer-allreduce-fusion",
                   "--engine-info-bootstrap-port", "--experts-shared-outer-loras", "--gc-threshold",
                   "--no-experts-shared-outer-loras", "--stream-response-default-include-usage"]
DROPPED_IN_0_5_10 = ["--disable-hicache-numa-detect", "--mm-max-concurrent-calls", "--mm-per-request-timeout",
                     "--speculative-ngram-max-match-window-size", "--speculative-ngram-min-match-window-size"]


def test_the_release_and_its_candidate_each_have_their_own_manifest():
    new, rc = (set(ef.manifest("sglang", v)["by_flag"]) for v in ("0.5.10", "0.5.10rc0"))
    assert sorted(new - rc) == ADDED_IN_0_5_10  # 7 the rc lacks
    assert sorted(rc - new) == DROPPED_IN_0_5_10  # 5 the release refuses


@pytest.mark.parametrize(("takes", "refuses", "flag"),
                         [("0.5.10", "0.5.10rc0", f) for f in ADDED_IN_0_5_10]
                         + [("0.5.10rc0", "0.5.10", f) for f in DROPPED_IN_0_5_10])
def test_each_flag_of_one_is_taken_by_its_own_manifest_and_refused_by_the_other(takes, refuses, flag):
    """An rc image is checked against the rc's parser, a release image against the release's."""
    args = [flag] if not ef.manifest("sglang", takes)["by_flag"][flag]["takes_value"] else [flag, "1"]
    ef.check_args("sglang", takes, args)
    with pytest.raises(ef.FlagError, match=rf"^{flag}: not a flag of sglang {refuses}(;|$)"):
        ef.check_args("sglang", refuses, args)


def test_a_choice_the_release_added_is_refused_for_the_rc():
    ef.check_args("sglang", "0.5.10", ["--fp4-gemm-backend", "cutlass"])
    with pytest.raises(ef.FlagError, match=r"^--fp4-gemm-backend cutlass: not one of .* \(sglang 0.5.10rc0\)$"):
        ef.check_args("sglang", "0.5.10rc0", ["--fp4-gemm-backend", "cutlass"])


@pytest.mark.parametrize(("version", "file"), [
    ("0.5.10rc0", "sglang-0.5.10rc0.json"), ("0.5.10", "sglang-0.5.10.json"),
    ("0.32.0+cpu", "vllm-0.32.0.json"),  # a local build label: the same release's parser
])
def test_an_image_version_reads_the_manifest_of_exactly_that_version(version, file):
    assert f"{file.partition('-')[0]}-{ef.manifest_version(version)}.json" == file
    assert ef.manifest(file.partition("-")[0], version)["built_from"].endswith(version.split("+")[0])


def test_a_release_candidate_without_its_own_manifest_is_not_checked_against_its_release():
    with pytest.raises(ef.FlagError, match=r"^no flag manifest for sglang 0.5.10rc1: make one with "
                                           r"`nox -s engine_flags -- sglang==0.5.10rc1`$"):
        ef.check_args("sglang", "0.5.10rc1", ["--port", "1"])


def test_the_seed_profile_loads():
    assert load_profile(SEED).engines


def _standin(args: list[str], manifest, main: str = "sglang_main") -> subprocess.CompletedProcess:
    code = (f"import sys; from sparkdeploy.lab.standins.engine_server import {main}; "
            f"sys.exit({main}(sys.argv[1:]))")
    env = {**os.environ, "SPARKDEPLOY_STANDIN_FLAGS": str(manifest), "PYTHONPATH": str(SRC)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          timeout=60)


@pytest.mark.parametrize(("version", "prog"), [("0.5.10", "sglang serve"), ("0.5.10rc0", "sglang serve"),
                                               ("0.5.4", "launch_server.py")])
def test_the_sglang_standin_refuses_an_unknown_flag_as_the_real_parser_does(version, prog):
    cp = _standin(["--model-path", "/m", "--tp-size", "2", "--mem-fraction-statik", "0.8"],
                  ef.DIR / f"sglang-{version}.json")
    lines = cp.stderr.splitlines()
    assert cp.returncode == 2 and lines[0].startswith(f"usage: {prog} ")
    assert lines[-1] == f"{prog}: error: unrecognized arguments: --mem-fraction-statik 0.8"


@pytest.mark.parametrize(("args", "last"), [
    (["--max-model-len", "32768", "--gpu-memory-utilisation", "0.8"],
     "vllm serve: error: unrecognized arguments: --gpu-memory-utilisation 0.8"),
    (["--distributed-executor-backend", "slurm"],
     "vllm serve: error: argument --distributed-executor-backend: invalid choice: 'slurm' "
     "(choose from 'ray', 'mp', 'uni', 'external_launcher')"),
])
def test_the_vllm_standin_refuses_what_vllms_parser_refuses(args, last):
    cp = _standin(["serve", "/m", *args], ef.DIR / "vllm-0.17.1.json", main="vllm_main")
    lines = cp.stderr.splitlines()
    assert cp.returncode == 2 and lines[0].startswith("usage: vllm serve "), cp.stderr[-500:]
    assert lines[-1] == last


def test_the_lab_images_carry_their_engine_versions_manifest_for_the_standin():
    from sparkdeploy.lab import images

    by_tag = {r.tag: images.flag_manifest(r) for r in images.COMMUNITY_IMAGES}
    assert by_tag["scitrera/dgx-spark-sglang:0.5.10rc0"] == (ef.DIR / "sglang-0.5.10rc0.json").read_bytes()
    assert by_tag["lmsysorg/sglang:spark"] == (ef.DIR / "sglang-0.5.4.json").read_bytes()
    assert by_tag["hellohal2064/vllm-qwen3.5-gb10"] == (ef.DIR / "vllm-0.17.1.json").read_bytes()


# --- every recipe, 1 to 4 nodes, each engine kind; and the check before anything stops ---------

def _lab_versions() -> dict[str, str]:
    """{image ref: the engine version the lab's image of it holds} (lab/images.py)."""
    from sparkdeploy.lab import images

    return {ref: spec.engine_version for spec in images.COMMUNITY_IMAGES
            for ref in (spec.tag, *spec.also)}


def _recipe_commands(tmp_path, name: str, n: int):
    """(engine, its engine args) of every engine container ``deploy.all --recipe name`` would
    start on the seed's cluster grown to ``n`` nodes; the RecipeError when no layout exists."""
    from sparkdeploy.profile.recipes import RecipeError

    p = tmp_path / f"{name}-{n}.yaml"
    p.write_text(yaml.safe_dump(_nodes_data(n)))
    try:
        prof = load_profile(p, name)
    except RecipeError as e:
        return e
    return [(e, list(c.engine_args)) for e in prof.engines
            for c in launch(prof, e, {}, True).containers if c.engine_args is not None]


def _recipes() -> list[str]:
    from sparkdeploy.profile import recipes as rcp

    return list(rcp.known(rcp.directories()))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("name", _recipes())
def test_every_command_of_every_recipe_on_1_to_4_nodes_is_accepted_by_the_real_parser(tmp_path,
                                                                                      name, n):
    got = _recipe_commands(tmp_path, name, n)
    if isinstance(got, Exception):  # the engines accept no layout on n nodes: said, not run
        assert f"recipe {name}: no layout for {n} node(s)" in str(got)
        return
    versions = _lab_versions()
    assert got
    for engine, args in got:
        version = versions.get(engine.image)
        if version:
            ef.check_args(engine.software, version, args)
        else:  # an image the lab does not build: some version with a manifest accepts them
            ef.check_args_any(engine.software, args, f"{engine.image} is not a lab image")


def test_the_recipes_commands_cover_every_engine_kind_on_every_node_count(tmp_path):
    from typing import get_args

    from sparkdeploy.profile.config import EngineKind

    for n in (1, 2, 3, 4):
        kinds = set()
        for name in _recipes():
            got = _recipe_commands(tmp_path, name, n)
            kinds |= set() if isinstance(got, Exception) else {e.kind for e, _ in got}
        assert kinds == set(get_args(EngineKind)), n


def test_without_a_probe_a_flag_no_version_has_is_refused_naming_every_version():
    with pytest.raises(ef.FlagError) as e:
        ef.check_args_any("sglang", ["--mem-fraction-statik", "0.8"], "no probe yet")
    assert str(e.value) == ("--mem-fraction-statik: not a flag of sglang 0.5.10; did you mean "
                            "--mem-fraction-static? (nor of sglang 0.5.4, 0.5.10rc0; no probe yet)")
    assert ef.check_args_any("vllm", ["--max-model-len", "8"], "x") == ef.versions("vllm")[-1]


def test_without_a_probe_an_engine_with_no_manifest_says_how_to_make_one(tmp_path):
    with pytest.raises(ef.FlagError) as e:
        ef.check_args_any("sglang", ["--port", "1"], "no probe yet", tmp_path)
    assert str(e.value) == ("no flag manifest for sglang: make one with "
                            "`nox -s engine_flags -- sglang==VERSION`")
    assert ef.versions("sglang") == ["0.5.4", "0.5.10rc0", "0.5.10"]  # by PEP 440, not by spelling


def test_without_a_probe_a_flag_one_version_has_passes_and_the_probed_version_decides():
    only_new = sorted(set(ef.manifest("sglang", "0.5.10")["by_flag"])
                      - set(ef.manifest("sglang", "0.5.4")["by_flag"]))
    flag = next(f for f in only_new if not ef.manifest("sglang", "0.5.10")["by_flag"][f]["takes_value"])
    assert ef.check_args_any("sglang", [flag], "no probe yet") == "0.5.10"
    with pytest.raises(ef.FlagError, match=rf"^{flag}: not a flag of sglang 0.5.4"):
        ef.check_args("sglang", "0.5.4", [flag])


def _seed_with(tmp_path, *extra: str):
    from tests.unit.fakes import deployment

    data = seed_data()
    data["sparkdeploy"]["engines"][0]["args"] += list(extra)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(data))
    return p, deployment(p, tmp_path / "state")


def test_deploy_checks_every_engines_flags_before_anything_and_says_against_what(tmp_path):
    from sparkdeploy.ops.engine_check import check_flags

    _, dep = _seed_with(tmp_path)
    newest = {software: ef.versions(software)[-1] for software in ("sglang", "vllm")}  # data-only
    assert check_flags(dep) == [
        f"engine sglang: flags checked against a sglang version with a manifest ({newest['sglang']})",
        f"engine vllm-ray: flags checked against a vllm version with a manifest ({newest['vllm']})",
        f"engine vllm: flags checked against a vllm version with a manifest ({newest['vllm']})"]


def test_the_probed_version_is_the_one_checked_against(tmp_path):
    from sparkdeploy.core.records import Candidate, EngineImage, ImageDecision
    from sparkdeploy.ops.engine_check import check_flags

    _, dep = _seed_with(tmp_path, "--mem-fraction-statik", "0.8")
    base = dep.profile.engines[0].image
    dep.records.write(ImageDecision(
        node="spark1", arch="arm64", config_from=base, chosen=None,
        engines={"sglang": EngineImage(image=base, kind="sglang", needs_layer=False,
                                       serve_image=base)},
        candidates=[Candidate(image=base, engine="sglang", verdict="viable",
                              engine_version="0.5.10rc0")],
        summary="sglang: " + base))
    with pytest.raises(ef.FlagError) as e:
        check_flags(dep)
    assert str(e.value) == ("engine sglang: --mem-fraction-statik: not a flag of sglang 0.5.10rc0; "
                            "did you mean --mem-fraction-static?")


@pytest.mark.parametrize("task", ["deploy.all", "profile.check"])
def test_a_misspelled_flag_is_one_line_exit_2_before_any_step(tmp_path, task):
    profile, _ = _seed_with(tmp_path, "--mem-fraction-statik", "0.8")
    root = SRC.parent
    r = subprocess.run([sys.executable, "-m", "invoke", task, "--profile", str(profile)],
                       cwd=root, capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(SRC),
                            "INVOKE_SPARKDEPLOY_STATE_DIR": str(tmp_path / "state")})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "engine sglang: --mem-fraction-statik: not a flag of sglang 0.5.10; did you mean "
        "--mem-fraction-static? (nor of sglang 0.5.4, 0.5.10rc0; no image.probe record names the sglang "
        "version of sparkdeploy/sglang-qwen3.5:latest)"]
    assert r.stdout == ""
