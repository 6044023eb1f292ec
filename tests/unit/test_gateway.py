"""The gateway (``helpers/gateway.py``, issue 41) on loopback, with real HTTP: engine stand-ins
behind it, each serving one model."""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sparkdeploy.core.wait import wait_for
from sparkdeploy.helpers import gateway as gw
from sparkdeploy.lab.standins import engine_server as es

KEY = "sk-gateway-test-7f3a9c"


@pytest.fixture
def engines():
    servers = [es.start_in_thread(es.Config(port=0, model=m, ttft_ms=5, gap_ms=2))
               for m in ("m-a", "m-b")]
    yield servers
    for s in servers:
        s.shutdown()
        s.server_close()


def start(backends, **kw) -> gw.Gateway:
    return gw.start_in_thread(gw.Config(backends=backends, **kw))


def url(srv) -> str:
    return f"http://127.0.0.1:{srv.port}"


@pytest.fixture
def gateway(engines):
    g = start([gw.Backend(url(s)) for s in engines])
    yield g
    g.shutdown()
    g.server_close()


def call(g, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", g.port, timeout=10)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        data = r.read()
        return r.status, dict(r.getheaders()), data
    finally:
        conn.close()


def chat(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 3, **kw}


def test_routes_by_model(gateway):
    for model in ("m-a", "m-b", "m-a"):
        status, _, data = call(gateway, "POST", "/v1/chat/completions", chat(model))
        assert status == 200
        assert json.loads(data)["model"] == model
    status, _, data = call(gateway, "POST", "/v1/completions",
                           {"model": "m-b", "prompt": "hi", "max_tokens": 2})
    assert status == 200 and json.loads(data)["model"] == "m-b"


def test_models_are_merged_from_the_backends(gateway):
    status, headers, data = call(gateway, "GET", "/v1/models")
    assert status == 200
    assert [m["id"] for m in json.loads(data)["data"]] == ["m-a", "m-b"]
    assert "X-Sparkdeploy-Unreachable" not in headers


def test_an_unknown_model_is_a_404_naming_the_models_there(gateway):
    status, _, data = call(gateway, "POST", "/v1/chat/completions", chat("nope"))
    assert status == 404
    err = json.loads(data)["error"]
    assert err["type"] == "NotFoundError" and err["param"] == "model" and err["code"] == 404
    assert "`nope`" in err["message"] and "m-a, m-b" in err["message"]
    assert "sparkdeploy_gateway_unknown_model_total 1" in call(gateway, "GET", "/metrics")[2].decode()


def test_a_client_cannot_write_lines_into_the_log(gateway, capfd):
    call(gateway, "POST", "/v1/chat/completions", chat("x\ngateway: forged"))
    seen: list[str] = []  # the line is written once the answer is sent: a moment after
    wait_for(lambda: seen.append(capfd.readouterr().err) or "404" in "".join(seen), deadline=5,
             interval=0.01, what="the line")
    err = "".join(seen)
    assert "model=x?gateway: forged 404" in err and "\ngateway: forged" not in err


def test_a_body_without_a_model_is_a_400(gateway):
    status, _, data = call(gateway, "POST", "/v1/chat/completions", {"messages": []})
    assert status == 400 and json.loads(data)["error"]["param"] == "model"


def test_the_key_is_checked_at_the_gateway(engines):
    g = start([gw.Backend(url(s)) for s in engines], api_key=KEY)
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            assert call(g, "POST", "/v1/chat/completions", chat("m-a"), headers)[0] == 401
            assert call(g, "GET", "/v1/models", None, headers)[0] == 401
        good = {"Authorization": f"Bearer {KEY}"}
        assert call(g, "POST", "/v1/chat/completions", chat("m-a"), good)[0] == 200
        assert call(g, "GET", "/v1/models", None, good)[0] == 200
        assert call(g, "GET", "/health")[0] == 200  # open, as the engines' own
        metrics = call(g, "GET", "/metrics")[2].decode()  # open too
        assert "sparkdeploy_gateway_unauthorized_total 6" in metrics
    finally:
        g.shutdown()
        g.server_close()


def test_a_stream_arrives_chunk_by_chunk_before_the_backend_finishes():
    slow = es.start_in_thread(es.Config(port=0, model="slow", ttft_ms=20, gap_ms=150))
    g = start([gw.Backend(url(slow))])
    try:
        conn = http.client.HTTPConnection("127.0.0.1", g.port, timeout=10)
        t0 = time.monotonic()
        conn.request("POST", "/v1/chat/completions",
                     body=json.dumps(chat("slow", max_tokens=6, stream=True, ignore_eos=True,
                                          chat_template_kwargs={"enable_thinking": False})),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        arrivals = []
        while data := r.read1(65536):
            arrivals.append((time.monotonic() - t0, data))
        conn.close()
    finally:
        g.shutdown()
        g.server_close()
        slow.shutdown()
        slow.server_close()
    content = [t for t, d in arrivals if b'"content":"' in d and b'"content":""' not in d]
    # six tokens 150 ms apart: the backend ends about 0.8 s after the request
    assert len(content) >= 6
    assert content[0] < 0.45, arrivals
    assert content[-1] - content[0] > 0.6  # spread out as sent, not delivered at the end
    assert arrivals[-1][1].rstrip().endswith(b"data: [DONE]")


def test_a_backend_down_is_a_502_naming_it(engines):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nobody listens once closed
    g = start([gw.Backend(url(engines[0])), gw.Backend(dead, ["gone"])])
    try:
        status, _, data = call(g, "POST", "/v1/chat/completions", chat("gone"))
        assert status == 502
        msg = json.loads(data)["error"]["message"]
        assert "`gone`" in msg and dead in msg
        status, headers, data = call(g, "GET", "/v1/models")
        assert status == 200 and [m["id"] for m in json.loads(data)["data"]] == ["m-a"]
        assert headers["X-Sparkdeploy-Unreachable"] == dead
        # still routed to its backend (it may come back), still failing
        assert call(g, "POST", "/v1/chat/completions", chat("gone"))[0] == 502
        assert call(g, "POST", "/v1/chat/completions", chat("m-a"))[0] == 200
        metrics = call(g, "GET", "/metrics")[2].decode()
        assert 'sparkdeploy_gateway_errors_total{model="gone"} 2' in metrics
    finally:
        g.shutdown()
        g.server_close()


def test_per_model_figures_on_metrics(engines, gateway):
    engines[1].state.control({"faults": "http500:every=1"})
    call(gateway, "POST", "/v1/chat/completions", chat("m-a"))
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
    conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps(chat("m-a", max_tokens=4, stream=True, ignore_eos=True,
                                      stream_options={"include_usage": True})))
    conn.getresponse().read()
    conn.close()
    call(gateway, "POST", "/v1/chat/completions", chat("m-b"))
    status, headers, _ = call(gateway, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    want = ['sparkdeploy_gateway_requests_total{model="m-a"} 2',
            'sparkdeploy_gateway_errors_total{model="m-a"} 0',
            'sparkdeploy_gateway_completion_tokens_total{model="m-a"} 7',
            'sparkdeploy_gateway_requests_total{model="m-b"} 1',
            'sparkdeploy_gateway_errors_total{model="m-b"} 1',  # the engine's 500
            'sparkdeploy_gateway_time_to_first_byte_seconds_count{model="m-a"} 2',
            '_bucket{model="m-a",le="+Inf"} 2']
    # an answer is counted once its last bytes are sent: a moment after the client has them
    def shown() -> str | None:
        text = call(gateway, "GET", "/metrics")[2].decode()
        return text if all(w in text for w in want) else None

    text = wait_for(shown, deadline=5, interval=0.01, what="the figures")
    assert all(w in text for w in want)


def test_the_program_keeps_the_key_out_of_its_argv_logs_and_metrics(engines, tmp_path):
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({"listen": "127.0.0.1:0",
                                  "api_key_sha256": hashlib.sha256(KEY.encode()).hexdigest(),
                                  "backends": [{"url": url(engines[0])},
                                               {"url": url(engines[1]), "models": ["m-b"]}]}))
    argv = [sys.executable, str(Path(gw.__file__)), "--config", str(config)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["models"] == {"m-a": url(engines[0]), "m-b": url(engines[1])}
        port = int(ready["listening"].rsplit(":", 1)[1])

        class At:
            pass
        g = At()
        g.port = port  # type: ignore[attr-defined]
        good = {"Authorization": f"Bearer {KEY}"}
        assert call(g, "POST", "/v1/chat/completions", chat("m-a"), good)[0] == 200
        assert call(g, "POST", "/v1/chat/completions", chat("m-b"), {"Authorization": "x"})[0] == 401
        assert call(g, "POST", "/v1/chat/completions", chat("zz"), good)[0] == 404
        metrics = call(g, "GET", "/metrics")[2].decode()
        # a request's line is written once its answer is sent: a moment after the client has it
        wait_for(lambda: sum("POST" in line for line in lines) == 3, deadline=10, interval=0.02,
                 what="the gateway's lines")
    finally:
        proc.terminate()
        proc.wait(10)
        reader.join(10)
    err = "".join(lines)
    assert KEY not in " ".join(argv) and KEY not in metrics and KEY not in err
    assert "POST /v1/chat/completions model=m-a 200" in err  # a line per request, no header
    assert "/metrics" not in err  # scraped often: not logged
    assert "model=zz 404" in err


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_the_framing_is_followed_however_the_bytes_arrive(step):
    body = (b"5\r\nhello\r\n1a;ext=1\r\n" + b"x" * 26 + b"\r\n0\r\nX-Trailer: y\r\n\r\n")
    frame = gw.Framing()
    for i in range(0, len(body), step):
        assert not frame.done
        frame.feed(body[i:i + step])
    assert frame.done
    with pytest.raises(ValueError):
        frame.feed(b"more")


@pytest.mark.parametrize("bad", [b"zz\r\n", b"-5\r\n", b"9" * 5000])
def test_what_is_not_chunked_is_refused(bad):
    with pytest.raises(ValueError):
        gw.Framing().feed(bad)


def stream(g, model: str, **kw) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", g.port, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                     body=json.dumps(chat(model, stream=True, ignore_eos=True, **kw)))
        return conn.getresponse().read()
    finally:
        conn.close()


def test_a_backend_connection_is_kept_for_the_next_request(engines):
    backend = gw.Backend(url(engines[0]))
    g = start([backend])
    try:
        for _ in range(3):
            assert stream(g, "m-a").rstrip().endswith(b"data: [DONE]")
            assert call(g, "POST", "/v1/chat/completions", chat("m-a"))[0] == 200
        # one connection reused (a second when the client's next request came before the
        # gateway put the first back, after the answer's last bytes): not one per request
        wait_for(lambda: backend._idle.qsize() >= 1, deadline=5, interval=0.01,
                 what="the connection back in the pool")
        assert backend._idle.qsize() <= 2
    finally:
        g.shutdown()
        g.server_close()


def test_a_stream_the_backend_breaks_is_broken_for_the_client_too(engines, gateway):
    engines[0].state.control({"faults": "close:every=1:after=2"})
    with pytest.raises(http.client.IncompleteRead):
        stream(gateway, "m-a", max_tokens=8)
    text = call(gateway, "GET", "/metrics")[2].decode()
    assert 'sparkdeploy_gateway_errors_total{model="m-a"} 1' in text
