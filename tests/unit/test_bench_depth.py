"""bench.depth (and bench.run --depths) against the engine stand-in on loopback: prompts of exactly
D tokens by the lab model's tokenizer, the server's count confirmed, prefill and decode rates as
the stand-in was set to give them; the coherence gate before any measured request (the lab fault
``garbage``); a missing or different tokenizer, a bad flag, a stalled stream: one line."""

import json
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from invoke.exceptions import Exit

from sparkdeploy.bench.depth import Tokens, message, parse_depths
from sparkdeploy.lab import faults, layout
from sparkdeploy.lab.hub_repo import tokenizer_files
from sparkdeploy.lab.standins import engine_server as es
from sparkdeploy.tasks import bench as bench_tasks
from tests.unit.hostile import Hostile
from tests.unit.test_bench_run import ctx

GATE = "coherence gate: 'What is 17 + 25? Answer with the number only.'"
TTFT_MS, GAP_MS, PREFILL, HALF = 60.0, 5.0, 20_000.0, 4096


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    for name, data in tokenizer_files().items():
        (d / name).write_bytes(data)
    return d


@pytest.fixture
def standin(tokdir):
    srv = es.start_in_thread(es.Config(port=0, ttft_ms=TTFT_MS, gap_ms=GAP_MS, reasoning_tokens=2,
                                       tokenizer=str(tokdir), prefill_tok_s=PREFILL,
                                       decode_half_depth=HALF))
    yield srv
    srv.shutdown()
    srv.server_close()


def failed_lines(text: str, step: str = "bench.depth") -> list[str]:
    return [m.group(1) for ln in text.splitlines()
            if (m := re.match(rf"\S+ failed +{re.escape(step)} +- +(.*)$", ln))]


def chatml(content: str) -> str:
    """The lab model's chat template rendered (hub_repo.CHAT_TEMPLATE, generation prompt on)."""
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n<think>\n"


# --- the stand-in counts as the tokenizer does --------------------------------------------------

TEXT = st.lists(st.sampled_from(list("abcdehinrt THE.,!?'s_-0123456789\n\t") +
                                ["é", "ÿ", "日", "½", " the", "<|im_end|>", "<|im_start|>"]),
                max_size=80).map("".join)


def counts_alike(tokdir, text: str) -> None:
    """The stand-in's standard-library count of ``text`` is the tokenizers library's."""
    counter = es.PromptCounter.load(str(tokdir))
    assert counter is not None
    assert counter.count(text) == Tokens(tokdir).count(text)


@settings(max_examples=300, deadline=None)
@given(text=TEXT)
def test_the_standin_counts_tokens_as_the_tokenizers_library(tokdir, text):
    counts_alike(tokdir, text)


QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
"""Qwen2/Qwen3's tokenizer.json pre-tokenizer pattern (a Split, then ByteLevel without its regex)."""


@pytest.fixture(scope="module")
def qwen_style(tmp_path_factory, tokdir):
    data = json.loads((tokdir / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN_SPLIT}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
         "use_regex": False}]}
    d = tmp_path_factory.mktemp("qwen-style")
    (d / "tokenizer.json").write_text(json.dumps(data))
    return d


@settings(max_examples=200, deadline=None)
@given(text=TEXT)
def test_a_split_pre_tokenizer_as_qwens_is_counted_as_tokenizers_does(qwen_style, text):
    counts_alike(qwen_style, text)


def test_the_standins_usage_counts_the_rendered_chat(tokdir):
    counter = es.PromptCounter.load(str(tokdir))
    body = {"messages": [{"role": "user", "content": "the theater in 2048"}]}
    want = Tokens(tokdir).count(chatml("the theater in 2048"))
    assert es._count_prompt(body, True, counter) == want
    assert es._count_prompt(body, True, None) == 4  # no tokenizer: words, as before


def test_a_tokenizer_the_standin_cannot_count_falls_back_to_words_and_says_so(tmp_path, capsys):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram"}}))
    assert es.PromptCounter.load(str(tmp_path)) is None
    assert "prompt tokens counted as words" in capsys.readouterr().err


# --- prompts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 7, 100, 1000, 4097])
def test_a_context_is_exactly_the_depth_asked(tokdir, n):
    import random

    tokens = Tokens(tokdir)
    assert tokens.count(tokens.context(n, random.Random(n))) == n


