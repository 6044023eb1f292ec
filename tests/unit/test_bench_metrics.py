"""Metric definitions against hand-made timelines: exact values (vLLM bench serve's)."""

import json

import pytest

from sparkdeploy.bench.metrics import Timeline, analyse, percentile, stats, summarize


def ev(d) -> bytes:
    return json.dumps(d).encode()


ROLE = ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})


def chunk(key, text):
    return ev({"choices": [{"index": 0, "delta": {key: text}}]})


def usage(n):
    return ev({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}})


def timeline(start=10.0):
    return Timeline(start=start, events=[
        (10.001, ROLE),                               # role chunk: not the first token
        (10.100, chunk("reasoning_content", "a")),    # first token (reasoning counts)
        (10.130, chunk("reasoning_content", "b")),
        (10.170, chunk("content", "c")),
        (10.200, chunk("content", "d")),
        (10.250, usage(4)),
        (10.251, b"[DONE]"),
    ], end=10.252)


def test_request_metrics_exact():
    m = analyse(timeline())
    assert m.error is None
    assert m.ttft_ms == pytest.approx(100.0)
    assert m.itl_ms == pytest.approx([30.0, 40.0, 30.0])
    assert m.e2el_ms == pytest.approx(250.0)  # to the last chunk before [DONE]
    assert m.output_tokens == 4 and m.tokens_source == "usage"
    assert m.input_tokens == 7
    assert m.tpot_ms == pytest.approx(50.0)  # (250 - 100) / (4 - 1)
    assert m.decode_tok_s == pytest.approx(20.0)


def test_without_usage_counts_text_chunks_and_says_so():
    tl = timeline()
    tl.events = [e for e in tl.events if b"usage" not in e[1]]
    m = analyse(tl)
    assert m.output_tokens == 4 and m.tokens_source == "chunks"
    assert m.e2el_ms == pytest.approx(200.0)


def test_completions_text_chunks():
    tl = Timeline(start=0.0, events=[
        (0.05, ev({"choices": [{"text": "x"}]})), (0.06, ev({"choices": [{"text": "y"}]})),
        (0.06, usage(2)), (0.07, b"[DONE]")], end=0.07)
    m = analyse(tl)
    assert m.ttft_ms == pytest.approx(50.0) and m.itl_ms == pytest.approx([10.0])
    assert m.tpot_ms == pytest.approx(10.0)


def test_stream_without_done_is_an_error():
    tl = timeline()
    tl.events = tl.events[:3]
    assert analyse(tl).error == "stream ended before [DONE]"
    tl.error = "stream closed midway (after 3 events)"
    m = analyse(tl)
    assert m.error == "stream closed midway (after 3 events)" and m.ttft_ms is None


def test_percentiles_linear_like_numpy():
    xs = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(7.6)  # numpy.percentile(xs, 90)
    assert percentile(xs, 99) == pytest.approx(9.76)
    assert stats(xs)["mean"] == 4.0
    assert stats([]) == {"mean": None, "median": None, "p50": None, "p90": None, "p95": None,
                         "p99": None}


def test_summary_counts_failures_and_aggregates():
    a = analyse(timeline(10.0))
    b_tl = timeline(10.0)
    b_tl.events = [(t + 0.75, p) for t, p in b_tl.events]
    b_tl.start, b_tl.end = 10.75, 11.002
    b = analyse(b_tl)
    bad = analyse(Timeline(start=10.0, end=10.5, error="HTTP 500: boom"))
    s = summarize([a, b, bad])
    assert s["requests"] == 3 and s["completed"] == 2 and s["failed"] == 1
    assert s["errors"] == {"HTTP 500: boom": 1}
    assert s["duration_s"] == pytest.approx(1.002)  # first start -> last end
    assert s["output_tok_s"] == pytest.approx(8 / 1.002)
    assert s["requests_s"] == pytest.approx(2 / 1.002)
    assert s["ttft_ms"]["median"] == pytest.approx(100.0)
    assert s["itl_ms"]["mean"] == pytest.approx(100.0 / 3)  # pooled: 30, 40, 30 twice
    assert s["per_request_output_tok_s"]["median"] == pytest.approx(20.0)


