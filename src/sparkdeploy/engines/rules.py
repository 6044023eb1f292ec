"""The words engine logs are read in, shared by ``sparkdeploy.engines.diagnose`` and the engine kinds'
own diagnosis (``Kind.diagnosis``, ``Kind.sequence_rules``): a pattern guarded by cheap keys, a
rule giving a failure class with its priority and one line of why, a node's log cleaned, a
finding with its evidence, and the lines every engine prints through torch, NCCL and its API
server (distributed init that begins and must end, a crash, a watchdog's kill, ready)."""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import accumulate

MAX_TEXT = 400
"""An evidence line's most characters."""


@dataclass(frozen=True)
class Evidence:
    label: str
    line_no: int  # 1-based
    text: str

    def __str__(self) -> str:
        return f"{self.label}:{self.line_no}: {self.text}"




@dataclass(frozen=True)
class Pat:
    """A regular expression guarded by cheap keys: it is tried only on a line whose lowercase text
    contains one of ``keys`` (logs run to hundreds of thousands of lines; most match nothing)."""

    regex: re.Pattern
    keys: tuple[str, ...]

    def search(self, line: str, low: str | None = None) -> bool:
        low = line.lower() if low is None else low
        return any(k in low for k in self.keys) and self.regex.search(line) is not None


def pat(regex: str, *keys: str, icase: bool = True) -> Pat:
    return Pat(re.compile(regex, re.IGNORECASE if icase else 0), keys)


@dataclass(frozen=True)
class Rule:
    """A line matching ``pattern`` is evidence of ``cls`` at ``priority`` (higher wins).

    ``context``: the rule holds only when this also matches one of the ``window`` lines before
    (a bare ``KeyError`` is a model type only inside transformers' config lookup).
    ``void_after``: the rule does not hold when this matches a later line of the same log
    (NCCL finding no RDMA device is harmless once NCCL init completed).
    """

    cls: str
    priority: int
    pattern: Pat
    why: str
    context: Pat | None = None
    window: int = 12
    void_after: Pat | None = None

READY = pat(r"Application startup complete|The server is fired up and ready to roll|Uvicorn running on",
            "startup complete", "ready to roll", "uvicorn running")
"""What the engines print once their API serves (a failure seen before it may be void after)."""

# Distributed init, as the engines print it: stages that begin and must end. A stage ends with its
# own end marker or with any sign that start-up went on past init (weights, KV cache, graphs, API).
PAST_INIT = pat(
    r"Load weight begin|Loading weights|Starting to load model|Loading model weights"
    r"|Model loading took|Loading safetensors checkpoint"
    r"|Memory profiling takes|# GPU blocks|KV cache|Capturing (?:CUDA )?graph|Capture cuda graph"
    r"|Uvicorn running on|Application startup complete|The server is fired up and ready to roll"
    r"|Starting vLLM API server",
    "load weight", "loading weights", "load model", "loading model", "model loading", "safetensors",
    "memory profiling", "gpu blocks", "kv cache", "graph", "uvicorn running", "startup complete", "ready to roll",
    "api server",
)
# SGLang's last line before its cross-node message queue waits (vLLM prints a similar one and goes on).
SPANS_NODES = pat(r"custom ?allreduce is disabled because this process group spans across nodes",
                  "spans across nodes")
TORCH_DIST_ENDS = pat(r"Init torch distributed ends", "init torch distributed ends", icase=False)
# SGLang's end, or vLLM's line at the end of initialize_model_parallel
DIST_ENDS = pat(r"Init torch distributed ends|is assigned as DP rank", "init torch distributed ends",
                "assigned as dp rank", icase=False)


@dataclass(frozen=True)
class Stage:
    name: str
    begin: Pat
    end: Pat


