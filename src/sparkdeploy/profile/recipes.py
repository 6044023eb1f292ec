"""Recipes: a profile fragment for one model (hub repo and revision, image candidates and their
rules, engines in order of preference with their args, the layouts public recipes ran, the
default context length), each value with its public source.

A recipe is a YAML file named ``NAME.yaml`` in a recipe directory: the package's
(``sparkdeploy/data/recipes/``), or an owner's (``recipes:`` in the profile, ``--recipes DIR``;
an owner's directory comes first, so an owner's recipe of a packaged name wins). Every recipe
lies over the one base (``data/recipes/base.yaml``) and may ``extends:`` other files, merged by
``overlays`` with provenance. Its body holds ``about`` (what only a recipe knows) and the
profile's model part: ``model`` (repo, revision, path, allow_patterns), ``images``, ``engines``.
The model's own ``config.json`` ships beside it (``about.config``) so that the fit calculator
(``estimate``) works offline.

A profile says ``recipe: NAME`` beside the cluster's own facts; ``apply`` lays the profile over
the recipe (the profile's values win) and gives each engine that names no layout the one for the
profile's GPUs: the recipe's ``about.layouts`` entry for that many nodes, else the calculator's
choice (``estimate.estimate``). ``deploy.all --recipe NAME`` replaces the profile's model part
with the recipe's (``apply(..., override=True)``). This module works on the merged YAML;
``config`` validates it.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from sparkdeploy.core import packaged
from sparkdeploy.model import estimate as est
from sparkdeploy.profile.overlays import KeyPath, Merged, ProfileError, dotted, layered, load_merged

BASE = "base.yaml"
TOP_KEYS = ("about", "model", "images", "engines")
MODEL_KEYS = ("repo", "revision", "path", "allow_patterns")
"""The model keys a recipe owns; the others (endpoint, sync, ...) are the cluster's."""
OWNED: tuple[KeyPath, ...] = (*(("model", k) for k in MODEL_KEYS), ("images", "candidates"),
                              ("images", "rules"), ("images", "layer"), ("engines",))
"""What ``--recipe`` takes from the recipe instead of the profile."""
CLUSTER_LEAVES: tuple[KeyPath, ...] = (("images", "layer", "index_url"),)
"""Values under a recipe's part that are the cluster's (the package index the derivative image
is built from): kept from the profile under ``--recipe``, used when the recipe builds one."""
LAYOUT_KEYS = ("tensor_parallel", "pipeline_parallel")
MODELS_DIR = "/srv/models"
"""Where a recipe's weights live on every node unless it says ``model.path``."""
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")


class RecipeError(ProfileError):
    """A recipe that cannot be found or used; ``str()`` is the one line to show."""


@dataclass
class Recipe:
    name: str
    path: Path
    merged: Merged
    """The base and the recipe's files merged; ``body`` validated by ``config.read_recipe``."""

    @property
    def about(self) -> dict[str, Any]:
        return self.merged.body["about"]

    @property
    def part(self) -> dict[str, Any]:
        """The profile fragment: ``model``, ``images``, ``engines``."""
        return {k: v for k, v in self.merged.body.items() if k != "about"}

    @property
    def weights_bytes(self) -> int:
        return int(self.about["weights"]["bytes"])

    @property
    def context(self) -> int:
        return int(self.about["context"]["tokens"])

    def config_path(self) -> Path:
        return self.path.parent / self.about["config"]

    def config(self) -> Any:
        """The model's config.json (parsed), beside the recipe."""
        try:
            return est.load_config(self.config_path())
        except est.EstimateError as e:
            raise RecipeError(f"{self.path}: sparkdeploy.about.config: {e}") from None

    def stated(self, nodes: int) -> dict[str, Any] | None:
        """The layout the recipe states for ``nodes`` nodes (a public recipe ran it), or None."""
        return next((lay for lay in self.about.get("layouts") or [] if lay["nodes"] == nodes), None)

    def estimate(self, nodes: int, memory_gib: float = est.GB10_USABLE_GIB,
                 memory_source: str = est.GB10_SOURCE) -> est.Estimate:
        """The fit calculator on ``nodes`` nodes: the recipe's weights and context, its stated
        layout for that many nodes (else the calculator's choice)."""
        stated = self.stated(nodes)
        return est.estimate(self.config(), weights_bytes=self.weights_bytes,
                            weights_source=self.about["weights"]["source"], nodes=nodes,
                            memory_gib=memory_gib, memory_source=memory_source,
                            context=self.context, tp=stated["tp"] if stated else None)

    def layout(self, nodes: int) -> tuple[int, int, str]:
        """(TP, PP, where it came from) for ``nodes`` GPUs; ``RecipeError`` when none works."""
        stated = self.stated(nodes)
        try:
            e = self.estimate(nodes)
        except est.EstimateError as x:
            raise RecipeError(f"{self.path}: recipe {self.name}: no layout for {nodes} node(s): "
                              f"{x}") from None
        why = (f"recipe {self.name}: about.layouts for {nodes} node(s) ({stated['source']})"
               if stated else f"the fit calculator for {nodes} node(s) on {self.name}'s "
               "config.json (estimate.py: TP where the engines accept it, else PP)")
        return e.tp, e.pp, why


