"""The depth sweep (``bench.depth``, ``bench.run --depths``): prefill and decode rates as the
context grows, measured as llama-benchy measures them (eugr/llama-benchy, ``results.py``).

At depth D the prompt is a context of exactly D tokens by the model's own tokenizer
(``tokenizer.json``, loaded with the ``tokenizers`` library: never a fallback, since a tokenizer
that silently fell back to GPT-2 corrupted published sweeps), then a short question; the server
adds its chat template. Each run at a depth sends a prompt of its own (random words from its own
seed, and a question naming the run), so no prefix cache serves it. Every measured request asks
for exactly ``--output-tokens`` (``ignore_eos``), one at a time.

Per request: ``pp_tok_s`` = the server's ``usage.prompt_tokens`` (template included) / TTFT,
nothing subtracted; TTFT ends at the first chunk carrying ``content`` or ``reasoning_content``;
``tg_tok_s`` = the tokens after the first / their time (``(completion_tokens - 1)`` over first
text chunk -> end of the stream: ``metrics.analyse``'s per-request decode rate). Each depth's
figures are the medians over its runs.

The prompt's length is confirmed, not assumed: the chat template's tokens are learnt from the
coherence gate's prompts (the server's count minus the tokenizer's; both prompts must agree),
and every measured request's ``usage.prompt_tokens`` must equal the tokenizer's count of its
message plus those. Any difference means the server does not tokenize as the given tokenizer
does: one failed line, no figures.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import random
import statistics
from pathlib import Path
from typing import Any

from sparkdeploy.bench import gate
from sparkdeploy.bench.client import BenchError, Settings, Target, default_model, prompt_body, run_level
from sparkdeploy.bench.metrics import RequestMetrics, confidence
from sparkdeploy.core.events import EventSink
from sparkdeploy.core.files import MB, InputError, read_input

STEP = "bench.depth"
MAX_DEPTH = 1_048_576
"""The deepest context asked for (tokens): beyond any model's context window today."""
MAX_DEPTHS = 32

_WORDS = ("the of and to in is was for on that with as by at from it an be this which or are "
          "river mountain city history music science winter garden market engine signal "
          "harbor letter window travel morning bridge forest library memory ocean summer "
          "quiet golden ancient distant simple careful bright narrow").split()


def parse_depths(text: str) -> list[int]:
    """``"0,2048,8192"`` -> [0, 2048, 8192]; ValueError naming what does not fit."""
    out: list[int] = []
    for part in str(text).split(","):
        p = part.strip()
        if not p.isdigit():
            raise ValueError(f"{p!r} is not a whole number of tokens (e.g. 0,2048,8192)")
        d = int(p)
        if d > MAX_DEPTH:
            raise ValueError(f"{d} is deeper than {MAX_DEPTH} tokens")
        if d in out:
            raise ValueError(f"depth {d} is given twice")
        out.append(d)
    if len(out) > MAX_DEPTHS:
        raise ValueError(f"more than {MAX_DEPTHS} depths")
    return out


class Tokens:
    """The model's tokenizer (``tokenizer.json``): counts and cuts text as the server will."""

    def __init__(self, where: str | Path):
        try:
            from tokenizers import Tokenizer  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            raise BenchError("the tokenizers library is missing (pip install "
                             "'sparkdeploy[bench]'): no depth sweep without the model's "
                             "tokenizer") from None
        path = Path(where)
        self.path = path / "tokenizer.json" if path.is_dir() else path
        try:
            text = read_input(self.path, limit=256 * MB, what="tokenizer.json")
        except InputError as e:
            raise BenchError(f"no tokenizer: {e} (the model's own tokenizer.json is needed; "
                             "there is no fallback)") from None
        try:
            self.tok = Tokenizer.from_str(text.decode("utf-8", errors="replace"))
        except Exception as e:  # noqa: BLE001  (tokenizers raises a bare Exception)
            first = (str(e).splitlines() or [type(e).__name__])[0][:160]
            raise BenchError(f"{self.path}: not a tokenizer.json: {first}") from None

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def context(self, n: int, rng: random.Random) -> str:
        """Text of exactly ``n`` tokens (random words of ``rng``)."""
        if n == 0:
            return ""
        words: list[str] = []
        text = ""
        while True:  # enough words: a word is at least one token
            have = self.count(text) if words else 0
            if have >= n + 8:
                break
            words += [rng.choice(_WORDS) for _ in range(max(8, n + 8 - have))]
            text = " ".join(words)
        enc = self.tok.encode(text, add_special_tokens=False)
        cut = enc.offsets[n - 1][1]
        got = text[:cut]
        for _ in range(64):  # a cut inside a word may tokenize differently: adjust by a character
            c = self.count(got)
            if c == n:
                return got
            cut += 1 if c < n else -1
            if not 0 < cut <= len(text):
                break
            got = text[:cut]
        raise BenchError(f"{self.path}: cannot make a prompt of exactly {n} tokens")


def question(run_id: str) -> str:
    return f"Request {run_id}: in one sentence, what is the text above about?"


