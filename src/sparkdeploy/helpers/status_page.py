"""sparkdeploy's status page: one page on the head showing the deployment, each node, the
engine's live figures, the last fabric test and bench, and the watchdog's last events.

Standard library only (Python 3.8 and later), run by the head's ``python3`` under the unit
``sparkdeploy-status.service`` (``metrics.up`` starts it beside Prometheus). Every figure is
read from Prometheus (``--prometheus``) at one instant, the page's own time: each figure's
element carries the query (``data-query``), the instant (the page's ``data-time``) and the
value as Prometheus gave it (``data-value``), so what the page shows can be checked against
what Prometheus answers for the same query at the same time. The watchdog's events come from the
head's records (``<state>/serve/<engine>.restarts.json``). No script: the page reloads itself
every ``--refresh`` seconds. It shows names and figures only: nothing it reads holds a secret.

``GET /`` the page; ``GET /health`` 200. Once listening it prints one JSON line on stdout,
``{"listening": "http://HOST:PORT"}``; a line per request goes to stderr.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import sys
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LIVE = (
    ("Output tokens/s", "sparkdeploy:generation_tokens:rate1m", "rate"),
    ("Prompt tokens/s", "sparkdeploy:prompt_tokens:rate1m", "rate"),
    ("TTFT p50", "sparkdeploy:ttft_seconds:p50_5m", "ms"),
    ("TTFT p99", "sparkdeploy:ttft_seconds:p99_5m", "ms"),
    ("ITL p50", "sparkdeploy:itl_seconds:p50_5m", "ms"),
    ("ITL p99", "sparkdeploy:itl_seconds:p99_5m", "ms"),
    ("KV-cache use", "sparkdeploy:kv_cache_usage:ratio", "pct"),
    ("Requests running", "sparkdeploy:requests_running", "count"),
    ("Requests waiting", "sparkdeploy:requests_waiting", "count"),
    ("Preemptions/s", "sparkdeploy:preemptions:rate5m", "rate"),
)
"""The engine's live figures: (label, query, how shown); the recording rules' series."""
BENCH = (
    ("Output tokens/s", "sparkdeploy_bench_output_tokens_per_second", "rate"),
    ("TTFT median", "sparkdeploy_bench_ttft_median_milliseconds", "plain_ms"),
    ("ITL median", "sparkdeploy_bench_itl_median_milliseconds", "plain_ms"),
)
EVENTS = 5
"""The watchdog's last events shown."""


FORMATS = {
    "ms": lambda v: f"{v * 1000:.1f} ms",  # a figure in seconds, shown in ms
    "plain_ms": lambda v: f"{v:.1f} ms",
    "pct": lambda v: f"{v * 100:.1f} %",
    "bytes": lambda v: f"{v / 2**30:.1f} GiB",
    "Bps": lambda v: f"{v / 1e6:.2f} MB/s",
    "count": lambda v: f"{v:.0f}",
    "rate": lambda v: f"{v:.1f}",
}
"""How each kind of figure is shown (the test formats Prometheus' answer the same way)."""


def show(value: float, how: str) -> str:
    """A figure as the page shows it."""
    return "no data" if math.isnan(value) else FORMATS[how](value)


class Prometheus:
    def __init__(self, url: str, at: float) -> None:
        self.url, self.at = url.rstrip("/"), at

    def query(self, q: str) -> list:
        """Prometheus' instant vector for ``q`` at the page's time ([] when it cannot say)."""
        qs = urllib.parse.urlencode({"query": q, "time": f"{self.at:.3f}"})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{qs}", timeout=5) as r:
                body = json.loads(r.read(4 * 2**20))
        except (OSError, ValueError):
            return []
        data = body.get("data") if isinstance(body, dict) else None
        result = data.get("result") if isinstance(data, dict) else None
        return [s for s in result if isinstance(s, dict)] if isinstance(result, list) else []


