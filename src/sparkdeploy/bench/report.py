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
    cols = ("mean", "p50", "p90", "p95", "p99")
    for q in cols:
        t.add_column(q, justify="right")
    blank = ("",) * (len(cols) - 1)
    for key, label in (("ttft_ms", "TTFT ms"), ("itl_ms", "ITL ms"), ("tpot_ms", "TPOT ms"),
                       ("e2el_ms", "E2EL ms"),
                       ("per_request_output_tok_s", "decode tok/s (per request)")):
        st = s[key]
        t.add_row(label, *(_f(st.get(q, st["median"] if q == "p50" else None), 2) for q in cols))
    t.add_section()
    t.add_row("output tok/s (aggregate)", _f(s["output_tok_s"]), *blank)
    t.add_row("requests/s", _f(s["requests_s"], 3), *blank)
    good = s.get("goodput")
    if good:
        slo = ", ".join(f"{k.removesuffix('_ms')}<={v:g}ms" for k, v in good["slo"].items())
        t.add_row("goodput req/s", _f(good["req_s"], 3), f"{good['good']} good", *blank[1:])
        t.add_row(f"goodput fraction ({slo})", _f(good["fraction"] * 100, 1) + "%", *blank)
    src = s.get("output_tokens_source")
    t.add_row("output tokens", f"{s['total_output_tokens']:,}",
              f"from {src}" if src else "", *blank[1:])
    for err, count in (s.get("errors") or {}).items():
        t.add_row(f"[red]failed x{count}[/]", f"[red]{err}[/]", *blank)
    ci = s.get("ci95")
    if ci:
        t.add_section()
        for name, c in ci.items():
            span = "-" if c["low"] is None else f"{_f(c['low'], 2)} .. {_f(c['high'], 2)}"
            t.add_row(f"95% CI {name} ({c['runs']} runs)", _f(c["mean"], 2), span, *blank[1:])
    c = s.get("client")
    if c:
        t.add_section()
        for key, label, digits in (("event_handling_us", "client: per-event handling us", 1),
                                   ("start_lateness_ms", "client: start lateness ms", 2),
                                   ("probe_wake_lag_ms", "client: wake-up lag ms", 2)):
            st = c[key]
            t.add_row(label, *(_f(st.get(q, st["median"] if q == "p50" else None), digits)
                               for q in cols))
        t.add_row("client: CPU %", _f(c["cpu_pct"]), *blank)
    return t


def depth_table(model: str, rows: list[dict], output_tokens: int) -> Table:
    """The depth sweep as llama-bench prints it (llama-benchy's columns: model, test, t/s): a
    ``pp`` and a ``tg`` row per depth, median +- standard deviation over the runs."""
    runs = max((len(r["runs"]) for r in rows), default=0)
    t = Table(title=f"prefill (pp) and decode (tg) by context depth: median ± sd of {runs} run(s)",
              title_justify="left")
    for col, j in (("model", "left"), ("test", "right"), ("t/s", "right"), ("ttft (ms)", "right"),
                   ("prompt tokens", "right")):
        t.add_column(col, justify=j)  # type: ignore[arg-type]

    def pm(row: dict, key: str, digits: int) -> str:
        sd = row.get(f"{key}_sd")
        return _f(row[key], digits) + ("" if sd is None else f" ± {_f(sd, digits)}")

    for row in rows:
        d = row["depth"]
        t.add_row(model, f"pp @ d{d}", pm(row, "pp_tok_s", 2), pm(row, "ttft_ms", 2),
                  _f(row["prompt_tokens"], 0))
        t.add_row(model, f"tg{output_tokens} @ d{d}", pm(row, "tg_tok_s", 2), "", "")
    return t


def engine_rows(eng: dict) -> list[tuple[str, str, str, str, str]]:
    """The engine's figures beside the client's, as rows of text (metric, client, engine,
    difference, verdict): the console table and the HTML report show the same."""
    rows = []
    for r in eng.get("vs_client") or []:
        diff = "-" if r["diff_pct"] is None else f"{r['diff_pct']:+.1f}%"
        rows.append((f"{r['label']} mean ms", _f(r["client"], 2), _f(r["engine"], 2), diff,
                     "DISAGREE" if r["disagree"] else "ok"))
    kv = eng.get("kv_cache_peak_pct")
    for label, value in (("queue mean ms", _f(eng.get("queue_ms"), 2)),
                         ("KV cache peak", "-" if kv is None else f"{kv:.1f}%"),
                         ("preemptions", _f(eng.get("preemptions"), 0)),
                         ("running peak", _f(eng.get("running_peak"), 0)),
                         ("waiting peak", _f(eng.get("waiting_peak"), 0))):
        rows.append((label, "", value, "", ""))
    return rows


def engine_table(run: dict) -> Table | None:
    """The level's engine /metrics beside the client's means (None: none were read)."""
    eng = run["summary"].get("engine")
    if not eng or "skipped" in eng:
        return None
    t = Table(title=f"{level_name(run)}: engine /metrics ({eng.get('engine') or '?'}) vs client",
              title_justify="left")
    for col in ("metric", "client", "engine", "client - engine", ""):
        t.add_column(col, justify="left" if col in ("metric", "") else "right")
    for row in engine_rows(eng):
        t.add_row(*row[:4], "[red]DISAGREE[/]" if row[4] == "DISAGREE" else row[4])
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
    for r in cmp.startup:  # side by side only: one bring-up each is no measurement to gate on
        change = "-" if r.change_pct is None else f"{r.change_pct:+.1f}%"
        t.add_row(r.level, r.metric, _f(r.base, 2), _f(r.new, 2), change, "(not gated)")
    return t