def test_stats_are_numpys_linear_percentiles_under_their_names():
    from sparkdeploy.bench import metrics

    got = metrics.stats([float(x) for x in (10, 1, 9, 2, 8, 3, 7, 4, 6, 5)])
    assert got == pytest.approx({"mean": 5.5, "median": 5.5, "p50": 5.5, "p90": 9.1, "p95": 9.55,
                                 "p99": 9.91})
    assert metrics.stats([]) == {"mean": None, "median": None, "p50": None, "p90": None,
                                 "p95": None, "p99": None}
    with pytest.raises(ValueError, match="^no values$"):
        metrics.percentile([], 50)


def test_text_of_a_chunk_counts_every_reasoning_field_and_nothing_else():
    from sparkdeploy.bench import metrics

    def text(d: dict) -> str:
        return metrics.Chunk.model_validate(d).text()

    assert text({"choices": [{"delta": {"reasoning": "r"}}]}) == "r"
    assert text({"choices": [{"delta": {"reasoning_content": "a", "content": "b"}}]}) == "ba"
    assert text({"choices": [{"index": 0}]}) == ""
    assert text({"choices": []}) == ""
    assert text({"choices": None, "usage": None}) == ""


def _tl(*payloads, start=0.0, end=None):
    from sparkdeploy.bench.metrics import Timeline

    return Timeline(start=start, events=[(0.1 * (i + 1), p) for i, p in enumerate(payloads)],
                    end=end)


def _chunk(text="", **extra):
    import json

    return json.dumps({"choices": [{"delta": {"content": text}}], **extra}).encode()


def test_analyse_failures_each_say_what_went_wrong():
    from sparkdeploy.bench.metrics import analyse

    bad = analyse(_tl(_chunk("a"), b"{not json", b"[DONE]"))
    assert bad.error == "bad SSE payload: b'{not json'" and bad.ttft_ms is None and bad.itl_ms == []
    ev = analyse(_tl(_chunk("a"), b'{"error": {"message": "overloaded"}}', b"[DONE]"))
    assert ev.error == "error event: overloaded"
    assert analyse(_tl(b'{"error": "plain"}', b"[DONE]")).error == "error event: plain"
    empty = analyse(_tl(_chunk(""), b'{"usage": {"prompt_tokens": 7}}', b"[DONE]"))
    assert empty.error == "no content in the stream" and empty.input_tokens == 7
    cut = analyse(_tl(_chunk("a")))
    assert cut.error == "stream ended before [DONE]"


def test_analyse_and_summarize_a_run_exactly():
    from sparkdeploy.bench.metrics import analyse, summarize

    one = analyse(_tl(_chunk(""), _chunk("a"), _chunk("b"), _chunk("c"),
                      b'{"usage": {"completion_tokens": 3, "prompt_tokens": 5}}', b"[DONE]",
                      start=0.0, end=1.0))
    # TTFT at the first text chunk (0.2 s), E2EL at the usage chunk (0.5 s)
    assert one.ttft_ms == pytest.approx(200.0) and one.e2el_ms == pytest.approx(500.0)
    assert one.itl_ms == pytest.approx([100.0, 100.0]) and one.output_tokens == 3
    assert one.tpot_ms == pytest.approx(150.0) and one.decode_tok_s == pytest.approx(1000 / 150)
    single = analyse(_tl(_chunk("a"), b"[DONE]", start=0.0, end=0.5))
    assert single.output_tokens == 1 and single.tokens_source == "chunks"
    assert single.tpot_ms is None and single.decode_tok_s is None
    failed = analyse(_tl(b"{bad", start=0.0, end=2.0))
    s = summarize([one, single, failed])
    assert s["requests"] == 3 and s["completed"] == 2 and s["failed"] == 1
    assert s["duration_s"] == pytest.approx(2.0)
    assert s["total_output_tokens"] == 4 and s["total_input_tokens"] == 5
    assert s["output_tok_s"] == pytest.approx(2.0) and s["requests_s"] == pytest.approx(1.0)
    assert s["output_tokens_source"] == "chunks+usage"
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert s["e2el_ms"]["mean"] == pytest.approx(300.0)
    assert s["errors"] == {"bad SSE payload: b'{bad'": 1}
    assert summarize([]) == {**summarize([]), "duration_s": 0.0, "output_tok_s": 0.0,
                             "requests_s": 0.0, "output_tokens_source": None}


