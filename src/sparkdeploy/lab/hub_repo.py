"""The lab hub's generated model repositories: ``Qwen/Qwen3.5-122B-A10B-FP8`` in miniature.

The real config shape, a small valid tokenizer, a safetensors index and N shards with valid
headers and pseudo-random data, generated deterministically into a data directory and reused
while the generation parameters are unchanged (``prepare_repo``). The recipe-shaped ones
(``lab.hub_layouts``: gpt-oss-120b with its original/ and metal/ copies, and the others) are
generated and reused the same way (``_prepared``). Served by ``lab.hub``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkdeploy.core.files import replace_dir

DEFAULT_DATA_DIR = Path("/var/cache/sparkdeploy/hub")
DEFAULT_SIZE_MB = 300
DEFAULT_SHARDS = 8
REPO_ID = "Qwen/Qwen3.5-122B-A10B-FP8"
GENERATOR_VERSION = 1  # bump when the generated content changes
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".model", ".jpg")
"""Stored in LFS on the hub (its default .gitattributes names these)."""
CREATED_AT = "2026-02-24T00:00:00.000Z"


HIDDEN = 3072
LAYERS = 48


def model_config() -> dict[str, Any]:
    """config.json of the FP8 checkpoint (key set of transformers' Qwen3_5MoeConfig)."""
    layer_types = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(LAYERS)
    ]
    text_config = {
        "model_type": "qwen3_5_moe_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": None,
        "eos_token_id": 248044,
        "pad_token_id": None,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 64,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "moe_intermediate_size": 1024,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 32,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "router_aux_loss_coef": 0.001,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
        "shared_expert_intermediate_size": 1024,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 248320,
    }
    vision_config = {
        "model_type": "qwen3_5_moe_vision",
        "deepstack_visual_indexes": [],
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4304,
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": HIDDEN,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": False,
        "text_config": text_config,
        "vision_config": vision_config,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": [
                "lm_head",
                "model.visual",
                "mtp",
                "model.language_model.embed_tokens",
            ],
        },
        "transformers_version": "5.2.0",
    }


def generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": 248044,
        "do_sample": True,
        "eos_token_id": [248046, 248044],
        "pad_token_id": 248044,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": "5.2.0",
    }


SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


def _byte_unicode() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (as in GPT-2 tokenizers)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_files() -> dict[str, bytes]:
    """A small valid byte-level BPE tokenizer: tokenizer.json, vocab.json, merges.txt, config."""
    byte_chars = _byte_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    merges: list[str] = []
    # A few merges so that common words are single tokens: t+h, th+e, i+n, e+r, a+n, Ġ+t.
    for left, right in [("t", "h"), ("th", "e"), ("i", "n"), ("e", "r"), ("a", "n"), ("Ġ", "t")]:
        merges.append(f"{left} {right}")
        vocab[left + right] = len(vocab)
    added = [
        {
            "id": len(vocab) + i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": True,
        },
        "post_processor": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added
        },
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    return {
        "tokenizer.json": _json_bytes(tokenizer),
        "tokenizer_config.json": _json_bytes(tokenizer_config),
        "vocab.json": json.dumps(vocab, ensure_ascii=False).encode(),
        "merges.txt": ("#version: 0.2\n" + "\n".join(merges) + "\n").encode(),
    }


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def _readme() -> bytes:
    return (
        b"---\nlibrary_name: transformers\nlicense: apache-2.0\npipeline_tag: image-text-to-text\n"
        b"---\n\n# Qwen3.5-122B-A10B-FP8 (sparkdeploy lab miniature)\n\n"
        b"Generated by `sparkdeploy.lab.hub`: the real config shape, a small tokenizer and\n"
        b"safetensors shards with valid headers and pseudo-random data. Not a usable model.\n"
    )


GITATTRIBUTES = (
    b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    b"*.bin filter=lfs diff=lfs merge=lfs -text\n"
)


