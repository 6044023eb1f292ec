"""The one task driver (``tasks/_common.drive``): every task loads, locks, renders, runs and
maps errors to exit codes there, and nowhere else."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from invoke import Config, Context
from invoke.exceptions import Exit

from sparkdeploy.core.errors import StepFailed, UsageError
from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.core.records import RecordError
from sparkdeploy.core.state import LockHeld
from sparkdeploy.node.hosts import HostError
from sparkdeploy.profile.config import ProfileError
from sparkdeploy.run.runner import PlanError
from sparkdeploy.tasks._common import drive
from tests.unit.profiles import SEED

TASKS = Path(__file__).resolve().parents[2] / "src" / "sparkdeploy" / "tasks"


def context(tmp_path: Path, profile: Path | str = SEED) -> Context:
    return Context(Config(overrides={"sparkdeploy": {"profile": str(profile),
                                                     "state_dir": str(tmp_path / "state")}}))


def test_only_the_driver_turns_an_error_into_an_exit():
    """No task module but ``_common`` catches an error to raise ``Exit`` (``_flags`` turns bad
    flag values into usage errors, which is no run's error)."""
    found = []
    for path in sorted(TASKS.glob("*.py")):
        if path.name in ("_common.py", "_flags.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ExceptHandler):
                raises = [n for n in ast.walk(node) if isinstance(n, ast.Raise)]
                if any("Exit" in ast.unparse(r) for r in raises):
                    found.append(f"{path.name}:{node.lineno}")
    # lab.up's --dockerd check is a flag's usage error, the lab's own parse
    assert [f.split(":")[0] for f in found] == ["lab.py"]


@pytest.mark.parametrize("error,code", [
    (ProfileError("p.yaml: nodes: empty"), 2), (PlanError("--only: no step 'x'"), 2),
    (HostError("spark1: no route"), 1), (LockHeld("held by pid 7"), 1),
    (RecordError("runs/x.json: not JSON"), 1),
    # any kind of the one tree: its own line and code (a step's failure outside a step too)
    (UsageError("--config: not JSON"), 2), (StepFailed("no engine recorded"), 1),
])
def test_an_error_in_the_work_is_one_line_and_its_exit_status(tmp_path, error, code):
    def work(dep, events):
        raise error

    with pytest.raises(Exit) as e:
        drive(context(tmp_path), "t.x", work, lock=False)
    assert (e.value.code, e.value.message) == (code, str(error))


def test_a_failed_result_exits_1_naming_how_many(tmp_path, capsys):
    def work(dep, events):
        bad = Result("t.x", Status.FAILED, "broke", "spark1")
        events.emit(bad)
        return [bad, Result("t.x", Status.OK, "fine", "spark2")]

    with pytest.raises(Exit) as e:
        drive(context(tmp_path), "t.x", work, lock=False)
    assert (e.value.code, e.value.message) == (1, "1 step(s) failed")


def test_a_missing_profile_is_exit_2_unless_the_work_does_without(tmp_path):
    c = context(tmp_path, tmp_path / "nope.yaml")
    seen = []

    def work(dep, events):
        seen.append(dep)
        return []

    with pytest.raises(Exit) as e:
        drive(c, "t.x", work)
    assert e.value.code == 2 and "nope.yaml" in e.value.message and seen == []
    drive(c, "t.x", work, deployment="optional")
    drive(c, "t.x", work, deployment="none")
    assert seen == [None, None]


def test_the_lock_is_held_while_the_work_runs(tmp_path):
    c = context(tmp_path)

    def work(dep, events):
        with pytest.raises(LockHeld):
            with dep.state.lock("other"):
                pass
        return []

    drive(c, "t.x", work)


def results_of_a_run() -> list[Result]:
    return [Result("services.stop", Status.CHANGED, "stopped glm", "spark1"),
            Result("services.stop", Status.OK, "nothing to stop", "spark2"),
            Result("serve.up", Status.FAILED, "sglang hang", "spark1-long-name"),
            Result("serve.up", Status.CHANGED, "vllm-ray serves", None),
            Result("serve.up", Status.SKIPPED, "dry run", "spark2"),
            Result("link.check", Status.OK, "mtu 9000", "spark1")]


def test_the_recap_counts_each_nodes_results_and_those_without_a_node_last():
    from sparkdeploy.tasks._common import recap_lines

    results = results_of_a_run()
    results[2].superseded = True  # fallen back from: not counted, as for the exit status
    assert recap_lines(results) == [
        "recap:",
        "  spark1           ok=1   changed=1   skipped=0   failed=0",
        "  spark2           ok=1   changed=0   skipped=1   failed=0",
        "  spark1-long-name ok=0   changed=0   skipped=0   failed=0",
        "  -                ok=0   changed=1   skipped=0   failed=0",
    ]
    assert recap_lines([]) == []
    assert recap_lines([Result("lab.up", Status.OK, "done", None)]) == [
        "recap:", "  -        ok=1   changed=0   skipped=0   failed=0"]


@pytest.mark.parametrize("terminal", [False, True])
def test_every_run_ends_with_the_recap_after_the_results(tmp_path, capsys, monkeypatch, terminal):
    import sys

    monkeypatch.setattr(sys.stdout, "isatty", lambda: terminal)

    def work(dep, events):
        results = results_of_a_run()
        for r in results:
            events.emit(r)
        return results

    with pytest.raises(Exit) as e:
        drive(context(tmp_path), "t.x", work, lock=False)
    assert e.value.message == "1 step(s) failed"
    # on a terminal the live view moves the cursor as it closes: what shows is the text
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", capsys.readouterr().out).splitlines()
    assert out[-5:] == [
        "recap:",
        "  spark1           ok=1   changed=1   skipped=0   failed=0",
        "  spark2           ok=1   changed=0   skipped=1   failed=0",
        "  spark1-long-name ok=0   changed=0   skipped=0   failed=1",
        "  -                ok=0   changed=1   skipped=0   failed=0",
    ]
    # the results came first, each once
    assert sum("sglang hang" in line for line in out[:-5]) == 1


# --- doors the audit found open -----------------------------------------------------------

@pytest.mark.parametrize("task,argv", [
    ("services", ("stop",)), ("services", ("status",)), ("serve", ("down",)),
    ("model", ("fit",)), ("deploy", ("all_",)), ("deploy", ("rollback",)), ("link", ("check",)),
    ("profile", ("check",)),
])
def test_a_state_dir_that_is_a_file_is_one_usage_line_for_every_task(tmp_path, task, argv):
    import importlib

    (tmp_path / "state").write_text("not a directory\n")
    fn = getattr(importlib.import_module(f"sparkdeploy.tasks.{task}"), argv[0])
    with pytest.raises(Exit) as e:
        fn(context(tmp_path))
    assert (e.value.code, e.value.message) == (
        2, f"sparkdeploy.state_dir: {tmp_path / 'state'}: is a regular file, not a directory")


def test_a_state_dir_below_a_file_is_one_usage_line(tmp_path):
    from sparkdeploy.tasks import services

    (tmp_path / "f").write_text("")
    c = Context(Config(overrides={"sparkdeploy": {"profile": str(SEED),
                                                  "state_dir": str(tmp_path / "f" / "state")}}))
    with pytest.raises(Exit) as e:
        services.stop(c)
    assert (e.value.code, e.value.message) == (
        2, f"sparkdeploy.state_dir: {tmp_path / 'f'} (above {tmp_path / 'f' / 'state'}): is a "
           "regular file, not a directory")


def test_a_secret_in_an_engines_env_is_used_but_never_shown_by_profile_check(tmp_path, capsys):
    import yaml

    from tests.unit.profiles import seed_data, write_profile

    token = "hf_abcdefghijklmnopqrstuvwxyz012345"
    data = seed_data()
    data["sparkdeploy"]["engines"][0].setdefault("env", {}).update(
        {"HF_TOKEN": token, "S3_ACCESS_KEY": "plainvalue", "NCCL_DEBUG": "INFO"})
    data["sparkdeploy"]["engines"][1].setdefault("env", {})["NOT_NAMED_SECRET"] = token
    base = write_profile(tmp_path, data, "base.yaml")
    child = write_profile(tmp_path, {"extends": "base.yaml", "sparkdeploy": {
        "engines": [{**data["sparkdeploy"]["engines"][0],
                     "env": {**data["sparkdeploy"]["engines"][0]["env"],
                             "HF_TOKEN": token + "x"}}]}}, "child.yaml")
    from sparkdeploy.node.deployment import load

    assert load(base, tmp_path / "s").profile.engines[0].env["HF_TOKEN"] == token  # accepted
    from sparkdeploy.tasks import profile

    for p in (base, child):
        profile.check(context(tmp_path, p))
        out = capsys.readouterr().out
        assert token not in out and "plainvalue" not in out
        shown = yaml.safe_load(out)["sparkdeploy"]["engines"]
        assert shown[0]["env"]["HF_TOKEN"] == "***" and shown[0]["env"]["S3_ACCESS_KEY"] == "***"
        assert shown[0]["env"]["NCCL_DEBUG"] == "INFO"
    assert "#   sparkdeploy.engines = " in out  # the child's override line, redacted too


# --- one flag selects nodes -------------------------------------------------------------------

@pytest.mark.parametrize("old,new", [
    ({"node": "spark2"}, {"nodes": "spark2"}),
])
@pytest.mark.parametrize("task", ["stop", "restore", "status"])
def test_the_old_node_flag_still_selects_and_says_it_is_deprecated(tmp_path, capsys, monkeypatch,
                                                                   old, new, task):
    from sparkdeploy.tasks import _common
    from sparkdeploy.tasks import services as tasks

    ran = []
    monkeypatch.setattr(_common, "run_one", lambda dep, name, **o: ran.append((name, o)) or [])
    getattr(tasks, task)(context(tmp_path), **old)
    err = capsys.readouterr().err
    assert err == "--node is deprecated and goes in the next release: use --nodes spark2\n"
    getattr(tasks, task)(context(tmp_path), **new)
    assert capsys.readouterr().err == ""
    assert ran == [(f"services.{task}", {"node": "spark2"})] * 2


def test_to_names_the_destination_and_nodes_is_the_same_without_a_warning(tmp_path, capsys,
                                                                          monkeypatch):
    from sparkdeploy.tasks import _common, image, model

    ran = []
    monkeypatch.setattr(_common, "run_one", lambda dep, name, **o: ran.append((name, o)) or [])
    image.ship(context(tmp_path), to="spark2")
    image.ship(context(tmp_path), nodes="spark2")
    image.ship(context(tmp_path))
    model.sync(context(tmp_path), nodes="spark2")
    model.sync(context(tmp_path))
    assert capsys.readouterr().err == ""
    assert ran == [("image.ship", {"to": "spark2", "image": None})] * 2 + [
        ("image.ship", {"to": "all", "image": None}), ("model.sync", {"to": "spark2"}),
        ("model.sync", {"to": "all"})]


def test_hosts_trusts_old_node_flag_says_the_new_one_takes_a_profile(tmp_path, capsys,
                                                                     monkeypatch):
    from sparkdeploy.tasks import _common, hosts

    ran = []
    monkeypatch.setattr(_common, "run_one", lambda dep, name, **o: ran.append((name, o["node"])) or [])
    hosts.trust(context(tmp_path), node="spark1", yes=True)
    hosts.trust(context(tmp_path), nodes="spark1", profile=str(SEED), yes=True)
    assert capsys.readouterr().err == ("--node is deprecated and goes in the next release: use "
                                       "--nodes spark1 --profile FILE\n")
    assert ran == [("hosts.trust", "spark1")] * 2