def test_a_payload_that_is_not_an_object_is_skipped():
    m = analyse(_tl(_chunk("a"), b"[1, 2]", b'"keep-alive"', _chunk("b"), b"[DONE]"))
    assert m.error is None and m.output_tokens == 2 and m.itl_ms == pytest.approx([300.0])


def test_a_usage_object_without_a_field_keeps_the_earlier_value():
    """Servers that send usage on every chunk: a later object naming only one count."""
    no_prompt = analyse(_tl(_chunk("a", usage={"prompt_tokens": 5, "completion_tokens": 1}),
                            _chunk("b", usage={"completion_tokens": 3}), b"[DONE]"))
    assert (no_prompt.input_tokens, no_prompt.output_tokens) == (5, 3)
    no_completion = analyse(_tl(_chunk("a", usage={"prompt_tokens": 5, "completion_tokens": 3}),
                                _chunk("b", usage={"prompt_tokens": 5}), b"[DONE]"))
    assert (no_completion.output_tokens, no_completion.tokens_source) == (3, "usage")


def test_rates_over_a_sub_second_run():
    one = analyse(_tl(_chunk("a"), _chunk("b"), _chunk("c"), b"[DONE]", start=0.0, end=0.5))
    s = summarize([one])
    assert s["duration_s"] == pytest.approx(0.5)
    assert s["output_tok_s"] == pytest.approx(6.0) and s["requests_s"] == pytest.approx(2.0)


def test_requests_without_an_end_give_no_duration():
    s = summarize([analyse(_tl(_chunk("a"), b"[DONE]", end=None))])
    assert s["completed"] == 1 and s["duration_s"] == 0.0 and s["output_tok_s"] == 0.0


def test_a_request_whose_usage_counts_no_tokens_for_its_text_is_failed_naming_it():
    # a broken peer: text streamed, completion_tokens 0; never "ok, 0.0 output tok/s"
    zero = analyse(_tl(_chunk("a", usage={"completion_tokens": 0}), b"[DONE]", end=1.0))
    assert zero.error == ("the server streamed 1 text chunk(s) and reports completion_tokens 0: "
                          "no token count to measure by")
    s = summarize([zero])
    assert s["completed"] == 0 and s["failed"] == 1 and s["total_output_tokens"] == 0


def test_an_answer_of_many_tokens_in_one_read_is_failed_and_one_token_is_not():
    one_read = [(0.5, b'{"choices": [{"delta": {"content": "a b c"}}], "usage": {"completion_tokens": 3}}'),
                (0.5, b"[DONE]")]
    m = analyse(Timeline(start=0.0, events=one_read, end=0.5))
    assert m.error is not None and m.error.startswith("the whole answer (3 tokens) came in one piece")
    single = [(0.5, b'{"choices": [{"delta": {"content": "42"}}], "usage": {"completion_tokens": 1}}'),
              (0.5, b"[DONE]")]
    assert analyse(Timeline(start=0.0, events=single, end=0.5)).error is None


def test_request_json_carries_the_metrics_under_their_names():
    m = analyse(timeline())
    assert m.as_json() == pytest.approx({
        "ttft_ms": 100.0, "e2el_ms": 250.0, "output_tokens": 4, "input_tokens": 7, "tpot_ms": 50.0,
        "decode_tok_s": 20.0, "tokens_source": "usage", "error": None})


