"""bench.run against a fast stand-in: faults counted as failures, JSON and PNG written, the
PNG holds the four panels' data; bench.compare exit codes."""

import json

import pytest
from invoke import Config, Context
from invoke.exceptions import Exit

from sparkdeploy.bench.client import BenchError
from sparkdeploy.bench.plot import panel_data, read_png_panels
from sparkdeploy.bench.sweep import check_baseline, run_sweep
from sparkdeploy.lab.standins import engine_server as es
from sparkdeploy.profile.config import Bench
from sparkdeploy.steps.bench import request_settings
from sparkdeploy.tasks import bench as bench_tasks


def sized(**given):
    """Request settings: the profile's bench defaults under what a test gives."""
    return request_settings(Bench(), **given)


@pytest.fixture
def server():
    srv = es.start_in_thread(es.Config(port=0, ttft_ms=20, gap_ms=5, reasoning_tokens=2))
    yield srv
    srv.shutdown()
    srv.server_close()


def ctx(tmp_path) -> Context:
    return Context(Config(overrides={"sparkdeploy": {"profile": str(tmp_path / "none.yaml"),
                                                     "state_dir": str(tmp_path / "state")}}))


def test_faulty_requests_fail_with_their_error_and_files_are_written(server, tmp_path):
    # requests are numbered per server: the coherence gate's are 1 and 2 (left alone), warm-up
    # is request 3, the measured ones 4..15
    server.state.control({"faults": "http500:every=4,close:every=5:after=2,"
                                    "stall:every=7:after=1:seconds=1.5"})
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    bench_tasks.run(ctx(tmp_path), url=f"http://127.0.0.1:{server.port}/v1", concurrency="3",
                    requests=12, output_tokens=6, input_tokens=8, warmup=1, timeout=0.5,
                    json=str(out), plot=str(png))
    doc = json.loads(out.read_text())
    run = doc["runs"][0]
    s = run["summary"]
    # 4, 8, 12 -> 500; 5, 10, 15 -> closed; 7, 14 -> stalled past the 0.5 s timeout
    assert s["requests"] == 12 and s["failed"] == 8 and s["completed"] == 4
    assert s["errors"] == {"HTTP 500: stand-in fault: internal server error": 3,
                           "stream closed midway (after 3 events)": 3,
                           "timeout: no data for 0.5s": 2}
    errors = [r["error"] for r in run["requests"]]
    assert errors.count(None) == 4
    ok = [r for r in run["requests"] if r["error"] is None]
    assert all(r["output_tokens"] == 6 for r in ok)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert read_png_panels(png) == panel_data(doc["runs"])


def test_png_holds_the_four_panels(server, tmp_path):
    doc = run_sweep(f"http://127.0.0.1:{server.port}", sized(input_tokens=4, output_tokens=4),
                    concurrency=[1, 2], requests=2, warmup=0)
    from sparkdeploy.bench.plot import plot

    path = tmp_path / "p.png"
    drawn = plot(doc["runs"], path)
    stored = read_png_panels(path)
    assert stored == drawn
    p = stored["panels"]
    s1, s2 = (r["summary"] for r in doc["runs"])
    assert p["output_tok_s"] == {"x": [1, 2], "series": {"total": [s1["output_tok_s"],
                                                                    s2["output_tok_s"]]}}
    assert p["decode_tok_s"]["series"]["median"] == [
        s1["per_request_output_tok_s"]["median"], s2["per_request_output_tok_s"]["median"]]
    for key in ("ttft_ms", "itl_ms"):
        for q in ("median", "p90", "p99"):
            assert p[key]["series"][q] == [s1[key][q], s2[key][q]]