INIT_STAGES: tuple[Stage, ...] = (
    Stage("torch distributed init (SGLang)",
          pat(r"Init torch distributed begin|Init nccl begin", "init torch distributed begin", "init nccl begin",
              icase=False), TORCH_DIST_ENDS),
    Stage("NCCL communicator init",
          pat(r"NCCL INFO .*Init START", "init start", icase=False),
          pat(r"Init COMPLETE", "init complete", icase=False)),
    Stage("distributed init (vLLM)",
          pat(r"distributed_init_method=\S+|(?:sglang|vLLM) is using nccl==", "distributed_init_method",
              "is using nccl", icase=False), DIST_ENDS),
    Stage("the cross-node message queue (after CustomAllreduce)", SPANS_NODES, DIST_ENDS),
)
CRASH = pat(
    r"Traceback \(most recent call last\)|terminate called after throwing|^\s*\w+(?:\.\w+)*(?:Error|Exception)\b:"
    r"|\bERROR\b.*(?:failed|exception|died)|core dumped|Segmentation fault|exited with code [1-9]",
    "traceback", "terminate called", "error", "exception", "core dumped", "segmentation fault", "exited with code",
    icase=False,
)
# A crash that is the hang's end, not its cause: a watchdog killing the wedged process (SGLang's
# scheduler watchdog kills it after ~300 s: "Rank 0 scheduler died (exit code: -9)").
KILLED = pat(r"exit code:? -9\b|signal 9\b|SIGKILL|watchdog timeout|killed by (?:the )?watchdog",
             "exit code", "signal 9", "sigkill", "watchdog", icase=False)


@dataclass
class Finding:
    cls: str
    priority: int
    why: str
    evidence: list[Evidence]


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _clean(line: str) -> str:
    line = _ANSI.sub("", line)
    if "\r" in line:  # progress bars redraw with \r: what stayed on screen is the last part
        parts = [p for p in line.split("\r") if p.strip()]
        line = parts[-1] if parts else ""
    return line.rstrip()


def _ev(label: str, i: int, text: str) -> Evidence:
    text = text.strip()
    if len(text) > MAX_TEXT:
        text = text[: MAX_TEXT - 3] + "..."
    return Evidence(label, i + 1, text)


@dataclass
class Log:
    """One node's log, cleaned, with each line's lowercase text for the patterns' keys."""

    label: str
    lines: list[str]
    lows: list[str]  # "" for a line no pattern's key occurs in
    candidates: list[int]  # the indices of the others, ascending

    @classmethod
    def of(cls, label: str, raw: str | Iterable[str], keys: Iterable[str]) -> Log:
        """``raw`` cleaned; the lines holding one of ``keys`` (every pattern's) are candidates."""
        lines: list[str] = []
        for item in [raw] if isinstance(raw, (str, bytes)) else raw:
            # tolerate a label mapped to one big string (or bytes), or lines with embedded newlines
            text = item.decode("utf-8", errors="replace") if isinstance(item, bytes) else str(item)
            lines += [_clean(piece) for piece in text.split("\n")]
        if isinstance(raw, (str, bytes)) and lines and not lines[-1]:
            lines.pop()  # the text's final newline ends the last line, it opens none
        lows = [line.lower() for line in lines]
        keep = sorted(_candidates(lows, keys))
        kept = set(keep)
        return cls(str(label), lines, [low if i in kept else "" for i, low in enumerate(lows)], keep)

    def hit(self, p: Pat, i: int) -> bool:
        low = self.lows[i]
        return bool(low) and p.search(self.lines[i], low)

    def last(self, p: Pat, start: int = 0) -> int | None:
        """Index of the last line at or after ``start`` matching ``p``."""
        return next((j for j in reversed(self.candidates) if j >= start and self.hit(p, j)), None)

    def ev(self, i: int) -> Evidence:
        return _ev(self.label, i, self.lines[i])


def _candidates(lows: list[str], keys: Iterable[str]) -> set[int]:
    """Indices of the lines containing any key: one fast substring scan of the whole log per key
    (trying every pattern on every line costs ~25 us a line; logs run to 10^5 lines)."""
    text = "\n".join(lows)
    starts = list(accumulate((len(low) + 1 for low in lows), initial=0))
    found: set[int] = set()
    for key in keys:
        pos = text.find(key)
        while pos != -1:
            i = bisect_right(starts, pos) - 1
            found.add(i)
            pos = text.find(key, starts[i + 1])
    return found


SequenceRule = Callable[[Log], "Finding | None"]
"""A rule over the order of one log's lines (a stage that began and never ended)."""
