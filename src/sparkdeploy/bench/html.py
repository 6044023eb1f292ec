"""One self-contained HTML report per benchmark run (and one per ``bench.compare``).

Everything is in the one file: the tables the console prints, the engine's /metrics beside the
client's, the four-panel plot as an inline base64 PNG, the profile, the image and the startup
timings when the run's context has them. No external URL: a Content-Security-Policy allows
only inline style, inline script and ``data:`` images, so a report that tried to load anything
would say so in the browser's console. The inline script checks that every plot decoded and
marks the page rendered (``<body data-rendered="ok">``); a plot that did not is a console error.
"""

from __future__ import annotations

import base64
import html
import json
import tempfile
from pathlib import Path
from typing import Any

from sparkdeploy.bench.compare import Comparison
from sparkdeploy.bench.gate import OFF
from sparkdeploy.bench.plot import plot
from sparkdeploy.bench.report import engine_rows, level_name

CSP = ("default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
       "script-src 'unsafe-inline'")

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th:first-child,td:first-child{text-align:left}
caption{text-align:left;font-weight:600;padding:.3em 0}
.bad{color:#b00;font-weight:600}
pre{background:#f6f6f6;padding:.8em;overflow:auto}
img{max-width:100%}
"""

_SCRIPT = """
window.addEventListener("load", function () {
  var bad = 0;
  document.querySelectorAll("img").forEach(function (img, i) {
    if (!img.complete || img.naturalWidth === 0) {
      bad++;
      console.error("plot " + (i + 1) + " did not render");
    }
  });
  if (!bad) { document.body.setAttribute("data-rendered", "ok"); }
});
"""


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _f(v: Any, digits: int = 2) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def table(caption: str, header: list[str], rows: list[list[Any]],
          bad: set[int] | None = None) -> str:
    """An HTML table; rows whose index is in ``bad`` are marked."""
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    marked = ' class="bad"'
    body = "".join(
        f"<tr{marked if bad and i in bad else ''}>"
        + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>"
        for i, row in enumerate(rows))
    return f"<table><caption>{_e(caption)}</caption><tr>{head}</tr>{body}</table>"


_LATENCIES = (("ttft_ms", "TTFT ms"), ("itl_ms", "ITL ms"), ("tpot_ms", "TPOT ms"),
              ("e2el_ms", "E2EL ms"), ("per_request_output_tok_s", "decode tok/s (per request)"))
_QS = ("mean", "p50", "p90", "p95", "p99")


def level_section(run: dict) -> str:
    s = run["summary"]
    rows: list[list[Any]] = []
    for key, label in _LATENCIES:
        st = s.get(key) or {}
        rows.append([label, *(_f(st.get(q, st.get("median") if q == "p50" else None))
                              for q in _QS)])
    out = [table(f"{level_name(run)}: {s['completed']}/{s['requests']} ok, {s['failed']} failed, "
                 f"{s['duration_s']:.2f} s", ["metric", *_QS], rows)]
    totals = [["output tok/s (aggregate)", _f(s.get("output_tok_s"), 1)],
              ["requests/s", _f(s.get("requests_s"), 3)],
              ["output tokens", f"{s.get('total_output_tokens', 0):,}"]]
    good = s.get("goodput")
    if good:
        totals += [["goodput req/s", _f(good["req_s"], 3)],
                   ["goodput fraction", f"{good['fraction'] * 100:.1f}%"]]
    for err, count in (s.get("errors") or {}).items():
        totals.append([f"failed x{count}", err])
    out.append(table("throughput", ["figure", "value"], totals))
    ci = s.get("ci95")
    if ci:
        out.append(table("95% confidence intervals over the runs", ["figure", "mean", "low", "high",
                                                                     "runs"],
                         [[name, _f(c["mean"]), _f(c["low"]), _f(c["high"]), c["runs"]]
                          for name, c in ci.items()]))
    eng = s.get("engine")
    if eng and "skipped" in eng:
        out.append(f"<p>{_e(eng['skipped'])}</p>")
    elif eng:
        rows = [list(r) for r in engine_rows(eng)]
        out.append(table(f"engine /metrics ({eng.get('engine') or '?'}) vs client",
                         ["metric", "client", "engine", "client - engine", ""], rows,
                         bad={i for i, r in enumerate(rows) if r[4] == "DISAGREE"}))
    return "\n".join(out)


def plot_png(runs: list[dict], title: str) -> str | None:
    """The four-panel plot as base64 PNG (None without matplotlib or runs to draw)."""
    if not runs:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plot.png"
        try:
            plot(runs, path, title=title)
        except ImportError:  # matplotlib is the bench extra
            return None
        return base64.b64encode(path.read_bytes()).decode()


def context_section(context: dict | None) -> str:
    """The profile, the images and the startup timings, as far as the run's context has them."""
    if not context:
        return ""
    out = []
    for key, label in (("image", "image"), ("startup", "startup timings"),
                       ("deploy_steps_s", "last deploy.all: seconds per step"),
                       ("profile", "profile")):
        value = context.get(key)
        if value:
            out.append(f"<h2>{_e(label)}</h2><pre>{_e(json.dumps(value, indent=1))}</pre>")
    return "\n".join(out)


def _page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            f"<title>{_e(title)}</title><style>{_STYLE}</style></head>\n<body>\n"
            f"<h1>{_e(title)}</h1>\n{body}\n<script>{_SCRIPT}</script>\n</body></html>\n")


def _config_rows(doc: dict) -> list[list[Any]]:
    c = doc.get("config") or {}
    keys = ("url", "model", "api", "input_tokens", "output_tokens", "requests", "warmup",
            "concurrency", "rates", "slo", "runs", "depths", "tokenizer", "gate", "started")
    return [[k, json.dumps(c[k]) if isinstance(c.get(k), (list, dict)) else c.get(k)]
            for k in keys if c.get(k) is not None]


def depth_section(doc: dict) -> str:
    """A depth sweep's rows (``bench.depth``): per depth its medians, or what failed."""
    rows = [[f"d{r['depth']}", _f(r.get("prompt_tokens"), 0), _f(r.get("pp_tok_s")),
             _f(r.get("tg_tok_s")), _f(r.get("ttft_ms")), r.get("error") or ""]
            for r in doc.get("depths") or []]
    return table("prefill (pp) and decode (tg) by context depth (medians over the runs)",
                 ["depth", "prompt tokens", "pp tok/s", "tg tok/s", "TTFT ms", "failed"], rows,
                 bad={i for i, r in enumerate(doc.get("depths") or []) if r.get("error")})


def run_body(doc: dict, title: str) -> str:
    parts = [table("run", ["setting", "value"], _config_rows(doc))]
    if "depths" in doc:
        parts.append(depth_section(doc))
    if (doc.get("config") or {}).get("gate") == "off":
        parts.append(f"<p><strong>{_e(OFF)}</strong></p>")
    skipped = (doc.get("engine_metrics") or {}).get("skipped")
    if skipped:
        parts.append(f"<p>{_e(skipped)}: the client's figures only</p>")
    parts += [level_section(run) for run in doc.get("runs", [])]
    png = plot_png(doc.get("runs", []), title)
    if png:
        parts.append(f'<h2>plots</h2><img alt="{_e(title)}" src="data:image/png;base64,{png}">')
    parts.append(context_section(doc.get("context")))
    return "\n".join(p for p in parts if p)


def run_report(doc: dict) -> str:
    """The HTML report of one ``bench.run`` document."""
    c = doc.get("config") or {}
    title = f"bench: {c.get('model')} @ {c.get('url')}"
    return _page(title, run_body(doc, title))


def compare_report(base: dict, new: dict, cmp: Comparison, base_name: str, new_name: str) -> str:
    """The HTML report of a ``bench.compare``: the headline comparison, then both runs."""
    rows = [[r.level, r.metric, _f(r.base), _f(r.new),
             "-" if r.change_pct is None else f"{r.change_pct:+.1f}%",
             "REGRESSION" if r.regressed else "ok"] for r in cmp.rows]
    body = [table(f"{new_name} vs {base_name} (max regression {cmp.max_regression_pct:g}%)",
                  ["level", "metric", "base", "new", "change", ""], rows,
                  bad={i for i, r in enumerate(cmp.rows) if r.regressed})]
    for level in cmp.only_base:
        body.append(f"<p>{_e(level)}: only in {_e(base_name)}</p>")
    for level in cmp.only_new:
        body.append(f"<p>{_e(level)}: only in {_e(new_name)}</p>")
    for name, doc in ((base_name, base), (new_name, new)):
        body.append(f"<h2>{_e(name)}</h2>")
        body.append(run_body(doc, name))
    return _page(f"bench.compare: {new_name} vs {base_name}", "\n".join(body))