def _shard_plan(size_mb: int, shards: int) -> list[list[tuple[str, str, list[int]]]]:
    """Tensors (name, dtype, shape) per shard; data sizes add up to about size_mb MiB."""
    shards = max(1, min(shards, LAYERS))
    per_layer = max(1, size_mb * 1024 * 1024 // LAYERS)
    # per row: HIDDEN fp8 bytes; plus one f32 scale per 128x128 block
    rows = max(1, per_layer // HIDDEN)
    plan: list[list[tuple[str, str, list[int]]]] = [[] for _ in range(shards)]
    for layer in range(LAYERS):
        shard = layer * shards // LAYERS
        prefix = f"model.language_model.layers.{layer}"
        plan[shard] += [
            (f"{prefix}.input_layernorm.weight", "BF16", [HIDDEN]),
            (f"{prefix}.mlp.experts.gate_up_proj", "F8_E4M3", [rows, HIDDEN]),
            (f"{prefix}.mlp.experts.gate_up_proj_scale_inv", "F32",
             [-(-rows // 128), HIDDEN // 128]),
            (f"{prefix}.post_attention_layernorm.weight", "BF16", [HIDDEN]),
        ]
    plan[-1].append(("model.language_model.norm.weight", "BF16", [HIDDEN]))
    return plan


_DTYPE_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1}


def _write_shard(path: Path, tensors: list[tuple[str, str, list[int]]], seed: str) -> dict:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    counts: dict[str, int] = {}
    for name, dtype, shape in tensors:
        n = 1
        for d in shape:
            n *= d
        nbytes = n * _DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        counts[dtype] = counts.get(dtype, 0) + n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    block = random.Random(seed).randbytes(1024 * 1024)
    sha = hashlib.sha256()
    with open(path, "wb") as f:
        for piece in (struct.pack("<Q", len(raw)), raw):
            f.write(piece)
            sha.update(piece)
        left = offset
        while left:
            piece = block[: min(left, len(block))]
            f.write(piece)
            sha.update(piece)
            left -= len(piece)
    return {"data_bytes": offset, "counts": counts, "sha256": sha.hexdigest()}


def _git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    spec = "https://git-lfs.github.com/spec/v1"
    return f"version {spec}\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass
class RepoFile:
    path: str
    size: int
    oid: str  # git blob id (of the LFS pointer for LFS files)
    sha256: str
    lfs: bool

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.oid

@dataclass
class Repo:
    repo_id: str
    root: Path
    commit: str
    files: dict[str, RepoFile]
    config: dict[str, Any]
    tensor_counts: dict[str, int] = field(default_factory=dict)


def _repo_dir(data_dir: Path, repo_id: str, size_mb: int, shards: int) -> Path:
    # one folder per size: generating another size never replaces files a running hub serves
    return Path(data_dir) / "models" / f"{repo_id.replace('/', '--')}--{size_mb}mb-{shards}s"


def prepare_repo(
    data_dir: Path | str = DEFAULT_DATA_DIR,
    size_mb: int = DEFAULT_SIZE_MB,
    shards: int = DEFAULT_SHARDS,
    repo_id: str = REPO_ID,
) -> Repo:
    """Generate the miniature model into data_dir (idempotent, safe across processes)."""
    shards = max(1, min(shards, LAYERS))
    params = {"generator": GENERATOR_VERSION, "repo_id": repo_id, "size_mb": size_mb,
              "shards": shards}
    return _prepared(Path(data_dir), _repo_dir(Path(data_dir), repo_id, size_mb, shards), params,
                     lambda tmp: _generate(tmp, params))


def _prepared(data_dir: Path, target: Path, params: dict[str, Any], generate: Any) -> Repo:
    """The repo at ``target`` when it was generated with ``params`` and is whole, else
    ``generate(tmp)`` (its manifest) into a directory that replaces ``target``."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest_path = target / ".lab-hub.json"
        if manifest_path.exists():
            manifest = json.loads(manifest_path.read_text())
            if manifest.get("params") == params and all(
                (target / p).is_file() and (target / p).stat().st_size == f["size"]
                for p, f in manifest["files"].items()
            ):
                return _repo_from_manifest(target, manifest)

        def build(tmp: Path) -> dict[str, Any]:
            manifest = generate(tmp)
            (tmp / ".lab-hub.json").write_text(json.dumps(manifest, indent=1))
            return manifest

        return _repo_from_manifest(target, replace_dir(target, build))


def _manifest(root: Path, params: dict[str, Any], repo_id: str) -> dict[str, Any]:
    """The manifest of every file under ``root``: size, git blob id (of the LFS pointer for an
    LFS file), sha256; the commit a hash of them all."""
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        data = path.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        lfs = rel.endswith(LFS_SUFFIXES)
        oid = _git_blob_oid(lfs_pointer(sha, len(data)) if lfs else data)
        files[rel] = {"size": len(data), "oid": oid, "sha256": sha, "lfs": lfs}
    commit = hashlib.sha1(
        json.dumps([repo_id, {p: f["oid"] for p, f in files.items()}]).encode()
    ).hexdigest()
    return {"params": params, "repo_id": repo_id, "commit": commit, "files": files,
            "tensor_counts": {}}


def _generate(root: Path, params: dict[str, Any]) -> dict[str, Any]:
    repo_id = params["repo_id"]
    small: dict[str, bytes] = {
        ".gitattributes": GITATTRIBUTES,
        "README.md": _readme(),
        "config.json": _json_bytes(model_config()),
        "generation_config.json": _json_bytes(generation_config()),
        **tokenizer_files(),
    }
    plan = _shard_plan(params["size_mb"], params["shards"])
    n = len(plan)
    weight_map: dict[str, str] = {}
    files: dict[str, dict[str, Any]] = {}
    counts: dict[str, int] = {}
    total = 0
    for i, tensors in enumerate(plan):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        info = _write_shard(root / name, tensors, seed=f"{repo_id}/{name}/{GENERATOR_VERSION}")
        size = (root / name).stat().st_size
        total += info["data_bytes"]
        for k, v in info["counts"].items():
            counts[k] = counts.get(k, 0) + v
        for tname, _, _ in tensors:
            weight_map[tname] = name
        sha = info["sha256"]
        files[name] = {"size": size, "oid": _git_blob_oid(lfs_pointer(sha, size)),
                       "sha256": sha, "lfs": True}
    small["model.safetensors.index.json"] = _json_bytes(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    )
    for name, data in small.items():
        (root / name).write_bytes(data)
        files[name] = {"size": len(data), "oid": _git_blob_oid(data),
                       "sha256": hashlib.sha256(data).hexdigest(), "lfs": False}
    files = dict(sorted(files.items()))
    commit = hashlib.sha1(
        json.dumps([repo_id, {p: f["oid"] for p, f in files.items()}]).encode()
    ).hexdigest()
    return {"params": params, "repo_id": repo_id, "commit": commit, "files": files,
            "tensor_counts": counts}


def _repo_from_manifest(root: Path, manifest: dict[str, Any]) -> Repo:
    files = {p: RepoFile(path=p, **f) for p, f in manifest["files"].items()}
    config = json.loads((root / "config.json").read_text())
    return Repo(repo_id=manifest["repo_id"], root=root, commit=manifest["commit"], files=files,
                config=config, tensor_counts=manifest.get("tensor_counts", {}))