def message(tokens: Tokens, depth: int, run: int, seed: int) -> str:
    """The prompt of run ``run`` at ``depth``: its own context of ``depth`` tokens, a question."""
    rng = random.Random(f"{seed}/{depth}/{run}")
    run_id = f"d{depth}-r{run}-{rng.randrange(16**6):06x}"
    ctx = tokens.context(depth, rng)
    return f"{ctx}\n\n{question(run_id)}" if ctx else question(run_id)


def template_tokens(answers: list[gate.Answer], tokens: Tokens) -> int:
    """What the server adds to a message (its chat template), from the gate's prompts."""
    extra = set()
    for a in answers:
        if a.prompt_tokens is None:
            raise BenchError(f"the server sent no usage.prompt_tokens for {a.prompt!r}: the "
                             "prompts' length cannot be confirmed; no figures")
        extra.add(a.prompt_tokens - tokens.count(a.prompt))
    if len(extra) != 1 or min(extra) < 0:
        said = "; ".join(f"{a.prompt!r}: server {a.prompt_tokens}, {tokens.path} "
                         f"{tokens.count(a.prompt)}" for a in answers)
        raise BenchError(f"the server does not count prompt tokens as {tokens.path} does "
                         f"({said}): not the served model's tokenizer; no figures")
    return extra.pop()


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def depth_row(depth: int, reqs: list[RequestMetrics]) -> dict[str, Any]:
    """One depth's figures: per run, and the medians over the runs (their 95 % interval too)."""
    runs: list[dict[str, Any]] = []
    for r in reqs:
        assert r.ttft_ms is not None and r.input_tokens is not None  # checked by the caller
        runs.append({"prompt_tokens": r.input_tokens, "ttft_ms": r.ttft_ms,
                     "pp_tok_s": r.input_tokens / (r.ttft_ms / 1000.0),
                     "tg_tok_s": r.decode_tok_s, "output_tokens": r.output_tokens,
                     "e2el_ms": r.e2el_ms})
    row: dict[str, Any] = {"depth": depth}
    for key in ("prompt_tokens", "pp_tok_s", "tg_tok_s", "ttft_ms"):
        values = [float(x[key]) for x in runs if x[key] is not None]
        row[key] = _median(values)
        row[f"{key}_sd"] = statistics.stdev(values) if len(values) > 1 else None
    row["ci95"] = {k: confidence([float(x[k]) for x in runs if x[k] is not None])
                   for k in ("pp_tok_s", "tg_tok_s", "ttft_ms")}
    row["runs"] = runs
    return row


def run_depths(url: str, settings: Settings, tokenizer: str | Path, depths: list[int], *,
               runs: int = 1, events: EventSink | None = None, step: str = STEP,
               judge: bool = True) -> dict:
    """The sweep as its JSON document (``config``, ``gate``, ``depths``); ``BenchError`` (one
    line) when the endpoint, the tokenizer or the gate fails (before any measured request) or the
    server counts a prompt otherwise than the tokenizer. A depth where a request failed (a prompt
    beyond the context window, a stall) is ``{"depth", "error"}`` (the first failure) and the
    sweep goes on. ``judge`` False: the coherence gate is off for this run (its prompts are still
    asked, unjudged: they teach the chat template's tokens; ``config["gate"]`` says so)."""
    tokens = Tokens(tokenizer)  # no tokenizer: fail before the first request
    if settings.output_tokens < 2:
        raise BenchError("--output-tokens must be at least 2: decode is the tokens after the first")
    target = Target.parse(url)
    listed = default_model(target, deadline=min(10.0, settings.timeout))
    s = dataclasses.replace(settings, model=settings.model or listed, api="chat", ignore_eos=True)
    answers = gate.check(target, s, judge)
    extra = template_tokens(answers, tokens)
    doc: dict[str, Any] = {
        "config": {"url": target.url, **s.as_json(), "tokenizer": str(tokens.path),
                   "depths": depths, "runs": runs, "template_tokens": extra,
                   "gate": "on" if judge else "off",
                   "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")},
        "gate": [dataclasses.asdict(a) for a in answers],
        "depths": [],
    }
    for depth in depths:
        texts = [message(tokens, depth, k, s.seed) for k in range(runs)]
        kept: list[RequestMetrics] = []
        run_level(target, s, runs, concurrency=1, events=events, step=step,
                  note=f"depth {depth}", keep=kept, bodies=[prompt_body(s, t) for t in texts])
        failed = None
        for k, (text, r) in enumerate(zip(texts, kept, strict=True)):
            where = f"depth {depth}, run {k + 1}"
            if r.error is not None:  # past the context window, a stall: this depth has no figure
                failed = failed or f"{where}: {r.error}"
                continue
            want = tokens.count(text) + extra
            if r.input_tokens != want:
                raise BenchError(
                    f"{where}: the server counted {r.input_tokens} prompt tokens where "
                    f"{tokens.path} counts {want} ({want - extra} + {extra} of the template): "
                    "not the served model's tokenizer; no figures")
            if r.decode_tok_s is None:
                failed = failed or f"{where}: no decode rate (fewer than 2 output tokens)"
        doc["depths"].append({"depth": depth, "error": failed} if failed
                             else depth_row(depth, kept))
    return doc
