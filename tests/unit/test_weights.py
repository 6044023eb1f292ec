"""Only the weights the engine loads: the selection rule (``sparkdeploy.model.weights``) on real
repository layouts, and model.download / model.verify against the lab hub's recipe-shaped
repositories on loopback (a scripted node whose helper runs for real)."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparkdeploy.core.outcomes import Status
from sparkdeploy.lab import hub, hub_layouts, tiny
from sparkdeploy.model import fit, weights
from sparkdeploy.ops import model_select
from sparkdeploy.steps import model, model_verify
from tests.unit.model_fakes import Node, deployment

GPT_OSS = "openai/gpt-oss-120b"
IMAGE = "scitrera/dgx-spark-sglang:0.5.10rc0"  # a candidate of the lab profile: the downloader's
# the repository's listing as public catalogs and download logs quote it (hub_layouts' source)
GPT_OSS_ROOT = [f"model-{i:05d}-of-00014.safetensors" for i in range(15)]
GPT_OSS_LISTING = sorted([
    ".gitattributes", "LICENSE", "README.md", "USAGE_POLICY", "chat_template.jinja", "config.json",
    "generation_config.json", "model.safetensors.index.json", "special_tokens_map.json",
    "tokenizer.json", "tokenizer_config.json", *GPT_OSS_ROOT, "metal/model.bin",
    "original/config.json", "original/dtypes.json", "original/model.safetensors.index.json",
    *[f"original/model--{i:05d}-of-00007.safetensors" for i in range(1, 8)]])
GPT_OSS_SUPPORT = ["chat_template.jinja", "config.json", "generation_config.json",
                   "model.safetensors.index.json", "special_tokens_map.json", "tokenizer.json",
                   "tokenizer_config.json"]


# --- the rule -------------------------------------------------------------------------------

def test_gpt_oss_selects_the_root_shards_and_the_files_beside_them_only():
    sel = weights.select(GPT_OSS_LISTING, GPT_OSS_ROOT)
    assert sel.files == sorted(GPT_OSS_ROOT + GPT_OSS_SUPPORT)
    assert sel.weights == GPT_OSS_ROOT and sel.rule == "index" and sel.widened == []


def test_patterns_add_files_and_never_remove_one():
    sel = weights.select(GPT_OSS_LISTING, GPT_OSS_ROOT, ["original/*"])
    assert sel.widened == [p for p in GPT_OSS_LISTING if p.startswith("original/")]
    assert set(sel.files) == set(GPT_OSS_ROOT + GPT_OSS_SUPPORT + sel.widened)
    # a pattern matching selected files adds nothing and removes nothing
    assert weights.select(GPT_OSS_LISTING, GPT_OSS_ROOT, ["config.json"]).files == \
        weights.select(GPT_OSS_LISTING, GPT_OSS_ROOT).files


def test_a_single_safetensors_file_without_an_index_and_bin_copies_beside_it():
    listing = ["config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json",
               "original/consolidated.00.pth", "model.gguf", "README.md"]
    sel = weights.select(listing, None)
    assert sel.files == ["config.json", "model.safetensors", "tokenizer.json"]
    assert sel.rule == "single" and sel.weights == ["model.safetensors"]


def test_remote_code_and_tiktoken_at_the_root_come_along_not_below_it():
    listing = ["config.json", "configuration_deepseek.py", "modeling_deepseek.py",
               "model.safetensors", "o200k.tiktoken", "inference/model.py", "figures/a.jpg"]
    assert weights.select(listing, None).files == [
        "config.json", "configuration_deepseek.py", "modeling_deepseek.py", "model.safetensors",
        "o200k.tiktoken"]


@pytest.mark.parametrize("listing, index, line", [
    (["config.json", "pytorch_model.bin", "original/model.safetensors"], None,
     "o/m: no model.safetensors.index.json and no model.safetensors: no safetensors weights "
     "the engine would load"),
    (["config.json", "a.safetensors", "b.safetensors"], None,
     "o/m: no model.safetensors.index.json for the 2 safetensors files at the root (e.g. "
     "a.safetensors): which of them the engine loads is not said"),
    (["config.json", "model.safetensors.index.json", "s1.safetensors"],
     ["s1.safetensors", "s2.safetensors", "s3.safetensors"],
     "o/m: model.safetensors.index.json names s2.safetensors and 1 more, which the "
     "repository lacks"),
    (["config.json", "model.safetensors.index.json", "pytorch_model.bin"], ["pytorch_model.bin"],
     "o/m: model.safetensors.index.json names pytorch_model.bin, which is not a safetensors "
     "file"),
])
def test_a_repository_the_engine_cannot_load_is_one_line(listing, index, line):
    with pytest.raises(weights.SelectionError) as e:
        weights.select(listing, index, repo="o/m")
    assert str(e.value) == line


def test_an_index_is_read_for_its_weight_map_only():
    doc = {"metadata": {"total_size": 3}, "weight_map": {"a": "s1.safetensors",
                                                         "b": "s2.safetensors",
                                                         "c": "s1.safetensors"}}
    assert weights.index_files(json.dumps(doc)) == ["s1.safetensors", "s2.safetensors"]
    with pytest.raises(weights.SelectionError, match="^x: has no weight_map$|^x has no weight_map$"):
        weights.index_files('{"metadata": {}}', "x")
    with pytest.raises(weights.SelectionError, match="^x is not JSON"):
        weights.index_files("<html>", "x")


NAMES = st.sampled_from([
    "config.json", "tokenizer.json", "chat_template.jinja", "README.md", "model.safetensors",
    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "x.py", "a.tiktoken",
    "original/config.json", "original/model.safetensors", "metal/model.bin", "model.gguf",
    "pytorch_model.bin", "model.safetensors.index.json", "sub/x.py", "consolidated.00.pth"])


@given(listed=st.lists(NAMES, unique=True), index=st.none() | st.lists(NAMES, unique=True),
       patterns=st.lists(st.sampled_from(["original/*", "*.bin", "*", "metal/*", "*.md"]),
                         max_size=2))
def test_the_selection_only_takes_from_the_listing_and_patterns_only_add(listed, index,
                                                                        patterns):
    try:
        base = weights.select(listed, index)
    except weights.SelectionError:
        with pytest.raises(weights.SelectionError):  # patterns never make a bad repo good
            weights.select(listed, index, patterns)
        return
    wide = weights.select(listed, index, patterns)
    assert base.files == [p for p in listed if p in set(base.files)]  # the listing's order
    assert set(base.files) <= set(wide.files) <= set(listed)
    assert set(wide.files) - set(base.files) == set(wide.widened)
    for p in base.files:  # never a copy: an index-named file, or one beside it at the root
        assert p in base.weights or ("/" not in p and weights.support(p))
    assert not any(p.endswith((".bin", ".gguf", ".pth", ".md")) for p in base.files)


# --- against the lab hub ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def recipe_hub(tmp_path_factory):
    srv = hub.start_hub(port=0, data_dir=tmp_path_factory.mktemp("hub"), size_mb=1, shards=1,
                        recipes=True, recipe_size_mb=3)
    yield srv
    srv.stop()


def _dep(tmp_path, srv, repo=GPT_OSS, **kw):
    srv.set_knobs(fault=None, reset_stats=True, bandwidth_bps=None)
    return deployment(tmp_path, {"spark1": Node(images={IMAGE: True}), "spark2": Node()}, srv.url,
                      repo=repo, token_to_image=True, **kw)


def _bodies(srv) -> dict[str, int]:
    """{file: body bytes} the hub served (a 302 to the LFS store is no body)."""
    out: dict[str, int] = {}
    for r in srv.stats()["requests"]:
        if r["method"] == "GET" and r.get("file") and r["status"] in (200, 206):
            out[r["file"]] = out.get(r["file"], 0) + r["bytes"]
    return out


def _held(root) -> list[str]:
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in (".sparkdeploy", ".cache")]
        out += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return sorted(out)


def test_the_lab_serves_gpt_oss_with_its_real_layout(recipe_hub):
    repo = recipe_hub.state.repos[GPT_OSS]
    assert sorted(repo.files) == GPT_OSS_LISTING
    assert json.loads((repo.root / "config.json").read_text()) == json.loads(
        (hub_layouts.CONFIGS / "gpt-oss-120b.json").read_text())
    size = {p: f.size for p, f in repo.files.items()}
    root = sum(size[p] for p in GPT_OSS_ROOT)
    original = sum(v for p, v in size.items() if p.startswith("original/model--"))
    # three copies of the weights, as the real repository's 3 x 65 GB
    # (the shards' headers aside)
    assert root == pytest.approx(original, rel=0.01) == pytest.approx(size["metal/model.bin"],
                                                                       rel=0.01)
    assert root > 0


def test_download_fetches_only_what_the_engine_loads_and_records_it_on_the_head(
        tmp_path, recipe_hub):
    dep, _ = _dep(tmp_path, recipe_hub)
    [res] = model.download(dep)
    assert res.status is Status.CHANGED, res.why
    path = dep.profile.model.path
    assert _held(path) == sorted(GPT_OSS_ROOT + GPT_OSS_SUPPORT)
    repo = recipe_hub.state.repos[GPT_OSS]
    engine = sum(repo.files[p].size for p in GPT_OSS_ROOT + GPT_OSS_SUPPORT)
    served = _bodies(recipe_hub)
    # no byte of original/ or metal/ left the hub: fetched / loaded is 1.00
    assert not [f for f in served if "/" in f]
    assert sum(v for f, v in served.items() if f != "model.safetensors.index.json") + \
        repo.files["model.safetensors.index.json"].size == engine
    assert "the 15 files model.safetensors.index.json names and 7 config, tokenizer and " \
           "template files" in res.why
    rec = json.loads(open(os.path.join(path, ".sparkdeploy", "selection.json")).read())
    assert [f["path"] for f in rec["files"]] == sorted(GPT_OSS_ROOT + GPT_OSS_SUPPORT)
    assert rec["selection"]["weights"] == GPT_OSS_ROOT and rec["commit"] == repo.commit


def test_a_rerun_at_the_same_commit_fetches_no_file_not_even_the_index(tmp_path, recipe_hub):
    dep, _ = _dep(tmp_path, recipe_hub)
    [first] = model.download(dep)
    assert first.status is Status.CHANGED, first.why
    recipe_hub.set_knobs(reset_stats=True)
    [again] = model.download(dep)
    assert again.status is Status.OK, again.why
    assert _bodies(recipe_hub) == {}


def test_verify_and_fit_read_the_heads_selection(tmp_path, recipe_hub):
    dep, ctx = _dep(tmp_path, recipe_hub)
    model.download(dep)
    meta, note = model_select.selected(dep)
    assert [f["path"] for f in meta["files"]] == sorted(GPT_OSS_ROOT + GPT_OSS_SUPPORT)
    recipe_hub.set_knobs(reset_stats=True)
    [res] = model_verify.verify(dep, "spark1")
    assert res.status is Status.OK and res.why.startswith("spark1: 22 files verified"), res.why
    assert recipe_hub.stats()["requests"] == []  # the head's record, not the hub
    calls = [a for _, a, _ in ctx.calls if "selection" in a and "--dir" in a]
    assert calls and calls[-1][-3:] == ["selection", "--dir", dep.profile.model.path]
    # model.fit weighs the same selection: the 15 root shards' bytes, no copy
    assert fit.weight_bytes(meta["files"]) == sum(
        recipe_hub.state.repos[GPT_OSS].files[p].size for p in GPT_OSS_ROOT)


def test_allow_patterns_widen_the_download(tmp_path, recipe_hub):
    dep, _ = _dep(tmp_path, recipe_hub, allow_patterns=["original/*"])
    [res] = model.download(dep)
    assert res.status is Status.CHANGED, res.why
    original = [p for p in GPT_OSS_LISTING if p.startswith("original/")]
    assert _held(dep.profile.model.path) == sorted(GPT_OSS_ROOT + GPT_OSS_SUPPORT + original)
    assert "metal/model.bin" not in _bodies(recipe_hub)
    assert ", 10 more by allow_patterns" in res.why


def test_a_changed_pattern_decides_again(tmp_path, recipe_hub):
    dep, _ = _dep(tmp_path, recipe_hub)
    model.download(dep)
    wide = dep.profile.model.model_copy(update={"allow_patterns": ["metal/*"]})
    dep.profile = dep.profile.model_copy(update={"model": wide})
    meta, _ = model_select.selected(dep)
    assert "metal/model.bin" in [f["path"] for f in meta["files"]]


def test_a_repository_without_loadable_weights_downloads_nothing(tmp_path):
    layout = hub_layouts.Layout("o/no-index", "Llama-3.3-70B-Instruct.json",
                                copies=(hub_layouts.Copy("", hub_layouts.shards(2), index=False),))
    srv = hub.HubServer(("127.0.0.1", 0), hub.HubState(
        [hub_layouts.prepare(tmp_path / "hub", layout, 1)])).start()
    try:
        dep, ctx = _dep(tmp_path, srv, repo="o/no-index")
        [res] = model.download(dep)
        assert res.status is Status.FAILED
        assert res.why == ("o/no-index: no model.safetensors.index.json for the 2 safetensors "
                           "files at the root (e.g. model-00001-of-00002.safetensors): which of "
                           "them the engine loads is not said")
        assert not os.path.exists(dep.profile.model.path)
        assert not [a for _, a, _ in ctx.calls if "fetch" in a or "mkroot" in a]
        assert not _bodies(srv)
    finally:
        srv.stop()


def test_the_perf_figure_selected_ratio_is_one_and_was_about_three(tmp_path, recipe_hub):
    """``nox -s perf -- model``'s ``model.selected_ratio``, its code run here on loopback (the
    lab runs it on its nodes): 1.00 with the selection; the whole repository (every file, as
    ``allow_patterns: ["*"]`` fetches, the default before) is about three times that."""
    from tools.perf import model as perf_model

    dep, _ = _dep(tmp_path / "a", recipe_hub)
    assert perf_model.selected_ratio(dep, recipe_hub) == pytest.approx(1.0, abs=0.005)
    dep, _ = _dep(tmp_path / "b", recipe_hub, allow_patterns=["*"])
    assert 2.9 < perf_model.selected_ratio(dep, recipe_hub) < 3.1


# --- the head's record, by the node helper run as a program --------------------------------------

def _helper(*args: str):
    import subprocess
    import sys

    from sparkdeploy.core.packaged import helper
    return subprocess.run([sys.executable, str(helper("model_node.py")), *args],
                          capture_output=True, text=True, timeout=30)


def test_the_node_records_a_spec_as_its_selection_and_refuses_one_that_is_not(tmp_path):
    root = tmp_path / "m"
    assert json.loads(_helper("selection", "--dir", str(root)).stdout) == {"selection": None}
    spec = {"repo": "o/m", "revision": "main", "commit": "c" * 40,
            "files": [{"path": "config.json", "size": 2, "sha256": None, "oid": "d" * 40}]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert _helper("mkroot", "--dir", str(root), "--spec", str(tmp_path / "spec.json")).returncode == 0
    assert json.loads(_helper("selection", "--dir", str(root)).stdout) == {"selection": spec}
    assert not list((root / ".sparkdeploy").glob("*.tmp"))
    bad = {**spec, "files": [{"path": "../x", "size": 1}]}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    r = _helper("mkroot", "--dir", str(tmp_path / "new"), "--spec", str(tmp_path / "bad.json"))
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: file name '../x' refused: has an empty, . or .. component")
    assert not (tmp_path / "new").exists()  # refused before the dir is made
    r = _helper("mkroot", "--dir", str(root), "--spec", str(tmp_path / "bad.json"))
    assert r.returncode == 2
    assert json.loads(_helper("selection", "--dir", str(root)).stdout) == {"selection": spec}
    # a record that is not a selection (tampered) is none, with a warning
    (root / ".sparkdeploy" / "selection.json").write_text(json.dumps(bad))
    r = _helper("selection", "--dir", str(root))
    assert json.loads(r.stdout.splitlines()[-1]) == {"selection": None}
    assert "is not a selection: file name '../x' refused" in r.stderr


@pytest.mark.parametrize("index, line", [
    ({"weight_map": {"a": "../x.safetensors"}},
     "the hub's answer is refused: o/m: model.safetensors.index.json names '../x.safetensors': "
     "has an empty, . or .. component"),
    ({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}},
     "o/m: model.safetensors.index.json names s2.safetensors, which the repository lacks"),
    ({"metadata": {}}, "o/m: model.safetensors.index.json has no weight_map"),
])
def test_an_index_the_engine_cannot_follow_is_one_line_before_any_node(tmp_path, monkeypatch,
                                                                        index, line):
    """The hub's listing and index, as the hub would answer them (``outside.request``)."""
    from sparkdeploy.core.outside import Response
    from sparkdeploy.ops import model as model_ops

    listing = {"sha": "c" * 40, "siblings": [
        {"rfilename": n, "size": 5, "blobId": "d" * 40}
        for n in ("config.json", "model.safetensors.index.json", "s1.safetensors")]}
    asked = []

    def answer(method, url, **kw):
        asked.append(url)
        body = index if url.endswith("/resolve/" + "c" * 40 + "/model.safetensors.index.json") \
            else listing
        return Response(200, json.dumps(body).encode(), {})

    monkeypatch.setattr(model_ops, "request", answer)
    dep, ctx = deployment(tmp_path, {"spark1": Node(), "spark2": Node()}, "http://hub.invalid",
                          repo="o/m")
    [res] = model.download(dep)
    assert res.status is Status.FAILED and res.why == line
    assert len(asked) == 2 and ctx.calls == []  # no node touched, nothing fetched
    assert not os.path.exists(dep.profile.model.path)


