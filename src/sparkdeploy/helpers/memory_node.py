"""sparkdeploy's node-side helper: the memory this node's GPUs can use (standard library only).

    read

Prints one JSON object: the node's GPUs (``nvidia-smi --query-gpu=index,name,memory.total,
memory.free --format=csv,noheader,nounits``) and, per GPU, the memory it has in all
(``gpu_total``) and the memory it can use now (``gpu_usable``), in bytes, with where each
figure was read (``source``).

- A discrete GPU has memory of its own: nvidia-smi's ``memory.total`` and ``memory.free``.
- A unified-memory GPU (a DGX Spark's GB10) has none: nvidia-smi answers ``[N/A]`` (``Not
  Supported`` in its table) for every framebuffer field, and the GPU allocates from the
  operating system's memory. Then the figures are ``/proc/meminfo``'s: ``MemTotal`` in all,
  ``MemAvailable`` usable (the page cache is reclaimed for an allocation), and ``MemFree`` as
  ``gpu_free`` (what CUDA's ``cudaMemGetInfo`` reports there: the page cache counts as used),
  shared by the node's GPUs.
"""

from __future__ import annotations

import os
import sys

try:  # in the package (the controller, the tests)
    from . import protocol
except ImportError:  # a script: protocol.py beside it (a checkout) or a directory up (staged on a node)
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [_here, os.path.dirname(_here)]
    import protocol  # type: ignore[import-not-found, no-redef]

MIB = 1024 * 1024
KIB = 1024
QUERY = ["index", "name", "memory.total", "memory.free"]
MEMINFO = "/proc/meminfo"
NA = ("[N/A]", "N/A", "[Not Supported]", "Not Supported", "")


def parse_meminfo(text: str) -> dict:
    """``/proc/meminfo`` as {field: bytes} (its ``kB`` are KiB)."""
    out = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or not parts or not parts[0].isdigit():
            continue
        unit = parts[1] if len(parts) > 1 else ""
        out[name.strip()] = int(parts[0]) * (KIB if unit == "kB" else 1)
    return out


def mib(value: str) -> int | None:
    """A memory field of nvidia-smi's csv (``81559`` with nounits, ``81559 MiB`` without) in
    bytes; None for ``[N/A]`` / ``Not Supported``."""
    v = value.strip()
    if v in NA:
        return None
    if v.endswith("MiB"):
        v = v[:-3].strip()
    return int(v) * MIB if v.isdigit() else None


def parse_gpus(text: str, fields: list[str]) -> list[dict]:
    """The rows of ``nvidia-smi --query-gpu=<fields> --format=csv[,noheader][,nounits]``:
    {field: text} per GPU, with ``memory.*`` fields in bytes (None when not supported). A
    header line (``--format=csv``) is skipped."""
    rows = []
    for line in text.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if not line.strip() or len(cols) != len(fields) or cols[0] == fields[0] or \
                cols[0].startswith(f"{fields[0]} ["):
            continue
        row: dict = {}
        for f, c in zip(fields, cols, strict=True):
            row[f] = mib(c) if f.startswith("memory.") else c
        rows.append(row)
    return rows


def judge(gpus: list[dict], meminfo: dict) -> dict:
    """What the node's GPUs can use, from its GPU rows and its ``/proc/meminfo``."""
    names = sorted({str(g.get("name", "?")) for g in gpus})
    base = {"gpus": len(gpus), "names": names, "unified": False, "gpu_total": None,
            "gpu_usable": None, "gpu_free": None, "source": "", "why": ""}
    if not gpus:
        return {**base, "why": "nvidia-smi lists no GPU"}
    totals = [g.get("memory.total") for g in gpus]
    if all(t is None for t in totals):  # unified memory: the OS's memory, shared by the GPUs
        need = ("MemTotal", "MemAvailable")
        missing = [k for k in need if k not in meminfo]
        if missing:
            return {**base, "unified": True,
                    "why": f"nvidia-smi shows no GPU memory and {MEMINFO} has no {', '.join(missing)}"}
        n = len(gpus)
        free = meminfo.get("MemFree")
        return {**base, "unified": True, "gpu_total": meminfo["MemTotal"] // n,
                "gpu_usable": meminfo["MemAvailable"] // n,
                "gpu_free": free // n if free is not None else None,
                "source": f"{MEMINFO} MemTotal/MemAvailable (unified memory: nvidia-smi shows "
                          "[N/A])" + (f", shared by {n} GPUs" if n > 1 else "")}
    if any(t is None for t in totals) or any(g.get("memory.free") is None for g in gpus):
        return {**base, "why": "nvidia-smi shows memory for some GPUs and not for others"}
    # discrete GPUs: each its own; the smallest bounds what each rank gets
    return {**base, "gpu_total": min(int(t) for t in totals if t is not None),
            "gpu_usable": min(int(g["memory.free"]) for g in gpus),
            "gpu_free": min(int(g["memory.free"]) for g in gpus),
            "source": "nvidia-smi memory.total/memory.free (the smallest GPU's)"}


def read_node() -> dict:
    rc, out, err = protocol.run(["nvidia-smi", f"--query-gpu={','.join(QUERY)}",
                        "--format=csv,noheader,nounits"])
    try:
        with open(MEMINFO) as f:
            meminfo = parse_meminfo(f.read())
    except OSError:
        meminfo = {}
    if rc != 0:
        lines = [ln.strip() for ln in (err or out).splitlines() if ln.strip()]
        answer = judge([], meminfo)
        answer["why"] = f"nvidia-smi failed: {lines[-1] if lines else f'exit code {rc}'}"
        return answer
    return judge(parse_gpus(out, QUERY), meminfo)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["read"]:
        print("usage: memory_node.py read", file=sys.stderr)
        return 2
    protocol.answer(read_node())
    return 0


if __name__ == "__main__":
    sys.exit(main())
