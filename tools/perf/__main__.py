"""``python -m tools.perf [NAME ...]``: speed and accuracy figures as ``name.key: value``.

Each benchmark is a function returning ``{key: number}``; register it in ``BENCHMARKS`` as
``"name": "module:function"`` (imported only when run). With no names, all run in order.
Progress goes to stderr; stdout holds only the figures. ``nox -s perf -- NAME`` runs this.
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS: dict[str, str] = {
    "bench": "tools.perf.bench:run",
    "ship": "tools.perf.ship:run",
    "model": "tools.perf.model:run",
    "deploy": "tools.perf.deploy:run",
    "diagnose": "tools.perf.diagnose:run",
    "watchdog": "tools.perf.watchdog:run",
    "fanout": "tools.perf.fanout:run",
    "swap": "tools.perf.swap:run",
    "gateway": "tools.perf.gateway:run",
    "nnodes": "tools.perf.nnodes:run",
}


def run(name: str) -> dict[str, float]:
    module, _, func = BENCHMARKS[name].partition(":")
    return getattr(importlib.import_module(module), func)()


def main(argv: list[str] | None = None) -> int:
    names = list(sys.argv[1:] if argv is None else argv) or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"perf: unknown benchmark(s) {', '.join(unknown)}; known: "
              f"{', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    for name in names:
        for key, value in run(name).items():
            shown = f"{value:.3f}" if isinstance(value, float) else value
            print(f"{name}.{key}: {shown}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