def test_save_under_state_dir_and_baseline_gate(server, tmp_path):
    c = ctx(tmp_path)
    url = f"http://127.0.0.1:{server.port}"
    # stand-in decode rate is 200 tok/s; the default baseline is 27: passes
    bench_tasks.run(c, url=url, concurrency="1", requests=2, output_tokens=4, warmup=0,
                    save=True, check_baseline=True)
    files = sorted(p.suffix for p in (tmp_path / "state" / "bench").iterdir())
    assert files == [".html", ".json", ".png"]
    doc = json.loads(next((tmp_path / "state" / "bench").glob("*.json")).read_text())
    doc["runs"][0]["summary"]["per_request_output_tok_s"]["median"] = 24.4  # no timing here
    assert check_baseline(doc, 27.0, 10)[0] is True  # floor 24.3
    assert check_baseline(doc, 27.2, 10)[0] is False  # floor 24.48
    doc["runs"][0]["concurrency"] = 8
    assert "no concurrency-1 run" in check_baseline(doc, 27, 10)[1]


def test_no_endpoint_no_url_is_a_clear_exit(tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text((__import__("pathlib").Path("configs/qwen3.5-122b-a10b-fp8.yaml")).read_text())
    c = Context(Config(overrides={"sparkdeploy": {"profile": str(prof),
                                                  "state_dir": str(tmp_path)}}))
    with pytest.raises(Exit, match="pass --url"):
        bench_tasks.run(c)


def test_unreachable_endpoint_is_one_line(tmp_path, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(Exit) as e:
        bench_tasks.run(ctx(tmp_path), url=f"http://127.0.0.1:{port}", requests=1)
    assert e.value.code == 1
    [line, *recap] = capsys.readouterr().out.splitlines()
    assert f"failed   bench.run          -        cannot reach http://127.0.0.1:{port}" in line
    assert recap == ["recap:", "  -        ok=0   changed=0   skipped=0   failed=1"]
    with pytest.raises(BenchError):
        run_sweep("ftp://x", sized(), requests=1, warmup=0)


def _doc(tok_s, decode, ttft, itl, conc=8):
    return {"config": {}, "runs": [{"concurrency": conc, "rate": None, "summary": {
        "output_tok_s": tok_s, "per_request_output_tok_s": {"median": decode},
        "ttft_ms": {"p90": ttft}, "itl_ms": {"p90": itl}}}]}


def test_compare_exit_codes(tmp_path):
    base, same, worse, better = (tmp_path / f"{n}.json" for n in ("b", "s", "w", "x"))
    base.write_text(json.dumps(_doc(200.0, 27.0, 100.0, 37.0)))
    same.write_text(json.dumps(_doc(195.0, 26.0, 104.0, 38.5)))     # all within 5%
    worse.write_text(json.dumps(_doc(200.0, 27.0, 100.0, 39.0)))    # p90 ITL +5.4%
    better.write_text(json.dumps(_doc(250.0, 30.0, 80.0, 30.0)))
    c = ctx(tmp_path)
    bench_tasks.compare(c, str(base), str(same))
    bench_tasks.compare(c, str(base), str(better))
    with pytest.raises(Exit) as e:
        bench_tasks.compare(c, str(base), str(worse))
    assert e.value.code == 1
    bench_tasks.compare(c, str(base), str(worse), max_regression="6%")
    with pytest.raises(Exit) as e:
        bench_tasks.compare(c, str(base), str(tmp_path / "missing.json"))
    assert e.value.code == 2
    other = tmp_path / "o.json"
    other.write_text(json.dumps(_doc(200.0, 27.0, 100.0, 37.0, conc=64)))
    with pytest.raises(Exit) as e:
        bench_tasks.compare(c, str(base), str(other))
    assert e.value.code == 2


def test_the_registered_step_benchmarks_the_profiles_endpoint_with_progress(server, tmp_path):
    from sparkdeploy.core.events import Progress
    from sparkdeploy.core.outcomes import Result, Status
    from sparkdeploy.node.deployment import load
    from sparkdeploy.steps.registry import run_one
    from tests.unit.profiles import SEED

    prof = tmp_path / "bench.yaml"
    prof.write_text(f"extends: {SEED}\nsparkdeploy:\n  endpoint: http://127.0.0.1:{server.port}\n"
                    "  bench: {concurrency: [1, 2], requests: 4, input_tokens: 4, output_tokens: 4, "
                    "warmup: 1}\n")
    dep = load(prof, tmp_path / "state")
    with dep.events.collect() as got:
        results = run_one(dep, "bench.run", check=True, save=True)
    skipped, one, two, *files, gate = results
    assert skipped.status is Status.SKIPPED and skipped.why.startswith("engine metrics: ")
    assert one.status is Status.OK and one.why.startswith("concurrency 1: 4/4 ok, ")
    assert two.status is Status.OK and two.why.startswith("concurrency 2: 4/4 ok, ")
    assert two.details["run"]["summary"]["requests"] == 4
    assert sorted(p.suffix for p in (tmp_path / "state" / "bench").iterdir()) == [
        ".html", ".json", ".png"]
    assert [f.status for f in files] == [Status.CHANGED, Status.CHANGED, Status.CHANGED]
    html = next((tmp_path / "state" / "bench").glob("*.html")).read_text()
    assert dep.profile.name in html and "<h2>profile</h2>" in html  # the deployment's context
    assert gate.status is Status.OK and "baseline 27 tok/s" in gate.why
    assert [e for e in got if isinstance(e, Result)] == results
    progress = [e for e in got if isinstance(e, Progress)]
    assert {(p.step, p.unit) for p in progress} == {("bench.run", "req")}
    # each warm-up and each level ends with its final count
    finals = [(p.note, p.done, p.total) for p in progress if p.done == p.total]
    assert finals == [("concurrency 1: warm-up", 1, 1), ("concurrency 1", 4, 4),
                      ("concurrency 2: warm-up", 1, 1), ("concurrency 2", 4, 4)]


def test_a_run_where_every_request_failed_exits_1_and_writes_nothing(server, tmp_path, capsys):
    server.state.control({"faults": "http500:every=1:first=3"})  # after the coherence gate's
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    with pytest.raises(Exit) as e:
        bench_tasks.run(ctx(tmp_path), url=f"http://127.0.0.1:{server.port}", concurrency="2",
                        requests=3, output_tokens=4, input_tokens=4, warmup=0, json=str(out),
                        plot=str(png), save=True)
    assert e.value.code == 1
    assert not out.exists() and not png.exists() and not (tmp_path / "state" / "bench").exists()
    text = capsys.readouterr().out
    assert ("0/3 ok, 3 failed" in text and "no request succeeded (most often: HTTP 500: "
            "stand-in fault: internal server error)" in text)
    assert "every request failed: nothing written" in text


@pytest.mark.parametrize("mode", ["trickle", "silent"])
def test_a_server_that_trickles_or_never_answers_ends_each_request_at_its_deadline(mode):
    from sparkdeploy.bench.client import Target, run_level
    from tests.unit.hostile import Hostile

    srv = Hostile(mode=mode, gap=0.02)  # a byte every 20 ms: never a read timeout
    try:
        import time

        started = time.monotonic()
        res = run_level(Target.parse(srv.url), sized(model="m", timeout=5, deadline=0.4),
                        requests=2, concurrency=2)
        took = time.monotonic() - started
    finally:
        srv.close()
    assert took < 1.5
    assert res["summary"]["errors"] == {"deadline: not done within 0.4s": 2}


@pytest.mark.parametrize("flag", ["--timeout", "--deadline"])
@pytest.mark.parametrize("value", ["1e300", "nan", "0", "86401"])
def test_a_timeout_a_socket_cannot_hold_is_a_usage_error(tmp_path, flag, value):
    with pytest.raises(Exit) as e:
        bench_tasks.run(ctx(tmp_path), url="http://127.0.0.1:9", **{flag[2:]: value})
    assert e.value.code == 2 and flag in str(e.value)


def test_a_huge_timeout_never_leaves_the_main_thread_at_a_barrier():
    from sparkdeploy.bench.client import Target, run_level

    with pytest.raises(BenchError, match=r"timeout 1e\+300 is not within \(0, 86400\]"):
        run_level(Target.parse("http://127.0.0.1:9"), sized(model="m", timeout=1e300),
                  requests=1)


@pytest.mark.parametrize(("doc", "why"), [
    ("[]", "not a benchmark JSON file: "),
    ('{"runs": 5}', "runs: "),
    ('{"runs": [{"summary": {"output_tok_s": "abc"}}]}', "runs.0.summary.output_tok_s: "),
    ('{"runs": [{"rate": "x", "summary": {}}]}', "runs.0.rate: "),
    ('{"runs": [{"rate": -1, "summary": {}}]}', "runs.0.rate: "),
    ('{"runs": [{"summary": {"ttft_ms": {"p90": NaN}}}]}', "runs.0.summary.ttft_ms.p90: "),
    ('{"runs": [{"summary": {"itl_ms": []}}]}', "runs.0.summary.itl_ms: "),
    ("{" * 50_000, "not JSON"),
    ("\x00\xff", "not JSON"),
    ('{"runs": [{"summary": {"x": NaN}}]}', "runs.0: a run names its level"),
])
def test_a_compare_input_that_does_not_fit_is_one_line_naming_the_file(tmp_path, doc, why):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_doc(100, 20, 50, 10)))
    bad = tmp_path / "bad.json"
    bad.write_text(doc)
    c = Context(Config())
    for args in ((good, bad), (bad, good)):
        with pytest.raises(Exit) as e:
            bench_tasks.compare(c, str(args[0]), str(args[1]))
        msg = str(e.value)
        assert e.value.code == 2 and msg.startswith(f"{bad}: ") and why in msg and "\n" not in msg


