"""bench.run's doors against real misbehaving HTTP servers on loopback: a host that is no host,
an answer with a field of the wrong type, ``--save`` where nothing can be saved, a server that
trickles. Each is one line and a non-zero exit, within ``--timeout``; never a traceback."""

import html
import json
import re
import time

import pytest
from invoke import Config, Context
from invoke.exceptions import Exit

from sparkdeploy.tasks import bench as bench_tasks
from tests.unit.hostile import Hostile

MODELS = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()


def ctx(tmp_path) -> Context:
    return Context(Config(overrides={"sparkdeploy": {"profile": str(tmp_path / "none.yaml"),
                                                     "state_dir": str(tmp_path / "state")}}))


def failed_lines(text: str) -> list[str]:
    return [m.group(1) for ln in text.splitlines()
            if (m := re.match(r"\S+ failed +bench\.run +- +(.*)$", ln))]


def sse(*events: dict, done: bool = True) -> bytes:
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return body + (b"data: [DONE]\n\n" if done else b"")


def text(s: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": s}}]}


@pytest.mark.parametrize(("url", "says"), [
    ("http://a..b:8000", "'a..b' is not a host name or an IP address"),
    ("http://.:80", "'.' is not a host name or an IP address"),
    (f"http://{'a' * 64}.lan:80", "is not a host name or an IP address"),
    ("http://-x:80", "'-x' is not a host name or an IP address"),
])
def test_a_host_that_is_no_host_is_one_line(tmp_path, url, says):
    with pytest.raises(Exit) as e:
        bench_tasks.run(ctx(tmp_path), url=url, requests=1, timeout="2")
    assert e.value.code == 2 and str(e.value).startswith("--url: ") and says in str(e.value)
    assert "\n" not in str(e.value)


def test_an_ipv6_host_is_put_back_in_brackets(tmp_path, capsys):
    with pytest.raises(Exit) as e:  # nothing listens on port 9 of ::1
        bench_tasks.run(ctx(tmp_path), url="http://[::1]:9", requests=1, timeout="2")
    assert e.value.code == 1
    [line] = failed_lines(capsys.readouterr().out)
    assert line.startswith("cannot reach http://[::1]:9/v1/models: ")


BAD_ANSWERS = [
    (sse(text("x"), {"choices": [], "usage": {"completion_tokens": "five"}}),
     "bad SSE event: usage.completion_tokens: Input should be a valid integer"),
    (sse(text("x"), {"choices": [], "usage": {"completion_tokens": 2.5}}),
     "bad SSE event: usage.completion_tokens: Input should be a valid integer"),
    (sse(text("x"), {"choices": [], "usage": {"completion_tokens": True}}),
     "bad SSE event: usage.completion_tokens: Input should be a valid integer"),
    (sse(text("x"), {"choices": [], "usage": {"completion_tokens": 1, "prompt_tokens": "7"}}),
     "bad SSE event: usage.prompt_tokens: Input should be a valid integer"),
    (sse(text("x"), {"choices": [], "usage": {"completion_tokens": -3}}),
     "bad SSE event: usage.completion_tokens: Input should be greater than or equal to 0"),
    (sse({"choices": "abc"}), "bad SSE event: choices: Input should be a valid list"),
    (sse({"choices": {"0": 1}}), "bad SSE event: choices: Input should be a valid list"),
    (sse({"choices": [{"delta": {"content": 5}}]}),
     "bad SSE event: choices.0.delta.content: Input should be a valid string"),
    (sse({"choices": [{"delta": "x"}]}),
     "bad SSE event: choices.0.delta: not a JSON object (str)"),
    (sse({"choices": [{"delta": {"content": "x"}}], "usage": "many"}),
     "bad SSE event: usage: not a JSON object (str)"),
    (b'data: {"choices": [{"delta": {"content": "x"}}], "usage": {"completion_tokens": 1e400}}'
     b"\n\ndata: [DONE]\n\n",
     "bad SSE event: usage.completion_tokens: Input should be a valid integer"),
    (b"data: {\n\ndata: [DONE]\n\n", "bad SSE payload: b'{'"),
    (sse(text("x"), done=False), "stream closed midway (after 1 events)"),
    # a broken peer: the whole answer in one SSE chunk (a buffering proxy), text counted as 0
    (sse(text("a b c d e f g h"), {"choices": [], "usage": {"completion_tokens": 8}}),
     "the whole answer (8 tokens) came in one piece: the server or a proxy buffers the stream, "
     "so no time per token can be measured"),
    (sse(*[text("w")] * 8, {"choices": [], "usage": {"completion_tokens": 0}}),
     "the server streamed 8 text chunk(s) and reports completion_tokens 0: no token count to "
     "measure by"),
]


def fails_writing_nothing(tmp_path, srv: Hostile) -> None:
    """bench.run against ``srv`` (closed after) exits 1 and writes neither --json nor --save."""
    out = tmp_path / "r.json"
    try:
        with pytest.raises(Exit) as e:
            bench_tasks.run(ctx(tmp_path), url=srv.url, concurrency="1", requests="2",
                            output_tokens="3", warmup="0", timeout="2", json=str(out), save=True)
    finally:
        srv.close()
    assert e.value.code == 1 and not out.exists() and not (tmp_path / "state" / "bench").exists()


@pytest.mark.parametrize(("body", "says"), BAD_ANSWERS)
def test_an_answer_with_a_field_that_does_not_fit_fails_in_one_line(tmp_path, capsys, body, says):
    srv = Hostile(body=body, ctype="text/event-stream", routes={"/v1/models": MODELS},
                  coherent=True)
    fails_writing_nothing(tmp_path, srv)
    assert failed_lines(capsys.readouterr().out) == [
        "concurrency 1: 0/2 ok, 2 failed, 0.0 output tok/s, decode median - tok/s, TTFT median "
        f"- ms: no request succeeded (most often: {says})",
        "every request failed: nothing written"]


GATE_LINE = "coherence gate: 'What is 17 + 25? Answer with the number only.'"


def test_a_whole_answer_to_a_streamed_request_is_named_not_a_stream(tmp_path, capsys):
    answer = json.dumps({"choices": [{"message": {"content": "hi"}}],
                         "usage": {"completion_tokens": 3}}).encode()
    srv = Hostile(body=answer, ctype="application/json", routes={"/v1/models": MODELS},
                  coherent=True)
    fails_writing_nothing(tmp_path, srv)
    assert failed_lines(capsys.readouterr().out)[0].endswith(
        "(most often: not a stream: HTTP 200 with one application/json answer, not server-sent "
        'events (the server ignores "stream": true))')


@pytest.mark.parametrize(("body", "says"), BAD_ANSWERS)
def test_a_gate_answer_that_does_not_fit_is_one_line_and_no_measured_request(tmp_path, capsys,
                                                                              body, says):
    srv = Hostile(body=body, ctype="text/event-stream", routes={"/v1/models": MODELS})
    fails_writing_nothing(tmp_path, srv)
    assert failed_lines(capsys.readouterr().out) == [f"{GATE_LINE}: {says}; no figures"]
    assert srv.paths == ["/v1/models", "/v1/chat/completions"]  # the gate's first prompt only


@pytest.mark.parametrize("mode", ["trickle", "trickle-headers", "silent"])
def test_a_gate_answer_that_trickles_ends_within_the_timeout(tmp_path, capsys, mode):
    srv = Hostile(mode=mode, gap=0.02, routes={"/v1/models": MODELS})
    started = time.monotonic()
    try:
        with pytest.raises(Exit) as e:
            bench_tasks.run(ctx(tmp_path), url=srv.url, requests="2", timeout="1",
                            deadline="86400")
    finally:
        srv.close()
    assert e.value.code == 1 and time.monotonic() - started < 3
    assert failed_lines(capsys.readouterr().out) == [
        f"{GATE_LINE}: timeout: no data for 1s; no figures"]


@pytest.mark.parametrize(("models", "says"), [
    (b'{"data": [{"id": 5}]}', "data.0.id: Input should be a valid string"),
    (b'{"data": "m"}', "data: Input should be a valid list"),
    (b'{"data": []}', "data: List should have at least 1 item"),
    (b"[1]", "not a JSON object (list)"),
])
def test_a_model_list_that_does_not_fit_is_one_line(tmp_path, capsys, models, says):
    srv = Hostile(body=models)
    try:
        with pytest.raises(Exit) as e:
            bench_tasks.run(ctx(tmp_path), url=srv.url, requests="1", timeout="2")
    finally:
        srv.close()
    assert e.value.code == 1
    [line] = failed_lines(capsys.readouterr().out)
    assert line.startswith(f"{srv.url}/v1/models: ") and says in line


def test_save_where_the_state_dir_cannot_take_it_is_one_line(tmp_path, capsys):
    from sparkdeploy.lab.standins import engine_server as es

    srv = es.start_in_thread(es.Config(port=0, ttft_ms=2, gap_ms=1, reasoning_tokens=0))
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "bench").write_text("a file where the bench directory goes\n")
    try:
        with pytest.raises(Exit) as e:
            bench_tasks.run(ctx(tmp_path), url=f"http://127.0.0.1:{srv.port}", concurrency="1",
                            requests="2", output_tokens="3", warmup="0", save=True)
    finally:
        srv.shutdown()
        srv.server_close()
    assert e.value.code == 1
    assert failed_lines(capsys.readouterr().out) == [
        f"--save: cannot make {tmp_path / 'state' / 'bench'}: File exists"]


