"""What ``recipe.list`` and ``recipe.show`` print: each recipe's model, weights, engines, the
fewest Sparks it needs (``estimate.min_nodes``) and whether it fits a cluster, with the reason."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from sparkdeploy.core.redaction import redact
from sparkdeploy.model import estimate as est
from sparkdeploy.profile import recipes as rcp
from sparkdeploy.profile.config import RecipeFile, read_recipe
from sparkdeploy.profile.overlays import dotted


@dataclass(frozen=True)
class Row:
    name: str
    repo: str
    weights_bytes: int
    engines: list[str]
    min_nodes: int | None
    fits: bool | None
    why: str
    file: str

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "repo": self.repo, "weights_bytes": self.weights_bytes,
                "engines": self.engines, "min_nodes": self.min_nodes, "fits": self.fits,
                "why": self.why, "file": self.file}

    def cells(self) -> list[str]:
        fits = "-" if self.fits is None else ("yes" if self.fits else "no")
        return [self.name, self.repo, f"{self.weights_bytes / 1e9:.1f} GB", ",".join(self.engines),
                str(self.min_nodes or ">8"), fits, self.why]


HEADER = ["recipe", "model", "weights", "engines", "min_nodes", "fits", "why"]


def row(recipe: rcp.Recipe, nodes: int | None, memory_gib: float, memory_source: str) -> Row:
    part = recipe.part
    best = est.min_nodes(recipe.config(), weights_bytes=recipe.weights_bytes,
                         memory_gib=memory_gib, context=recipe.context)
    fits: bool | None = None
    why = "" if best is None else f"fewest: {best.why()}"
    if nodes is not None:
        try:
            e = recipe.estimate(nodes, memory_gib, memory_source)
            fits, why = e.fits, e.why()
        except est.EstimateError as x:
            fits, why = False, str(x)
    return Row(recipe.name, part["model"]["repo"], recipe.weights_bytes,
               [e["name"] for e in part["engines"]], best.nodes if best else None, fits, why,
               str(recipe.path))


def rows(dirs: list[Path], nodes: int | None, memory_gib: float, memory_source: str) -> list[Row]:
    out = []
    for name in rcp.known(dirs):
        r = row(read_recipe(name, dirs), nodes, memory_gib, memory_source)
        hidden = rcp.shadowed(name, dirs)
        if hidden:  # an owner's recipe of a name another directory has too: said, not silent
            r = replace(r, why=f"{r.why}; shadows {', '.join(map(str, hidden))}".lstrip("; "))
        out.append(r)
    return out


def show(name: str, dirs: list[Path], nodes: list[int]) -> str:
    """The recipe with defaults filled in, where each part came from, its layouts."""
    r = read_recipe(name, dirs)
    full = RecipeFile.model_validate(r.merged.body).model_dump(mode="json")
    lines = [f"# recipe {name}: {r.about['title']}",
             "# files, base first: " + ", ".join(r.merged.files)]
    lines += [f"# shadows {p} (the first directory's recipe of a name wins)"
              for p in rcp.shadowed(name, dirs)]
    lines.append("# where each part came from:")
    for path in sorted(p for p in r.merged.origin if len(p) == 2 and p[0] != "about"):
        lines.append(f"#   {dotted(path)}: {r.merged.origin[path]}")
    for part, source in r.about["sources"].items():
        lines.append(f"#   source of {part}: {' '.join(str(source).split())}")
    for n in nodes:
        try:
            e = r.estimate(n)
            tp, pp, why = r.layout(n)
            lines.append(f"# {n} node(s): TP={tp} x PP={pp} ({why}); {e.why()}")
        except (est.EstimateError, rcp.RecipeError) as x:
            lines.append(f"# {n} node(s): {x}")
    return "\n".join(lines) + "\n" + yaml.safe_dump({"sparkdeploy": redact(full)}, sort_keys=False)