def test_levels_without_a_metric_on_both_sides_compare_nothing(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(_doc(None, None, None, None)))
    c = Context(Config())
    with pytest.raises(Exit) as e:
        bench_tasks.compare(c, str(empty), str(empty))
    assert (e.value.code, str(e.value)) == (
        2, "no headline metric in both files at a common level: nothing to compare")
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_doc(100, 20, 50, 10)))
    with pytest.raises(Exit) as e:   # NEW lost every metric BASE had: regressions, not nothing
        bench_tasks.compare(c, str(good), str(empty))
    assert (e.value.code, str(e.value)) == (1, "4 regression(s) beyond 5%")
    with pytest.raises(Exit) as e:   # BASE had nothing to regress from
        bench_tasks.compare(c, str(empty), str(good))
    assert e.value.code == 2


def test_a_fifo_is_not_a_compare_input(tmp_path):
    import os

    fifo = tmp_path / "f.json"
    os.mkfifo(fifo)
    with pytest.raises(Exit) as e:
        bench_tasks.compare(Context(Config()), str(fifo), str(fifo))
    assert e.value.code == 2 and "not a regular file (a FIFO, a device or a socket)" in str(e.value)


def test_the_api_key_travels_in_the_header_and_nowhere_in_what_is_written(tmp_path, monkeypatch,
                                                                          capsys):
    secret = "k3y-" + "7f" * 8
    srv = es.start_in_thread(es.Config(port=0, ttft_ms=1, gap_ms=1, api_key=secret))
    try:
        out = tmp_path / "r.json"
        url = f"http://127.0.0.1:{srv.port}/v1"
        monkeypatch.delenv("SPARKDEPLOY_API_KEY", raising=False)
        with pytest.raises(Exit):  # no key: /v1/models answers 401, one line
            bench_tasks.run(ctx(tmp_path), url=url, concurrency="1", requests=2,
                            output_tokens=3, input_tokens=4, warmup=0, json=str(out))
        assert "HTTP 401" in capsys.readouterr().out and not out.exists()
        monkeypatch.setenv("SPARKDEPLOY_API_KEY", secret)
        bench_tasks.run(ctx(tmp_path), url=url, concurrency="1", requests=2, output_tokens=3,
                        input_tokens=4, warmup=0, json=str(out))
        doc = out.read_text()
        assert json.loads(doc)["runs"][0]["summary"]["completed"] == 2
        assert secret not in doc and secret not in capsys.readouterr().out
    finally:
        srv.shutdown()
        srv.server_close()


