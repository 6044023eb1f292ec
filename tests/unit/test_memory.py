"""The GPU-usable memory of a node, parsed from outputs recorded on real machines (a DGX Spark's
GB10 with its ``[N/A]`` memory, discrete GPUs): ``tests/unit/data/memory``, each file naming its
source and the query that produced it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkdeploy.helpers import memory_node as mn
from sparkdeploy.node import memory
from tests.unit.fakes import FakeContext, deployment
from tests.unit.profiles import SEED

DATA = Path(__file__).parent / "data" / "memory"
MIB = 1024 * 1024


def recorded(name: str) -> tuple[str, list[str]]:
    """(the recorded output, the fields its ``# query:`` line asked for)."""
    lines = (DATA / name).read_text().splitlines()
    query = next(ln for ln in lines if ln.startswith("# query: "))
    fields = query.removeprefix("# query: ").split()[0].split(",")
    return "\n".join(ln for ln in lines if not ln.startswith("#")), fields


def test_gb10_meminfo_recorded():
    text = (DATA / "gb10-meminfo.txt").read_text()
    assert mn.parse_meminfo(text) == {"MemTotal": 127600748 * 1024, "MemAvailable": 118566368 * 1024}


def test_gb10_query_with_header_is_not_supported():
    text, fields = recorded("gb10-query-gpu.csv")
    [row] = mn.parse_gpus(text, fields)
    assert row["memory.total"] is None and row["memory.used"] is None and row["memory.free"] is None
    assert row["utilization.gpu"] == "0 %" and row["temperature.gpu"] == "35"


def test_gb10_query_noheader():
    text, fields = recorded("gb10-query-gpu-noheader.csv")
    assert mn.parse_gpus(text, fields) == [{"memory.used": None, "memory.total": None,
                                            "utilization.memory": "0"}]


def test_discrete_query_recorded():
    text, fields = recorded("discrete-query-gpu.csv")
    assert mn.parse_gpus(text, fields) == [
        {"gpu_name": "NVIDIA GeForce GTX 1050 Ti", "memory.free": 2131 * MIB},
        {"gpu_name": "NVIDIA GeForce RTX 3080 Ti", "memory.free": 16000 * MIB}]


@pytest.mark.parametrize("value, want", [("81559", 81559 * MIB), ("81559 MiB", 81559 * MIB),
                                         ("[N/A]", None), ("N/A", None), ("[Not Supported]", None),
                                         ("Not Supported", None), ("", None), ("12.5", None)])
def test_mib(value, want):
    assert mn.mib(value) == want


def gb10_rows(n: int = 1) -> list[dict]:
    """GB10 rows as the helper's own query shows them (the recorded [N/A] memory)."""
    return mn.parse_gpus("".join(f"{i}, NVIDIA GB10, [N/A], [N/A]\n" for i in range(n)), mn.QUERY)


def test_unified_memory_comes_from_meminfo():
    meminfo = mn.parse_meminfo((DATA / "gb10-meminfo.txt").read_text())
    got = mn.judge(gb10_rows(), meminfo)
    assert got == {"gpus": 1, "names": ["NVIDIA GB10"], "unified": True,
                   "gpu_total": 127600748 * 1024, "gpu_usable": 118566368 * 1024, "gpu_free": None,
                   "source": "/proc/meminfo MemTotal/MemAvailable (unified memory: nvidia-smi "
                             "shows [N/A])", "why": ""}
    line = memory.NodeMemory.model_validate(got).line()
    assert line == ("1 x NVIDIA GB10: 113.1 GiB of 121.7 GiB usable per GPU (unified memory; "
                    "/proc/meminfo MemTotal/MemAvailable (unified memory: nvidia-smi shows [N/A]))")


def test_unified_memory_shared_by_gpus_and_memfree_kept():
    meminfo = mn.parse_meminfo("MemTotal: 1000 kB\nMemFree: 300 kB\nMemAvailable: 600 kB\n")
    got = mn.judge(gb10_rows(2), meminfo)
    assert (got["gpu_total"], got["gpu_usable"], got["gpu_free"]) == (500 * 1024, 300 * 1024, 150 * 1024)
    assert got["source"].endswith(", shared by 2 GPUs")


def test_unified_without_memavailable_says_why():
    got = mn.judge(gb10_rows(), mn.parse_meminfo("MemTotal: 1000 kB\nMemFree: 300 kB\n"))
    assert got["gpu_usable"] is None
    assert got["why"] == "nvidia-smi shows no GPU memory and /proc/meminfo has no MemAvailable"


def test_discrete_gpus_own_memory_smallest_bounds():
    rows = mn.parse_gpus("0, NVIDIA H100 80GB HBM3, 81559, 80000\n1, NVIDIA H100 80GB HBM3, 81559, 70000\n",
                         mn.QUERY)
    got = mn.judge(rows, {"MemTotal": 10 ** 12, "MemAvailable": 10 ** 12})
    assert (got["unified"], got["gpu_total"], got["gpu_usable"]) == (False, 81559 * MIB, 70000 * MIB)


def test_no_gpu_and_mixed_gpus_say_why():
    assert mn.judge([], {})["why"] == "nvidia-smi lists no GPU"
    rows = mn.parse_gpus("0, A, 81559, 80000\n1, B, [N/A], [N/A]\n", mn.QUERY)
    assert mn.judge(rows, {})["why"] == "nvidia-smi shows memory for some GPUs and not for others"


class OneNode(FakeContext):
    """A node that stages the helper and answers it with ``answer``."""

    def __init__(self, answer: dict):
        super().__init__()
        self._set("reply", answer)

    def answer(self, alias, argv, stdin, command, kw):
        if argv[:2] == ["sh", "-c"] and "base64 -d" in argv[2]:
            return self.result(command, 0, f"/tmp/sparkdeploy-stage-0/{argv[4]}/{argv[5]}\n")
        assert argv[:2] == ["sh", "-c"] and argv[2].endswith('exec "$@"'), argv
        return self.result(command, 0, json.dumps(self.reply) + "\n")


def test_read_runs_the_staged_helper(tmp_path):
    ctx = OneNode(mn.judge(gb10_rows(), {"MemTotal": 2 * 1024 ** 3, "MemAvailable": 1024 ** 3}))
    dep = deployment(SEED, tmp_path / "state", ctx)
    got = memory.read(dep.host("spark2"))
    assert (got.unified, got.gpu_usable) == (True, 1024 ** 3)
    alias, argv = ctx.calls[-1]
    assert alias == "spark2" and argv[4] == "python3" and argv[5].endswith("/memory_node.py")
    assert argv[6:] == ["read"] and "sha256sum -c --status" in argv[2]
