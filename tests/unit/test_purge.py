"""``deploy.rollback --purge`` removes a model dir only when sparkdeploy made it (the node
helper's marker), never a path it was merely given (``/home/ubuntu``, ``/var/lib/docker``)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sparkdeploy.core.packaged import helper
from sparkdeploy.steps.deploy import CREATED, remove_model_dir
from tests.unit.fakes import FakeNode, scripted

HELPER = helper("model_node.py")


@dataclass
class DiskNode(FakeNode):
    files: set[str] = field(default_factory=set)
    removed: list[str] = field(default_factory=list)

    def answer(self, argv, stdin=None):
        if argv[:2] == ["sudo", "-n"]:
            argv = argv[3:] if argv[2] == "--" else argv[2:]
        if argv[:2] == ["test", "-f"]:
            return (0 if argv[2] in self.files else 1), "", ""
        if argv[:3] == ["rm", "-rf", "--"]:
            self.removed.append(argv[3])
            return 0, "", ""
        return super().answer(argv, stdin)


@pytest.mark.parametrize("path", ["/home/ubuntu", "/var/lib/docker", "/srv/models/given"])
def test_a_dir_sparkdeploy_did_not_make_is_left_in_place(tmp_path, path):
    node = DiskNode()
    dep, ctx, _ = scripted(tmp_path, {"spark1": node})
    status, why = remove_model_dir(dep.host("spark1"), path)
    assert status == "skipped" and why.startswith(f"{path} was not made by sparkdeploy")
    assert node.removed == []
    assert [a for _, a in ctx.calls] == [["test", "-f", f"{path}/{CREATED}"]]


def test_a_dir_sparkdeploy_made_is_removed(tmp_path):
    node = DiskNode(files={f"/srv/models/m/{CREATED}"})
    dep, _, _ = scripted(tmp_path, {"spark1": node})
    assert remove_model_dir(dep.host("spark1"), "/srv/models/m") == ("changed", "removed /srv/models/m")
    assert node.removed == ["/srv/models/m"]


def test_dry_run_removes_nothing(tmp_path):
    node = DiskNode(files={f"/srv/models/m/{CREATED}"})
    dep, _, _ = scripted(tmp_path, {"spark1": node}, dry=True)
    assert remove_model_dir(dep.host("spark1"), "/srv/models/m")[0] == "skipped"
    assert node.removed == []


def _mkroot(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HELPER), "mkroot", "--dir", str(path)],
                          capture_output=True, text=True, timeout=30)


def test_the_node_helper_marks_only_a_dir_it_made(tmp_path):
    made = tmp_path / "new" / "model"
    assert _mkroot(made).returncode == 0
    assert (made / CREATED).is_file()
    given = tmp_path / "given"
    given.mkdir()
    assert _mkroot(given).returncode == 0
    assert not (given / CREATED).exists()
    (made / CREATED).unlink()  # a dir that exists is never marked afterwards
    assert _mkroot(made).returncode == 0 and not (made / CREATED).exists()


def test_the_node_helper_says_why_it_cannot_make_the_dir(tmp_path):
    (tmp_path / "file").write_text("x")
    r = _mkroot(tmp_path / "file" / "model")
    assert r.returncode == 3 and r.stderr.startswith(f"error: cannot create {tmp_path}/file/model: ")
    assert "Traceback" not in r.stderr