def test_compare_sets_the_startup_timings_side_by_side_without_gating_on_them(tmp_path, capsys):
    from sparkdeploy.bench.compare import compare

    base, new = _doc(200.0, 27.0, 100.0, 37.0), _doc(200.0, 27.0, 100.0, 37.0)
    base["context"] = {"startup": {"port_open": 40.0, "first_token": 41.0, "dist_init": 12.0}}
    new["context"] = {"startup": {"port_open": 60.0, "first_token": 62.0}}
    got = compare(base, new)
    assert [(r.metric, r.base, r.new, r.change_pct, r.regressed) for r in got.startup] == [
        ("dist_init s", 12.0, None, None, False),
        ("port_open s", 40.0, 60.0, 50.0, False),
        ("first_token s", 41.0, 62.0, pytest.approx(51.22, abs=0.01), False)]
    assert got.regressions == []  # a slower bring-up is shown, not a failed gate
    b, n = tmp_path / "b.json", tmp_path / "n.json"
    b.write_text(json.dumps(base))
    n.write_text(json.dumps(new))
    bench_tasks.compare(ctx(tmp_path), str(b), str(n))
    out = capsys.readouterr().out
    assert "first_token s" in out and "+51.2%" in out and "(not gated)" in out
    assert compare(_doc(1, 1, 1, 1), _doc(1, 1, 1, 1)).startup == []


