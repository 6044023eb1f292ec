"""The HTML reports render in a real headless browser (Debian's Chromium) with no console
message: nothing external, every plot decoded, the page's own check ran. The test skips only
where Chromium is absent and this is not CI (``.ci/run`` installs it and sets ``CI``)."""

import json
import os
import re

import pytest

from sparkdeploy.bench.compare import compare
from sparkdeploy.bench.html import compare_report, run_report
from sparkdeploy.bench.sweep import run_sweep
from sparkdeploy.lab.standins import engine_server as es
from sparkdeploy.profile.config import Bench
from sparkdeploy.steps.bench import request_settings
from tests.chromium import CHROMIUM, render

if CHROMIUM is None and not os.environ.get("CI"):
    pytest.skip("no chromium here (apt-get install chromium); CI runs this", allow_module_level=True)


@pytest.fixture(scope="module")
def docs():
    srv = es.start_in_thread(es.Config(port=0, model="m", ttft_ms=10, gap_ms=1, metrics="vllm"))
    try:
        url = f"http://127.0.0.1:{srv.port}"
        settings = request_settings(Bench(), input_tokens=8, output_tokens=6)
        a = run_sweep(url, settings, concurrency=[1, 2], requests=2, warmup=0)
        b = run_sweep(url, settings, concurrency=[1, 2], requests=2, warmup=0)
    finally:
        srv.shutdown()
        srv.server_close()
    a["context"] = {"profile": {"name": "p<&>"}, "startup": {"port_open_s": 12.5}}
    return a, b


def test_run_report_renders_with_no_console_message(docs, tmp_path):
    doc = docs[0]
    path = tmp_path / "r.html"
    path.write_text(run_report(doc))
    text = path.read_text()
    assert "http://" not in text.replace(doc["config"]["url"], "") and "https://" not in text
    dom, console = render(path, tmp_path)
    assert console == []
    assert 'data-rendered="ok"' in dom  # the page's script ran and every plot decoded
    assert dom.count("<img") == 1
    assert "engine /metrics (vllm) vs client" in dom and "concurrency 2: 2/2 ok" in dom
    assert "TTFT mean ms" in dom and "port_open_s" in dom and "p&lt;&amp;&gt;" in dom


def test_compare_report_renders_both_runs(docs, tmp_path):
    a, b = docs
    path = tmp_path / "c.html"
    path.write_text(compare_report(a, b, compare(a, b, 5.0), "a.json", "b.json"))
    dom, console = render(path, tmp_path)
    assert console == [] and 'data-rendered="ok"' in dom
    assert dom.count("<img") == 2 and "b.json vs a.json (max regression 5%)" in dom


def test_the_check_bites_a_broken_plot_and_an_external_url(docs, tmp_path):
    page = run_report(docs[0])
    broken = re.sub(r'src="data:image/png;base64,[^"]+"', 'src="data:image/png;base64,AAAA"', page)
    external = page.replace("</body>", '<img src="https://example.invalid/x.png"></body>')
    for name, text in (("broken", broken), ("external", external)):
        path = tmp_path / f"{name}.html"
        path.write_text(text)
        dom, console = render(path, tmp_path)
        assert console, name
        assert 'data-rendered="ok"' not in dom, name
    assert json.dumps(console)  # the messages are text to show