def test_save_on_an_unreachable_endpoint_writes_nothing(tmp_path, capsys):
    with pytest.raises(Exit) as e:
        bench_tasks.run(ctx(tmp_path), url="http://127.0.0.1:9", requests="1", save=True)
    assert e.value.code == 1 and not (tmp_path / "state" / "bench").exists()
    assert failed_lines(capsys.readouterr().out) == [
        "cannot reach http://127.0.0.1:9/v1/models: [Errno 111] Connection refused"]


@pytest.mark.parametrize("mode", ["trickle", "trickle-headers", "silent"])
def test_a_server_that_trickles_ends_within_the_timeout(tmp_path, capsys, mode):
    # a byte every 20 ms: never a socket timeout; the deadline (a day) never comes either
    srv = Hostile(mode=mode, gap=0.02, routes={"/v1/models": MODELS}, coherent=True)
    started = time.monotonic()
    try:
        with pytest.raises(Exit) as e:
            bench_tasks.run(ctx(tmp_path), url=srv.url, concurrency="2", requests="2",
                            output_tokens="3", warmup="0", timeout="1", deadline="86400")
    finally:
        srv.close()
    took = time.monotonic() - started
    assert e.value.code == 1 and took < 3
    assert failed_lines(capsys.readouterr().out)[0].endswith(
        "no request succeeded (most often: timeout: no data for 1s)")


