"""The gateway's cost (issue 41): the engine stand-in reached directly against the same stand-in
through the gateway (``helpers/gateway.py``, its own process, as on the head), with the bench
client (``run_sweep``), on loopback.

On a 2-core machine shared with others, the two are never compared across minutes: each round
measures direct and through the gateway back to back, the order swapped every round, and the
figures are the median over the rounds of the round's own difference (or ratio).

- ``ttft_added_ms``: the median over rounds of (the gateway's median TTFT - the direct median
  TTFT) at concurrency 1 (issue 41: at most 2 ms).
- ``throughput_ratio_c64``: the median over rounds of (output tokens/s through the gateway) /
  (output tokens/s direct) at concurrency 64 (issue 41: at least 0.97).
- ``cpu_ms_per_1k_tokens``: the gateway process's CPU time (user + system, its children's
  too) per 1000 tokens relayed at concurrency 64 (what it takes from the head's cores; a
  figure the machine's other load moves less than the ratios).
- ``start_s``: from starting the gateway's process to its ``/v1/models`` answering.

``python -m tools.perf.gateway --candidate NAME=COMMAND ...`` measures other gateways the
same way (docs/gateway.md: LiteLLM's proxy, vLLM's router): COMMAND is a shell-free argv with
``{port}`` and ``{backend}`` (the stand-in's URL) filled in; ``{config}`` names a file written
from ``--config-text`` with the same fields filled in.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from sparkdeploy.bench.client import Settings
from sparkdeploy.bench.sweep import run_sweep
from sparkdeploy.core.files import write_text_atomic
from sparkdeploy.core.outside import OutsideError, request
from sparkdeploy.core.wait import Stop, WaitTimeout, wait_for
from sparkdeploy.helpers import gateway as gw_module
from tools.perf.bench import free_port, start_standin

TTFT_MS = 50.0
GAP_MS = 20.0
TTFT_ROUNDS = 7
TTFT_REQUESTS = 12
TTFT_OUTPUT_TOKENS = 4
C64_ROUNDS = 5
C64_REQUESTS = 128
C64_OUTPUT_TOKENS = 64
TIMEOUT_S = 60.0
START_DEADLINE_S = 120.0


def start_gateway(argv: list[str], port: int, env: dict | None = None) -> tuple[subprocess.Popen,
                                                                               float]:
    """The gateway's process and the seconds until its ``/v1/models`` answered 200."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env)

    def answers() -> bool:
        if proc.poll() is not None:
            assert proc.stderr is not None
            raise Stop(f"gateway exited {proc.returncode}: {proc.stderr.read().decode()[-400:]}")
        try:
            return request("GET", f"http://127.0.0.1:{port}/v1/models",
                           deadline=2.0).status == 200
        except OutsideError:
            return False

    try:
        wait_for(answers, deadline=START_DEADLINE_S, interval=0.05, what="the gateway to answer")
    except (Stop, WaitTimeout) as e:
        stop(proc)
        raise RuntimeError(str(e)) from None
    return proc, time.monotonic() - t0


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


FAILED: list[str] = []
"""What failed in a candidate's runs (``--candidate``: measured on, counted in ``failed``)."""


def _sweep(url: str, conc: int, n: int, tokens: int, strict: bool = True) -> dict:
    doc = run_sweep(url, Settings(input_tokens=32, output_tokens=tokens, timeout=TIMEOUT_S,
                                  deadline=TIMEOUT_S),
                    concurrency=[conc], requests=n, warmup=min(conc, 8), gate=False)
    s = doc["runs"][0]["summary"]
    if s["failed"]:
        what = f"{url} concurrency {conc}: {s['failed']} of {n} failed: {s['errors']}"
        if strict:
            raise RuntimeError(what)
        FAILED.append(what)
    return s


