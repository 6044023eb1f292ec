"""The lab's model hub, driven by the real huggingface_hub client over loopback."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from sparkdeploy.lab import hub

# The hub is reached with endpoint= (and HF_ENDPOINT set too): huggingface_hub reads its
# environment at import time, which may have happened before these tests.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import huggingface_hub  # noqa: E402
from huggingface_hub import HfApi, hf_hub_download, hf_hub_url, snapshot_download  # noqa: E402
from huggingface_hub.errors import (  # noqa: E402
    EntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

REPO = hub.REPO_ID


@pytest.fixture(scope="module")
def small_hub(tmp_path_factory):
    server = hub.start_hub(port=0, data_dir=tmp_path_factory.mktemp("hubdata"), size_mb=8,
                           shards=3)
    yield server
    server.stop()


@pytest.fixture()
def hf_env(tmp_path, monkeypatch, small_hub):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_ENDPOINT", small_hub.url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    small_hub.set_knobs(bandwidth_bps=None, fault=None, reset_stats=True)
    return tmp_path / "hf_home" / "hub"


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def shard_names(server) -> list[str]:
    return sorted(p for p, f in server.state.repos[REPO].files.items() if f.lfs)


def test_model_info_lists_files_with_sizes_and_lfs_sha256(small_hub, hf_env):
    info = HfApi(endpoint=small_hub.url).model_info(REPO, files_metadata=True)
    repo = small_hub.state.repos[REPO]

    assert info.id == REPO
    assert info.sha == repo.commit
    by_name = {s.rfilename: s for s in info.siblings}
    assert set(by_name) == set(repo.files)
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json"} <= set(by_name)
    shards = [n for n in by_name if n.endswith(".safetensors")]
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    on_disk = repo.root
    for name, sib in by_name.items():
        assert sib.size == (on_disk / name).stat().st_size
        if name in shards:
            assert sib.lfs is not None
            assert sib.lfs.size == sib.size
            assert sib.lfs.sha256 == sha256(on_disk / name)
        else:
            assert sib.lfs is None
            assert sib.blob_id == git_blob_oid((on_disk / name).read_bytes())
    assert info.config["model_type"] == "qwen3_5_moe"


def test_snapshot_download_gets_every_file_matching_the_hub_metadata(small_hub, hf_env):
    info = HfApi(endpoint=small_hub.url).model_info(REPO, files_metadata=True)
    folder = Path(snapshot_download(REPO, endpoint=small_hub.url, cache_dir=hf_env))

    assert folder.name == info.sha
    assert sorted(p.name for p in folder.iterdir()) == sorted(s.rfilename for s in info.siblings)
    for sib in info.siblings:
        data = (folder / sib.rfilename).read_bytes()
        assert len(data) == sib.size
        if sib.lfs:
            assert hashlib.sha256(data).hexdigest() == sib.lfs.sha256
        else:
            assert git_blob_oid(data) == sib.blob_id
    # LFS files went through the same-host redirect to the blob route
    paths = [r["path"] for r in small_hub.stats()["requests"] if r["method"] == "GET"]
    assert sum(p.startswith("/_lab/lfs/") for p in paths) == 3


def test_generated_config_has_the_real_shape(small_hub):
    root = small_hub.state.repos[REPO].root
    config = json.loads((root / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe"
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    text = config["text_config"]
    assert text["model_type"] == "qwen3_5_moe_text"
    assert (text["num_hidden_layers"], text["hidden_size"]) == (48, 3072)
    assert (text["num_experts"], text["num_experts_per_tok"]) == (256, 8)
    quant = config["quantization_config"]
    assert quant["quant_method"] == "fp8"
    assert quant["weight_block_size"] == [128, 128]
    tok = json.loads((root / "tokenizer.json").read_text())
    assert tok["model"]["type"] == "BPE"
    assert "<|im_end|>" in {t["content"] for t in tok["added_tokens"]}


def test_shards_have_valid_safetensors_headers_and_index(small_hub):
    root = small_hub.state.repos[REPO].root
    index = json.loads((root / "model.safetensors.index.json").read_text())
    seen = {}
    total = 0
    for name in shard_names(small_hub):
        data = (root / name).read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        header.pop("__metadata__")
        spans = sorted(t["data_offsets"] for t in header.values())
        assert spans[0][0] == 0
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert spans[-1][1] == len(data) - 8 - n
        total += spans[-1][1]
        seen.update(dict.fromkeys(header, name))
    assert index["weight_map"] == seen
    assert index["metadata"]["total_size"] == total


def test_prepare_repo_is_deterministic_and_reuses_its_cache(tmp_path):
    a = hub.prepare_repo(tmp_path / "a", size_mb=2, shards=2)
    mtimes = {p: (a.root / p).stat().st_mtime_ns for p in a.files}
    again = hub.prepare_repo(tmp_path / "a", size_mb=2, shards=2)
    b = hub.prepare_repo(tmp_path / "b", size_mb=2, shards=2)

    assert again.commit == a.commit == b.commit
    assert {p: (a.root / p).stat().st_mtime_ns for p in a.files} == mtimes
    assert {p: f.sha256 for p, f in b.files.items()} == {p: f.sha256 for p, f in a.files.items()}
    other = hub.prepare_repo(tmp_path / "a", size_mb=3, shards=2)
    assert other.commit != a.commit and other.root != a.root
    assert {p: (a.root / p).stat().st_mtime_ns for p in a.files} == mtimes


def test_resume_after_the_fault_drops_the_connection_once(tmp_path, monkeypatch):
    # huggingface_hub 2.x writes the body in 10 MiB chunks and retries with `Range: bytes=N-`
    # from what it wrote: shards of ~12 MiB and a fault after 11 MiB give a real resume.
    server = hub.start_hub(port=0, data_dir=tmp_path / "data", size_mb=24, shards=2)
    try:
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
        shard = shard_names(server)[1]
        expected = server.state.repos[REPO].files[shard]
        assert expected.size > 11 * 1024 * 1024
        server.set_knobs(fault={"file": shard, "after_bytes": 11 * 1024 * 1024})

        path = hf_hub_download(REPO, shard, endpoint=server.url, cache_dir=tmp_path / "cache")

        assert Path(path).stat().st_size == expected.size
        assert sha256(path) == expected.sha256
        stats = server.stats()
        assert stats["faults_fired"] == [
            {"file": shard, "after_bytes": 11 * 1024 * 1024, "range_start": 0}]
        assert stats["knobs"]["fault"] is None
        gets = [r for r in stats["requests"] if r["method"] == "GET" and r["file"] == shard]
        assert gets[0]["fault_fired"] and gets[0]["bytes"] == 11 * 1024 * 1024
        ranged = [r for r in gets if r["range"]]
        assert ranged and ranged[-1]["status"] == 206
        start = int(ranged[-1]["range"].split("=")[1].split("-")[0])
        assert start > 0 and ranged[-1]["bytes"] == expected.size - start
    finally:
        server.stop()


def test_bandwidth_limit_is_applied_to_file_bodies(small_hub, hf_env, tmp_path):
    rate = 4 * 1024 * 1024
    assert hub.set_knobs(small_hub.url, bandwidth_bps=rate)["bandwidth_bps"] == rate
    shard = shard_names(small_hub)[0]
    size = small_hub.state.repos[REPO].files[shard].size
    try:
        hf_hub_download(REPO, shard, endpoint=small_hub.url, cache_dir=tmp_path / "c")
    finally:
        hub.set_knobs(small_hub.url, bandwidth_bps=None)
    stats = hub.get_stats(small_hub.url)
    body = [r for r in stats["requests"] if r["method"] == "GET" and r["file"] == shard]
    assert body[-1]["limit_bps"] == rate and body[-1]["bytes"] == size
    # The bucket (burst: one chunk) made the body wait: by the server's own clock, the body
    # took at least the time the limit allows for the bytes above the burst (a lower bound
    # that a slow machine only makes easier to meet).
    burst = stats["throttle"]["burst"]
    assert stats["throttle"]["waited_s"] > 0
    assert stats["throttle"]["bytes"] >= size
    assert body[-1]["duration_s"] >= (size - burst) / rate * 0.999
    assert stats["knobs"]["bandwidth_bps"] is None


def test_resolve_headers_carry_lfs_metadata_and_never_xet(small_hub, hf_env):
    repo = small_hub.state.repos[REPO]
    shard = shard_names(small_hub)[0]
    r = requests.head(hf_hub_url(REPO, shard, endpoint=small_hub.url), allow_redirects=False)
    assert r.status_code == 302
    assert r.headers["X-Repo-Commit"] == repo.commit
    assert r.headers["X-Linked-Etag"] == f'"{repo.files[shard].sha256}"'
    assert r.headers["X-Linked-Size"] == str(repo.files[shard].size)
    assert r.headers["Location"].startswith("/_lab/lfs/")
    followed = requests.head(hf_hub_url(REPO, shard, endpoint=small_hub.url))
    for resp in (r, followed):
        assert not [h for h in resp.headers if h.lower().startswith("x-xet")]
    assert followed.headers["Accept-Ranges"] == "bytes"
    meta = huggingface_hub.get_hf_file_metadata(hf_hub_url(REPO, shard, endpoint=small_hub.url),
                                                endpoint=small_hub.url)
    assert meta.xet_file_data is None
    assert (meta.etag, meta.size, meta.commit_hash) == (
        repo.files[shard].sha256, repo.files[shard].size, repo.commit)


def test_http_range_requests(small_hub):
    repo = small_hub.state.repos[REPO]
    data = (repo.root / "config.json").read_bytes()
    url = hf_hub_url(REPO, "config.json", endpoint=small_hub.url)

    r = requests.get(url, headers={"Range": "bytes=10-19"})
    assert (r.status_code, r.content) == (206, data[10:20])
    assert r.headers["Content-Range"] == f"bytes 10-19/{len(data)}"
    r = requests.get(url, headers={"Range": "bytes=-5"})
    assert (r.status_code, r.content) == (206, data[-5:])
    r = requests.get(url, headers={"Range": f"bytes={len(data)}-"})
    assert r.status_code == 416
    r = requests.get(url)
    assert (r.status_code, r.content, r.headers["ETag"]) == (200, data, f'"{git_blob_oid(data)}"')


def test_missing_repo_revision_and_file_raise_the_hub_errors(small_hub, hf_env):
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "nope.json", endpoint=small_hub.url, cache_dir=hf_env)
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=small_hub.url).model_info("nobody/nothing")
    with pytest.raises(RevisionNotFoundError):
        HfApi(endpoint=small_hub.url).model_info(REPO, revision="v9")


def test_paths_info_and_tree(small_hub, hf_env):
    api = HfApi(endpoint=small_hub.url)
    repo = small_hub.state.repos[REPO]
    infos = api.get_paths_info(REPO, ["config.json", shard_names(small_hub)[0], "missing"])
    assert [i.path for i in infos] == ["config.json", shard_names(small_hub)[0]]
    assert infos[1].lfs.sha256 == repo.files[infos[1].path].sha256
    tree = list(api.list_repo_tree(REPO, recursive=True))
    assert sorted(f.path for f in tree) == sorted(repo.files)


def test_control_endpoint(small_hub):
    url = small_hub.url + "/_lab/control"
    assert requests.post(url, json={"bogus": 1}).status_code == 400
    assert requests.post(url, json={"bandwidth_bps": -3}).status_code == 400
    r = requests.post(url, json={"fault": {"file": "x.safetensors", "after_bytes": 7}})
    assert r.json()["fault"] == {"file": "x.safetensors", "after_bytes": 7}
    assert requests.get(url).json() == {"bandwidth_bps": None,
                                        "fault": {"file": "x.safetensors", "after_bytes": 7}}
    assert requests.post(url, json={"fault": None}).json()["fault"] is None


def test_cli_serves_and_reports_ready(tmp_path):
    argv = hub.cli_argv("127.0.0.1", 0, tmp_path, size_mb=1, shards=1)
    assert argv == [sys.executable, "-m", "sparkdeploy.lab.hub", "--bind", "127.0.0.1",
                    "--port", "0", "--data", str(tmp_path), "--size-mb", "1", "--shards", "1"]
    proc = subprocess.Popen(
        [*argv, "--bandwidth-bps", "1000000", "--fault", "model-00001-of-00001.safetensors:100",
         "--no-recipes"],
        stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("READY http://127.0.0.1:")
        url = line.split()[1]
        assert hub.wait_ready(url, timeout=10)
        assert requests.get(url + "/_lab/health").json()["repos"] == [REPO]
        assert requests.get(url + "/_lab/control").json() == {
            "bandwidth_bps": 1000000,
            "fault": {"file": "model-00001-of-00001.safetensors", "after_bytes": 100}}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
