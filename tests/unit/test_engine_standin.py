"""The engine stand-in: SSE shape, keep-alive, max_tokens, thinking, faults, entry points."""

import http.client
import json
import socket
import subprocess
import sys
import time

import pytest

from sparkdeploy.lab.standins import engine_server as es


@pytest.fixture
def server():
    srv = es.start_in_thread(es.Config(port=0, ttft_ms=20, gap_ms=2, reasoning_tokens=3))
    yield srv
    srv.shutdown()
    srv.server_close()


def post(conn, path, body):
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp, resp.read()


def sse(raw: bytes) -> list:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            p = block[6:]
            out.append(p if p == "[DONE]" else json.loads(p))
    return out


CHAT = {"model": "m", "messages": [{"role": "user", "content": "one two three"}],
        "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}


def test_chat_stream_shape_and_keepalive(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    resp, raw = post(conn, "/v1/chat/completions", CHAT)
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    ev = sse(raw)
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [e["choices"][0]["delta"] for e in ev[1:7]]
    assert [list(d) for d in deltas] == [["reasoning_content"]] * 3 + [["content"]] * 3
    assert ev[7]["choices"] == [] and ev[7]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert ev[8] == "[DONE]" and len(ev) == 9
    sock = conn.sock
    resp, raw = post(conn, "/v1/chat/completions",
                     {**CHAT, "chat_template_kwargs": {"enable_thinking": False},
                      "stream_options": {}})
    assert conn.sock is sock  # same connection, reused
    ev = sse(raw)
    assert all("reasoning_content" not in e["choices"][0]["delta"] for e in ev[:-1])
    assert ev[-1] == "[DONE]" and len(ev) == 1 + 6 + 1  # role, 6 tokens, no usage


def test_natural_length_unless_ignore_eos(server):
    server.state.control({"natural_tokens": 4})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    _, raw = post(conn, "/v1/completions", {"prompt": "x", "max_tokens": 10})
    d = json.loads(raw)
    assert d["usage"]["completion_tokens"] == 4 and d["choices"][0]["finish_reason"] == "stop"
    _, raw = post(conn, "/v1/completions", {"prompt": "x", "max_tokens": 10, "ignore_eos": True,
                                            "stream": True,
                                            "stream_options": {"include_usage": True}})
    ev = sse(raw)
    assert [e["choices"][0]["text"] for e in ev[:10]] == [es._token(i) for i in range(10)]
    assert ev[10]["usage"]["completion_tokens"] == 10


def test_health_models_control(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request("GET", "/v1/models")
    assert json.loads(conn.getresponse().read())["data"][0]["id"] == "standin"
    resp, raw = post(conn, "/_control", {"faults": "http500:every=2", "ttft_ms": 5})
    snap = json.loads(raw)
    assert snap["ttft_ms"] == 5 and snap["faults"][0]["kind"] == "http500"
    codes = [post(conn, "/v1/chat/completions", {**CHAT, "stream": False})[0].status
             for _ in range(4)]
    assert codes == [200, 500, 200, 500]


def test_fault_rules_deterministic():
    r = es.parse_faults("close:fraction=0.25:after=2")[0]
    assert [n for n in range(1, 13) if r.selects(n)] == [4, 8, 12]
    assert r.after == 2
    with pytest.raises(ValueError):
        es.parse_faults("explode:every=2")


def test_stream_closed_midway_and_stall(server):
    server.state.control({"faults": "close:every=1:after=2"})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request("POST", "/v1/chat/completions", json.dumps(CHAT))
    resp = conn.getresponse()
    with pytest.raises(http.client.IncompleteRead):
        resp.read()
    server.state.control({"faults": "stall:every=1:after=1:seconds=0.3"})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=0.1)
    conn.request("POST", "/v1/chat/completions", json.dumps(CHAT))
    resp = conn.getresponse()
    with pytest.raises(TimeoutError):
        resp.read()


def _run(args, env=None, timeout=10):
    import os

    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-c", args], capture_output=True, text=True,
                          timeout=timeout, env=e)


def test_oom_and_port_in_use_exit_nonzero():
    code = "from sparkdeploy.lab.standins.engine_server import main; raise SystemExit(main())"
    r = _run(code.replace("main())", "main(['--port', '0', '--startup-fault', 'oom']))"))
    assert r.returncode == 1 and "CUDA out of memory" in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = _run(code.replace("main())", f"main(['--port', '{port}']))"))
    assert r.returncode == 1 and "address already in use" in r.stderr


def _never_opens(code: str, env: dict, port: int, marker: str) -> None:
    import os

    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, **env))
    try:
        first = p.stdout.readline()
        lines = first
        deadline = time.monotonic() + 5
        while marker not in lines and time.monotonic() < deadline:
            lines += p.stdout.readline()
        assert marker in lines
        assert p.poll() is None
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    finally:
        p.terminate()
        p.wait(5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hang_at_init_never_opens_port():
    port = _free_port()
    _never_opens("from sparkdeploy.lab.standins.engine_server import main; "
                 f"main(['--port', '{port}'])", {"SPARKDEPLOY_STANDIN_STARTUP_FAULT": "hang"},
                 port, "Init: waiting")


def test_vllm_ray_backend_without_ray_refuses(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    rc = es.vllm_main(["serve", "/models/q", "--tensor-parallel-size", "2",
                       "--distributed-executor-backend", "ray", "--port", "0", "--foo", "1"])
    assert rc == 1 and "Ray is required" in capsys.readouterr().err


class FakeRay:
    """Ray's API as vLLM's placement uses it: a group is ready once ``ready_after`` waits passed."""

    def __init__(self, gpus, ready_after=None):
        self.gpus, self.ready_after, self.calls, self.waits = gpus, ready_after, [], []
        self.util = self

    def cluster_resources(self):
        return {"GPU": self.gpus, "CPU": 4.0}

    def placement_group(self, specs, strategy):
        self.calls.append(("placement_group", specs, strategy))
        return self

    def ready(self):
        return "ref"

    def wait(self, refs, timeout):
        self.waits.append(timeout)
        self.now += timeout
        ok = self.ready_after is not None and len(self.waits) > self.ready_after
        return (refs, []) if ok else ([], refs)


def test_vllm_placement_group_specs_and_waiting_lines():
    fake = FakeRay(1.0, ready_after=3)
    fake.now = 0.0
    said = []
    pg = es.ray_placement(fake, 2, "10.77.1.1", said.append, clock=lambda: fake.now)
    assert pg is fake
    assert fake.calls == [("placement_group", [{"node:10.77.1.1": 0.001, "GPU": 1.0}, {"GPU": 1.0}], "PACK")]
    assert fake.waits == [10, 20, 40, 80]
    assert said[0].startswith("WARNING [ray_utils.py:352] Tensor parallel size (2) exceeds available GPUs (1).")
    waiting = [m for m in said if "Waiting for creating a placement group" in m]
    assert [m.split(" seconds.")[0].rsplit(" ", 1)[1] for m in waiting] == ["10", "30", "70"]
    assert "specs=[{'node:10.77.1.1': 0.001, 'GPU': 1.0}, {'GPU': 1.0}]" in waiting[0]
    assert "same as VLLM_HOST_IP environment variable" in waiting[0]


def test_vllm_placement_gives_up_after_the_timeout():
    fake = FakeRay(2.0)
    fake.now = 0.0
    with pytest.raises(es.StandinError, match="Cannot provide a placement group of placement_group_specs="):
        es.ray_placement(fake, 2, "10.77.0.11", lambda m: None, timeout=100, clock=lambda: fake.now)
    assert fake.waits == [10, 20, 40, 80]


def test_vllm_driver_address_order():
    assert es.vllm_host_ip({"VLLM_HOST_IP": "10.77.1.1"}, lambda: "10.77.0.11") == "10.77.1.1"
    assert es.vllm_host_ip({}, lambda: "10.77.0.11") == "10.77.0.11"
    assert es.vllm_host_ip({}, lambda: None) == "0.0.0.0"


def test_an_api_key_guards_v1_but_not_health():
    srv = es.start_in_thread(es.Config(port=0, ttft_ms=1, gap_ms=1, api_key="k3y"))
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        assert r.status == 200
        conn.request("GET", "/v1/models")
        r = conn.getresponse()
        assert (r.status, json.loads(r.read())) == (401, {"error": "Unauthorized"})
        conn.request("GET", "/v1/models", headers={"Authorization": "Bearer k3y"})
        r = conn.getresponse()
        r.read()
        assert r.status == 200
        resp, _ = post(conn, "/v1/chat/completions", CHAT)
        assert resp.status == 401
    finally:
        srv.shutdown()
        srv.server_close()
