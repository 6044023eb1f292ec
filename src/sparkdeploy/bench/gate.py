"""The coherence gate: before any figure, fixed prompts with one checkable answer must come back
right from the served model (named by ``/v1/models``).

Why: a stale image produced garbage while every health check passed (spark-arena's blog), and
sparkrun refuses to benchmark until a known prompt comes back right. A model that answers
nonsense fast would otherwise be benchmarked as a fast model.

Each prompt is one streamed chat request (the thinking switch as the measurement will send it,
``temperature`` 0, no ``ignore_eos``: the model stops when it has answered); its answer is the
``content`` (the reasoning is not part of it), compared with the expected one with surrounding
whitespace stripped. Any other answer, or a request that fails, is one ``BenchError`` line naming
the prompt and what came back. The server's ``usage.prompt_tokens`` of each prompt is kept: the
depth sweep learns the chat template's tokens from them (``bench.depth``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from sparkdeploy.bench.client import BenchError, Overhead, Settings, Target, guarded_request, prompt_body
from sparkdeploy.bench.metrics import Chunk, Timeline, analyse
from sparkdeploy.core.outside import OutsideError, parsed, validated

PROMPTS: tuple[tuple[str, str], ...] = (
    ("What is 17 + 25? Answer with the number only.", "42"),
    ("Repeat this word exactly, nothing else: pineapple", "pineapple"),
)
"""(prompt, the answer) pairs: an arithmetic answer and a word repeated back."""
MAX_TOKENS = 1024
"""Room for a thinking model to think before it answers (Qwen3.5 thinks by default)."""
SHOWN = 60
"""How much of a wrong answer the failed line shows."""


@dataclass(frozen=True)
class Answer:
    prompt: str
    answer: str
    prompt_tokens: int | None
    """The server's ``usage.prompt_tokens`` for this prompt (template included), if it sent one."""


def _content(tl: Timeline) -> str:
    """The answer's text of a stream ``analyse`` found sound."""
    out = []
    for _t, payload in tl.events:
        if payload.strip() == b"[DONE]":
            continue
        d = parsed(payload, "bad SSE event")
        if isinstance(d, dict):
            out.append(validated(Chunk, d, "bad SSE event").answer())
    return "".join(out)


OFF = ("coherence gate off (--no-gate): its answers were not checked, so these figures may be a "
       "model's that answers nonsense")
"""What a run with the gate off says, in its results, its JSON and its HTML report."""


def prompts_for(s: Settings) -> tuple[tuple[tuple[str, str], ...], int]:
    """The gate's (prompt, answer) pairs and its answers' token cap for ``s.model``: its
    recipe's ``about.gate`` when one is given in ``s.gates``, else ``PROMPTS``.

    A model that cannot add (a base model, the lab's ``lab-tiny`` with random weights) still has
    a checkable answer: the greedy text its recipe recorded for those exact weights (from a
    single vLLM process on the same files). A broken engine (a rank that computes garbage, a
    wrong or corrupt shard, a stale image) gives another text, and is refused as before."""
    for model, pairs, max_tokens, _source in s.gates:
        if model == s.model:
            return pairs, max_tokens
    return PROMPTS, MAX_TOKENS


def check(target: Target, s: Settings, judge: bool = True) -> list[Answer]:
    """Ask every prompt of the gate (``prompts_for``) of ``s.model``; the answers, or
    ``BenchError`` (one line) at the first one that does not come back right (``judge`` False:
    the gate is off for this run; a request that fails still fails, what comes back is kept
    unjudged)."""
    pairs, max_tokens = prompts_for(s)
    gs = dataclasses.replace(s, api="chat", output_tokens=max_tokens, ignore_eos=False)
    out = []
    for prompt, want in pairs:
        tl = Timeline(start=time.perf_counter())
        conn = guarded_request(None, target, gs, "/v1/chat/completions",
                               prompt_body(gs, prompt, temperature=0), tl, Overhead())
        if conn is not None:
            conn.close()
        m = analyse(tl)
        what = f"coherence gate: {prompt!r}"
        if m.error is not None:
            raise BenchError(f"{what}: {m.error}; no figures")
        try:
            answer = _content(tl)
        except (ValueError, OutsideError) as e:  # analyse parsed it already: not expected
            raise BenchError(f"{what}: {e}; no figures") from None
        if judge and answer.strip() != want.strip():
            shown = answer.strip()
            shown = shown if len(shown) <= SHOWN else shown[:SHOWN] + "..."
            raise BenchError(f"{what} came back {shown!r}, not {want!r}: the model answers "
                             "nonsense; no figures")
        out.append(Answer(prompt, answer, m.input_tokens))
    return out