def test_each_run_at_a_depth_sends_a_prompt_of_its_own(tokdir):
    tokens = Tokens(tokdir)
    texts = [message(tokens, 512, k, seed=0) for k in range(3)] + [message(tokens, 0, k, 0)
                                                                  for k in range(3)]
    assert len({t[:24] for t in texts}) == 6  # no two share a prefix a cache could serve
    assert message(tokens, 512, 1, 0) == message(tokens, 512, 1, 0)  # reproducible


# --- the sweep ----------------------------------------------------------------------------------

def test_the_sweep_measures_the_rates_the_standin_was_set_to(standin, tokdir, tmp_path, capsys):
    out = tmp_path / "d.json"
    bench_tasks.depth(ctx(tmp_path), url=f"http://127.0.0.1:{standin.port}", tokenizer=str(tokdir),
                      depths="0,512,2048", runs="3", output_tokens="16", json=str(out))
    doc = json.loads(out.read_text())
    assert [r["depth"] for r in doc["depths"]] == [0, 512, 2048]
    tokens = Tokens(tokdir)
    gate_extra = {a["prompt_tokens"] - tokens.count(a["prompt"]) for a in doc["gate"]}
    assert gate_extra == {tokens.count(chatml("x")) - 1} == {doc["config"]["template_tokens"]}
    for row in doc["depths"]:
        k = row["depth"]
        # the server's count: the message (depth + the question) and the template, exactly
        want = [tokens.count(chatml(message(tokens, k, r, 0))) for r in range(3)]
        assert [x["prompt_tokens"] for x in row["runs"]] == want
        p = row["prompt_tokens"]
        assert p == sorted(want)[1]
        pp_set = p / (TTFT_MS / 1000 + p / PREFILL)
        tg_set = 1000 / GAP_MS / (1 + p / HALF)
        # what the stand-in was set to, or a little slower: a busy machine (the unit tests run
        # beside the lab's) only adds time, never takes it away
        assert 0.85 * pp_set <= row["pp_tok_s"] <= 1.02 * pp_set
        assert 0.85 * tg_set <= row["tg_tok_s"] <= 1.02 * tg_set
        assert 0.98 <= row["ttft_ms"] / (p / pp_set * 1000) <= 1.18
        assert all(x["output_tokens"] == 16 for x in row["runs"])
    assert doc["depths"][0]["pp_tok_s"] < doc["depths"][2]["pp_tok_s"]  # the shape
    assert doc["depths"][0]["tg_tok_s"] > doc["depths"][2]["tg_tok_s"]
    text = capsys.readouterr().out
    for k in (0, 512, 2048):
        assert re.search(rf"\| +pp @ d{k} \| +[\d,.]+ ± [\d,.]+ \|", text.replace("│", "|"))
        assert f"tg16 @ d{k}" in text


def test_bench_run_depths_is_the_same_sweep(standin, tokdir, tmp_path):
    out = tmp_path / "d.json"
    bench_tasks.run(ctx(tmp_path), url=f"http://127.0.0.1:{standin.port}", depths="0,256",
                    tokenizer=str(tokdir), runs="1", output_tokens="4", json=str(out))
    rows = json.loads(out.read_text())["depths"]
    assert [r["depth"] for r in rows] == [0, 256]
    assert all({"pp_tok_s", "tg_tok_s", "ttft_ms"} <= set(r) for r in rows)


# --- the coherence gate -------------------------------------------------------------------------

NONSENSE = f"{GATE} came back '{'!' * 16}', not '42': the model answers nonsense; no figures"


@pytest.mark.parametrize("task", ["depth", "run"])
def test_a_standin_answering_garbage_gets_no_figures(standin, tokdir, tmp_path, capsys, task):
    import urllib.request

    standin.state.control({"faults": "garbage"})
    url = f"http://127.0.0.1:{standin.port}"
    with urllib.request.urlopen(url + "/health") as r:
        assert r.status == 200  # healthy, by its health check
    out = tmp_path / "r.json"
    with pytest.raises(Exit) as e:
        if task == "depth":
            bench_tasks.depth(ctx(tmp_path), url=url, tokenizer=str(tokdir), depths="0",
                              json=str(out))
        else:
            bench_tasks.run(ctx(tmp_path), url=url, requests="2", warmup="0", json=str(out),
                            save=True)
    assert e.value.code == 1 and not out.exists() and not (tmp_path / "state" / "bench").exists()
    assert failed_lines(capsys.readouterr().out, f"bench.{task}") == [NONSENSE]
    assert standin.state.snapshot()["requests"] == 1  # the gate's first prompt; nothing measured