def packaged_dir() -> Path:
    return packaged.data("recipes")


def directories(extra: list[str] | tuple[str, ...] = ()) -> list[Path]:
    """Where recipes are looked up, first first: the owner's directories, then the package's."""
    return [*(Path(d) for d in extra), packaged_dir()]


def check_dirs(dirs: list[str] | list[Path], where: str) -> None:
    """Each of ``dirs`` a directory, else ``RecipeError`` labelled ``where`` (``--recipes``, or
    the profile's ``recipes:`` key): one that does not exist, or a file."""
    for d in dirs:
        p = Path(d)
        if not p.exists():
            raise RecipeError(f"{where}: recipe directory {d} does not exist")
        if not p.is_dir():
            raise RecipeError(f"{where}: {d} is a file, not a directory of recipes")


def recipe_files(d: Path) -> list[Path]:
    """The recipe files of directory ``d`` (its ``NAME.yaml``, the base aside); a YAML file whose
    name is no recipe name is a ``RecipeError`` naming it (never left out without a word)."""
    if not d.is_dir():
        return []
    files = [f for f in sorted(d.glob("*.yaml")) if f.name != BASE]
    for f in files:
        if not _NAME.fullmatch(f.stem):
            raise RecipeError(f"{f}: {f.stem!r} is not a recipe name (lowercase letters, digits, "
                              "'.', '_', '-', starting with a letter or digit): rename the file")
    return files


def known(dirs: list[Path]) -> dict[str, Path]:
    """Every recipe by name (an earlier directory's wins: ``shadowed`` says over which)."""
    out: dict[str, Path] = {}
    for d in reversed(dirs):
        for f in recipe_files(d):
            out[f.stem] = f
    return dict(sorted(out.items()))


def shadowed(name: str, dirs: list[Path]) -> list[Path]:
    """The files of recipe ``name`` in later directories, which the first one's hides."""
    return [f for d in dirs for f in recipe_files(d) if f.stem == name][1:]


def find(name: str, dirs: list[Path], where: str) -> Path:
    """The file of recipe ``name``; ``RecipeError`` (one line listing the known ones) if none."""
    check_dirs(dirs, "recipe directories")
    found = known(dirs)
    if not isinstance(name, str) or name not in found:
        raise RecipeError(f"{where}: no recipe named {name!r} (recipes: {', '.join(found)})")
    return found[name]


def _check_keys(m: Merged) -> None:
    def bad(path: KeyPath, why: str) -> RecipeError:
        return RecipeError(f"{m.file_of(path)}: {dotted(path)}: {why}")

    for k in m.body:
        if k not in TOP_KEYS:
            raise bad((k,), f"unknown key (a recipe holds {', '.join(TOP_KEYS)})")
    for k in m.body.get("model") or {}:
        if k not in MODEL_KEYS:
            raise bad(("model", k), "not a recipe's key (a recipe's model holds "
                      f"{', '.join(MODEL_KEYS)}; the rest is the cluster's profile)")
    engines = m.body.get("engines")
    for i, e in enumerate(engines if isinstance(engines, list) else []):
        for k in LAYOUT_KEYS:
            if isinstance(e, dict) and k in e:
                raise bad(("engines", i, k), "set per cluster (about.layouts, else the fit "
                          "calculator for the profile's nodes), not in a recipe")


def read(name: str, dirs: list[Path], where: str) -> Recipe:
    """Recipe ``name`` over the base, its keys checked (values: ``config.read_recipe``)."""
    path = find(name, dirs, where)
    merged = layered([load_merged(packaged_dir() / BASE), load_merged(path)])
    _check_keys(merged)
    model = merged.body.get("model")
    if isinstance(model, dict) and "path" not in model and isinstance(model.get("repo"), str):
        model["path"] = f"{MODELS_DIR}/{PurePosixPath(model['repo']).name}"
        merged.origin[("model", "path")] = f"default: {MODELS_DIR}/<the repo's name>"
    return Recipe(name, path, merged)


def profile_dirs(merged: Merged) -> list[str]:
    """The profile's ``recipes:`` directories, each relative to the file that named it."""
    value = merged.body.get("recipes")
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    where = merged.file_of(("recipes",))
    if not isinstance(items, list) or not all(isinstance(x, str) and x for x in items):
        raise RecipeError(f"{where}: sparkdeploy.recipes: must be a directory or a list of them")
    base = Path(where).parent
    return [str(Path(x) if Path(x).is_absolute() else base / x) for x in items]


