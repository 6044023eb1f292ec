"""The lab's memory-small fault: the crafted /proc/meminfo it binds over a node's is what the
memory helper then reads (1.0 GiB usable, the real total kept)."""

from __future__ import annotations

from pathlib import Path

from sparkdeploy.helpers import memory_node as mn
from sparkdeploy.lab import memory_fault

DATA = Path(__file__).parent / "data" / "memory"


def test_crafted_meminfo_reports_little_memory_keeps_the_rest():
    real = ("MemTotal:       24683792 kB\nMemFree:        22539080 kB\n"
            "MemAvailable:   23837644 kB\nBuffers:          123456 kB\n")
    text = memory_fault.crafted(real)
    assert text == ("MemTotal:       24683792 kB\nMemFree:         1048576 kB\n"
                    "MemAvailable:    1048576 kB\nBuffers:          123456 kB\n")
    rows = mn.parse_gpus("0, NVIDIA GB10, [N/A], [N/A]\n", mn.QUERY)
    got = mn.judge(rows, mn.parse_meminfo(text))
    assert (got["gpu_total"], got["gpu_usable"]) == (24683792 * 1024, 1024 ** 3)


def test_crafted_recorded_gb10_meminfo():
    text = memory_fault.crafted((DATA / "gb10-meminfo.txt").read_text().split("\n", 1)[1], 2048)
    assert mn.parse_meminfo(text) == {"MemTotal": 127600748 * 1024, "MemAvailable": 2048 * 1024}