def test_with_the_gate_off_a_model_answering_garbage_is_measured_and_said_so(standin, tokdir,
                                                                              tmp_path, capsys):
    from sparkdeploy.bench.gate import OFF

    standin.state.control({"faults": "garbage"})
    out = tmp_path / "r.json"
    bench_tasks.depth(ctx(tmp_path), url=f"http://127.0.0.1:{standin.port}", tokenizer=str(tokdir),
                      depths="0", runs="1", output_tokens="4", json=str(out), gate=False)
    text = capsys.readouterr().out
    assert OFF in text and [ln for ln in text.splitlines() if ln.endswith("(gate off)")]
    doc = json.loads(out.read_text())
    assert doc["config"]["gate"] == "off" and doc["depths"][0]["tg_tok_s"] > 0


def test_the_lab_fault_garbage_reaches_an_engine_already_serving(standin, tokdir, tmp_path,
                                                                 monkeypatch, capsys):
    monkeypatch.setattr(layout, "NODES_DIR", tmp_path / "nodes")
    monkeypatch.setattr(layout, "LAB_DIR", tmp_path)
    (tmp_path / "nodes" / "spark1").mkdir(parents=True)
    monkeypatch.setattr(es, "LAB_VIEW", str(faults.view_dir("spark1")))  # the container's view
    rec = tmp_path / "faults.json"
    [r] = faults.set_fault("garbage", rec)
    assert r.status == "changed" and "It shows at once, in engines already serving too" in r.why
    url = f"http://127.0.0.1:{standin.port}"
    with pytest.raises(Exit):
        bench_tasks.depth(ctx(tmp_path), url=url, tokenizer=str(tokdir), depths="0")
    assert failed_lines(capsys.readouterr().out) == [NONSENSE]
    faults.set_fault("none", rec)
    bench_tasks.depth(ctx(tmp_path), url=url, tokenizer=str(tokdir), depths="0", runs="1",
                      output_tokens="2")
    assert not failed_lines(capsys.readouterr().out)


# --- every answer is data -----------------------------------------------------------------------

def test_no_tokenizer_is_one_line_and_no_request(tmp_path, capsys):
    srv = Hostile(routes={"/v1/models": b'{"data": [{"id": "m"}]}'})
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text('{"model": 5}')
    try:
        for tok, says in ((None, "no tokenizer: pass --tokenizer DIR (the served model's "
                                 "directory with its tokenizer.json); there is no fallback"),
                          (tmp_path / "empty", f"no tokenizer: {tmp_path}/empty/tokenizer.json: "
                                               "no such file (the model's own tokenizer.json is "
                                               "needed; there is no fallback)"),
                          (tmp_path / "bad", f"{tmp_path}/bad/tokenizer.json: not a tokenizer.json")):
            with pytest.raises(Exit) as e:
                bench_tasks.depth(ctx(tmp_path), url=srv.url, depths="0",
                                  tokenizer=None if tok is None else str(tok))
            assert e.value.code == 1
            [line] = failed_lines(capsys.readouterr().out)
            assert line.startswith(says)
    finally:
        srv.close()
    assert srv.paths == []


def test_a_server_counting_with_another_tokenizer_is_refused(tokdir, tmp_path, capsys):
    srv = es.start_in_thread(es.Config(port=0, ttft_ms=2, gap_ms=1))  # counts words
    out = tmp_path / "d.json"
    try:
        with pytest.raises(Exit) as e:
            bench_tasks.depth(ctx(tmp_path), url=f"http://127.0.0.1:{srv.port}",
                              tokenizer=str(tokdir), depths="0", json=str(out))
        served = srv.state.snapshot()["requests"]
    finally:
        srv.shutdown()
        srv.server_close()
    assert e.value.code == 1 and not out.exists() and served == 2  # the gate only
    [line] = failed_lines(capsys.readouterr().out)
    assert line.startswith(f"the server does not count prompt tokens as {tokdir}/tokenizer.json "
                           "does ('What is 17 + 25? Answer with the number only.': server 10, "
                           f"{tokdir}/tokenizer.json 40; 'Repeat this word exactly, nothing "
                           f"else: pineapple': server 7, {tokdir}/tokenizer.json 45)")
    assert line.endswith("not the served model's tokenizer; no figures")


