"""The benchmark's accuracy figure: measure the engine stand-in, whose timing is known.

The stand-in runs in its own process on loopback (a free port) at a set time to first token
and inter-token gap; the client sweeps concurrency 1, 8 and 64 on this machine. Errors are the
distance of the measured medians from the set values, worst over the levels (issue 6: ITL within
3%, TTFT within 5 ms, decode rate within 3%); ``ttft_vs_engine_pct``: the client's mean TTFT
against the stand-in's own /metrics TTFT mean (vLLM's histogram), worst over the levels
(issue 31: within 5%).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from sparkdeploy.bench.client import Settings
from sparkdeploy.bench.sweep import run_sweep
from sparkdeploy.lab.standins import engine_server as es
from sparkdeploy.wait import Stop, WaitTimeout, wait_for

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
         "--port", str(port), "--ttft-ms", str(ttft_ms), "--tok-s", str(tok_s), *(extra or [])],
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


def run() -> dict[str, float]:
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