def _depths(*rows):
    return {"config": {"model": "m", "depths": [r[0] for r in rows]}, "gate": [],
            "depths": [{"depth": d, "error": e} if e else
                       {"depth": d, "prompt_tokens": d + 20, "pp_tok_s": pp, "tg_tok_s": tg,
                        "ttft_ms": ttft, "runs": []} for d, pp, tg, ttft, e in rows]}


def test_compare_reads_depth_sweeps_and_its_html_shows_them(tmp_path, capsys):
    """bench.compare of two bench.depth JSON files: per depth pp/tg tok/s and TTFT (was
    "runs: Field required"); a depth that failed in NEW is a regression; the HTML shows both."""
    base, same, lost = (tmp_path / f"{n}.json" for n in ("b", "s", "l"))
    base.write_text(json.dumps(_depths((0, 2000.0, 27.0, 50.0, None), (4096, 1800.0, 25.0, 2300.0, None))))
    same.write_text(json.dumps(_depths((0, 1990.0, 26.9, 50.5, None), (4096, 1790.0, 25.1, 2310.0, None))))
    lost.write_text(json.dumps(_depths((0, 2000.0, 27.0, 50.0, None), (4096, 0, 0, 0, "HTTP 400: too long"))))
    c = ctx(tmp_path)
    page = tmp_path / "cmp.html"
    bench_tasks.compare(c, str(base), str(same), html=str(page))
    out = capsys.readouterr().out
    assert "depth 4096" in out and "pp tok/s" in out and "tg tok/s" in out
    text = page.read_text()
    assert "pp tok/s" in text and "<td>d4096</td>" in text and "1,800.00" in text
    with pytest.raises(Exit) as e:
        bench_tasks.compare(c, str(base), str(lost), html=str(page))
    assert (e.value.code, e.value.message) == (1, "3 regression(s) beyond 5%")
    assert "HTTP 400: too long" in page.read_text()
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(_doc(200.0, 27.0, 100.0, 37.0)))
    with pytest.raises(Exit) as e:
        bench_tasks.compare(c, str(sweep), str(base))
    assert (e.value.code, e.value.message) == (
        2, "BASE is a sweep (bench.run) and NEW a depth sweep (bench.depth): compare like with like")
