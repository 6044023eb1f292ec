"""Compare two benchmark JSON files on the headline metrics, level by level.

Headlines of a sweep (``bench.run``): aggregate output tok/s (higher is better), median
per-request decode rate (higher), p90 TTFT (lower), p90 ITL (lower), per concurrency or rate. Of
a depth sweep (``bench.depth``): prefill (pp) and decode (tg) tok/s (higher) and TTFT (lower),
per depth. NEW regresses when, at a level present in both files, one of them is worse than BASE
by more than ``max_regression_pct`` percent, or is missing in NEW (every request failed, a depth
that failed) while BASE has it. A sweep and a depth sweep are not compared with each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparkdeploy.bench.client import BenchError
from sparkdeploy.engines.base import STARTUP

HEADLINES = [
    ("aggregate output tok/s", ("output_tok_s",), True),
    ("median decode tok/s", ("per_request_output_tok_s", "median"), True),
    ("p90 TTFT ms", ("ttft_ms", "p90"), False),
    ("p90 ITL ms", ("itl_ms", "p90"), False),
]


DEPTH_HEADLINES = [
    ("pp tok/s", ("pp_tok_s",), True),
    ("tg tok/s", ("tg_tok_s",), True),
    ("TTFT ms", ("ttft_ms",), False),
]


class CompareError(BenchError):
    """Two files that cannot be compared (a sweep and a depth sweep); one line, a usage error."""


@dataclass
class Row:
    level: str
    metric: str
    base: float | None
    new: float | None
    change_pct: float | None
    regressed: bool


@dataclass
class Comparison:
    rows: list[Row]
    only_base: list[str]
    only_new: list[str]
    max_regression_pct: float
    startup: list[Row] = field(default_factory=list)
    """The deployment's startup milestones both files carry (``context.startup``, seconds):
    shown side by side, never a regression (a bring-up is one sample, not a measurement)."""

    @property
    def regressions(self) -> list[Row]:
        return [r for r in self.rows if r.regressed]

    @property
    def compared(self) -> list[Row]:
        """The rows with a value in both files (a row with one side missing compares nothing,
        unless NEW lost what BASE had: that is a regression, and counted there)."""
        return [r for r in self.rows if r.regressed or (r.base is not None and r.new is not None)]


def parse_pct(text: str | float) -> float:
    """``"5%"``, ``"5"`` or ``5`` -> 5.0 (percent)."""
    s = str(text).strip().removesuffix("%").strip()
    try:
        v = float(s)
    except ValueError:
        raise ValueError(f"not a percentage: {text!r}") from None
    if v < 0:
        raise ValueError(f"must not be negative: {text!r}")
    if not v <= 100:  # nan fails this too; beyond 100% a gate lets everything through
        raise ValueError(f"must be a percentage from 0 to 100: {text!r}")
    return v


def _level(run: dict) -> str:
    if run.get("rate") is not None:
        return f"rate {run['rate']:g}"
    return f"c={run.get('concurrency')}"


def _get(summary: dict, keys):
    v: Any = summary
    for k in keys:
        v = v.get(k) if isinstance(v, dict) else None
    return v


def is_depth(doc: dict) -> bool:
    """A depth sweep's document (``bench.depth``: ``depths``), not a sweep's (``runs``)."""
    return "depths" in doc


def _levels(doc: dict) -> dict[str, dict]:
    """Each level's figures by its name: a sweep's summaries, a depth sweep's rows."""
    if is_depth(doc):
        return {f"depth {r['depth']}": r for r in doc["depths"]}
    return {_level(r): r["summary"] for r in doc["runs"]}


def compare(base: dict, new: dict, max_regression_pct: float = 5.0) -> Comparison:
    if is_depth(base) != is_depth(new):
        kinds = {True: "a depth sweep (bench.depth)", False: "a sweep (bench.run)"}
        raise CompareError(f"BASE is {kinds[is_depth(base)]} and NEW {kinds[is_depth(new)]}: "
                           "compare like with like")
    headlines = DEPTH_HEADLINES if is_depth(base) else HEADLINES
    b, n = _levels(base), _levels(new)
    rows = []
    for level in (k for k in b if k in n):
        for metric, keys, higher in headlines:
            bv, nv = _get(b[level], keys), _get(n[level], keys)
            if bv is None:
                rows.append(Row(level, metric, bv, nv, None, False))
                continue
            if nv is None:
                rows.append(Row(level, metric, bv, nv, None, True))
                continue
            change = (nv - bv) / bv * 100.0 if bv else 0.0
            worse = -change if higher else change
            rows.append(Row(level, metric, bv, nv, change, worse > max_regression_pct))
    return Comparison(rows, [k for k in b if k not in n], [k for k in n if k not in b],
                      max_regression_pct, startup_rows(base, new))


def startup_rows(base: dict, new: dict) -> list[Row]:
    """One row per startup milestone either file has (``engines.base.STARTUP`` order)."""
    def of(doc: dict) -> dict:
        got = _get(doc, ("context", "startup"))
        return got if isinstance(got, dict) else {}

    b, n = of(base), of(new)
    rows = []
    for k in (k for k in STARTUP if k in b or k in n):
        bv, nv = b.get(k), n.get(k)
        ok = isinstance(bv, int | float) and isinstance(nv, int | float)
        change = (nv - bv) / bv * 100.0 if ok and bv else None
        rows.append(Row("startup", f"{k} s", bv, nv, change, False))
    return rows