def cpu_s(pid: int) -> float:
    """The CPU seconds (user + system, its waited-for children's too) a process has used."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def compare(direct: str, through: str, say: Callable[[str], None],
            pid: int | None = None, strict: bool = True) -> dict[str, float]:
    """Alternating rounds, direct against through the gateway (see the module's doc); with the
    gateway's ``pid``, its CPU time per 1000 tokens relayed at concurrency 64."""
    ttft_diffs, ttft_direct, ttft_gw = [], [], []
    for r in range(TTFT_ROUNDS):
        order = [(False, direct), (True, through)]
        got = {}
        for is_gw, url in (order if r % 2 == 0 else order[::-1]):
            got[is_gw] = _sweep(url, 1, TTFT_REQUESTS, TTFT_OUTPUT_TOKENS, strict)["ttft_ms"]["median"]
        ttft_direct.append(got[False])
        ttft_gw.append(got[True])
        ttft_diffs.append(got[True] - got[False])
        say(f"gateway perf: TTFT round {r + 1}/{TTFT_ROUNDS}: direct {got[False]:.2f} ms, "
            f"through {got[True]:.2f} ms")
    ratios, tput_direct, tput_gw, cpu_per_k = [], [], [], []
    for r in range(C64_ROUNDS):
        order = [(False, direct), (True, through)]
        got = {}
        for is_gw, url in (order if r % 2 == 0 else order[::-1]):
            cpu0 = cpu_s(pid) if is_gw and pid else 0.0
            s = _sweep(url, 64, C64_REQUESTS, C64_OUTPUT_TOKENS, strict)
            got[is_gw] = s["output_tok_s"]
            if is_gw and pid:  # the warm-up's tokens count too
                tokens = s["total_output_tokens"] * (1 + min(64, 8) / C64_REQUESTS)
                cpu_per_k.append((cpu_s(pid) - cpu0) * 1000 / tokens * 1000)
        tput_direct.append(got[False])
        tput_gw.append(got[True])
        ratios.append(got[True] / got[False])
        say(f"gateway perf: c64 round {r + 1}/{C64_ROUNDS}: direct {got[False]:.0f} tok/s, "
            f"through {got[True]:.0f} tok/s")
    return {"ttft_added_ms": statistics.median(ttft_diffs),
            "ttft_added_ms_max_round": max(ttft_diffs),
            "ttft_direct_median_ms": statistics.median(ttft_direct),
            "ttft_through_median_ms": statistics.median(ttft_gw),
            "throughput_ratio_c64": statistics.median(ratios),
            "throughput_ratio_c64_min_round": min(ratios),
            "c64_direct_tok_s": statistics.median(tput_direct),
            "c64_through_tok_s": statistics.median(tput_gw),
            **({"cpu_ms_per_1k_tokens": statistics.median(cpu_per_k)} if cpu_per_k else {})}


def measure(argv_of: Callable[[int, str], list[str]], say: Callable[[str], None],
            env: dict | None = None, strict: bool = True) -> dict[str, float]:
    """One gateway's figures: ``argv_of(port, backend_url)`` starts it in front of a fresh
    stand-in."""
    sport, gport = free_port(), free_port()
    standin = start_standin(sport, TTFT_MS, 1000.0 / GAP_MS, ["--model", "standin"])
    backend = f"http://127.0.0.1:{sport}"
    try:
        proc, start_s = start_gateway(argv_of(gport, backend), gport, env)
        try:
            return {**compare(backend, f"http://127.0.0.1:{gport}", say, proc.pid, strict), "start_s": start_s}
        finally:
            stop(proc)
    finally:
        stop(standin)


def own_argv(port: int, backend: str) -> list[str]:
    return [sys.executable, str(Path(gw_module.__file__).resolve()), "--listen",
            f"127.0.0.1:{port}", "--backend", backend, "--quiet"]


def _candidate(cmd: str, config: str, config_text: str) -> Callable[[int, str], list[str]]:
    def argv_of(port: int, backend: str) -> list[str]:
        fill = {"port": str(port), "backend": backend, "config": config}
        write_text_atomic(Path(config), config_text.format(**fill))
        return [a.format(**fill) for a in shlex.split(cmd)]
    return argv_of


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run() -> dict[str, float]:
    return {**measure(own_argv, _say),
            "set_ttft_ms": TTFT_MS, "set_gap_ms": GAP_MS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.perf.gateway")
    p.add_argument("--candidate", action="append", default=[],
                   help="NAME=COMMAND ({port}, {backend}, {config} filled in)")
    p.add_argument("--config-text", default="", help="the text of {config} ({port}, {backend})")
    ns = p.parse_args(argv)
    todo: list[tuple[str, Callable[[int, str], list[str]]]] = [("sparkdeploy", own_argv)]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = os.path.join(tmp, "config")
        for spec in ns.candidate:
            name, _, cmd = spec.partition("=")

            todo.append((name, _candidate(cmd, cfg, ns.config_text)))
        for name, argv_of in todo:
            FAILED.clear()
            for key, value in measure(argv_of, _say, strict=name == "sparkdeploy").items():
                print(f"{name}.{key}: {value:.3f}", flush=True)
            print(f"{name}.failed_runs: {len(FAILED)}", flush=True)
            for line in FAILED:
                _say(f"{name}: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