@pytest.mark.parametrize(("body", "says"), [
    (b'data: {"choices": [{"delta": {"content": "x"}}]}\n\ndata: {"choices": [], "usage": '
     b'{"prompt_tokens": "many", "completion_tokens": 2}}\n\ndata: [DONE]\n\n',
     "bad SSE event: usage.prompt_tokens: Input should be a valid integer"),
    (b'data: {"choices": [{"delta": {"content": 7}}]}\n\ndata: [DONE]\n\n',
     "bad SSE event: choices.0.delta.content: Input should be a valid string"),
    (b'data: {"choices": "x"}\n\ndata: [DONE]\n\n', "bad SSE event: choices: Input should be a valid list"),
    (b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n', "stream closed midway (after 1 events)"),
    # a broken peer: the whole answer in one SSE chunk (a buffering proxy), a count of 0
    (b'data: {"choices": [{"delta": {"content": "a b c d e f g h"}}]}\n\ndata: {"choices": [], '
     b'"usage": {"completion_tokens": 8}}\n\ndata: [DONE]\n\n',
     "the whole answer (8 tokens) came in one piece: the server or a proxy buffers the stream, so "
     "no time per token can be measured"),
    (b"".join(b'data: {"choices": [{"delta": {"content": "w"}}]}\n\n' for _ in range(8))
     + b'data: {"choices": [], "usage": {"completion_tokens": 0}}\n\ndata: [DONE]\n\n',
     "the server streamed 8 text chunk(s) and reports completion_tokens 0: no token count to "
     "measure by"),
])
def test_a_measured_answer_that_does_not_fit_is_one_line(tokdir, tmp_path, capsys, body, says):
    tokens = Tokens(tokdir)
    srv = Hostile(body=body, ctype="text/event-stream", coherent=True,
                  routes={"/v1/models": b'{"data": [{"id": "m"}]}'},
                  gate_tokens=lambda p: tokens.count(chatml(p)))
    out = tmp_path / "d.json"
    try:
        with pytest.raises(Exit) as e:
            bench_tasks.depth(ctx(tmp_path), url=srv.url, tokenizer=str(tokdir), depths="0",
                              runs="1", timeout="2", json=str(out))
    finally:
        srv.close()
    assert e.value.code == 1 and not out.exists()
    assert failed_lines(capsys.readouterr().out) == [f"depth 0, run 1: {says}",
                                                     "no depth was measured: nothing written"]


@pytest.mark.parametrize("mode", ["trickle", "trickle-headers", "silent"])
def test_a_measured_answer_that_trickles_ends_within_the_timeout(tokdir, tmp_path, capsys, mode):
    tokens = Tokens(tokdir)
    srv = Hostile(mode=mode, gap=0.02, coherent=True, gate_tokens=lambda p: tokens.count(chatml(p)),
                  routes={"/v1/models": b'{"data": [{"id": "m"}]}'})
    started = time.monotonic()
    try:
        with pytest.raises(Exit) as e:
            bench_tasks.depth(ctx(tmp_path), url=srv.url, tokenizer=str(tokdir), depths="0",
                              runs="1", timeout="1", deadline="86400")
    finally:
        srv.close()
    assert e.value.code == 1 and time.monotonic() - started < 6  # a trickle never ends by itself
    assert failed_lines(capsys.readouterr().out) == [
        "depth 0, run 1: timeout: no data for 1s", "no depth was measured: nothing written"]


def test_a_depth_that_fails_is_one_line_and_the_others_are_written(standin, tokdir, tmp_path,
                                                                    capsys):
    # requests 1-2: the gate; 3: depth 0; 4: depth 256 stalls past the timeout; 5: depth 512
    # the stall (8 s) outlasts the timeout (1 s) by more than a loaded machine adds to the run
    standin.state.control({"faults": "stall:first=4:every=4:after=1:seconds=8"})
    out = tmp_path / "d.json"
    started = time.monotonic()
    with pytest.raises(Exit) as e:
        bench_tasks.depth(ctx(tmp_path), url=f"http://127.0.0.1:{standin.port}",
                          tokenizer=str(tokdir), depths="0,256,512", runs="1", timeout="1",
                          deadline="86400", output_tokens="4", json=str(out))
    assert e.value.code == 1 and time.monotonic() - started < 6  # CI ran it in 3.2 s beside the lab
    assert failed_lines(capsys.readouterr().out) == ["depth 256, run 1: timeout: no data for 1s"]
    rows = json.loads(out.read_text())["depths"]
    assert rows[1] == {"depth": 256, "error": "depth 256, run 1: timeout: no data for 1s"}
    assert [r["depth"] for r in rows] == [0, 256, 512] and rows[2]["tg_tok_s"] > 0


@pytest.mark.parametrize(("given", "says"), [
    ({"depths": "0,x"}, "--depths: 'x' is not a whole number of tokens (e.g. 0,2048,8192)"),
    ({"depths": "-1"}, "--depths: '-1' is not a whole number of tokens (e.g. 0,2048,8192)"),
    ({"depths": "8,8"}, "--depths: depth 8 is given twice"),
    ({"depths": "2000000"}, "--depths: 2000000 is deeper than 1048576 tokens"),
    ({"output_tokens": "1"}, "--output-tokens: "),
    ({"runs": "zero"}, "--runs: "),
    ({"url": "http://a..b:8000"}, "--url: 'http://a..b:8000': 'a..b' is not a host name or an "
                                  "IP address"),
])
def test_a_bad_flag_is_a_usage_error(tmp_path, given, says):
    with pytest.raises(Exit) as e:
        bench_tasks.depth(ctx(tmp_path), **{"url": "http://127.0.0.1:9", **given})
    assert e.value.code == 2 and str(e.value).startswith(says) and "\n" not in str(e.value)


@pytest.mark.parametrize(("given", "says"), [
    ({"depths": "0", "concurrency": "1,8"}, "--concurrency: does not apply to a depth sweep"),
    ({"depths": "0", "slo": "ttft=1s"}, "--slo: does not apply to a depth sweep"),
    ({"tokenizer": "/x"}, "--tokenizer: only applies with --depths"),
])
def test_bench_run_refuses_flags_of_the_other_sweep(tmp_path, given, says):
    with pytest.raises(Exit) as e:
        bench_tasks.run(ctx(tmp_path), url="http://127.0.0.1:9", **given)
    assert e.value.code == 2 and str(e.value).startswith(says)


def test_depths_parse():
    assert parse_depths("0, 2048,8192") == [0, 2048, 8192]


# --- the head's tokenizer by default --------------------------------------------------------------

def test_without_tokenizer_the_heads_model_directory_gives_it(standin, tokdir, tmp_path):
    from sparkdeploy.bench.client import Settings
    from sparkdeploy.core.outcomes import Status
    from sparkdeploy.steps.bench import depth_benchmark
    from sparkdeploy.steps.registry import run_one
    from tests.unit.fakes import FakeNode, scripted

    head = FakeNode()
    dep, ctx_, _ = scripted(tmp_path, {"spark1": head, "spark2": FakeNode()})
    path = f"{dep.profile.model.path.rstrip('/')}/tokenizer.json"
    keep = tmp_path / "state" / "bench" / "tokenizer"

    def sweep():
        return run_one(None, "bench.depth", f"http://127.0.0.1:{standin.port}",
                       Settings(input_tokens=1, output_tokens=2, timeout=10, deadline=10),
                       body=depth_benchmark, tokenizer=None, depths=[0], runs=1,
                       deployment=dep, tokenizer_dir=keep)

    [missing] = sweep()
    assert missing.status is Status.FAILED and missing.why == (
        f"no tokenizer: spark1:{path} does not exist (is the model downloaded?); pass "
        "--recipe R (the recipe serving) or --tokenizer DIR")
    assert standin.state.snapshot()["requests"] == 0 and not keep.exists()
    assert ("spark1", ["cat", "--", path]) in ctx_.calls
    head.node_files[path] = (tokdir / "tokenizer.json").read_text()
    [row] = sweep()
    assert row.status is Status.OK and row.details["depth"]["depth"] == 0
    assert (keep / "tokenizer.json").read_text() == head.node_files[path]


def test_the_standin_as_a_command_counts_with_the_model_directory_it_serves(tokdir, tmp_path):
    """``engine_server --model DIR`` (and SGLang's --model-path, vLLM's model argument): the
    directory's tokenizer counts, so the depth sweep runs against the command as the lab runs it."""
    from tools.perf.bench import free_port, start_standin

    port = free_port()
    proc = start_standin(port, 5, 500, ["--model", str(tokdir), "--prefill-tok-s", "100000"])
    out = tmp_path / "d.json"
    try:
        bench_tasks.depth(ctx(tmp_path), url=f"http://127.0.0.1:{port}", tokenizer=str(tokdir),
                          depths="0,300", runs="1", output_tokens="4", json=str(out))
    finally:
        proc.terminate()
        proc.wait(10)
    rows = json.loads(out.read_text())["depths"]
    tokens = Tokens(tokdir)
    assert [r["prompt_tokens"] for r in rows] == [tokens.count(chatml(message(tokens, d, 0, 0)))
                                                  for d in (0, 300)]
