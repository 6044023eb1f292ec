"""Profile overlays: ``extends:``, merge rules, provenance in errors, profile.check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sparkdeploy.lab import layout
from sparkdeploy.profile.config import ProfileError, load_layered, load_profile
from sparkdeploy.profile.overlays import REMOVED, UNSET, load_merged, parse_dotted
from tests.unit.profiles import ROOT, SEED, lab_profile_with_overlay, seed_data


def child(path: Path, body: dict, extends=None) -> Path:
    data = {} if extends is None else {"extends": extends}
    data["sparkdeploy"] = body
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def seed_copy(tmp_path) -> Path:
    p = tmp_path / "base" / "seed.yaml"
    p.parent.mkdir()
    p.write_text(yaml.safe_dump(seed_data()))  # the seed over its recipe, standalone
    return p


def test_relative_extends_resolves_from_the_profiles_own_directory(tmp_path, seed_copy):
    c = child(tmp_path / "sub" / "lab.yaml", {"name": "x-lab"}, "../base/seed.yaml")
    p, m = load_layered(c)
    assert p.name == "x-lab"
    assert p.head.name == "spark1"  # from the parent
    assert m.files == [str(tmp_path / "base" / "seed.yaml"), str(c)]


def test_relative_label_stays_relative(tmp_path, seed_copy, monkeypatch):
    monkeypatch.chdir(tmp_path)
    child(tmp_path / "sub" / "lab.yaml", {"name": "x-lab"}, "../base/seed.yaml")
    _, m = load_layered("sub/lab.yaml")
    assert m.files == ["base/seed.yaml", "sub/lab.yaml"]


def test_absolute_extends(tmp_path, seed_copy):
    c = child(tmp_path / "elsewhere" / "c.yaml", {"name": "abs"}, str(seed_copy))
    assert load_profile(c).name == "abs"


def test_mappings_merge_key_by_key(tmp_path, seed_copy):
    c = child(tmp_path / "c.yaml", {"services": {"gpu_poll_s": 5}, "ssh": {"connect_timeout": 3}},
              "base/seed.yaml")
    p = load_profile(c)
    assert p.services.gpu_poll_s == 5
    assert p.services.gpu_free_timeout_s == 120  # sibling key kept from the parent
    assert p.services.stop["spark1"][0] == "vllm-proxy.service"
    assert p.ssh.connect_timeout == 3 and p.ssh.control_persist == "10m"


def test_lists_replace(tmp_path, seed_copy):
    c = child(tmp_path / "c.yaml", {"bench": {"concurrency": [4]},
                                    "images": {"candidates": [{"ref": "a/b:c", "engine": "vllm"}]}},
              "base/seed.yaml")
    p = load_profile(c)
    assert p.bench.concurrency == [4]
    assert [c.ref for c in p.images.candidates] == ["a/b:c"]


def test_null_removes_the_key(tmp_path, seed_copy):
    c = child(tmp_path / "c.yaml", {"images": {"layer": None}, "services": {"stop": None}},
              "base/seed.yaml")
    p, m = load_layered(c)
    assert p.images.layer is None
    assert p.services.stop == {}  # the default, not the parent's units
    assert "layer" not in m.body["images"]
    removed = {o.path: o for o in m.overrides if o.value is REMOVED}
    assert set(removed) == {("images", "layer"), ("services", "stop")}


def test_removing_a_required_key_names_the_file_that_removed_it(tmp_path, seed_copy):
    c = child(tmp_path / "c.yaml", {"model": {"repo": None}}, "base/seed.yaml")
    with pytest.raises(ProfileError) as e:
        load_profile(c)
    assert str(e.value) == f"{c}: sparkdeploy.model.repo: required key is missing"


def test_validation_runs_on_the_merged_result(tmp_path, seed_copy):
    # neither file is a valid profile alone: the parent lacks the model, the child has only it
    whole = yaml.safe_load(seed_copy.read_text())
    model = whole["sparkdeploy"].pop("model")
    parent = child(tmp_path / "p.yaml", whole["sparkdeploy"])
    with pytest.raises(ProfileError, match="model: required key is missing"):
        load_profile(parent)
    c = child(tmp_path / "c.yaml", {"model": model}, "p.yaml")
    assert load_profile(c).model.repo == "Qwen/Qwen3.5-122B-A10B-FP8"


def test_bad_value_in_the_child_names_the_child(tmp_path, seed_copy):
    c = child(tmp_path / "c.yaml", {"bench": {"requests": 0}}, "base/seed.yaml")
    with pytest.raises(ProfileError) as e:
        load_profile(c)
    assert str(e.value) == f"{c}: sparkdeploy.bench.requests: 0 is out of range (must be >= 1)"


def test_bad_value_in_the_parent_names_the_parent_via_the_child(tmp_path):
    whole = seed_data()
    whole["sparkdeploy"]["nodes"][1]["role"] = "boss"
    parent = child(tmp_path / "p.yaml", whole["sparkdeploy"])
    c = child(tmp_path / "c.yaml", {"name": "c"}, "p.yaml")
    with pytest.raises(ProfileError) as e:
        load_profile(c)
    assert str(e.value) == (f"{parent}: sparkdeploy.nodes[1].role: must be 'head' or 'worker' "
                            f"(via {c})")


def test_cross_check_names_the_file_that_set_the_key(tmp_path, seed_copy):
    engines = yaml.safe_load(seed_copy.read_text())["sparkdeploy"]["engines"]
    engines[1]["dist_port"] = engines[1]["port"]
    c = child(tmp_path / "c.yaml", {"engines": engines}, "base/seed.yaml")
    with pytest.raises(ProfileError) as e:
        load_profile(c)
    assert str(e.value) == f"{c}: sparkdeploy.engines[1].dist_port: must differ from port"


def test_unknown_key_in_the_child(tmp_path, seed_copy):
    c = child(tmp_path / "c.yaml", {"model": {"revison": "x"}}, "base/seed.yaml")
    with pytest.raises(ProfileError) as e:
        load_profile(c)
    assert str(e.value) == f"{c}: sparkdeploy.model.revison: unknown key"


def test_missing_parent_is_one_line(tmp_path):
    c = child(tmp_path / "c.yaml", {"name": "c"}, "nope.yaml")
    with pytest.raises(ProfileError) as e:
        load_profile(c)
    assert str(e.value) == f"{c}: extends: nope.yaml: no such profile file"


@pytest.mark.parametrize("ext", [3, [], [""], {"a": 1}, ["ok.yaml", 4]])
def test_extends_must_be_paths(tmp_path, ext):
    c = child(tmp_path / "c.yaml", {"name": "c"}, ext)
    with pytest.raises(ProfileError) as e:
        load_profile(c)
    assert str(e.value) == f"{c}: extends: must be a file path or a list of file paths"


def test_cycle_is_one_line(tmp_path):
    a = child(tmp_path / "a.yaml", {"name": "a"}, "b.yaml")
    b = child(tmp_path / "b.yaml", {"name": "b"}, "a.yaml")
    with pytest.raises(ProfileError) as e:
        load_profile(a)
    assert str(e.value) == f"{b}: extends: cycle: {a} -> {b} -> {a}"


def test_self_cycle(tmp_path):
    a = child(tmp_path / "a.yaml", {"name": "a"}, "a.yaml")
    with pytest.raises(ProfileError) as e:
        load_profile(a)
    assert str(e.value) == f"{a}: extends: cycle: {a} -> {a}"


def test_diamond_is_not_a_cycle(tmp_path, seed_copy):
    child(tmp_path / "l.yaml", {"bench": {"requests": 3}}, "base/seed.yaml")
    child(tmp_path / "r.yaml", {"bench": {"warmup": 0}}, "base/seed.yaml")
    c = child(tmp_path / "c.yaml", {"name": "d"}, ["l.yaml", "r.yaml"])
    p, m = load_layered(c)
    # r.yaml (the later parent) brings the whole seed again, so the seed's requests win
    assert (p.bench.requests, p.bench.warmup) == (16, 0)
    assert m.file_of(("bench", "requests")) == str(seed_copy)
    assert m.files == [str(seed_copy), str(tmp_path / "l.yaml"), str(tmp_path / "r.yaml"), str(c)]


def test_later_parents_win_and_the_file_itself_wins_over_all(tmp_path, seed_copy):
    child(tmp_path / "one.yaml", {"bench": {"requests": 3, "warmup": 2}})
    child(tmp_path / "two.yaml", {"bench": {"requests": 5}})
    c = child(tmp_path / "c.yaml", {"bench": {"warmup": 0}},
              ["base/seed.yaml", "one.yaml", "two.yaml"])
    p, m = load_layered(c)
    assert (p.bench.requests, p.bench.warmup) == (5, 0)
    assert m.file_of(("bench", "requests")) == str(tmp_path / "two.yaml")
    assert m.file_of(("bench", "warmup")) == str(c)
    assert m.file_of(("bench", "input_tokens")) == str(tmp_path / "base" / "seed.yaml")


def test_a_bad_parent_file_is_named(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_bytes(b"sparkdeploy:\n  name: \xff\xfe\n")
    c = child(tmp_path / "c.yaml", {"name": "c"}, "p.yaml")
    with pytest.raises(ProfileError) as e:
        load_profile(c)
    assert str(e.value).startswith(f"{bad}: not UTF-8 text")


def test_overrides_record_what_was_there(tmp_path, seed_copy):
    c = child(tmp_path / "c.yaml", {"name": "c", "endpoint": "http://127.0.0.1:8000"},
              "base/seed.yaml")
    m = load_merged(c)
    got = {o.path: (o.value, o.was, o.file, o.was_file) for o in m.overrides}
    assert got[("name",)] == ("c", "qwen3.5-122b-a10b-fp8", str(c), str(seed_copy))
    # the seed says `endpoint: null`: the child sets it
    assert got[("endpoint",)][:2] == ("http://127.0.0.1:8000", None)


def test_added_key_is_listed_as_was_unset(tmp_path, seed_copy):
    c = child(tmp_path / "c.yaml", {"model": {"endpoint": "http://127.0.0.1:1"}}, "base/seed.yaml")
    [o] = load_merged(c).overrides
    assert o.path == ("model", "endpoint") and o.was is UNSET


def test_parse_dotted_inverts_dotted():
    assert parse_dotted("sparkdeploy.nodes[1].link.address") == ("nodes", 1, "link", "address")
    assert parse_dotted("sparkdeploy.services.stop.spark9") == ("services", "stop", "spark9")


# --- the lab profile ----------------------------------------------------------------------


def test_lab_profile_holds_only_the_labs_differences():
    lines = (ROOT / "configs" / "lab.yaml").read_text().splitlines()
    assert len(lines) <= 45
    text = "\n".join(ln.split("#")[0] for ln in lines)
    assert "://" not in text  # the hub and index come from lab.up's overlay only


@pytest.mark.parametrize("mgmt", layout.MGMT_CANDIDATES)
def test_lab_profile_takes_the_hub_and_index_from_lab_ups_overlay(tmp_path, mgmt):
    plan = layout.AddressPlan(mgmt, layout.FAST_NET)
    path = lab_profile_with_overlay(tmp_path, plan.controller)
    p, m = load_layered(path)
    assert p.model.endpoint == f"http://{plan.controller}:8900"
    assert p.images.layer.index_url == f"http://{plan.controller}:8901/simple/"
    overlay = str(tmp_path / "lab" / "profile.yaml")
    assert m.file_of(("model", "endpoint")) == overlay
    assert m.file_of(("images", "layer", "index_url")) == overlay
    # everything else is the seed's, apart from the lab's own keys
    assert p.engines == load_profile(SEED).engines
    assert p.model.repo == load_profile(SEED).model.repo


def test_lab_profile_without_the_lab_is_one_line(tmp_path):
    path = lab_profile_with_overlay(tmp_path, "10.77.0.1")
    (tmp_path / "lab" / "profile.yaml").unlink()
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    assert str(e.value) == f"{path}: extends: {tmp_path}/lab/profile.yaml: no such profile file"


# --- inv profile.check --------------------------------------------------------------------


def inv_check(profile: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invoke", "profile.check"], cwd=ROOT,
                          capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "INVOKE_SPARKDEPLOY_PROFILE": str(profile),
                               "PYTHONPATH": os.environ.get("PYTHONPATH", "")})


def test_profile_check_shows_the_override(tmp_path, seed_copy):
    c = child(tmp_path / "c.yaml", {"bench": {"requests": 4}}, "base/seed.yaml")
    r = inv_check(c)
    assert r.returncode == 0, r.stderr
    assert (f"#   sparkdeploy.bench.requests = 4 ({c}; was 16 from {seed_copy})"
            in r.stdout.splitlines())
    assert yaml.safe_load(r.stdout)["sparkdeploy"]["bench"]["requests"] == 4


def test_profile_check_bad_child_value_exits_2_naming_the_child(tmp_path, seed_copy):
    c = child(tmp_path / "c.yaml", {"nodes": [{"name": "spark1", "role": "boss"}]},
              "base/seed.yaml")
    r = inv_check(c)
    assert r.returncode == 2
    assert r.stderr.strip().startswith(f"{c}: sparkdeploy.nodes[0].")
    assert "Traceback" not in r.stderr
