"""The PNG: four panels against concurrency (or request rate), matplotlib's Agg backend.

1. aggregate output tok/s; 2. per-request decode rate (median, mean); 3. TTFT (median, p90,
p99); 4. ITL (median, p90, p99). The data actually drawn (read back from the figure's lines) is
also stored inside the PNG as a ``tEXt`` chunk under ``sparkdeploy.bench``, so
``read_png_panels(path)`` recovers it without matplotlib: the check that the picture holds what
the runs measured.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path
from typing import Any

from sparkdeploy.core.outside import parsed

PNG_KEY = "sparkdeploy.bench"

PANELS: list[tuple[str, str, list[tuple[str, tuple[str, ...]]]]] = [
    ("output_tok_s", "aggregate output tok/s", [("total", ("output_tok_s",))]),
    ("decode_tok_s", "per-request decode rate (tok/s)",
     [("median", ("per_request_output_tok_s", "median")),
      ("mean", ("per_request_output_tok_s", "mean"))]),
    ("ttft_ms", "TTFT (ms)", [(q, ("ttft_ms", q)) for q in ("median", "p90", "p99")]),
    ("itl_ms", "ITL (ms)", [(q, ("itl_ms", q)) for q in ("median", "p90", "p99")]),
]


def _get(summary: dict, keys: tuple[str, ...]):
    v: Any = summary
    for k in keys:
        v = v.get(k) if isinstance(v, dict) else None
    return v


def panel_data(runs: list[dict]) -> dict:
    """What the four panels should show, straight from the run summaries."""
    by_rate = any(r.get("rate") is not None for r in runs)
    xs = [r["rate"] if by_rate else r["concurrency"] for r in runs]
    panels = {key: {"x": xs, "series": {name: [_get(r["summary"], path) for r in runs]
                                        for name, path in series}}
              for key, _title, series in PANELS}
    return {"x": "rate" if by_rate else "concurrency", "panels": panels}


def _clean(v) -> float | None:
    v = float(v)
    return None if math.isnan(v) else v


def plot(runs: list[dict], path: str | Path, title: str | None = None) -> dict:
    """Draw and save the PNG; return the data read back from the drawn lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    want = panel_data(runs)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    drawn = {"x": want["x"], "panels": {}}
    for ax, (key, label, _series) in zip(axes.flat, PANELS, strict=True):
        spec = want["panels"][key]
        for name, ys in spec["series"].items():
            ax.plot(spec["x"], [float("nan") if y is None else y for y in ys], marker="o",
                    label=name)
        ax.set_title(label)
        ax.set_xlabel("request rate (req/s)" if want["x"] == "rate" else "concurrency")
        if want["x"] == "concurrency" and len(set(spec["x"])) > 1 and min(spec["x"]) > 0:
            ax.set_xscale("log", base=2)
            ax.set_xticks(spec["x"], [str(x) for x in spec["x"]])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        top = max((y for ys in spec["series"].values() for y in ys if y is not None),
                  default=0.0)
        ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)
        drawn["panels"][key] = {
            "x": [_clean(x) for x in ax.lines[0].get_xdata()],
            "series": {ln.get_label(): [_clean(y) for y in ln.get_ydata()] for ln in ax.lines},
        }
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, metadata={PNG_KEY: json.dumps(drawn)})
    plt.close(fig)
    return drawn


def read_png_panels(path: str | Path) -> dict | None:
    """The panel data stored in a PNG by ``plot`` (stdlib only: walks the PNG chunks)."""
    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG")
    pos = 8
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"tEXt":
            key, _, val = body.partition(b"\0")
            text = val.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            text = zlib.decompress(rest[1:]).decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            compressed, rest = rest[0], rest[2:]
            _lang, _, rest = rest.partition(b"\0")
            _tkey, _, val = rest.partition(b"\0")
            text = (zlib.decompress(val) if compressed else val).decode("utf-8")
        else:
            continue
        if key.decode("latin-1") == PNG_KEY:
            return parsed(text, f"{path}: {PNG_KEY}")
    return None
