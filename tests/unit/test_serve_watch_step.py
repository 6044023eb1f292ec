"""``serve.watch`` on scripted nodes (fake clock): a serving deployment is left alone; a frozen
rank or a canary without a token restarts every rank together, recorded on the head with the
saved logs and the class; the budget ends it; persisted units are left to their supervisors."""

from __future__ import annotations

import json

from sparkdeploy.core.outcomes import Status
from sparkdeploy.helpers import serve_watchdog as wd
from sparkdeploy.steps import serve
from sparkdeploy.steps import watchdog as serve_watch
from tests.unit.serve_fakes import Script
from tests.unit.test_serve import healthy_sglang, lab  # noqa: F401 - the fixture

RECORD = f"{wd.NODE_DIR}/sglang.restarts.json"
HEAD, WORKER = "sparkdeploy-sglang-head", "sparkdeploy-sglang-worker"


def _up(lab, monkeypatch):  # noqa: F811
    dep, ctx, nodes, cluster, clock = lab
    healthy_sglang(nodes)
    assert serve.up(dep)[-1].status is Status.OK
    monkeypatch.setattr(serve_watch, "WALL", lambda: 1_764_800_000.0 + clock())
    return dep, ctx, nodes, cluster, clock


def _records(nodes) -> list[dict]:
    return wd.parse_records(nodes["spark1"].files.get(RECORD, ""))


def test_a_serving_deployment_is_looked_at_and_left_alone(lab, monkeypatch):  # noqa: F811
    dep, ctx, nodes, cluster, clock = _up(lab, monkeypatch)
    before = {n: dict(nd.containers) for n, nd in nodes.items()}
    t0 = clock()
    [r] = serve_watch.watch(dep, checks=3)
    assert r.status is Status.OK and r.why == "3 check(s) of http://10.0.0.1:30000: serving"
    assert clock() - t0 >= 2 * 30  # serve.watch_s between looks
    assert {n: dict(nd.containers) for n, nd in nodes.items()} == before
    assert _records(nodes) == [] and nodes["spark2"].saved == []
    # the look: each node's ranks by its helper, exact argv
    ranks = [c for c in ctx.commands if " ranks " in c]
    want = ("serve_watchdog.py ranks --docker=docker --docker=-H --docker=unix:///run/spark2.sock "
            f"--name={WORKER}")
    assert len(ranks) == 6 and sum(want in c for c in ranks) == 3, ranks


def test_a_frozen_worker_restarts_every_rank_recorded_on_the_head(lab, monkeypatch):  # noqa: F811
    dep, ctx, nodes, cluster, clock = _up(lab, monkeypatch)
    head0 = nodes["spark1"].containers[HEAD].started
    nodes["spark2"].frozen.add(WORKER)
    results = serve_watch.watch(dep, checks=1)
    assert [r.status for r in results][-2:] == [Status.CHANGED, Status.OK], results
    changed = results[-2]
    assert changed.why.startswith(f"restart 1: spark2: {WORKER} stopped (state T: pid 100); "
                                  "class unknown; every rank restarted, serving again after ")
    # both ranks removed and started again (a half-cluster never serves)
    assert nodes["spark1"].removed == [HEAD] and nodes["spark2"].removed == [WORKER]
    assert nodes["spark1"].containers[HEAD].started > head0
    [rec] = _records(nodes)
    assert rec["by"] == "serve.watch" and rec["kind"] == "rank" and rec["outcome"] == "restarted"
    assert rec["why"] == f"spark2: {WORKER} stopped (state T: pid 100)"
    assert rec["class"] == "unknown" and rec["restart"] == 1 and rec["backoff_s"] == 0.0
    assert rec["logs"] == {n: f"{wd.NODE_DIR}/logs/{rec['id']}" for n in ("spark1", "spark2")}
    assert nodes["spark1"].saved == [(rec["id"], [HEAD])] and nodes["spark2"].saved == [(rec["id"], [WORKER])]
    assert rec["served_again_after_s"] is not None and rec["served_again_after_s"] > 0
    # the saving runs as root (the node's state dir), the record is written through stdin
    assert any("sudo -n --" in c and "save-logs" in c for c in ctx.commands)
    status = serve.status(dep)
    assert any(r.why.startswith(f"sglang: restart 1 at {rec['at']} by serve.watch: {rec['why']}; "
                                "class unknown; served again after ") for r in status), status