def _drop(body: dict[str, Any], origin: dict[KeyPath, str], path: KeyPath) -> Any:
    node: Any = body
    for k in path[:-1]:
        node = node.get(k) if isinstance(node, dict) else None
    if not isinstance(node, dict) or path[-1] not in node:
        return None
    for q in [q for q in origin if q[:len(path)] == path]:
        del origin[q]
    return node.pop(path[-1])


def _without_model_part(body: dict[str, Any], origin: dict[KeyPath, str]) -> None:
    """The profile's model part left out (``--recipe``), the cluster's values in it kept."""
    keep = {leaf: (_get(body, leaf), origin.get(leaf)) for leaf in CLUSTER_LEAVES}
    for path in OWNED:
        _drop(body, origin, path)
    for leaf, (value, by) in keep.items():
        if value is not None:
            node: dict[Any, Any] = body
            for k in leaf[:-1]:
                node = node.setdefault(k, {})
            node[leaf[-1]] = value
            origin[leaf] = by or "the profile"


def _get(body: dict[str, Any], path: KeyPath) -> Any:
    node: Any = body
    for k in path:
        node = node.get(k) if isinstance(node, dict) else None
    return node


def fill_layouts(merged: Merged, recipe: Recipe) -> None:
    """Each engine that names neither TP nor PP gets the recipe's layout for the GPUs of the
    profile's nodes."""
    body = merged.body
    nodes = body.get("nodes")
    if not isinstance(nodes, list) or not all(isinstance(n, dict) for n in nodes):
        return  # config's validation names what is wrong
    gpus = [n.get("gpus", 1) for n in nodes]
    if not all(isinstance(g, int) and not isinstance(g, bool) for g in gpus) or sum(gpus) < 1:
        return
    engines = body.get("engines")
    for i, e in enumerate(engines if isinstance(engines, list) else []):
        if isinstance(e, dict) and not any(k in e for k in LAYOUT_KEYS):
            tp, pp, why = recipe.layout(sum(gpus))
            e["tensor_parallel"], e["pipeline_parallel"] = tp, pp
            for k in LAYOUT_KEYS:
                merged.origin[("engines", i, k)] = why


def apply(profile: Merged, recipe: Recipe, *, override: bool = False) -> Merged:
    """The profile laid over ``recipe`` (the profile's values win; ``override``: the profile's
    model part is left out, the recipe's used), the engines' layouts filled."""
    body, origin = copy.deepcopy(profile.body), dict(profile.origin)
    if override:
        _without_model_part(body, origin)
        origin[("recipe",)] = "--recipe"
    body["recipe"] = recipe.name
    layer = _get(body, ("images", "layer"))
    if (isinstance(layer, dict) and "base" not in layer
            and _get(recipe.part, ("images", "layer")) is None):
        _drop(body, origin, ("images", "layer"))  # only the cluster's index_url: no derivative
    part = recipe.part
    own = Merged(part, list(recipe.merged.files),
                 {p: f for p, f in recipe.merged.origin.items() if p[0] != "about"},
                 list(recipe.merged.overrides))
    mine = Merged(body, list(profile.files), origin, list(profile.overrides))
    out = layered([own, mine])
    fill_layouts(out, recipe)
    return out


GATE_MAX_TOKENS = 64


def gates(dirs: list[Path]) -> tuple[tuple[str, tuple[tuple[str, str], ...], int, str], ...]:
    """Every recipe's coherence gate (``about.gate``), as (model repo, (prompt, answer) pairs,
    answer token cap, source): a recipe whose model cannot answer the bench's fixed prompts
    (random weights, a base model) records the greedy answers its weights give instead. A
    malformed one is a ``RecipeError`` naming the key."""
    out = []
    for name in known(dirs):
        r = read(name, dirs, "--recipe")
        g = r.about.get("gate")
        if g is None:
            continue
        where = f"{r.path}: sparkdeploy.about.gate"
        answers = g.get("answers") if isinstance(g, dict) else None
        cap = g.get("max_tokens") if isinstance(g, dict) else None
        if not answers or not isinstance(answers, list) or not all(
                isinstance(a, dict) and isinstance(a.get("prompt"), str) and isinstance(a.get("answer"), str)
                for a in answers):
            raise RecipeError(f"{where}.answers: a list of {{prompt: text, answer: text}}")
        if not isinstance(cap, int) or isinstance(cap, bool) or not 1 <= cap <= GATE_MAX_TOKENS:
            raise RecipeError(f"{where}.max_tokens: a whole number 1..{GATE_MAX_TOKENS}")
        if not isinstance(g.get("source"), str) or not g["source"].strip():
            raise RecipeError(f"{where}.source: where the answers come from")
        out.append((r.part["model"]["repo"], tuple((a["prompt"], a["answer"]) for a in answers),
                    cap, g["source"]))
    return tuple(out)
