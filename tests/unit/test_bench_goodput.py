"""bench.run --slo and --runs against the engine stand-in: goodput exact against known answers
(failed and stalled requests by the stand-in's deterministic faults), the percentiles, and the
95 % interval of each headline figure over repeated runs."""

import json

import pytest
from invoke.exceptions import Exit

from sparkdeploy.tasks import bench as bench_tasks
from tests.unit.test_bench_run import ctx, server  # noqa: F401, F811  (the stand-in fixture)


def test_goodput_is_exact_against_known_answers(server, tmp_path, capsys):  # noqa: F811
    # of 12 requests: 4, 8, 12 fail (HTTP 500); 3, 6, 9 stall 0.4 s after their first token,
    # so their E2E (~0.45 s) misses a 250 ms SLO that the others (~45 ms) meet: 6 good
    server.state.control({"faults": "http500:every=4,stall:every=3:after=1:seconds=0.4"})
    out = tmp_path / "r.json"
    bench_tasks.run(ctx(tmp_path), url=f"http://127.0.0.1:{server.port}", concurrency="3",
                    requests="12", output_tokens="6", input_tokens="8", warmup="0",
                    slo="ttft=1s,e2e=250ms", json=str(out))
    run = json.loads(out.read_text())["runs"][0]
    s = run["summary"]
    assert s["completed"] == 9 and s["failed"] == 3
    g = s["goodput"]
    assert (g["slo"], g["good"], g["fraction"]) == ({"ttft_ms": 1000.0, "e2el_ms": 250.0}, 6, 0.5)
    assert g["req_s"] == pytest.approx(6 / s["duration_s"])
    # the stand-in numbers requests as they arrive, three at a time: count, not order
    met = [r["slo_met"] for r in run["requests"]]
    assert met.count(True) == 6
    assert all(r["slo_met"] is False for r in run["requests"] if r["error"] is not None)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        q = s[key]
        assert q["p50"] == q["median"] and q["p50"] <= q["p90"] <= q["p95"] <= q["p99"]
    text = capsys.readouterr().out
    assert "goodput 0.5" not in text  # req/s is not the fraction
    assert f"goodput {g['req_s']:,.3f} req/s (50.0% met the SLO)" in text


def test_runs_give_each_headline_figure_its_interval(server, tmp_path):  # noqa: F811
    out = tmp_path / "r.json"
    bench_tasks.run(ctx(tmp_path), url=f"http://127.0.0.1:{server.port}", concurrency="2",
                    requests="4", output_tokens="4", input_tokens="4", warmup="0", runs="3",
                    slo="tpot=1s", json=str(out))
    doc = json.loads(out.read_text())
    assert doc["config"]["runs"] == 3 and doc["config"]["slo"] == {"tpot_ms": 1000.0}
    run = doc["runs"][0]
    s, each = run["summary"], run["repeats"]
    assert len(each) == 3 and [e["requests"] for e in each] == [4, 4, 4]
    assert s["requests"] == 12 and len(run["requests"]) == 12
    assert s["goodput"]["good"] == 12 and s["goodput"]["fraction"] == 1.0
    assert s["duration_s"] == pytest.approx(sum(e["duration_s"] for e in each))
    ci = s["ci95"]
    assert set(ci) == {"output_tok_s", "requests_s", "goodput.req_s", "goodput.fraction",
                       "per_request_output_tok_s.median", "ttft_ms.p50", "ttft_ms.p90",
                       "tpot_ms.p50", "itl_ms.p50", "e2el_ms.p50"}
    tok = [e["output_tok_s"] for e in each]
    assert ci["output_tok_s"]["mean"] == pytest.approx(sum(tok) / 3)
    assert ci["output_tok_s"]["low"] <= min(tok) and ci["output_tok_s"]["high"] >= max(tok)
    assert ci["goodput.fraction"] == {"mean": 1.0, "low": 1.0, "high": 1.0, "runs": 3}


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("slo", "ttft=fast", "--slo: ttft: 'fast' is not a duration (2s, 80ms)"),
    ("slo", "itl=5ms", "--slo: 'itl=5ms' is not ttft=, tpot= or e2e= a duration"),
    ("runs", "0", "--runs: must be >= 1, not 0"),
    ("runs", "many", "--runs: must be an integer, not 'many'"),
    ("runs", "101", "--runs: must be <= 100, not 101"),
])
def test_a_bad_slo_or_runs_is_a_usage_error(tmp_path, flag, value, says):
    with pytest.raises(Exit) as e:
        bench_tasks.run(ctx(tmp_path), url="http://127.0.0.1:9", **{flag: value})
    assert e.value.code == 2 and str(e.value).startswith(says)