def test_a_canary_without_a_token_is_a_wedge_and_the_budget_ends_the_watch(lab, monkeypatch):  # noqa: F811
    dep, ctx, nodes, cluster, clock = _up(lab, monkeypatch)
    now = serve_watch.WALL()
    nodes["spark1"].files[RECORD] = wd.records_text(
        [{"t": now - 60 * k, "outcome": "restarted", "id": f"r{k}"} for k in (3, 2, 1)])
    cluster.stalled = True
    [r] = serve_watch.watch(dep, checks=5)
    assert r.status is Status.FAILED
    assert r.why == ("wedge: canary: no token within 30s; class unknown; the restart budget is "
                     "spent (3 within 3600s): not restarted")
    assert nodes["spark1"].removed == [] and nodes["spark2"].removed == []
    rec = _records(nodes)[-1]
    assert (rec["kind"], rec["outcome"], rec["restart"]) == ("canary", "gave-up", 4)


def test_the_second_restart_soon_after_waits_the_backoff(lab, monkeypatch):  # noqa: F811
    dep, ctx, nodes, cluster, clock = _up(lab, monkeypatch)
    nodes["spark1"].files[RECORD] = wd.records_text(
        [{"t": serve_watch.WALL() - 10, "outcome": "restarted", "id": "r1"}])
    nodes["spark2"].containers[WORKER].script = Script(exit_at=0)  # the worker's engine exited
    t0 = clock()
    results = serve_watch.watch(dep, checks=1)
    assert results[-2].status is Status.CHANGED, results
    rec = _records(nodes)[-1]
    assert rec["why"] == f"spark2: {WORKER} exited (exit code 1)"
    assert (rec["restart"], rec["backoff_s"]) == (2, 20.0)
    assert clock() - t0 >= 20


def test_persisted_units_are_left_to_their_supervisors(lab, monkeypatch):  # noqa: F811
    dep, ctx, nodes, cluster, clock = _up(lab, monkeypatch)
    answer = nodes["spark1"].answer

    def with_unit(argv, stdin):
        if argv[:2] == ["sh", "-c"] and "for f" in argv[2]:
            return 0, "/etc/systemd/system/sparkdeploy-sglang.service\n", ""
        if argv[:2] == ["systemctl", "is-active"]:
            return 0, "active\n", ""
        return answer(argv, stdin)

    nodes["spark1"].answer = with_unit
    [r] = serve_watch.watch(dep, checks=1)
    assert r.status is Status.OK
    assert r.why == "the persisted supervisors watch it (sparkdeploy-sglang.service): nothing to do"
    assert json.dumps(_records(nodes)) == "[]"


def test_a_restart_that_does_not_come_up_is_said_and_nothing_is_left(lab, monkeypatch):  # noqa: F811
    dep, ctx, nodes, cluster, clock = _up(lab, monkeypatch)
    nodes["spark2"].scripts[WORKER] = Script(exit_at=0)  # it exits again at once
    nodes["spark2"].containers[WORKER].script = nodes["spark2"].scripts[WORKER]
    results = serve_watch.watch(dep, checks=1)
    assert results[-1].status is Status.FAILED, results
    assert results[-1].why.startswith(f"restart 1 after spark2: {WORKER} exited (exit code 1): ")
    assert nodes["spark1"].containers == {} and nodes["spark2"].containers == {}
    assert _records(nodes)[-1]["served_again_after_s"] is None
