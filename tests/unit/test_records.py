"""Decision records: the envelope, Markdown, atomic writes, names, secrets."""

import json
import os

import pytest

from sparkdeploy.records import Records, markdown_table
from sparkdeploy.state import StateDir

T = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def records(tmp_path) -> Records:
    return Records(StateDir(tmp_path / "state"), "qwen-lab", clock=lambda: T)


def test_envelope_and_markdown(tmp_path):
    rec = records(tmp_path)
    w = rec.write("image-probe", "image.probe", {"chosen": {"image": "a:1"}},
                  "**chosen a:1**", title="Image decision")
    assert w.json == tmp_path / "state/decisions/image-probe.json"
    env = json.loads(w.json.read_text())
    assert env == {"name": "image-probe", "step": "image.probe", "profile": "qwen-lab",
                   "time": T, "time_iso": "2026-01-01T00:00:00Z",
                   "data": {"chosen": {"image": "a:1"}}}
    assert rec.read("image-probe") == env
    assert rec.data("image-probe") == {"chosen": {"image": "a:1"}}
    assert w.markdown.read_text() == ("# Image decision\n\n- profile: `qwen-lab`\n"
                                      "- step: `image.probe`\n- time: 2026-01-01T00:00:00Z\n\n"
                                      "**chosen a:1**\n")


def test_no_markdown_unless_given_and_remove(tmp_path):
    rec = records(tmp_path)
    w = rec.write("engine", "serve.plan", {"x": 1})
    assert w.markdown is None and not (rec.dir / "engine.md").exists()
    rec.remove("engine")
    assert rec.read("engine") is None and rec.data("engine") is None


def test_a_failed_write_keeps_the_old_record_and_leaves_no_temp_file(tmp_path, monkeypatch):
    rec = records(tmp_path)
    rec.write("image-probe", "image.probe", {"v": 1})

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        rec.write("image-probe", "image.probe", {"v": 2})
    monkeypatch.undo()
    assert rec.data("image-probe") == {"v": 1}
    assert sorted(p.name for p in rec.dir.iterdir()) == ["image-probe.json"]


def test_secrets_never_reach_a_record(tmp_path):
    rec = records(tmp_path)
    w = rec.write("env", "serve.plan", {"env": ["HF_TOKEN=hf_abcdefghijklmnopqrstu"]},
                  "token hf_abcdefghijklmnopqrstu")
    assert "hf_abcdefghijklmnop" not in w.json.read_text()
    assert "hf_abcdefghijklmnop" not in w.markdown.read_text()


@pytest.mark.parametrize("name", ["", "../x", "a/b", ".hidden"])
def test_bad_names_are_refused(tmp_path, name):
    with pytest.raises(ValueError, match="bad record name"):
        records(tmp_path).write(name, "s", {})


def test_a_corrupt_record_reads_as_none(tmp_path):
    rec = records(tmp_path)
    rec.dir.mkdir(parents=True)
    (rec.dir / "x.json").write_text("{half")
    assert rec.read("x") is None


def test_markdown_table_escapes_and_fills():
    assert markdown_table(["a", "b"], [["x|y", None], ["two\nlines", 3]]) == (
        "| a | b |\n|---|---|\n| x\\|y | - |\n| two lines | 3 |")