def test_huggingface_hub_reads_the_recipe_repositories_from_the_lab_hub(recipe_hub, tmp_path):
    from huggingface_hub import HfApi, hf_hub_download

    api = HfApi(endpoint=recipe_hub.url, token=False)
    info = api.model_info(GPT_OSS, files_metadata=True)
    assert sorted(s.rfilename for s in info.siblings) == GPT_OSS_LISTING
    assert {s.rfilename for s in info.siblings if s.lfs} == {
        p for p in GPT_OSS_LISTING if p.endswith((".safetensors", ".bin"))}
    got = hf_hub_download(GPT_OSS, "original/model--00007-of-00007.safetensors",
                          endpoint=recipe_hub.url, local_dir=tmp_path, token=False)
    assert os.path.getsize(got) == recipe_hub.state.repos[GPT_OSS].files[
        "original/model--00007-of-00007.safetensors"].size
    served = sorted(recipe_hub.state.repos)
    assert served == sorted(["Qwen/Qwen3.5-122B-A10B-FP8", *(m.repo_id for m in tiny.MODELS),
                             *(la.repo_id for la in hub_layouts.available())])
    # the seed's, the real engine's three (lab-tiny, lab-tiny-b, lab-tiny-c) and the five of
    # tests/unit/data/configs
    assert len(served) == 9
