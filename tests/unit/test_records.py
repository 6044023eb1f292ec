"""Records: typed, one envelope, one atomic writer, Markdown beside decisions, names kept under
the state dir, a broken or foreign file as one line naming it."""

import json
import os

import pytest

from sparkdeploy.core.records import (
    Attempt,
    DeployRun,
    Endpoint,
    HubMetadata,
    ImageDecision,
    PlanMemory,
    RecordError,
    Records,
    ServeDecision,
    markdown_table,
)
from sparkdeploy.core.state import StateDir

T = 1_767_225_600.0  # 2026-01-01T00:00:00Z
CHOSEN = {"image": "a:1", "kind": "sglang", "needs_layer": False, "serve_image": "a:1"}


def records(tmp_path) -> Records:
    return Records(StateDir(tmp_path / "state"), "qwen-lab", clock=lambda: T)


def decision() -> ImageDecision:
    return ImageDecision(node="spark1", arch="arm64", config_from="hub",
                         chosen={"engine": "sglang", **CHOSEN}, engines={"sglang": CHOSEN},
                         candidates=[{"image": "a:1", "engine": "sglang", "verdict": "viable",
                                      "why": "all there", "platform": "linux/arm64"}],
                         summary="chosen a:1 for sglang")


def test_envelope_and_markdown(tmp_path):
    rec = records(tmp_path)
    w = rec.write(decision(), markdown="**chosen a:1**", title="Image decision")
    assert w.json == tmp_path / "state/decisions/qwen-lab/image-probe.json"
    env = json.loads(w.json.read_text())
    assert {k: env[k] for k in ("name", "step", "profile", "time", "time_iso")} == {
        "name": "image-probe", "step": "image.probe", "profile": "qwen-lab", "time": T,
        "time_iso": "2026-01-01T00:00:00Z"}
    assert env["data"]["chosen"] == {"engine": "sglang", **CHOSEN, "digest": None}  # not probed
    assert env["data"]["candidates"][0]["platform"] == "linux/arm64"  # the probe's extras kept
    got = rec.read(ImageDecision)
    assert got.model_dump() == decision().model_dump() and got.made.time_iso == "2026-01-01T00:00:00Z"
    assert w.markdown.read_text() == ("# Image decision\n\n- profile: `qwen-lab`\n"
                                      "- step: `image.probe`\n- time: 2026-01-01T00:00:00Z\n\n"
                                      "**chosen a:1**\n")


def test_each_kind_has_its_home(tmp_path):
    rec = records(tmp_path)
    state = tmp_path / "state"
    homes = [
        (rec.write(Endpoint(url="http://h:1", engine="sglang", model="m")), "decisions/qwen-lab/endpoint.json"),
        (rec.write(ServeDecision(chosen="sglang", run_dir="/r")), "decisions/qwen-lab/serve.json"),
        (rec.write(PlanMemory(steps={}), "deploy-qwen-lab"), "runs/deploy-qwen-lab.json"),
        (rec.write(HubMetadata(repo="o/m", revision="main", commit="c" * 40, files=[], fetched_at=T),
                   "o--m@main"), "model/o--m@main.json"),
    ]
    assert [w.json for w, _ in homes] == [state / p for _, p in homes]
    assert all(w.markdown is None for w, _ in homes)
    assert rec.read(PlanMemory, "deploy-qwen-lab").steps == {}
    assert rec.read(Endpoint).url == "http://h:1"
    assert rec.read(ServeDecision).tried == []


def test_a_missing_record_is_none_and_remove_takes_both_files(tmp_path):
    rec = records(tmp_path)
    assert rec.read(ImageDecision) is None
    rec.write(decision(), markdown="x")
    rec.remove(ImageDecision)
    assert rec.read(ImageDecision) is None and not list((tmp_path / "state/decisions/qwen-lab").iterdir())


