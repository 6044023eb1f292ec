"""Which of a model repository's files the serving engine loads: the one selection of files that
``model.download`` fetches and ``model.sync`` and ``model.verify`` cover (pure: no hub, no node).

The rule, as the engines read a Hugging Face checkpoint:

- **the weights**: the files the root ``model.safetensors.index.json`` names in its
  ``weight_map``; with no index, the one ``*.safetensors`` file at the root (vLLM and SGLang
  load the safetensors files at the repo's root, filtered by that index when there is one:
  vLLM's ``filter_duplicate_safetensors_files``, ``vllm/model_executor/model_loader/
  weight_utils.py``);
- **beside them**: the configs, tokenizer, chat template, generation config and processor
  files at the root (``SUPPORT``), and the root's ``*.py`` (the code a ``trust_remote_code``
  config names);
- **never**: the other copies of the same weights a repo ships (``original/``, ``metal/``,
  ``*.gguf``, ``*.pth``, ``*.bin`` beside the safetensors: openai/gpt-oss-120b holds its
  weights three times, https://huggingface.co/openai/gpt-oss-120b/discussions/15), nor
  README, LICENSE and the like;
- **widened** by the profile's ``model.allow_patterns``: each file a pattern matches is added
  (fnmatch, as huggingface_hub's ``allow_patterns``); a pattern never removes a file.

A repository with neither an index nor one root safetensors file, or whose index names a file
the repository lacks, is refused (``SelectionError``, one line): nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Literal

from sparkdeploy.core.errors import StepFailed
from sparkdeploy.core.outside import OutsideError, parsed

Rule = Literal["index", "single"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SUPPORT = frozenset({
    "config.json", "generation_config.json", INDEX,
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt",
    "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
})
"""The root files an engine reads beside the weights (transformers' ``AutoConfig``,
``AutoTokenizer``, ``AutoProcessor`` and ``GenerationConfig`` file names)."""
SUPPORT_SUFFIXES = (".tiktoken", ".py")
"""Root files read beside them too: tiktoken vocabularies, remote code."""


class SelectionError(StepFailed, ValueError):
    """A repository the engine cannot load as listed: ``str()`` is the one line to show."""


@dataclass(frozen=True)
class Selection:
    """The files to fetch (``files``: paths, in the listing's order), the weights among them
    (``weights``), what the patterns added (``widened``) and how the weights were found
    (``rule``: ``index`` or ``single``)."""

    files: list[str]
    weights: list[str]
    rule: Rule
    widened: list[str] = field(default_factory=list)

    def bytes_of(self, sizes: dict[str, int], only: Sequence[str] | None = None) -> int:
        return sum(sizes[p] for p in (self.files if only is None else only))


def index_files(text: str | bytes, where: str = INDEX) -> list[str]:
    """The file names an index's ``weight_map`` names, sorted, each once; ``SelectionError``
    for a file that is not such an index."""
    try:
        doc = parsed(text, where)
    except OutsideError as e:
        why = str(e).removeprefix(f"{where}: not JSON (").removesuffix(")")  # the parser's words
        raise SelectionError(f"{where} is not JSON: {why}") from None
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise SelectionError(f"{where} has no weight_map")
    names = set()
    for tensor, name in wmap.items():
        if not isinstance(name, str) or not name:
            raise SelectionError(f"{where}: weight_map[{tensor!r:.80}] is not a file name")
        names.add(name)
    return sorted(names)


def _root(path: str) -> bool:
    return "/" not in path


def support(path: str) -> bool:
    """Whether a listed file is one the engine reads beside the weights."""
    return _root(path) and (path in SUPPORT or path.endswith(SUPPORT_SUFFIXES))


def weight_files(listed: Sequence[str], index: list[str] | None,
                 repo: str = "") -> tuple[list[str], Rule]:
    """(the weights, the rule that found them) among ``listed``; ``index``: the names the root
    index's weight_map gives (None: the repo lists no index)."""
    have = set(listed)
    where = f"{repo}: " if repo else ""
    if index is not None:
        other = [n for n in index if not n.endswith(".safetensors")]
        if other:
            raise SelectionError(f"{where}{INDEX} names {other[0]}, which is not a safetensors "
                                 f"file")
        lacking = [n for n in index if n not in have]
        if lacking:
            more = f" and {len(lacking) - 1} more" if len(lacking) > 1 else ""
            raise SelectionError(f"{where}{INDEX} names {lacking[0]}{more}, which the repository "
                                 f"lacks")
        return list(index), "index"
    root = [p for p in listed if _root(p) and p.endswith(".safetensors")]
    if len(root) == 1:
        return root, "single"
    if not root:
        raise SelectionError(f"{where}no {INDEX} and no {SINGLE}: no safetensors weights the "
                             f"engine would load")
    raise SelectionError(f"{where}no {INDEX} for the {len(root)} safetensors files at the root "
                         f"(e.g. {root[0]}): which of them the engine loads is not said")


def select(listed: Sequence[str], index: list[str] | None, patterns: Sequence[str] = (),
           repo: str = "") -> Selection:
    """The selection from a repository's listing (every path, in order), the names its index
    gives, and the profile's ``allow_patterns`` (each adds the files it matches)."""
    weights, rule = weight_files(listed, index, repo)
    core = set(weights)
    core.update(p for p in listed if support(p))
    widened = [p for p in listed if p not in core and any(fnmatchcase(p, pat) for pat in patterns)]
    keep = core | set(widened)
    return Selection(files=[p for p in listed if p in keep], weights=weights, rule=rule,
                     widened=widened)


def describe(sel: Selection, sizes: dict[str, int], listed_bytes: int) -> str:
    """One line: what is fetched of how much the repository holds."""
    got = sel.bytes_of(sizes)
    how = {"index": f"the {len(sel.weights)} files {INDEX} names",
           "single": f"the single {sel.weights[0]}"}[sel.rule]
    more = f", {len(sel.widened)} more by allow_patterns" if sel.widened else ""
    return (f"{how} and {len(sel.files) - len(sel.weights) - len(sel.widened)} config, tokenizer "
            f"and template files{more}: {got / 1e9:.2f} of the repository's "
            f"{listed_bytes / 1e9:.2f} GB")


def as_json(sel: Selection) -> dict[str, Any]:
    return {"rule": sel.rule, "weights": sel.weights, "widened": sel.widened}


__all__ = ["INDEX", "SINGLE", "SUPPORT", "Selection", "SelectionError", "as_json", "describe",
           "index_files", "select", "support", "weight_files"]
