"""The status page (helpers/status_page.py) against a Prometheus that answers as Prometheus does:
each figure carries its query, the page's instant and Prometheus' value; names are escaped;
what Prometheus cannot say is "no data"; the watchdog's events come from the head's records."""

from __future__ import annotations

import html
import json
import re
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sparkdeploy.helpers import status_page as sp

SERIES = {
    "sparkdeploy_deployment_info": [
        {"metric": {"node": "spark1", "deployment": "qwen<b>", "recipe": "r", "engine": "vllm",
                    "kind": "vllm", "image_digest": "sha256:ab", "role": "head"}, "value": [1, "1"]},
        {"metric": {"node": "spark2", "deployment": "qwen<b>", "recipe": "r", "engine": "vllm",
                    "kind": "vllm", "image_digest": "sha256:ab", "role": "worker", "ranks": "1"},
         "value": [1, "1"]}],
    "sparkdeploy_node_memory_available_bytes": [
        {"metric": {"node": "spark1"}, "value": [1, "107374182400"]}],
    "sparkdeploy_node_memory_total_bytes": [
        {"metric": {"node": "spark1"}, "value": [1, "128849018880"]},
        {"metric": {"node": "spark2"}, "value": [1, "128849018880"]}],
    'up{job="sparkdeploy"}': [{"metric": {"node": "spark1"}, "value": [1, "1"]},
                               {"metric": {"node": "spark2"}, "value": [1, "0"]}],
    "sparkdeploy:generation_tokens:rate1m": [{"metric": {}, "value": [1, "27.43"]}],
    "sparkdeploy:ttft_seconds:p50_5m": [{"metric": {}, "value": [1, "NaN"]}],
    "sparkdeploy:kv_cache_usage:ratio": [{"metric": {}, "value": [1, "0.125"]}],
    "sparkdeploy_fabric_verdict": [{"metric": {"verdict": "degraded"}, "value": [1, "1"]}],
    "sparkdeploy_fabric_busbw_gbytes_per_second": [
        {"metric": {"bytes": "1073741824"}, "value": [1, "1.2"]},
        {"metric": {"bytes": "1048576"}, "value": [1, "0.4"]},
        {"metric": {"bytes": "1\"}) or vector(1"}, "value": [1, "9"]}],
}


@pytest.fixture
def prometheus():
    asked: list[dict] = []

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            q = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
            asked.append({k: v[0] for k, v in q.items()})
            query = q["query"][0]
            base = query.split("{")[0] if query.split("{")[0] in SERIES and "node=" in query else query
            got = SERIES.get(base, [])
            if "node=" in query:
                node = re.search(r'node="([^"]+)"', query).group(1)
                got = [s for s in got if s["metric"].get("node") == node]
            body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": got}})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}", asked
    srv.shutdown()


def test_every_figure_carries_its_query_the_instant_and_prometheus_value(prometheus, tmp_path):
    url, asked = prometheus
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "vllm.restarts.json").write_text(json.dumps({"restarts": [
        {"at": "2026-12-07T18:00:00Z", "restart": 1, "class": "nccl-hang", "why": "spark2: <frozen>",
         "outcome": "restarted"}]}))
    page = sp.page(url, str(tmp_path), 10, at=1796666400.0)
    assert {a["time"] for a in asked} == {"1796666400.000"}  # one instant for every figure
    assert '<body data-time="1796666400.000"' in page
    assert "<h1>qwen&lt;b&gt;</h1>" in page and "<b>" not in page.replace("<body", "")
    cells = re.findall(r'<td class="figure" data-query="([^"]*)" data-value="([^"]*)" data-how="(\w+)">'
                       r"([^<]*)</td>", page)
    shown = {html.unescape(q): (v, text) for q, v, how, text in cells}
    assert shown["sparkdeploy:generation_tokens:rate1m"] == ("27.43", "27.4")
    assert shown["sparkdeploy:ttft_seconds:p50_5m"] == ("NaN", "no data")
    assert shown["sparkdeploy:kv_cache_usage:ratio"] == ("0.125", "12.5 %")
    assert shown['sparkdeploy_node_memory_available_bytes{node="spark1"}'] == ("107374182400", "100.0 GiB")
    # a node Prometheus has no figure of shows none; the exporter that is down says so
    assert re.search(r"<tr><th>spark2</th><td>worker</td><td>1</td><td>-</td><td[^>]*>120.0 GiB</td>"
                     r"<td>-</td><td>down</td></tr>", page), page
    # the fabric's sizes in order, a label that is no size left out (it would be a query)
    sizes = [q for q in shown if q.startswith("sparkdeploy_fabric_busbw")]
    assert sizes == ['sparkdeploy_fabric_busbw_gbytes_per_second{bytes="1048576"}',
                     'sparkdeploy_fabric_busbw_gbytes_per_second{bytes="1073741824"}']
    assert "<th>verdict</th><td>degraded</td>" in page
    assert '<td class="none">no data</td>' in page  # the bench never ran
    assert "<td>nccl-hang</td><td>spark2: &lt;frozen&gt;</td>" in page


def test_a_prometheus_that_does_not_answer_is_a_page_of_no_data(tmp_path):
    page = sp.page("http://127.0.0.1:9", str(tmp_path), 10, at=0.0)
    assert "<h1>Nothing of sparkdeploy serves</h1>" in page
    assert 'class="figure"' not in page and "no restart recorded" in page


@pytest.mark.parametrize("value, how, text", [
    (0.0123, "ms", "12.3 ms"), (12.34, "plain_ms", "12.3 ms"), (0.5, "pct", "50.0 %"),
    (2**31, "bytes", "2.0 GiB"), (1.5e6, "Bps", "1.50 MB/s"), (3.0, "count", "3"),
    (27.04, "rate", "27.0"), (float("nan"), "rate", "no data")])
def test_each_figure_is_shown_one_way(value, how, text):
    assert sp.show(value, how) == text


def test_of_two_series_of_a_node_the_one_scraped_last_is_shown(prometheus, tmp_path, monkeypatch):
    url, _ = prometheus
    old = {"node": "spark1", "deployment": "d", "recipe": "before", "exported_node": "spark1"}
    new = {"node": "spark1", "deployment": "d", "recipe": "after"}
    monkeypatch.setitem(SERIES, "sparkdeploy_deployment_info", [
        {"metric": {"__name__": "sparkdeploy_deployment_info", **old}, "value": [1, "1"]},
        {"metric": {"__name__": "sparkdeploy_deployment_info", **new}, "value": [1, "1"]}])
    monkeypatch.setitem(SERIES, "timestamp(sparkdeploy_deployment_info)", [
        {"metric": new, "value": [1, "1796666400.5"]}, {"metric": old, "value": [1, "1796666100.0"]}])
    page = sp.page(url, str(tmp_path), 10, at=1796666401.0)
    assert "<th>recipe</th><td>after</td>" in page