def test_a_failed_write_keeps_the_old_record_and_leaves_no_temp_file(tmp_path, monkeypatch):
    rec = records(tmp_path)
    rec.write(Endpoint(url="http://h:1", engine="e", model="m"))

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        rec.write(Endpoint(url="http://h:2", engine="e", model="m"))
    monkeypatch.undo()
    assert rec.read(Endpoint).url == "http://h:1"
    assert sorted(p.name for p in (tmp_path / "state/decisions/qwen-lab").iterdir()) == ["endpoint.json"]


def test_secrets_never_reach_a_record(tmp_path):
    rec = records(tmp_path)
    w = rec.write(ServeDecision(chosen="x", run_dir="/r", tried=[Attempt(engine="e", outcome="exited",
                                                                   why="HF_TOKEN=hf_abcdefghijklmnopqrstu")]),
                  markdown="token hf_abcdefghijklmnopqrstu")
    assert "hf_abcdefghijklmnop" not in w.json.read_text()
    assert "hf_abcdefghijklmnop" not in w.markdown.read_text()


@pytest.mark.parametrize("name", ["", "../x", "a/b", ".hidden", "..", "a\nb", "a\0b"])
def test_names_that_would_leave_the_folder_are_refused(tmp_path, name):
    with pytest.raises(RecordError, match="bad record name"):
        records(tmp_path).write(PlanMemory(steps={}), name or None)
    assert not (tmp_path / "state").exists()


def test_a_link_out_of_the_state_dir_is_refused(tmp_path):
    rec = records(tmp_path)
    (tmp_path / "state").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "state/runs").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RecordError, match="leads out of"):
        rec.write(PlanMemory(steps={}), "deploy-qwen-lab")
    assert not list((tmp_path / "elsewhere").iterdir())


@pytest.mark.parametrize(("text", "why"), [
    ("{half", "unreadable endpoint record (JSONDecodeError"),
    ("\xff", "unreadable endpoint record"),
    ('{"runs": []}', "bad endpoint record (no envelope)"),
    ('{"name": "endpoint", "step": "serve.up", "profile": "p", "time": 1, "time_iso": "x", '
     '"data": {"url": "http://h:1"}}', "bad endpoint record (engine: Field required)"),
])
def test_a_broken_or_foreign_file_is_one_line_naming_it(tmp_path, text, why):
    rec = records(tmp_path)
    path = tmp_path / "state/decisions/qwen-lab/endpoint.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(RecordError) as e:
        rec.read(Endpoint)
    line = str(e.value)
    assert line.startswith(f"{path}: {why}") and "\n" not in line
    assert line.endswith("move it away to start afresh")


def test_records_written_before_the_envelope_still_read(tmp_path):
    rec = records(tmp_path)
    state = tmp_path / "state"
    (state / "runs").mkdir(parents=True)
    (state / "runs/deploy-qwen-lab.json").write_text(json.dumps({"steps": {"image.probe": {
        "state": "done", "why": "chosen", "elapsed": 1.0, "fingerprint": {"x": 1}, "time": T}}}))
    assert rec.read(PlanMemory, "deploy-qwen-lab").steps["image.probe"].fingerprint == {"x": 1}
    (state / "runs/deploy-qwen-lab.json").write_text(json.dumps({"steps": {"x": "done"}}))
    with pytest.raises(RecordError, match="bad plan state record"):
        rec.read(PlanMemory, "deploy-qwen-lab")


def test_a_deploy_run_needs_every_part(tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        DeployRun.model_validate({"plan": [], "serial": False})


def test_markdown_table_escapes_and_fills():
    assert markdown_table(["a", "b"], [["x|y", None], ["two\nlines", 3]]) == (
        "| a | b |\n|---|---|\n| x\\|y | - |\n| two lines | 3 |")


def test_two_profiles_in_one_state_dir_keep_their_own_decisions(tmp_path):
    state = StateDir(tmp_path / "state")
    Records(state, "seed").write(Endpoint(url="http://a:1", engine="sglang", model="m"))
    assert Records(state, "lab").read(Endpoint) is None
    assert Records(state, "seed").read(Endpoint).url == "http://a:1"
