"""The benchmark's accuracy figures: measure the engine stand-in, whose timing is known.

The stand-in runs in its own process on loopback (a free port) at a set time to first token
and inter-token gap; the client sweeps concurrency 1, 8 and 64 on this machine. Errors are the
distance of the measured medians from the set values, worst over the levels (issue 6: ITL within
3%, TTFT within 5 ms, decode rate within 3%); ``ttft_vs_engine_pct``: the client's mean TTFT
against the stand-in's own /metrics TTFT mean (vLLM's histogram), worst over the levels
(issue 31: within 5%).

The depth sweep (issue 31) against the stand-in started in this process with a known prefill
rate and a decode rate that falls with depth, counting prompts with the lab model's tokenizer:
``pp_error_pct`` and ``tg_error_pct``, the worst distance over the depths of the measured medians
from what the stand-in was set to (at most 3 %). Goodput against known answers: a run whose
failing and slow requests are set by the stand-in's fault rules, ``goodput_fraction_exact`` 1
when the fraction is the expected one exactly.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from sparkdeploy.bench.client import Settings
from sparkdeploy.bench.depth import run_depths
from sparkdeploy.bench.sweep import run_sweep
from sparkdeploy.core.files import write_text_atomic
from sparkdeploy.core.wait import Stop, WaitTimeout, wait_for
from sparkdeploy.lab.hub_repo import tokenizer_files
from sparkdeploy.lab.standins import engine_server as es

TTFT_MS = 100.0
TOK_S = 27.0
LEVELS = ((1, 4), (8, 16), (64, 128))  # (concurrency, requests)
OUTPUT_TOKENS = 64
TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_standin(port: int, ttft_ms: float, tok_s: float, extra: list[str] | None = None):
    """The stand-in as a child process; returns the Popen once /health answers."""
    env = dict(os.environ)
    src = str(Path(es.__file__).resolve().parents[3])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparkdeploy.lab.standins.engine_server", "--host", "127.0.0.1",
         "--port", str(port), "--ttft-ms", str(ttft_ms), "--tok-s", str(tok_s),
         "--prefill-tok-s", "0", "--decode-half-depth", "0", *(extra or [])],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)

    def port_open() -> bool:
        if proc.poll() is not None:
            assert proc.stderr is not None  # stderr=PIPE
            raise Stop(f"stand-in exited: {proc.stderr.read().decode()[-300:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            return False

    try:
        wait_for(port_open, deadline=20, interval=0.05, what="the stand-in to open its port")
    except (Stop, WaitTimeout) as e:
        proc.kill()
        proc.wait()
        raise RuntimeError(str(e)) from None
    return proc


DEPTHS = (0, 2048, 8192)
DEPTH_RUNS = 3
DEPTH_OUTPUT_TOKENS = 32
PREFILL_TOK_S = 4000.0
DECODE_HALF_DEPTH = 8192
DEPTH_TTFT_MS = 80.0
DEPTH_TOK_S = 50.0


def depth_accuracy() -> dict[str, float]:
    """The depth sweep's figures against what the stand-in was set to, at every depth: prefill
    ``P / (ttft + P / rate)`` and decode ``tok_s / (1 + P / half_depth)``, P the prompt's tokens
    (template included) as the stand-in counted them with the model's tokenizer."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in tokenizer_files().items():
            write_text_atomic(Path(tmp) / name, data.decode())
        srv = es.start_in_thread(es.Config(
            port=0, ttft_ms=DEPTH_TTFT_MS, gap_ms=1000.0 / DEPTH_TOK_S, tokenizer=tmp,
            prefill_tok_s=PREFILL_TOK_S, decode_half_depth=DECODE_HALF_DEPTH))
        try:
            print(f"bench perf: depths {DEPTHS}, {DEPTH_RUNS} runs each", file=sys.stderr, flush=True)
            doc = run_depths(f"http://127.0.0.1:{srv.port}",
                             Settings(input_tokens=1, output_tokens=DEPTH_OUTPUT_TOKENS,
                                      timeout=TIMEOUT_S, deadline=TIMEOUT_S),
                             tmp, list(DEPTHS), runs=DEPTH_RUNS)
        finally:
            srv.shutdown()
            srv.server_close()
    out: dict[str, float] = {}
    worst_pp = worst_tg = 0.0
    for row in doc["depths"]:
        if row.get("error"):
            raise RuntimeError(row["error"])
        p = row["prompt_tokens"]
        pp_set = p / (DEPTH_TTFT_MS / 1000.0 + p / PREFILL_TOK_S)
        tg_set = DEPTH_TOK_S / (1.0 + p / DECODE_HALF_DEPTH)
        pp_err = abs(row["pp_tok_s"] - pp_set) / pp_set * 100
        tg_err = abs(row["tg_tok_s"] - tg_set) / tg_set * 100
        worst_pp, worst_tg = max(worst_pp, pp_err), max(worst_tg, tg_err)
        d = row["depth"]
        out[f"d{d}.prompt_tokens"] = p
        out[f"d{d}.pp_tok_s"] = row["pp_tok_s"]
        out[f"d{d}.pp_set_tok_s"] = pp_set
        out[f"d{d}.pp_error_pct"] = pp_err
        out[f"d{d}.tg_tok_s"] = row["tg_tok_s"]
        out[f"d{d}.tg_set_tok_s"] = tg_set
        out[f"d{d}.tg_error_pct"] = tg_err
    return {"pp_error_pct": worst_pp, "tg_error_pct": worst_tg, **out}