def latest(p: Prometheus, query: str) -> list:
    """``query``'s series, of each node only the one scraped last: after Prometheus restarts, a
    series it no longer scrapes is still answered for five minutes (its lookback), beside the
    one that replaced it."""
    when = {_key(s): _val(s) for s in p.query(f"timestamp({query})")}
    best: dict = {}
    for s in p.query(query):
        node = s.get("metric", {}).get("node", "")
        t = when.get(_key(s), math.nan)
        if node not in best or t > best[node][0]:
            best[node] = (t, s)
    return [s for _, s in best.values()]


def _key(series: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in series.get("metric", {}).items() if k != "__name__"))


def _val(series: dict) -> float:
    try:
        return float(series["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return math.nan


def cell(p: Prometheus, query: str, how: str, series: dict | None = None) -> str:
    """A figure's cell: it carries its query and Prometheus' value at the page's instant."""
    if series is None:
        got = p.query(query)
        series = got[0] if got else None
    if series is None:
        return '<td class="none">no data</td>'
    raw = series["value"][1]
    return (f'<td class="figure" data-query="{html.escape(query)}" data-value="{html.escape(str(raw))}"'
            f' data-how="{how}">{html.escape(show(_val(series), how))}</td>')


def figure(p: Prometheus, label: str, query: str, how: str, series: dict | None = None) -> str:
    """One figure as a row: its label, its cell."""
    return f"<tr><th>{html.escape(label)}</th>{cell(p, query, how, series)}</tr>"


def _restarts(state: str, engine: str) -> list:
    if not engine or "/" in engine or engine.startswith("."):
        return []
    try:
        with open(os.path.join(state, "serve", f"{engine}.restarts.json")) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return []
    got = data.get("restarts") if isinstance(data, dict) else None
    return [r for r in got if isinstance(r, dict)][-EVENTS:] if isinstance(got, list) else []


def page(prom_url: str, state: str, refresh: int, at: float | None = None) -> str:
    at = time.time() if at is None else at
    p = Prometheus(prom_url, at)
    e = html.escape
    info = latest(p, "sparkdeploy_deployment_info")
    nodes = sorted({s.get("metric", {}).get("node", "") for s in info} - {""})
    first = info[0].get("metric", {}) if info else {}
    since = latest(p, "sparkdeploy_deployment_since_timestamp_seconds")
    out = [
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="refresh" content="{int(refresh)}">',
        f"<title>sparkdeploy: {e(first.get('deployment', 'nothing serves'))}</title>",
        "<style>body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}"
        "table{border-collapse:collapse;margin:.3em 0 1.2em}"
        "th,td{padding:.2em .8em;border-bottom:1px solid #ddd;text-align:left}"
        "td.figure{font-variant-numeric:tabular-nums}h2{margin:.8em 0 .2em;font-size:1.1em}"
        ".none{color:#999}</style></head>",
        f'<body data-time="{at:.3f}" data-prometheus="{e(prom_url)}">',
        f"<h1>{e(first.get('deployment', 'Nothing of sparkdeploy serves'))}</h1>",
        f"<p>as of {e(time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(at)))}; "
        f"Prometheus: {e(prom_url)}</p>",
        "<h2>Deployment</h2><table>",
    ]
    for key in ("recipe", "engine", "kind", "image_digest"):
        out.append(f"<tr><th>{e(key)}</th><td>{e(first.get(key, '') or '-')}</td></tr>")
    if since:
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(_val(since[0])))
        out.append(f"<tr><th>serving since</th><td>{e(started)}</td></tr>")
    out.append("</table><h2>Nodes</h2><table><tr><th>node</th><th>role</th><th>engine ranks</th>"
               "<th>memory available"
               "</th><th>memory total</th><th>fast link</th><th>exporter</th></tr>")
    mem_a = {s["metric"].get("node"): s for s in p.query("sparkdeploy_node_memory_available_bytes")}
    mem_t = {s["metric"].get("node"): s for s in p.query("sparkdeploy_node_memory_total_bytes")}
    link = {s["metric"].get("node"): s for s in p.query("sparkdeploy:link_bytes:rate1m")}
    up = {s["metric"].get("node"): s for s in p.query('up{job="sparkdeploy"}')}
    roles = {s["metric"].get("node"): s["metric"].get("role", "") for s in info}
    ranks = {s["metric"].get("node"): s["metric"].get("ranks", "") for s in info}
    for n in nodes:
        cells = [cell(p, f'{name}{{node="{n}"}}', how, table[n]) if n in table else "<td>-</td>"
                 for table, name, how in ((mem_a, "sparkdeploy_node_memory_available_bytes", "bytes"),
                                          (mem_t, "sparkdeploy_node_memory_total_bytes", "bytes"),
                                          (link, "sparkdeploy:link_bytes:rate1m", "Bps"))]
        state_up = "up" if n in up and _val(up[n]) == 1 else "down"
        out.append(f"<tr><th>{e(n)}</th><td>{e(roles.get(n, ''))}</td><td>{e(ranks.get(n, '') or '-')}</td>"
                   f"{''.join(cells)}"
                   f"<td>{state_up}</td></tr>")
    out.append("</table><h2>Engine, live</h2><table>")
    out += [figure(p, label, q, how) for label, q, how in LIVE]
    out.append("</table><h2>Last fabric test</h2><table>")
    verdict = p.query("sparkdeploy_fabric_verdict")
    out.append(f"<tr><th>verdict</th><td>{e(verdict[0]['metric'].get('verdict', '-')) if verdict else 'none'}"
               "</td></tr>")
    sized = [s for s in p.query("sparkdeploy_fabric_busbw_gbytes_per_second")
             if str(s.get("metric", {}).get("bytes", "")).isdigit()]  # a size, never a query
    for s in sorted(sized, key=lambda s: int(s["metric"]["bytes"])):
        size = s["metric"]["bytes"]
        out.append(figure(p, f"bus bandwidth, {size} B (GB/s)",
                          f'sparkdeploy_fabric_busbw_gbytes_per_second{{bytes="{size}"}}', "rate", s))
    out.append("</table><h2>Last bench</h2><table>")
    out += [figure(p, label, q, how) for label, q, how in BENCH]
    out.append("</table><h2>Watchdog</h2>")
    events = _restarts(state, first.get("engine", ""))
    if not events:
        out.append("<p>no restart recorded</p>")
    else:
        out.append("<table><tr><th>at</th><th>what</th><th>class</th><th>why</th></tr>")
        for r in reversed(events):
            what = "gave up" if r.get("outcome") == "gave-up" else f"restart {r.get('restart', '')}"
            out.append(f"<tr><td>{e(str(r.get('at', '')))}</td><td>{e(what)}</td>"
                       f"<td>{e(str(r.get('class') or '-'))}</td><td>{e(str(r.get('why', '')))}</td></tr>")
        out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


class Handler(BaseHTTPRequestHandler):
    server_version = "sparkdeploy-status"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        if path == "/health":
            body, ctype, code = b"ok\n", "text/plain", 200
        elif path == "/":
            cfg = self.server.cfg  # type: ignore[attr-defined]
            body = page(cfg.prometheus, cfg.state, cfg.refresh).encode()
            ctype, code = "text/html; charset=utf-8", 200
        else:
            body, ctype, code = b"not found\n", "text/plain", 404
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args) -> None:
        sys.stderr.write(f"{self.address_string()} {fmt % args}\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="status_page", description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", required=True, help="ADDRESS:PORT")
    ap.add_argument("--prometheus", required=True, help="Prometheus' URL")
    ap.add_argument("--state", required=True, help="the node's records")
    ap.add_argument("--refresh", type=int, default=10, help="seconds between reloads")
    a = ap.parse_args(argv)
    host, _, port = a.listen.rpartition(":")
    if not port.isdigit():
        print(f"error: --listen {a.listen!r}: not ADDRESS:PORT", file=sys.stderr)
        return 2
    try:
        srv = ThreadingHTTPServer((host or "0.0.0.0", int(port)), Handler)
    except OSError as err:
        print(f"error: cannot listen on {a.listen}: {err.strerror or err}", file=sys.stderr)
        return 1
    srv.cfg = a  # type: ignore[attr-defined]
    print(json.dumps({"listening": f"http://{a.listen}"}), flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
