"""The whole suite in less time: the unit tests run beside the lab tests, at the lowest CPU
priority, so they take the CPU the lab tests leave while they wait on their nodes (a stall
deadline, a bring-up, a transfer); the lab tests keep what they need.

``python tests/together.py [PYTEST ARGS]``: the lab tests' output live, then the unit tests'
(kept aside until they end); the exit code is the lab tests' when they failed, else the unit
tests'. ``nox -s tests`` runs this when it is given no pytest arguments (docs/tests.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile


def _lowest_priority() -> None:
    os.nice(19)


def main(args: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest"]
    with tempfile.TemporaryFile("w+") as log:
        unit = subprocess.Popen([*pytest, "-p", "no:cacheprovider", *args, "tests/unit"],
                                stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=_lowest_priority)
        try:
            lab = subprocess.call([*pytest, *args, "tests/lab"])
            units = unit.wait()
        finally:
            if unit.poll() is None:  # interrupted: end the one process this started
                unit.terminate()
                unit.wait()
        log.seek(0)
        print("\n==== the unit tests, run beside the lab tests ====", flush=True)
        sys.stdout.write(log.read())
    print(f"\nlab tests: exit {lab}; unit tests: exit {units}", flush=True)
    return lab or units


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
