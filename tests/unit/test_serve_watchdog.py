"""The watchdog's decisions (helpers/serve_watchdog.py) and the head supervisor's handling of a
wedge (helpers/serve_unit.py), on a fake clock with exact argv; the canary against the
engine stand-in."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from sparkdeploy.helpers import serve_unit
from sparkdeploy.helpers import serve_watchdog as wd
from sparkdeploy.lab.standins import engine_server as es

DOCKER = ["docker", "-H", "unix:///run/docker.sock"]
POLICY = wd.Policy(watch_s=30, canary_s=20, max_restarts=3, window_s=3600, backoff_s=30,
                   backoff_max_s=100)


# --- one rank ---------------------------------------------------------------------------------


@pytest.mark.parametrize("status, code, pid, procs, want", [
    ("running", 0, 10, {10: "S", 11: "R", 12: "D"}, None),
    ("running", 0, 10, {10: "S", 11: "I"}, None),
    ("paused", 0, 10, {10: "S"}, "paused (every process frozen)"),
    ("exited", 137, 0, {}, "exited (exit code 137)"),
    ("", -1, 0, {}, "gone (exit code -1)"),
    ("running", 0, 10, {}, "its engine process is gone"),
    ("running", 0, 0, {10: "S"}, "its engine process is gone"),
    ("running", 0, 10, {10: "Z"}, "its engine process is a zombie (pid 10)"),
    ("running", 0, 10, {10: "S", 11: "T"}, "stopped (state T: pid 11)"),
    ("running", 0, 10, {10: "t"}, "stopped (state T: pid 10)"),
    ("running", 0, 10, {10: "T", 11: "T", 12: "T", 13: "T", 9: "S"},
     "stopped (state T: pid 10, 11, 12 +1)"),
])
def test_rank_problem(status, code, pid, procs, want):
    assert wd.rank_problem(status, code, pid, procs) == want


def _proc(root: Path, pid: int, comm: str, state: str, ppid: int) -> None:
    (root / str(pid)).mkdir()
    (root / str(pid) / "stat").write_text(f"{pid} ({comm}) {state} {ppid} 1 1 0 -1 4194560\n")


def test_process_tree_follows_descendants_only_and_reads_odd_names(tmp_path):
    _proc(tmp_path, 100, "python3", "S", 1)
    _proc(tmp_path, 101, "sglang::sched (TP0)", "T", 100)  # a name with spaces and parentheses
    _proc(tmp_path, 102, "child", "S", 101)
    _proc(tmp_path, 200, "other", "T", 1)  # not the container's
    (tmp_path / "self").mkdir()
    assert wd.process_tree(100, str(tmp_path)) == {100: "S", 101: "T", 102: "S"}
    assert wd.process_tree(999, str(tmp_path)) == {}


def test_inspect_ranks_exact_argv_and_a_missing_container_is_gone(tmp_path):
    _proc(tmp_path, 50, "python3", "S", 1)
    _proc(tmp_path, 51, "python3", "T", 50)
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, "/head|running|0|50\n", "")

    got = wd.inspect_ranks(DOCKER, ["head", "worker"], str(tmp_path), run=run)
    assert calls == [[*DOCKER, "inspect", "--format",
                      "{{.Name}}|{{.State.Status}}|{{.State.ExitCode}}|{{.State.Pid}}",
                      "head", "worker"]]
    assert got == {"head": "stopped (state T: pid 51)", "worker": "gone (exit code -1)"}


# --- the decisions ------------------------------------------------------------------------------


def test_serving_is_no_wedge():
    assert wd.wedge(None, {"spark1: head": None, "spark2: worker": None}) is None


def test_a_canary_without_a_token_is_a_wedge():
    w = wd.wedge("no token within 20s", {"spark1: head": None})
    assert w == wd.Wedge("canary", "canary: no token within 20s", ["canary: no token within 20s"])


def test_a_wrong_rank_is_the_wedge_named_first_even_with_the_canary_failing():
    w = wd.wedge("no token within 20s", {"spark2: worker": "stopped (state T: pid 7)",
                                         "spark1: head": None})
    assert w == wd.Wedge("rank", "spark2: worker stopped (state T: pid 7)",
                         ["spark2: worker stopped (state T: pid 7)", "canary: no token within 20s"])


def _rec(t: float, outcome: str = "restarted") -> dict:
    return {"t": t, "outcome": outcome}


def test_the_first_restart_waits_nothing():
    assert wd.next_restart([], 1000.0, POLICY) == (True, 0.0, 1)


def test_backoff_doubles_counted_from_the_restart_before_and_is_capped():
    now = 10_000.0
    assert wd.next_restart([_rec(now - 10)], now, POLICY) == (True, 20.0, 2)
    assert wd.next_restart([_rec(now - 40)], now, POLICY) == (True, 0.0, 2)
    p = wd.Policy(max_restarts=10, window_s=3600, backoff_s=30, backoff_max_s=100)
    assert wd.next_restart([_rec(now - 50), _rec(now - 5)], now, p) == (True, 55.0, 3)
    assert wd.next_restart([_rec(now - 9)] * 3, now, p) == (True, 91.0, 4)  # 120 capped at 100


def test_the_budget_counts_restarts_within_the_window_only():
    now = 10_000.0
    three = [_rec(now - 300), _rec(now - 200), _rec(now - 100)]
    assert wd.next_restart(three, now, POLICY) == (False, 0.0, 4)
    old = [_rec(now - 3600), *three[1:]]  # the first is out of the window now
    assert wd.next_restart(old, now, POLICY)[:2] == (True, 0.0)
    gave_up = [*three[1:], _rec(now - 50, "gave-up")]  # a give-up is no restart
    assert wd.next_restart(gave_up, now, POLICY)[0] is True
    assert wd.next_restart([_rec(now - 1)], now, wd.Policy(max_restarts=0))[0] is False


def test_served_again_is_set_once_on_the_latest_restart():
    recs = [_rec(100.0)]
    assert wd.served_again(recs, 141.26) is True
    assert recs[-1]["served_again_after_s"] == 41.3
    assert wd.served_again(recs, 500.0) is False and recs[-1]["served_again_after_s"] == 41.3
    assert wd.served_again([_rec(1.0, "gave-up")], 5.0) is False
    assert wd.served_again([], 5.0) is False


def test_records_round_trip_keep_the_last_ones_and_ignore_what_is_not_one(tmp_path):
    path = str(tmp_path / "n" / "sglang.restarts.json")
    wd.write_records(path, [{"id": str(i)} for i in range(wd.KEEP + 5)])
    got = wd.read_records(path)
    assert [r["id"] for r in got] == [str(i) for i in range(5, wd.KEEP + 5)]
    assert oct(Path(path).stat().st_mode & 0o777) == "0o644"
    assert wd.parse_records("not json") == [] and wd.parse_records('{"restarts": 3}') == []
    assert wd.parse_records('[1]') == [] and wd.parse_records('{"restarts": [1, {"a": 1}]}') == [{"a": 1}]
    assert wd.read_records(str(tmp_path / "none")) == []


def test_save_logs_bounded_exact_argv_and_only_the_last_restarts_kept(tmp_path):
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, b"x" * (wd.LOG_BYTES + 10), b"err\n")

    for i in range(wd.KEEP_LOGS + 2):
        d, files = wd.save_logs(DOCKER, ["head"], f"2026120{i}T000000Z-ab", str(tmp_path), run=run)
    assert calls[-1] == [*DOCKER, "logs", "--timestamps", "--tail", str(wd.LOG_LINES), "head"]
    assert files == [f"{d}/head.log"] and d == f"{tmp_path}/logs/2026120{wd.KEEP_LOGS + 1}T000000Z-ab"
    data = Path(files[0]).read_bytes()
    assert len(data) == wd.LOG_BYTES and data.endswith(b"err\n")
    kept = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert kept == [f"2026120{i}T000000Z-ab" for i in range(2, wd.KEEP_LOGS + 2)]


def test_the_helper_refuses_an_id_that_is_a_path(capsys):
    assert wd.main(["save-logs", "--docker=docker", "--name", "x", "--id", "../etc"]) == 2


# --- the canary against the stand-in --------------------------------------------------------------


@pytest.fixture
def standin():
    srv = es.start_in_thread(es.Config(port=0, ttft_ms=1, gap_ms=1, model="m", api_key="k3y"))
    yield srv
    srv.shutdown()


def test_the_canary_brings_a_token_with_the_key(standin):
    assert wd.canary("127.0.0.1", standin.port, "m", 5, key="k3y") is None
    assert wd.canary("127.0.0.1", standin.port, "m", 5) == "HTTP 401"


def test_a_stream_that_brings_no_token_in_time_is_said_so(standin):
    standin.state.control({"faults": "stall:every=1:after=0:seconds=3"})
    assert wd.canary("127.0.0.1", standin.port, "m", 0.3, key="k3y") == "no token within 0.3s"


@pytest.mark.parametrize("line,alive", [
    # the role chunk, then vLLM holding back the bytes of one character: not yet
    (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}', False),
    (b'data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":null}]}', False),
    # text, reasoning, or the answer's end (at its length, or the model's own end first)
    (b'data: {"choices":[{"index":0,"delta":{"content":"\xef\xbf\xbd]"},"finish_reason":null}]}', True),
    (b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"hm"},"finish_reason":null}]}', True),
    (b'data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":"length"}]}', True),
    (b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}', True),
    (b"data: [DONE]", False), (b"data: {not json", False), (b": keep-alive", False),
])
def test_what_shows_the_engine_generated(line, alive):
    assert wd._has_token(line) is alive


def test_a_closed_port_is_said_so():
    assert wd.canary("127.0.0.1", 9, "m", 1).startswith("ConnectionRefusedError")


# --- the head supervisor's handling of a wedge ------------------------------------------------------


class Clock:
    def __init__(self, t: float = 1_764_800_000.0):
        self.t = t
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def _group(tmp_path: Path, clock: Clock, calls: list) -> serve_unit.Group:
    spec = {"node": "spark1", "role": "head", "docker": DOCKER, "engine": "sglang",
            "unit": "sparkdeploy-sglang.service", "node_dir": str(tmp_path),
            "nodes": ["spark1", "spark2"], "watch": POLICY.as_dict(),
            "stages": [{"wait": None, "containers": [{"node": "spark1", "name": "head", "run": []},
                                                     {"node": "spark2", "name": "worker", "run": []}]}]}

    def run(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, b"log line\n", b"")

    g = serve_unit.Group(spec, b"k" * 32, clock=clock, sleep=clock.sleep, run=run)
    g.state["epoch"] = "abcdef123456"
    return g


def test_a_wedge_is_recorded_the_workers_told_the_logs_saved_then_restart(tmp_path):
    clock, calls = Clock(), []
    g = _group(tmp_path, clock, calls)
    w = wd.Wedge("rank", "spark2: worker stopped (state T: pid 7)", ["spark2: worker stopped (state T: pid 7)"])
    with pytest.raises(serve_unit.Restart) as e:
        serve_unit.wedged(g, w)
    assert e.value.wait_s == 0.0 and str(e.value) == w.why
    rid = "20251203T221320Z-abcd"
    assert g.state["restarting"] == {"id": rid, "why": w.why, "gave_up": False}
    assert calls == [[*DOCKER, "logs", "--timestamps", "--tail", "2000", "head"]]  # its own only
    assert clock.slept == [3 * serve_unit.POLL]
    [rec] = wd.read_records(str(tmp_path / "sglang.restarts.json"))
    assert rec == {"id": rid, "at": "2025-12-03T22:13:20Z", "t": clock.t - 3, "by": "sparkdeploy-sglang.service",
                   "engine": "sglang", "kind": "rank", "why": w.why, "evidence": w.evidence,
                   "class": None, "logs": {"spark1": f"{tmp_path}/logs/{rid}",
                                           "spark2": f"{tmp_path}/logs/{rid}"},
                   "restart": 1, "backoff_s": 0.0, "outcome": "restarted",
                   "served_again_after_s": None}
    assert (tmp_path / "logs" / rid / "head.log").read_bytes() == b"log line\n"


def test_the_next_wedge_soon_after_waits_the_backoff_and_a_spent_budget_gives_up(tmp_path):
    clock, calls = Clock(), []
    g = _group(tmp_path, clock, calls)
    w = wd.Wedge("canary", "canary: no token within 20s", [])
    outcomes = []
    for _ in range(4):
        try:
            serve_unit.wedged(g, w)
        except serve_unit.Restart as e:
            outcomes.append(("restart", e.wait_s))
        except serve_unit.GaveUp:
            outcomes.append(("gave-up", 0))
        clock.t += 7
    # 3 s of telling the workers + 7 s later: 10 s since the one before
    assert outcomes == [("restart", 0.0), ("restart", 20.0), ("restart", 50.0), ("gave-up", 0)]
    recs = wd.read_records(str(tmp_path / "sglang.restarts.json"))
    assert [(r["restart"], r["outcome"], r["backoff_s"]) for r in recs] == [
        (1, "restarted", 0.0), (2, "restarted", 20.0), (3, "restarted", 50.0), (4, "gave-up", 0.0)]
    assert g.state["restarting"]["gave_up"] is True


def test_a_worker_told_of_a_restart_saves_its_logs_and_restarts(tmp_path, monkeypatch):
    clock, calls = Clock(), []
    g = _group(tmp_path, clock, calls)
    g.spec.update(node="spark2", role="worker", head=["10.0.0.1", 1])
    head = {"epoch": "h1", "stage": 0, "accepting": True, "restarting": None}
    states = iter([head, {**head, "restarting": {"id": "r1", "why": "canary: x", "gave_up": False}}])
    monkeypatch.setattr(serve_unit, "peer", lambda g, addr: next(states))
    monkeypatch.setattr(serve_unit.time, "sleep", lambda s: None)
    monkeypatch.setattr(serve_unit.Group, "start_stage", lambda self, k: None)
    monkeypatch.setattr(serve_unit.Group, "check_mine", lambda self, upto: {})
    with pytest.raises(serve_unit.Restart, match="the head restarts the group: canary: x"):
        serve_unit.run_worker(g)
    assert calls == [[*DOCKER, "logs", "--timestamps", "--tail", "2000", "worker"]]
    assert json.loads(json.dumps(g.state))["following"] == "h1"


def _head(tmp_path, monkeypatch, canaries: list, worker_ranks: list):
    """A head whose group is up: the worker follows it; the canary and the worker's published
    ranks answer from the lists, one per look."""
    clock, calls = Clock(), []
    g = _group(tmp_path, clock, calls)
    g.mono = clock
    g.spec.update(workers={"spark2": ["10.0.0.2", 1]}, ready_timeout_s=100,
                  canary={"port": 30000, "model": "m"})
    ranks = iter(worker_ranks)
    monkeypatch.setattr(serve_unit, "peer", lambda g_, addr: {
        "stage": 0, "following": g.state["epoch"], "ranks": next(ranks, {})})
    monkeypatch.setattr(serve_unit.Group, "start_stage", lambda self, k: None)
    monkeypatch.setattr(serve_unit.Group, "check_mine", lambda self, upto: {})
    seen = []

    def canary(host, port, model, deadline_s):
        seen.append((host, port, model, deadline_s, clock.t))
        return canaries.pop(0) if canaries else None

    monkeypatch.setattr(serve_unit.wd, "canary", canary)
    return g, clock, seen


def test_the_head_waits_for_serving_then_a_canary_without_a_token_restarts_the_group(
        tmp_path, monkeypatch):
    # still coming up (refused twice), serving, serving, then no token: a wedge
    g, clock, seen = _head(tmp_path, monkeypatch,
                           ["ConnectionRefusedError: refused", "ConnectionRefusedError: refused",
                            None, None, "no token within 20s"], [])
    wd.write_records(str(tmp_path / "sglang.restarts.json"),
                     [{"t": clock.t - 50, "outcome": "restarted", "id": "before"}])
    with pytest.raises(serve_unit.Restart, match="canary: no token within 20s") as e:
        serve_unit._head_group(g)
    assert isinstance(e.value, serve_unit.Recorded)
    assert [s[:4] for s in seen] == [("127.0.0.1", 30000, "m", 20)] * 5
    gaps = [b[4] - a[4] for a, b in zip(seen, seen[1:], strict=False)]
    assert gaps == [serve_unit.POLL, serve_unit.POLL, 30, 30]  # watch_s once serving
    before, rec = wd.read_records(str(tmp_path / "sglang.restarts.json"))
    assert before["served_again_after_s"] == 52.0  # when the canary first brought a token
    assert (rec["kind"], rec["why"], rec["restart"]) == ("canary", "canary: no token within 20s", 2)


def test_a_rank_a_worker_publishes_as_wrong_restarts_the_group_at_once(tmp_path, monkeypatch):
    g, clock, seen = _head(tmp_path, monkeypatch, [],
                           [{}, {}, {"spark2: worker": "stopped (state T: pid 9)"}])
    with pytest.raises(serve_unit.Recorded, match=r"spark2: worker stopped \(state T: pid 9\)"):
        serve_unit._head_group(g)
    [rec] = wd.read_records(str(tmp_path / "sglang.restarts.json"))
    assert rec["kind"] == "rank" and rec["evidence"] == ["spark2: worker stopped (state T: pid 9)"]


def test_a_head_that_never_serves_within_the_ready_timeout_restarts(tmp_path, monkeypatch):
    g, clock, seen = _head(tmp_path, monkeypatch, ["HTTP 503"] * 1000, [])
    with pytest.raises(serve_unit.Restart, match=r"did not serve within 100s \(HTTP 503\)") as e:
        serve_unit._head_group(g)
    assert not isinstance(e.value, serve_unit.Recorded)  # run_head records it as a group wedge
