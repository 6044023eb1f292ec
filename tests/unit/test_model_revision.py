"""A new model revision is a change: model.sync sends what the new revision holds, not what the
head's record of the old one says is there; serve.up's fingerprint and the engines' labels name
the revision, so a new one redeploys instead of serving the old weights."""

from __future__ import annotations

from sparkdeploy.ops import model_select
from sparkdeploy.steps import model_sync
from tests.unit.conftest import SEED
from tests.unit.fakes import deployment

OLD, NEW = "a" * 40, "b" * 40
SEL = {"rule": "single", "weights": ["model.safetensors"], "patterns": [], "listed_files": 2,
       "listed_bytes": 12}


def _record(revision: str, commit: str, sha: str) -> dict:
    """What the head's selection.json says (``model_node.py selection``)."""
    return {"repo": "Qwen/Qwen3.5-122B-A10B-FP8", "revision": revision, "commit": commit,
            "files": [{"path": "config.json", "size": 2, "sha256": None, "oid": commit},
                      {"path": "model.safetensors", "size": 10, "sha256": sha, "oid": None}],
            "selection": SEL}


def _hub(revision: str, commit: str, sha: str) -> dict:
    """The hub's listing of ``revision`` now (``ops.model.metadata``)."""
    meta = _record(revision, commit, sha)
    return {**meta, "index": None, "fetched_at": 1.0}


def _sync_sees(monkeypatch, tmp_path, head_holds: dict, hub_has: dict, revision: str) -> dict:
    """The metadata model.sync sends the workers by, the head recording ``head_holds`` and
    the hub answering ``hub_has`` for the profile's ``revision``."""
    dep = deployment(SEED, tmp_path / "state")
    m = dep.profile.model.model_copy(update={"revision": revision, "allow_patterns": []})
    dep.profile = dep.profile.model_copy(update={"model": m})
    monkeypatch.setattr(model_select, "run_helper",
                        lambda *a, **k: model_select._Recorded(selection=head_holds))
    monkeypatch.setattr(model_select, "metadata", lambda d, refresh=True: (hub_has, ""))
    got: dict = {}
    monkeypatch.setattr(model_sync, "sync_files",
                        lambda ctx, targets, meta, only=None, note="": got.update(meta))
    monkeypatch.setattr(model_sync, "own_lock", lambda *a: __import__("contextlib").nullcontext())
    model_sync.sync(dep)
    return got


def test_sync_after_the_profile_moves_to_a_new_revision_sends_the_new_revisions_files(monkeypatch, tmp_path):
    got = _sync_sees(monkeypatch, tmp_path, _record("v1", OLD, "1" * 64), _hub("v2", NEW, "2" * 64), "v2")
    assert (got["revision"], got["commit"]) == ("v2", NEW)
    assert {f["path"]: f["sha256"] for f in got["files"]}["model.safetensors"] == "2" * 64


def test_sync_when_the_revision_names_a_new_commit_compares_against_it_not_the_heads_record(monkeypatch,
                                                                                            tmp_path):
    # the profile's revision (a branch) moved to a new commit; the head still records the old
    # one (its download of the new one starts beside this sync): its files are not "there"
    got = _sync_sees(monkeypatch, tmp_path, _record("main", OLD, "1" * 64), _hub("main", NEW, "2" * 64), "main")
    assert (got["revision"], got["commit"]) == ("main", NEW)
    assert {f["path"]: f["sha256"] for f in got["files"]}["model.safetensors"] == "2" * 64


def test_sync_at_the_heads_commit_keeps_the_heads_record(monkeypatch, tmp_path):
    head = _record("main", OLD, "1" * 64)
    got = _sync_sees(monkeypatch, tmp_path, head, _hub("main", OLD, "1" * 64), "main")
    assert got["commit"] == OLD and got["fetched_at"] == 0.0  # the head's record, as recorded


def test_sync_without_the_hub_or_its_cache_sends_by_the_heads_record_and_says_so(monkeypatch, tmp_path):
    from sparkdeploy.ops.model import ModelError

    def offline(d, refresh=True):
        raise ModelError("cannot read Qwen/Qwen3.5-122B-A10B-FP8@main from the hub: timed out")

    dep = deployment(SEED, tmp_path / "state")
    monkeypatch.setattr(model_select, "run_helper",
                        lambda *a, **k: model_select._Recorded(selection=_record("main", OLD, "1" * 64)))
    monkeypatch.setattr(model_select, "metadata", offline)
    got: list = []
    monkeypatch.setattr(model_sync, "sync_files", lambda ctx, t, meta, only=None, note="": got.append((meta, note)))
    monkeypatch.setattr(model_sync, "own_lock", lambda *a: __import__("contextlib").nullcontext())
    model_sync.sync(dep)
    (meta, note), = got
    assert meta["commit"] == OLD and note == ("the revision's commit not checked: cannot read "
                                              "Qwen/Qwen3.5-122B-A10B-FP8@main from the hub: timed out")


def _at(tmp_path, revision: str):
    dep = deployment(SEED, tmp_path / "state")
    dep.profile = dep.profile.model_copy(update={"model": dep.profile.model.model_copy(
        update={"revision": revision})})
    return dep


def test_serve_up_fingerprints_the_model_revision(tmp_path):
    from sparkdeploy.core.fingerprint import diff_keys
    from sparkdeploy.steps import registry

    registry.load_all()
    fp = registry.get("serve.up").fingerprint
    old, new = fp.local(_at(tmp_path, "main")), fp.local(_at(tmp_path, "v2"))
    assert old["model.revision"] == "main" and diff_keys(old, new) == ["model.revision"]


def test_the_engines_labels_name_the_revision_so_a_running_engine_of_another_one_differs(tmp_path):
    from sparkdeploy.core import labels
    from sparkdeploy.core.fingerprint import digest, key_digests

    old, new = _at(tmp_path, "main").profile, _at(tmp_path, "v2").profile
    fp = labels.engine_fingerprint(old, old.engines[0])
    running = labels.parse_ps(__import__("json").dumps(
        ["c0ffee", "sparkdeploy-sglang-head", "running", "Up", *(
            {labels.FINGERPRINT: digest(fp), labels.FINGERPRINT_KEYS: __import__("json").dumps(
                key_digests(fp))}.get(k, "") for k in labels.READ)]))[0]
    assert running.differs(labels.engine_fingerprint(old, old.engines[0])) == []
    assert running.differs(labels.engine_fingerprint(new, new.engines[0])) == ["model.revision"]
