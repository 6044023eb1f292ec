"""The lab hub's recipe-shaped repositories: each model's real file layout (shard names, the
safetensors index, the extra folders that hold the same weights again), its real config.json
(``tests/unit/data/configs/``, where each one's source is named), weights tiny.

What is real and what is a stand-in, per file:

- ``config.json``: the real one (``tests/unit/data/configs/SOURCES.md``).
- shard names, folders and the small files' names: the hub's listing where a public copy of it
  was found (``source`` of each layout); elsewhere the hub's usual naming
  (``model-0000N-of-0000M.safetensors``) with a shard count from the weights' size at about
  5 GB a shard, said so in ``source``.
- the weights: valid safetensors files (header, one U8 tensor per shard) of pseudo-random
  bytes; ``SIZE_MB`` per copy of the weights, so a repository that holds its weights three
  times holds three times ``SIZE_MB``, as the real one holds three times 65 GB.
- ``model.safetensors.index.json``: names every root shard in its ``weight_map``.
- tokenizer files, chat template, LICENSE, README and the other small files: stand-ins (the
  lab's small byte-level BPE tokenizer of ``hub_repo``), under their real names.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkdeploy.lab.hub_repo import (
    CHAT_TEMPLATE,
    GENERATOR_VERSION,
    Repo,
    _manifest,
    _prepared,
    _repo_dir,
    _write_shard,
    tokenizer_files,
)

CONFIGS = Path(__file__).resolve().parents[3] / "tests" / "unit" / "data" / "configs"
"""The real config.json files, one per model (a checkout's; the lab runs from one)."""
SIZE_MB = 12
"""Data bytes of one copy of a repository's weights."""
MIB = 1024 * 1024


@dataclass(frozen=True)
class Copy:
    """One copy of the weights in a repository: its folder ("" is the root), its files, whether
    an index beside them names them, whether they are one raw blob (``metal/model.bin``)."""

    folder: str
    names: tuple[str, ...]
    index: bool = True
    raw: bool = False

    def paths(self) -> list[str]:
        return [f"{self.folder}/{n}" if self.folder else n for n in self.names]


@dataclass(frozen=True)
class Layout:
    repo_id: str
    config: str
    """The file in ``CONFIGS``."""
    copies: tuple[Copy, ...]
    tokenizer: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json")
    extra: tuple[str, ...] = ("README.md", "LICENSE", ".gitattributes", "generation_config.json")
    """Small files beside (stand-ins but for generation_config.json, written from config.json)."""
    source: str = ""
    pipeline: str = "text-generation"
    extra_json: dict[str, Any] = field(default_factory=dict)

    def root_weights(self) -> list[str]:
        return [p for c in self.copies if c.folder == "" for p in c.paths()]


def shards(count: int, first: int = 1, total: int | None = None, stem: str = "model-",
           total_width: int = 5) -> tuple[str, ...]:
    """``model-00001-of-00004.safetensors`` ... (``first`` 0: gpt-oss's 0-based numbering;
    ``total_width`` 6: DeepSeek's ``-of-000163``)."""
    last = count - 1 + first if total is None else total
    return tuple(f"{stem}{i:05d}-of-{last:0{total_width}d}.safetensors"
                 for i in range(first, first + count))


LAYOUTS: tuple[Layout, ...] = (
    Layout(
        "openai/gpt-oss-120b", "gpt-oss-120b.json",
        copies=(Copy("", shards(15, first=0, total=14)),
                Copy("original", shards(7, stem="model--")),
                Copy("metal", ("model.bin",), index=False, raw=True)),
        tokenizer=("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja"),
        extra=("README.md", "LICENSE", "USAGE_POLICY", ".gitattributes", "generation_config.json",
               "original/config.json", "original/dtypes.json"),
        source="the hub's file list as public catalogs and download logs quote it: root "
               "model-00000-of-00014 .. model-00014-of-00014.safetensors and their index; "
               "original/model--00001-of-00007 .. 00007.safetensors, original/config.json, "
               "dtypes.json and model.safetensors.index.json; metal/model.bin "
               "(https://huggingface.co/openai/gpt-oss-120b/discussions/15: root for vLLM and "
               "transformers, original/ for the reference torch/triton code, metal/ for Apple)"),
    Layout(
        "Qwen/Qwen3-235B-A22B-Instruct-2507-FP8", "Qwen3-235B-A22B-Instruct-2507-FP8.json",
        copies=(Copy("", shards(24)),),
        tokenizer=("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"),
        source="the hub's usual naming; 24 shards for about 236 GB of FP8 weights (count not "
               "checked against the hub's listing)"),
    Layout(
        "zai-org/GLM-4.5-Air", "GLM-4.5-Air.json",
        copies=(Copy("", shards(47)),),
        tokenizer=("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"),
        source="the hub's usual naming; 47 shards for about 220 GB of BF16 weights (count not "
               "checked against the hub's listing)"),
    Layout(
        "deepseek-ai/DeepSeek-R1", "DeepSeek-R1.json",
        copies=(Copy("", shards(163, total_width=6)),),
        extra=("README.md", "LICENSE", ".gitattributes", "generation_config.json",
               "configuration_deepseek.py", "modeling_deepseek.py", "figures/benchmark.jpg"),
        source="163 shards named model-00001-of-000163.safetensors, remote code "
               "(configuration_deepseek.py, modeling_deepseek.py) beside the config, as the "
               "hub lists them"),
    Layout(
        "meta-llama/Llama-3.3-70B-Instruct", "Llama-3.3-70B-Instruct.json",
        copies=(Copy("", shards(30)),
                Copy("original", tuple(f"consolidated.{i:02d}.pth" for i in range(8)),
                     index=False, raw=True)),
        tokenizer=("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"),
        extra=("README.md", "LICENSE", ".gitattributes", "generation_config.json",
               "USE_POLICY.md", "original/params.json", "original/tokenizer.model"),
        source="30 shards and an original/ folder of the reference checkpoint "
               "(consolidated.NN.pth, params.json, tokenizer.model), as Meta's Llama 3 "
               "repositories hold them; the .pth count not checked against the hub's listing"),
)


def available() -> list[Layout]:
    """The layouts whose real config.json this checkout holds."""
    return [la for la in LAYOUTS if (CONFIGS / la.config).is_file()]


def _small(layout: Layout, name: str, config: dict[str, Any]) -> bytes:
    """A small file's bytes: config.json and generation_config.json from the real config; the
    tokenizer files from the lab's small tokenizer; the rest a stand-in naming itself."""
    tok = tokenizer_files()
    base = name.rsplit("/", 1)[-1]
    if name == "generation_config.json":
        keep = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                if k in config}
        return (json.dumps({**keep, "transformers_version": config.get(
            "transformers_version", "4.55.0")}, indent=2) + "\n").encode()
    if name in tok:
        return tok[name]
    if name == "chat_template.jinja":
        return CHAT_TEMPLATE.encode()
    if name == "special_tokens_map.json":
        return b'{"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}\n'
    if base.endswith(".json"):
        return (json.dumps({"sparkdeploy_lab": f"stand-in for {layout.repo_id}'s {name}"})
                + "\n").encode()
    return f"sparkdeploy lab stand-in for {layout.repo_id}'s {name}\n".encode()


