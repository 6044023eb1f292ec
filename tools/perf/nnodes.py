"""``nox -s perf -- nnodes``: ``deploy.all`` with pipeline parallel 3 on three of four lab nodes
(configs/lab-3nodes.yaml), through the lab test that checks what it leaves (one rank per node,
the pipeline's stages in the ranks' own logs, the endpoint streaming), timed.

- ``nnodes.deploy_all_3_seconds``: the whole ``deploy.all``.

It is the lab test marked ``perf_lab`` in tests/lab/test_lab_nnodes.py: 75-85 s of a stand-in
bring-up, left out of the suite CI runs (the pipeline's flags are held exactly by the unit tests,
and the real vLLM's PP=2 was measured by hand). Needs root and the lab; grows it to four nodes
and leaves the pair.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run() -> dict[str, float]:
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "perf_lab", "-s",
                        "tests/lab/test_lab_nnodes.py"], cwd=ROOT, capture_output=True, text=True)
    sys.stderr.write(p.stdout[-3000:] + p.stderr[-2000:])
    if p.returncode != 0:
        raise SystemExit(f"perf nnodes: the lab test failed (exit {p.returncode})")
    from sparkdeploy.lab import layout, lifecycle

    back = [r for r in lifecycle.up(nodes=2, flavor=layout.DEFAULT_DOCKERD) if r.failed]  # the pair
    if back:
        raise SystemExit(f"perf nnodes: back to the pair: {back[0].why}")
    m = re.search(r"nnodes\.deploy_all_3_seconds: ([0-9.]+)", p.stdout)
    if m is None:
        raise SystemExit("perf nnodes: the test printed no figure")
    return {"deploy_all_3_seconds": float(m.group(1))}
