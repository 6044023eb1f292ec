"""Recipes: package data over one base, merged under a profile, layouts from the calculator,
the listing, and one line for bad input."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import yaml

from sparkdeploy.profile import catalog, recipes
from sparkdeploy.profile.config import ProfileError, load_layered, load_profile, read_recipe
from tests.unit.profiles import ROOT, SEED, seed_data, write_profile

REQUIRED = {"qwen3.5-122b-a10b-fp8", "gpt-oss-120b", "qwen3-235b-a22b-instruct-2507-fp8"}


def run_inv(*args: str):
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT, capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src"),
                                          "INVOKE_SPARKDEPLOY_PROFILE": str(SEED)})


def test_the_package_ships_at_least_six_recipes_each_valid_with_its_config():
    names = recipes.known(recipes.directories())
    assert REQUIRED <= set(names) and len(names) >= 6
    for name in names:
        r = read_recipe(name)
        assert r.config_path().is_file()
        assert set(r.about["sources"]) == {"model", "images", "engines", "config"}


def test_the_seed_profile_is_its_recipe_plus_the_cluster():
    p, merged = load_layered(SEED)
    assert p.recipe == "qwen3.5-122b-a10b-fp8"
    assert p.model.repo == "Qwen/Qwen3.5-122B-A10B-FP8"
    assert p.model.path == "/srv/models/Qwen3.5-122B-A10B-FP8"
    assert [(e.name, e.tensor_parallel, e.pipeline_parallel) for e in p.engines] == [
        ("sglang", 2, 1), ("vllm-ray", 2, 1), ("vllm", 2, 1)]
    assert merged.files[0].endswith("recipes/base.yaml") and merged.files[-1] == str(SEED)
    assert "about.layouts for 2 node(s)" in merged.origin[("engines", 0, "tensor_parallel")]


def test_the_profiles_own_values_win_over_the_recipes(tmp_path):
    p = write_profile(tmp_path, {"extends": str(SEED),
                                 "sparkdeploy": {"model": {"revision": "abc123"}}})
    assert load_profile(p).model.revision == "abc123"


def test_recipe_override_replaces_the_model_part_and_keeps_the_cluster():
    p = load_profile(SEED, recipe="gpt-oss-120b")
    assert (p.model.repo, p.recipe) == ("openai/gpt-oss-120b", "gpt-oss-120b")
    assert [c.ref for c in p.images.candidates] == ["sparkarena/spark-vllm-docker:mxfp4"]
    assert p.images.layer is None  # the seed's derivative image is the seed recipe's
    assert [(e.name, e.tensor_parallel) for e in p.engines] == [("vllm", 2)]
    assert [n.name for n in p.nodes] == ["spark1", "spark2"]


def test_three_gpus_get_pp3_where_heads_refuse_tp3(tmp_path):
    data = seed_data()
    body = data["sparkdeploy"]
    extra = copy.deepcopy(body["nodes"][1])
    extra["name"], extra["link"]["address"] = "spark3", "192.168.100.12"
    body["nodes"].append(extra)
    p = load_profile(write_profile(tmp_path, data), recipe="qwen3-235b-a22b-instruct-2507-fp8")
    assert {(e.tensor_parallel, e.pipeline_parallel) for e in p.engines} == {(1, 3)}


def test_an_unknown_recipe_is_one_line_listing_the_known(tmp_path):
    data = seed_data()
    data["sparkdeploy"]["recipe"] = "nope"
    path = write_profile(tmp_path, data)
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    known = ", ".join(recipes.known(recipes.directories()))
    assert str(e.value) == f"{path}: sparkdeploy.recipe: no recipe named 'nope' (recipes: {known})"


def _own(tmp_path, body: dict, name: str = "mine") -> str:
    d = tmp_path / "own"
    d.mkdir(exist_ok=True)
    mine = yaml.safe_load((recipes.packaged_dir() / "gpt-oss-20b.yaml").read_text())
    mine["sparkdeploy"].update(body)
    (d / f"{name}.yaml").write_text(yaml.safe_dump(mine))
    (d / "gpt-oss-20b.config.json").write_text(
        (recipes.packaged_dir() / "gpt-oss-20b.config.json").read_text())
    return str(d)


def test_an_owners_directory_adds_a_recipe_from_the_profile(tmp_path):
    d = _own(tmp_path, {})
    data = seed_data()
    data["sparkdeploy"]["recipes"] = "own"
    data["sparkdeploy"].pop("engines")
    data["sparkdeploy"]["recipe"] = "mine"
    for k in ("model",):
        data["sparkdeploy"][k] = {}
    data["sparkdeploy"].pop("images")
    p = load_profile(write_profile(tmp_path, data))
    assert p.recipe == "mine" and p.model.repo == "openai/gpt-oss-20b"
    assert p.recipes == [d]


def test_a_recipe_from_recipes_on_the_command_line_is_found_again_from_the_profile(tmp_path):
    """``--recipes DIR`` (deploy.all, serve.swap): the loaded profile lists DIR, so what reads
    the recipe again later (model.fit, for its config.json) finds it there too."""
    d = _own(tmp_path, {})
    p = load_profile(SEED, recipe="mine", recipe_dirs=(str(d),))
    assert p.recipe == "mine" and p.recipes == [d]
    assert read_recipe(p.recipe, recipes.directories(p.recipes)).name == "mine"


@pytest.mark.parametrize("body, where, why", [
    ({"modle": {}}, "sparkdeploy.modle", "unknown key"),
    ({"model": {"repo": "a/b", "endpoint": "http://x"}}, "sparkdeploy.model.endpoint",
     "not a recipe's key"),
    ({"about": {"title": "t", "config": "gpt-oss-20b.config.json",
                "weights": {"bytes": -1, "source": "s"}, "context": {"tokens": 1, "source": "s"},
                "sources": {"model": "m", "images": "i", "engines": "e", "config": "c"}}},
     "sparkdeploy.about.weights.bytes", "-1 is out of range"),
])
def test_a_bad_recipe_file_names_the_file_and_the_key(tmp_path, body, where, why):
    d = _own(tmp_path, body)
    with pytest.raises(ProfileError) as e:
        read_recipe("mine", recipes.directories([d]))
    assert str(e.value).startswith(f"{d}/mine.yaml: {where}: {why}")


def test_layouts_come_from_the_recipe_file_not_from_tp_keys(tmp_path):
    mine = yaml.safe_load((recipes.packaged_dir() / "gpt-oss-20b.yaml").read_text())
    engines = mine["sparkdeploy"]["engines"]
    engines[0]["tensor_parallel"] = 2
    d = _own(tmp_path, {"engines": engines})
    with pytest.raises(ProfileError, match=r"mine.yaml: sparkdeploy.engines\[0\].tensor_parallel: "
                                           r"set per cluster"):
        read_recipe("mine", recipes.directories([d]))


def test_catalog_rows_say_min_nodes_and_fit():
    got = {r.name: r for r in catalog.rows(recipes.directories(), 2, 101.0, "test")}
    assert got["gpt-oss-120b"].min_nodes == 1 and got["gpt-oss-120b"].fits is True
    big = got["qwen3-235b-a22b-instruct-2507-fp8"]
    assert big.min_nodes == 3 and big.fits is False
    assert big.why.startswith("TP=2 x PP=1 on 2 node(s) does not fit:")


def test_inv_recipe_list_json_and_an_unknown_show():
    r = run_inv("recipe.list", "--json", "--nodes", "4")
    assert r.returncode == 0, r.stderr
    rows = {x["name"]: x for x in json.loads(r.stdout)}
    assert REQUIRED <= set(rows)
    assert rows["qwen3-235b-a22b-instruct-2507-fp8"]["fits"] is True
    assert {"name", "repo", "weights_bytes", "min_nodes", "engines"} <= set(rows["gpt-oss-120b"])
    r = run_inv("recipe.show", "nope")
    assert r.returncode == 2 and r.stderr.startswith("--recipe: no recipe named 'nope' (recipes: ")


def test_deploy_all_with_an_unknown_recipe_or_directory_is_one_line_exit_2(tmp_path):
    r = run_inv("deploy.all", "--recipe", "nope")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("--recipe: no recipe named 'nope' (recipes: glm-4.5-air-fp8, ")
    r = run_inv("deploy.all", "--recipe", "gpt-oss-120b", "--recipes", str(tmp_path / "none"))
    assert (r.returncode, r.stderr) == (
        2, f"--recipes: recipe directory {tmp_path / 'none'} does not exist\n")
    (tmp_path / "file").write_text("x")
    r = run_inv("deploy.all", "--recipe", "gpt-oss-120b", "--recipes", str(tmp_path / "file"))
    assert (r.returncode, r.stderr) == (
        2, f"--recipes: {tmp_path / 'file'} is a file, not a directory of recipes\n")
    r = run_inv("recipe.show", "gpt-oss-120b", "--recipes", str(tmp_path / "file"))
    assert (r.returncode, r.stderr) == (
        2, f"--recipes: {tmp_path / 'file'} is a file, not a directory of recipes\n")


# --- what an owner's recipe directory says (issue 39) ------------------------------------------

def test_a_yaml_file_whose_name_is_no_recipe_name_is_named_not_ignored(tmp_path):
    d = _own(tmp_path, {})
    (tmp_path / "own" / "My_Model.yaml").write_text((tmp_path / "own" / "mine.yaml").read_text())
    with pytest.raises(recipes.RecipeError) as e:
        recipes.known(recipes.directories([d]))
    assert str(e.value) == (f"{d}/My_Model.yaml: 'My_Model' is not a recipe name (lowercase "
                            "letters, digits, '.', '_', '-', starting with a letter or digit): "
                            "rename the file")


def test_a_recipe_shadowing_another_of_its_name_says_so(tmp_path):
    d = _own(tmp_path, {}, name="gpt-oss-20b")
    dirs = recipes.directories([d])
    packaged = recipes.packaged_dir() / "gpt-oss-20b.yaml"
    assert recipes.shadowed("gpt-oss-20b", dirs) == [packaged]
    assert f"# shadows {packaged} (the first directory's recipe of a name wins)" in \
        catalog.show("gpt-oss-20b", dirs, [1]).splitlines()
    [row] = [r for r in catalog.rows(dirs, None, 101, "x") if r.name == "gpt-oss-20b"]
    assert row.file == f"{d}/gpt-oss-20b.yaml" and row.why.endswith(f"; shadows {packaged}")
    assert recipes.shadowed("gpt-oss-120b", dirs) == []


def test_a_recipe_without_a_model_is_blamed_on_its_own_file_naming_every_missing_key(tmp_path):
    d = _own(tmp_path, {})
    body = yaml.safe_load((tmp_path / "own" / "mine.yaml").read_text())
    del body["sparkdeploy"]["model"]
    (tmp_path / "own" / "mine.yaml").write_text(yaml.safe_dump(body))
    with pytest.raises(ProfileError) as e:
        read_recipe("mine", recipes.directories([d]))
    assert str(e.value) == (f"{d}/mine.yaml: sparkdeploy.model.repo: required key is missing "
                            "(and 1 more: sparkdeploy.model.path)")


def test_recipe_list_and_show_check_the_engines_flags(tmp_path):
    d = _own(tmp_path, {})
    body = yaml.safe_load((tmp_path / "own" / "mine.yaml").read_text())
    body["sparkdeploy"]["engines"][0]["args"] = ["--max-model-len", "8192", "--gpu-memory-utilisation",
                                                 "0.8"]
    (tmp_path / "own" / "mine.yaml").write_text(yaml.safe_dump(body))
    for call in (lambda: catalog.show("mine", recipes.directories([d]), [1]),
                 lambda: catalog.rows(recipes.directories([d]), None, 101, "x")):
        with pytest.raises(ProfileError) as e:
            call()
        assert str(e.value).startswith(f"{d}/mine.yaml: sparkdeploy.engines[0].args: "
                                       "--gpu-memory-utilisation: not a flag of vllm")
        assert "did you mean --gpu-memory-utilization?" in str(e.value)


def test_a_profiles_recipes_directory_that_is_a_file_is_blamed_on_the_profile(tmp_path):
    (tmp_path / "notadir").write_text("x")
    data = seed_data()
    data["sparkdeploy"]["recipes"] = "notadir"
    path = write_profile(tmp_path, data)
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    assert str(e.value) == (f"{path}: sparkdeploy.recipes: {tmp_path / 'notadir'} is a file, not "
                            "a directory of recipes")
