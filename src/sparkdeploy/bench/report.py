"""Console tables (rich renderables; the task prints them)."""

from __future__ import annotations

from rich.console import JustifyMethod
from rich.table import Table

from sparkdeploy.bench.compare import Comparison


def _f(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def level_name(run: dict) -> str:
    if run.get("rate") is not None:
        return f"rate {run['rate']:g} req/s"
    return f"concurrency {run.get('concurrency')}"


def run_table(run: dict) -> Table:
    """One level: the latency stats, throughput, failures with their errors, client overhead."""
    s = run["summary"]
    t = Table(title=f"{level_name(run)}: {s['completed']}/{s['requests']} ok, "
                    f"{s['failed']} failed, {s['duration_s']:.2f} s", title_justify="left")
    t.add_column("metric")
    for q in ("mean", "median", "p90", "p99"):
        t.add_column(q, justify="right")
    for key, label in (("ttft_ms", "TTFT ms"), ("itl_ms", "ITL ms"), ("tpot_ms", "TPOT ms"),
                       ("e2el_ms", "E2EL ms"),
                       ("per_request_output_tok_s", "decode tok/s (per request)")):
        st = s[key]
        t.add_row(label, *(_f(st[q], 2) for q in ("mean", "median", "p90", "p99")))
    t.add_section()
    t.add_row("output tok/s (aggregate)", _f(s["output_tok_s"]), "", "", "")
    t.add_row("requests/s", _f(s["requests_s"], 3), "", "", "")
    src = s.get("output_tokens_source")
    t.add_row("output tokens", f"{s['total_output_tokens']:,}",
              f"from {src}" if src else "", "", "")
    for err, count in (s.get("errors") or {}).items():
        t.add_row(f"[red]failed x{count}[/]", f"[red]{err}[/]", "", "", "")
    c = s.get("client")
    if c:
        t.add_section()
        t.add_row("client: per-event handling us", *(_f(c["event_handling_us"][q], 1)
                                                      for q in ("mean", "median", "p90", "p99")))
        t.add_row("client: start lateness ms", *(_f(c["start_lateness_ms"][q], 2)
                                                 for q in ("mean", "median", "p90", "p99")))
        t.add_row("client: wake-up lag ms", *(_f(c["probe_wake_lag_ms"][q], 2)
                                              for q in ("mean", "median", "p90", "p99")))
        t.add_row("client: CPU %", _f(c["cpu_pct"]), "", "", "")
    return t


def comparison_table(cmp: Comparison, base_name: str, new_name: str) -> Table:
    t = Table(title=f"{new_name} vs {base_name} (max regression {cmp.max_regression_pct:g}%)",
              title_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("level", "left"), ("metric", "left"), ("base", "right"), ("new", "right"),
        ("change", "right"), ("", "left"))
    for col, j in columns:
        t.add_column(col, justify=j)
    for r in cmp.rows:
        change = "-" if r.change_pct is None else f"{r.change_pct:+.1f}%"
        verdict = "[red]REGRESSION[/]" if r.regressed else "ok"
        t.add_row(r.level, r.metric, _f(r.base, 2), _f(r.new, 2), change, verdict)
    return t