def _write_copy(root: Path, layout: Layout, copy: Copy, size_mb: int) -> dict[str, bytes]:
    """The copy's weight files under ``root``; returns its index (when it has one) to write."""
    per = max(64, size_mb * MIB // len(copy.names))
    weight_map: dict[str, str] = {}
    for i, (name, rel) in enumerate(zip(copy.names, copy.paths(), strict=True)):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        seed = f"{layout.repo_id}/{rel}"
        if copy.raw:
            path.write_bytes(random.Random(seed).randbytes(per))
            continue
        tensor = f"model.layers.{i}.mlp.experts.weight"
        _write_shard(path, [(tensor, "U8", [per])], seed=seed)
        weight_map[tensor] = name
    if not copy.index:
        return {}
    rel = f"{copy.folder}/model.safetensors.index.json" if copy.folder else \
        "model.safetensors.index.json"
    doc = {"metadata": {"total_size": per * len(copy.names)}, "weight_map": weight_map}
    return {rel: (json.dumps(doc, indent=2) + "\n").encode()}


def write(root: Path, layout: Layout, size_mb: int = SIZE_MB) -> dict[str, bytes]:
    """Write the layout's files under ``root``; returns the small files written (name -> bytes)
    so the caller lists them without reading them back."""
    config = json.loads((CONFIGS / layout.config).read_text())
    small: dict[str, bytes] = {"config.json": (CONFIGS / layout.config).read_bytes()}
    for name in (*layout.tokenizer, *layout.extra):
        small[name] = _small(layout, name, config)
    for copy in layout.copies:
        small.update(_write_copy(root, layout, copy, size_mb))
    for name, data in small.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return small


def prepare(data_dir: Path | str, layout: Layout, size_mb: int = SIZE_MB) -> Repo:
    """The layout's repository generated into data_dir, as ``hub_repo.prepare_repo``
    (idempotent, safe across processes, reused while nothing changed)."""
    params = {"generator": GENERATOR_VERSION, "repo_id": layout.repo_id, "size_mb": size_mb,
              "layout": repr(layout)}

    def generate(tmp: Path) -> dict[str, Any]:
        write(tmp, layout, size_mb)
        return _manifest(tmp, params, layout.repo_id)

    return _prepared(Path(data_dir), _repo_dir(Path(data_dir), layout.repo_id, size_mb, 0),
                     params, generate)


__all__ = ["CONFIGS", "Copy", "LAYOUTS", "Layout", "SIZE_MB", "available", "prepare", "shards",
           "write"]