def test_a_model_list_that_trickles_ends_within_the_timeout(tmp_path, capsys):
    srv = Hostile(mode="trickle", gap=0.02)
    started = time.monotonic()
    try:
        with pytest.raises(Exit) as e:
            bench_tasks.run(ctx(tmp_path), url=srv.url, requests="1", timeout="1")
    finally:
        srv.close()
    assert e.value.code == 1 and time.monotonic() - started < 3
    assert failed_lines(capsys.readouterr().out) == [
        f"{srv.url}/v1/models: no whole answer within 1s"]


def test_the_gate_turned_off_for_one_run_measures_and_says_so_everywhere(tmp_path, capsys):
    """A model that cannot add (a base model): refused with the gate, measured without it, and the
    results, the JSON and the HTML report say the gate was off."""
    from sparkdeploy.bench.gate import OFF

    answer = sse(text("banana"), {"choices": [], "usage": {"completion_tokens": 1}})
    srv = Hostile(body=answer, ctype="text/event-stream", routes={"/v1/models": MODELS})
    out = tmp_path / "r.json"
    try:
        with pytest.raises(Exit):
            bench_tasks.run(ctx(tmp_path), url=srv.url, concurrency="1", requests="2",
                            warmup="0", timeout="2", json=str(out))
        assert failed_lines(capsys.readouterr().out)[0].startswith(f"{GATE_LINE} came back 'banana'")
        bench_tasks.run(ctx(tmp_path), url=srv.url, concurrency="1", requests="2", warmup="0",
                        timeout="2", json=str(out), gate=False)
    finally:
        srv.close()
    text_out = capsys.readouterr().out
    assert OFF in text_out
    assert [ln for ln in text_out.splitlines() if " ok " in ln and "concurrency 1: " in ln
            and ln.endswith("(gate off)")]
    doc = json.loads(out.read_text())
    assert doc["config"]["gate"] == "off" and doc["gate"] == []
    assert html.escape(OFF) in out.with_suffix(".html").read_text()
