"""The lab fixture: brings the rehearsal lab up once per test run (root + Linux only).

The lab stays up after a run of some lab tests (a developer's re-run is then fast); set
``SPARKDEPLOY_LAB_DOWN=1`` to take it down at the end. A run of them all ends with the test that
takes it down from four nodes (``lab_last``); CI calls ``inv lab.down`` after it all the same.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
from dataclasses import dataclass

import pytest

from sparkdeploy.lab import layout, lifecycle

pytestmark = pytest.mark.lab


def pytest_collection_modifyitems(items):
    """Tests marked ``real_engine`` run one module after another, late: the real vLLM image
    loaded and shipped by the first serves the next (a test between them that swaps a node's
    dockerd, ``test_lab_dockerds``, would make each load it again: about 90 s). Tests marked
    ``lab_last`` (they take the lab down) run after every other test."""
    items.sort(key=lambda item: (item.get_closest_marker("lab_last") is not None,
                                 item.get_closest_marker("real_engine") is not None))


@dataclass
class Lab:
    nodes: list[str]
    ssh_config: str
    known_hosts: str
    state: dict
    up_results: list

    def addr(self, node: str, which: str = "fast") -> str:
        return self.state["node"][node][f"{which}_addr"]

    def ssh_argv(self, node: str, command: str | list[str]) -> list[str]:
        cmd = command if isinstance(command, str) else shlex.join(command)
        return ["ssh", "-F", self.ssh_config, "-o", "BatchMode=yes", "-o",
                "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={self.known_hosts}",
                node, "--", cmd]

    def ssh(self, node: str, command: str | list[str], check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess:
        """Run a command on a node over the lab's ssh_config (host keys checked)."""
        cp = subprocess.run(self.ssh_argv(node, command), capture_output=True, text=True,
                            timeout=timeout)
        if check and cp.returncode != 0:
            raise AssertionError(f"ssh {node} {command!r} -> {cp.returncode}\n"
                                 f"stdout: {cp.stdout}\nstderr: {cp.stderr}")
        return cp


@pytest.fixture(scope="session")
def lab() -> Lab:
    why = lifecycle.preflight()
    if why:
        pytest.skip(why)
    results = lifecycle.up(nodes=2, flavor=layout.DEFAULT_DOCKERD)
    bad = [r for r in results if r.failed]
    if bad:
        pytest.fail("lab.up failed: " + "; ".join(f"{r.step} {r.node or ''}: {r.why}"
                                                  for r in bad), pytrace=False)
    facts = lifecycle.lab_facts()
    yield Lab(nodes=facts["nodes"], ssh_config=facts["ssh_config"],
              known_hosts=facts["known_hosts"], state=facts, up_results=results)
    if os.environ.get("SPARKDEPLOY_LAB_DOWN") == "1":
        lifecycle.down()


@contextlib.contextmanager
def lab_with(lab: Lab, n: int):
    """The lab with ``n`` nodes for a module's tests, then the pair again (as the rest of the
    suite expects it): the extra nodes come and go around spark1 and spark2."""
    results = lifecycle.up(nodes=n, flavor=layout.DEFAULT_DOCKERD)
    try:
        bad = [r for r in results if r.failed]
        if bad:
            pytest.fail(f"lab.up --nodes {n} failed: " + "; ".join(
                f"{r.step} {r.node or ''}: {r.why}" for r in bad), pytrace=False)
        facts = lifecycle.lab_facts()
        yield Lab(nodes=facts["nodes"], ssh_config=facts["ssh_config"],
                  known_hosts=facts["known_hosts"], state=facts, up_results=results)
    finally:
        back = [r for r in lifecycle.up(nodes=len(lab.nodes), flavor=layout.DEFAULT_DOCKERD)
                if r.failed]
        assert not back, f"putting the {len(lab.nodes)}-node lab back failed: {back}"