GOODPUT_FAULTS = "http500:every=4:first=3,stall:every=3:after=1:seconds=0.4:first=3"
"""Of the 12 measured requests (3..14: the coherence gate's are 1 and 2), 4, 8 and 12 fail and
3, 6 and 9 stall 0.4 s past a 250 ms end-to-end SLO: 6 of 12 are good."""
GOODPUT_EXPECTED = 0.5


def goodput_accuracy() -> dict[str, float]:
    srv = es.start_in_thread(es.Config(port=0, ttft_ms=20, gap_ms=5, reasoning_tokens=2,
                                       faults=es.parse_faults(GOODPUT_FAULTS)))
    try:
        print("bench perf: goodput against known answers", file=sys.stderr, flush=True)
        doc = run_sweep(f"http://127.0.0.1:{srv.port}",
                        Settings(input_tokens=8, output_tokens=6, timeout=TIMEOUT_S,
                                 deadline=TIMEOUT_S),
                        concurrency=[3], requests=12, warmup=0,
                        slo={"ttft_ms": 1000.0, "e2el_ms": 250.0})
    finally:
        srv.shutdown()
        srv.server_close()
    got = doc["runs"][0]["summary"]["goodput"]["fraction"]
    return {"goodput_fraction": got, "goodput_fraction_expected": GOODPUT_EXPECTED,
            "goodput_fraction_exact": float(got == GOODPUT_EXPECTED)}


def run() -> dict[str, float]:
    return {**depth_accuracy(), **goodput_accuracy(), **levels_accuracy()}


def levels_accuracy() -> dict[str, float]:
    port = free_port()
    proc = start_standin(port, TTFT_MS, TOK_S, ["--metrics", "vllm"])  # vLLM's /metrics
    gap_ms = 1000.0 / TOK_S
    out: dict[str, float] = {}
    worst_itl = worst_ttft = worst_rate = worst_engine = 0.0
    try:
        for conc, n in LEVELS:
            print(f"bench perf: concurrency {conc}, {n} requests", file=sys.stderr, flush=True)
            doc = run_sweep(f"http://127.0.0.1:{port}",
                            Settings(input_tokens=128, output_tokens=OUTPUT_TOKENS, timeout=TIMEOUT_S,
                                     deadline=TIMEOUT_S),
                            concurrency=[conc], requests=n, warmup=1)
            s = doc["runs"][0]["summary"]
            if s["failed"]:
                raise RuntimeError(f"concurrency {conc}: {s['failed']} failed: {s['errors']}")
            itl = abs(s["itl_ms"]["median"] - gap_ms) / gap_ms * 100
            ttft = abs(s["ttft_ms"]["median"] - TTFT_MS)
            rate = abs(s["per_request_output_tok_s"]["median"] - TOK_S) / TOK_S * 100
            worst_itl, worst_ttft, worst_rate = (max(worst_itl, itl), max(worst_ttft, ttft),
                                                 max(worst_rate, rate))
            # the client's TTFT against the engine's own (its /metrics histogram, the run's delta)
            engine_ttft = (s.get("engine") or {}).get("ttft_ms")
            if engine_ttft is None:
                raise RuntimeError(f"concurrency {conc}: no engine TTFT from /metrics: "
                                   f"{doc['engine_metrics']['skipped'] or s.get('engine')}")
            vs_engine = abs(s["ttft_ms"]["mean"] - engine_ttft) / engine_ttft * 100
            worst_engine = max(worst_engine, vs_engine)
            out[f"c{conc}.engine_ttft_mean_ms"] = engine_ttft
            out[f"c{conc}.client_ttft_mean_ms"] = s["ttft_ms"]["mean"]
            out[f"c{conc}.ttft_vs_engine_pct"] = vs_engine
            out[f"c{conc}.itl_median_ms"] = s["itl_ms"]["median"]
            out[f"c{conc}.ttft_median_ms"] = s["ttft_ms"]["median"]
            out[f"c{conc}.decode_median_tok_s"] = s["per_request_output_tok_s"]["median"]
            out[f"c{conc}.client_event_handling_us_p99"] = \
                s["client"]["event_handling_us"]["p99"]
            out[f"c{conc}.client_wake_lag_ms_p99"] = s["client"]["probe_wake_lag_ms"]["p99"]
            out[f"c{conc}.client_cpu_pct"] = s["client"]["cpu_pct"]
    finally:
        proc.terminate()
        proc.wait(10)
    return {"itl_error_pct": worst_itl, "ttft_error_ms": worst_ttft,
            "ttft_vs_engine_pct": worst_engine,
            "decode_rate_error_pct": worst_rate, "set_ttft_ms": TTFT_MS, "set_gap_ms": gap_ms,
            **out}