def _req(ttft, e2el, out, error=None):
    from sparkdeploy.bench.metrics import RequestMetrics

    tpot = (e2el - ttft) / (out - 1) if error is None and out > 1 else None
    return RequestMetrics(ttft, e2el, out, 7, [], tpot, None, "usage", error, 0.0, 1.0)


def test_goodput_counts_requests_that_met_every_slo_over_all_requests():
    from sparkdeploy.bench.metrics import goodput, met_slo

    slo = {"ttft_ms": 100.0, "tpot_ms": 20.0}
    reqs = [_req(100.0, 290.0, 11),     # TTFT at the SLO, TPOT 19: good (<= as vLLM)
            _req(100.1, 200.0, 11),     # TTFT over
            _req(50.0, 260.0, 11),      # TPOT 21: over
            _req(50.0, 9e9, 1),         # one token: TPOT counts 0 (vLLM), no E2E SLO: good
            _req(None, None, None, error="HTTP 500")]  # failed: never good, but counted
    assert [met_slo(r, slo) for r in reqs] == [True, False, False, True, False]
    assert goodput(reqs, slo, 4.0) == {"slo": slo, "good": 2, "req_s": 0.5, "fraction": 0.4}
    assert met_slo(reqs[0], {"e2el_ms": 289.9}) is False
    assert goodput([], slo, 0.0)["fraction"] == 0.0


@pytest.mark.parametrize(("text", "slo"), [
    ("ttft=2s,tpot=80ms,e2e=30s", {"ttft_ms": 2000.0, "tpot_ms": 80.0, "e2el_ms": 30000.0}),
    ("tpot=40", {"tpot_ms": 40.0}),
    (" TTFT = 0.5s , e2el=1500ms", {"ttft_ms": 500.0, "e2el_ms": 1500.0}),
])
def test_slo_flags_parse_to_milliseconds(text, slo):
    from sparkdeploy.bench.metrics import parse_slo

    assert parse_slo(text) == slo


_NOT_SLO = "is not ttft=, tpot= or e2e= a duration (e.g. ttft=2s,tpot=80ms,e2e=30s)"


@pytest.mark.parametrize(("text", "says"), [
    ("ttft", f"'ttft' {_NOT_SLO}"),
    ("itl=5ms", f"'itl=5ms' {_NOT_SLO}"),
    ("ttft=fast", "ttft: 'fast' is not a duration (2s, 80ms)"),
    ("ttft=0s", "ttft: '0s' is not within (0, 1 day]"),
    ("tpot=nanms", "tpot: 'nanms' is not within (0, 1 day]"),
    ("e2e=1s,e2el=2s", "e2el is given twice"),
])
def test_a_bad_slo_is_one_line(text, says):
    from sparkdeploy.bench.metrics import parse_slo

    with pytest.raises(ValueError) as e:
        parse_slo(text)
    assert str(e.value) == says


def test_confidence_interval_is_students_t():
    from sparkdeploy.bench.metrics import confidence, intervals

    c = confidence([1.0, 2.0, 3.0])  # mean 2, s 1, t(0.975, 2) 4.303
    assert c["mean"] == 2.0 and c["runs"] == 3
    assert c["low"] == pytest.approx(2 - 4.303 / 3 ** 0.5)
    assert c["high"] == pytest.approx(2 + 4.303 / 3 ** 0.5)
    assert confidence([5.0]) == {"mean": 5.0, "low": None, "high": None, "runs": 1}
    wide = confidence([float(x) for x in range(40)])  # beyond the table: the normal's 1.96
    assert wide["high"] - wide["mean"] == pytest.approx(1.96 * (5330 / 39) ** 0.5 / 40 ** 0.5)
    got = intervals([{"output_tok_s": 10.0, "ttft_ms": {"p50": 5.0}},
                     {"output_tok_s": 12.0, "ttft_ms": {"p50": None}}])
    assert set(got) == {"output_tok_s", "ttft_ms.p50"}
    assert got["ttft_ms.p50"]["runs"] == 1 and got["output_tok_s"]["mean"] == 11.0
