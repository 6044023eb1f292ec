"""``nox -s perf -- diagnose``: the engine-log classifier's speed on a long synthetic two-node
log, and its accuracy on the real excerpts the unit tests hold."""

from __future__ import annotations

import time
from pathlib import Path

from sparkdeploy.engines.diagnose import classify, read_log


def run() -> dict[str, float]:
    """Speed on a long synthetic two-node log that hangs at the end; accuracy on the real excerpts
    under tests/unit/data/engine_logs/<class>/ (when the source tree is at hand)."""
    chatter = [
        "[2026-08-26 10:12:0{} TP0] Prefill batch. #new-seq: 1, #new-token: 512, #cached-token: 0, "
        "token usage: 0.01, #running-req: 0, #queue-req: 0",
        'INFO:     10.0.0.{}:4242 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
        "spark1:4242:4242 [0] NCCL INFO Channel 0{}/02 :    0   1",
    ]
    n = 100_000
    body = [chatter[i % 3].format(i % 10) for i in range(n)]
    logs = {
        "head": body + ["[2026-08-26 10:12:01 TP0] Init torch distributed begin.",
                        "[2026-08-26 10:12:03 TP0] CustomAllreduce is disabled because this process group "
                        "spans across nodes."],
        "worker": body,
    }
    t = time.perf_counter()
    d = classify(logs)
    spent = time.perf_counter() - t
    figures: dict[str, float] = {"lines": float(2 * n + 2), "seconds": spent, "lines_per_s": (2 * n + 2) / spent,
                                 "synthetic_right": float(d.cls == "nccl-init-hang")}
    root = Path(__file__).resolve().parents[2] / "tests" / "unit" / "data" / "engine_logs"
    cases = sorted(p for p in root.glob("*/*"))
    if cases:
        right = 0
        for case in cases:
            files = sorted(case.iterdir()) if case.is_dir() else [case]
            right += classify({f.name: read_log(str(f)) for f in files}).cls == case.parent.name
        figures.update({"real_excerpts": float(len(cases)), "real_excerpts_right": float(right),
                        "accuracy": right / len(cases)})
    return figures
