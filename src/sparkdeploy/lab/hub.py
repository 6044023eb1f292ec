"""A Hugging Face Hub-compatible model hub for the rehearsal lab (runs on the controller).

It serves ``Qwen/Qwen3.5-122B-A10B-FP8`` in miniature: the real config shape, a small valid
tokenizer, a safetensors index and N shards with valid headers and pseudo-random data, generated
deterministically into a data directory. ``huggingface_hub`` talks to it through ``HF_ENDPOINT``
(or ``endpoint=``) unchanged: ``snapshot_download``, ``hf_hub_download`` and
``HfApi().model_info(repo, files_metadata=True)``. Files whose size or kind makes them LFS on the
real hub (the shards) answer ``/resolve`` with a same-host 302 to ``/_lab/lfs/<sha256>`` carrying
``X-Linked-Etag``/``X-Linked-Size``; no ``X-Xet-*`` header is ever sent, so xet is never used.

Default port: 8900 (the package index, ``sparkdeploy.lab.pkgindex``, uses 8901).
Default data directory: /var/cache/sparkdeploy/hub (generated files are reused while the
generation parameters are unchanged).

Knobs, at start and while running (``POST /_lab/control`` with a JSON object; ``GET`` reads them):
    {"bandwidth_bps": 50000000}                 # limit on file bodies, all connections together;
                                                # null or 0 = unlimited
    {"fault": {"file": "model-00002-of-00008.safetensors", "after_bytes": 1000000}}
                                                # drop the connection once after that many body
                                                # bytes of that file; the next request succeeds
    {"fault": null}                             # disarm
    {"reset_stats": true}                       # clear the request log and counters
Other lab endpoints: ``GET /_lab/health`` (readiness), ``GET /_lab/stats`` (request log with
method, path, Range header, status, body bytes, limit in force and duration; faults fired).

Function API (tests, ``lab.up`` in-process)::

    from sparkdeploy.lab import hub
    server = hub.start_hub(bind="127.0.0.1", port=0, data_dir=tmp, size_mb=8, shards=3)
    server.url            # "http://127.0.0.1:<port>" -> HF_ENDPOINT
    server.set_knobs(bandwidth_bps=2_000_000, fault={"file": "...", "after_bytes": 100_000})
    server.stats()        # same JSON as GET /_lab/stats
    server.stop()

    hub.set_knobs(url, bandwidth_bps=...)   # same, over HTTP, for a hub running as a daemon

CLI (``lab.up`` as a daemon: ``Popen(hub.cli_argv(controller_addr))``, record the PID, then
``hub.wait_ready(url)``; it prints ``READY <url>`` on stdout once it serves; the lab's env file
gets ``HF_ENDPOINT=http://<controller>:8900``)::

    python -m sparkdeploy.lab.hub --bind 10.x.y.1 --port 8900 \
        --data /var/cache/sparkdeploy/hub --size-mb 300 --shards 8 \
        [--bandwidth-bps N] [--fault FILE:BYTES]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import random
import shutil
import socket
import struct
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

DEFAULT_PORT = 8900
DEFAULT_DATA_DIR = Path("/var/cache/sparkdeploy/hub")
DEFAULT_SIZE_MB = 300
DEFAULT_SHARDS = 8
REPO_ID = "Qwen/Qwen3.5-122B-A10B-FP8"
GENERATOR_VERSION = 1  # bump when the generated content changes
CHUNK = 64 * 1024
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
CREATED_AT = "2026-02-24T00:00:00.000Z"

# --------------------------------------------------------------------------------------------
# Generated content
# --------------------------------------------------------------------------------------------

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


_DTYPE_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1}


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


def _lfs_pointer(sha256: str, size: int) -> bytes:
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

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "oid": self.oid, "sha256": self.sha256,
                "lfs": self.lfs}


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
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    shards = max(1, min(shards, LAYERS))
    target = _repo_dir(data_dir, repo_id, size_mb, shards)
    params = {"generator": GENERATOR_VERSION, "repo_id": repo_id, "size_mb": size_mb,
              "shards": shards}
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
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        manifest = _generate(tmp, params)
        (tmp / ".lab-hub.json").write_text(json.dumps(manifest, indent=1))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        return _repo_from_manifest(target, manifest)


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
        files[name] = {"size": size, "oid": _git_blob_oid(_lfs_pointer(sha, size)),
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


# --------------------------------------------------------------------------------------------
# Knobs and accounting
# --------------------------------------------------------------------------------------------


class Throttle:
    """Token bucket shared by every connection; burst is one chunk."""

    def __init__(self, rate: int | None = None, burst: int = CHUNK):
        self._lock = threading.Lock()
        self.burst = burst
        self.rate: int | None = None
        self._tokens = float(burst)
        self._last = time.monotonic()
        self.waited_s = 0.0  # sum of the waits the bucket imposed (its own accounting)
        self.bytes = 0
        self.set_rate(rate)

    def set_rate(self, rate: int | None) -> None:
        with self._lock:
            self.rate = int(rate) if rate else None
            self._tokens = min(self._tokens, float(self.burst))
            self._last = time.monotonic()

    def reset_counters(self) -> None:
        with self._lock:
            self.waited_s, self.bytes = 0.0, 0

    def take(self, n: int) -> None:
        with self._lock:
            self.bytes += n
            if not self.rate:
                return
            now = time.monotonic()
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
            self.waited_s += wait
        if wait > 0:
            time.sleep(wait)


@dataclass
class Fault:
    file: str
    after_bytes: int

    def matches(self, path: str) -> bool:
        return self.file in (path, path.rsplit("/", 1)[-1])


class HubState:
    def __init__(self, repos: list[Repo], bandwidth_bps: int | None = None,
                 fault: Fault | None = None):
        self.repos = {r.repo_id: r for r in repos}
        self.by_sha = {f.sha256: (r, f) for r in repos for f in r.files.values() if f.lfs}
        self.throttle = Throttle(bandwidth_bps)
        self.fault = fault
        self.lock = threading.Lock()
        self.log: list[dict[str, Any]] = []
        self.faults_fired: list[dict[str, Any]] = []

    def knobs(self) -> dict[str, Any]:
        fault = self.fault
        return {
            "bandwidth_bps": self.throttle.rate,
            "fault": {"file": fault.file, "after_bytes": fault.after_bytes} if fault else None,
        }

    def apply(self, body: dict[str, Any]) -> dict[str, Any]:
        unknown = set(body) - {"bandwidth_bps", "fault", "reset_stats"}
        if unknown:
            raise ValueError(f"unknown knobs: {sorted(unknown)}")
        if "bandwidth_bps" in body:
            rate = body["bandwidth_bps"]
            if rate is not None and (not isinstance(rate, int) or rate < 0):
                raise ValueError("bandwidth_bps must be a non-negative integer or null")
            self.throttle.set_rate(rate)
        if "fault" in body:
            f = body["fault"]
            with self.lock:
                self.fault = None if f is None else Fault(str(f["file"]), int(f["after_bytes"]))
        if body.get("reset_stats"):
            with self.lock:
                self.log.clear()
                self.faults_fired.clear()
            self.throttle.reset_counters()
        return self.knobs()

    def take_fault(self, path: str) -> Fault | None:
        with self.lock:
            if self.fault is not None and self.fault.matches(path):
                fault, self.fault = self.fault, None
                return fault
        return None

    def record(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.log.append(entry)
            del self.log[:-2000]

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "requests": list(self.log),
                "faults_fired": list(self.faults_fired),
                "throttle": {"rate": self.throttle.rate, "burst": self.throttle.burst,
                             "waited_s": self.throttle.waited_s,
                             "bytes": self.throttle.bytes},
                "knobs": self.knobs(),
            }


# --------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------


class _Error(Exception):
    def __init__(self, status: int, code: str, message: str, commit: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end inclusive) of a single 'bytes=' range; None = whole file; raises on bad."""
    if not header:
        return None
    unit, _, spec = header.partition("=")
    if unit.strip() != "bytes" or "," in spec:
        raise _Error(416, "RangeNotSatisfiable", f"unsupported range {header!r}")
    first, _, last = spec.strip().partition("-")
    try:
        if first == "":
            n = int(last)
            start, end = max(0, size - n), size - 1
        else:
            start = int(first)
            end = int(last) if last else size - 1
    except ValueError:
        raise _Error(416, "RangeNotSatisfiable", f"bad range {header!r}") from None
    end = min(end, size - 1)
    if start >= size or start > end:
        raise _Error(416, "RangeNotSatisfiable", f"range {header!r} outside 0-{size - 1}")
    return start, end


class HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "sparkdeploy-lab-hub/1"
    state: HubState  # set on the server subclass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    # --- plumbing ---------------------------------------------------------------------------

    @property
    def hub(self) -> HubState:
        return self.server.state  # type: ignore[attr-defined]

    def _send(self, status: int, body: bytes = b"", ctype: str = "application/json",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)
        self._status, self._bytes = status, len(body) if self.command != "HEAD" else 0

    def _json(self, obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers=headers)

    def _dispatch(self) -> None:
        t0 = time.monotonic()
        self._status, self._bytes, self._file, self._limit = 0, 0, None, None
        self._fault_fired = False
        url = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(url.path)
        query = urllib.parse.parse_qs(url.query)
        try:
            self._route(path, query)
        except _Error as e:
            headers = {"X-Error-Code": e.code, "X-Error-Message": e.message}
            if e.commit:
                headers["X-Repo-Commit"] = e.commit
            self._json({"error": e.message}, status=e.status, headers=headers)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        if path not in ("/_lab/health", "/_lab/control", "/_lab/stats"):
            self.hub.record({
                "method": self.command, "path": path, "range": self.headers.get("Range"),
                # a digest of the credential the client sent (tests prove a token arrived)
                "auth": hashlib.sha256(self.headers["Authorization"].encode()).hexdigest()[:16]
                if self.headers.get("Authorization") else None,
                "status": self._status, "bytes": self._bytes, "file": self._file,
                "limit_bps": self._limit, "fault_fired": self._fault_fired,
                "duration_s": round(time.monotonic() - t0, 6),
            })

    do_GET = do_HEAD = do_POST = _dispatch

    def _read_body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    # --- routes ------------------------------------------------------------------------------

    def _route(self, path: str, query: dict[str, list[str]]) -> None:
        if path == "/_lab/health":
            return self._json({"ok": True, "repos": sorted(self.hub.repos)})
        if path == "/_lab/control":
            if self.command == "POST":
                try:
                    body = json.loads(self._read_body() or b"{}")
                    return self._json(self.hub.apply(body))
                except (ValueError, KeyError, TypeError) as e:
                    raise _Error(400, "BadRequest", str(e)) from None
            return self._json(self.hub.knobs())
        if path == "/_lab/stats":
            return self._json(self.hub.stats())
        if path.startswith("/_lab/lfs/"):
            sha = path[len("/_lab/lfs/"):].split("/", 1)[0]
            if sha not in self.hub.by_sha:
                raise _Error(404, "EntryNotFound", "no such LFS object")
            repo, f = self.hub.by_sha[sha]
            return self._file_body(repo, f)
        for kind in ("models", "datasets", "spaces"):
            if path.startswith(f"/api/{kind}/"):
                return self._api(kind, path[len(f"/api/{kind}/"):], query)
        for repo in self.hub.repos.values():
            prefix = f"/{repo.repo_id}/resolve/"
            if path.startswith(prefix):
                rev, _, fpath = path[len(prefix):].partition("/")
                commit = self._revision(repo, rev)
                f = repo.files.get(fpath)
                if f is None:
                    raise _Error(404, "EntryNotFound", f"{fpath} not in {repo.repo_id}", commit)
                return self._resolve(repo, f)
        raise _Error(404, "RepoNotFound", f"not found: {path}")

    def _revision(self, repo: Repo, rev: str) -> str:
        if rev in ("main", repo.commit, "refs/heads/main"):
            return repo.commit
        raise _Error(404, "RevisionNotFound", f"revision {rev} not found in {repo.repo_id}")

    def _api(self, kind: str, rest: str, query: dict[str, list[str]]) -> None:
        repo = next((r for r in self.hub.repos.values() if kind == "models"
                     and (rest == r.repo_id or rest.startswith(r.repo_id + "/"))), None)
        if repo is None:
            raise _Error(404, "RepoNotFound", f"repository {rest} not found")
        tail = rest[len(repo.repo_id):].lstrip("/")
        action, _, arg = tail.partition("/")
        if action in ("", "revision"):
            if action == "revision":
                self._revision(repo, arg)
            blobs = query.get("blobs", ["false"])[0].lower() in ("1", "true")
            return self._json(self._model_info(repo, blobs))
        if action == "tree":
            rev, _, sub = arg.partition("/")
            self._revision(repo, rev)
            recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
            return self._json(self._tree(repo, sub.strip("/"), recursive))
        if action == "paths-info" and self.command == "POST":
            self._revision(repo, arg)
            form = urllib.parse.parse_qs(self._read_body().decode())
            if not form and self.headers.get("Content-Type", "").startswith("application/json"):
                form = {}
            paths = form.get("paths", [])
            return self._json(self._paths_info(repo, paths))
        raise _Error(404, "EntryNotFound", f"unsupported API path {tail!r}")

    def _entry(self, repo: Repo, f: RepoFile) -> dict[str, Any]:
        e: dict[str, Any] = {"type": "file", "oid": f.oid, "size": f.size, "path": f.path}
        if f.lfs:
            e["lfs"] = {"oid": f.sha256, "size": f.size,
                        "pointerSize": len(_lfs_pointer(f.sha256, f.size))}
        return e

    def _tree(self, repo: Repo, sub: str, recursive: bool) -> list[dict[str, Any]]:
        if sub and not any(p.startswith(sub + "/") for p in repo.files):
            raise _Error(404, "EntryNotFound", f"{sub} not a folder of {repo.repo_id}")
        out = []
        for p, f in repo.files.items():
            rel = p[len(sub) + 1:] if sub else p
            if sub and not p.startswith(sub + "/"):
                continue
            if "/" in rel and not recursive:
                continue
            out.append(self._entry(repo, f))
        return out

    def _paths_info(self, repo: Repo, paths: list[str]) -> list[dict[str, Any]]:
        out = []
        for p in paths:
            p = p.strip("/")
            if p in repo.files:
                out.append(self._entry(repo, repo.files[p]))
            elif any(q.startswith(p + "/") for q in repo.files):
                oid = hashlib.sha1(f"{repo.commit}/{p}".encode()).hexdigest()
                out.append({"type": "directory", "oid": oid, "size": 0, "path": p})
        return out

    def _model_info(self, repo: Repo, blobs: bool) -> dict[str, Any]:
        siblings = []
        for f in repo.files.values():
            s: dict[str, Any] = {"rfilename": f.path}
            if blobs:
                s["size"] = f.size
                s["blobId"] = f.oid
                if f.lfs:
                    s["lfs"] = {"sha256": f.sha256, "size": f.size,
                                "pointerSize": len(_lfs_pointer(f.sha256, f.size))}
            siblings.append(s)
        author = repo.repo_id.split("/")[0] if "/" in repo.repo_id else None
        counts = dict(sorted(repo.tensor_counts.items()))
        tok_cfg = json.loads((repo.root / "tokenizer_config.json").read_text()) if (
            "tokenizer_config.json" in repo.files) else {}
        return {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": author,
            "sha": repo.commit,
            "lastModified": CREATED_AT,
            "createdAt": CREATED_AT,
            "private": False,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "library_name": "transformers",
            "pipeline_tag": "image-text-to-text",
            "tags": ["transformers", "safetensors", "qwen3_5_moe", "image-text-to-text", "fp8",
                     "sparkdeploy-lab"],
            "config": {
                "architectures": repo.config.get("architectures"),
                "model_type": repo.config.get("model_type"),
                "quantization_config": {
                    "quant_method": repo.config.get("quantization_config", {}).get("quant_method")
                },
                "tokenizer_config": {k: tok_cfg.get(k) for k in ("eos_token", "pad_token")
                                     if k in tok_cfg},
            },
            "cardData": {"library_name": "transformers", "license": "apache-2.0",
                         "pipeline_tag": "image-text-to-text"},
            "siblings": siblings,
            "spaces": [],
            "safetensors": {"parameters": counts, "total": sum(counts.values())},
            "usedStorage": sum(f.size for f in repo.files.values()),
        }

    def _common_headers(self, repo: Repo, f: RepoFile) -> dict[str, str]:
        base = f.path.rsplit("/", 1)[-1]
        h = {
            "X-Repo-Commit": repo.commit,
            "ETag": f'"{f.etag}"',
            "Accept-Ranges": "bytes",
            "Content-Disposition": f"inline; filename*=UTF-8''{urllib.parse.quote(base)}; "
            f'filename="{base}"',
            "Cache-Control": "public, max-age=3600",
        }
        if f.lfs:
            h["X-Linked-Etag"] = f'"{f.sha256}"'
            h["X-Linked-Size"] = str(f.size)
        return h

    def _resolve(self, repo: Repo, f: RepoFile) -> None:
        if f.lfs:
            headers = self._common_headers(repo, f)
            headers["ETag"] = f'"{f.oid}"'
            headers["Location"] = f"/_lab/lfs/{f.sha256}/{urllib.parse.quote(f.path)}"
            self._file = f.path
            return self._send(302, b"", ctype="text/plain; charset=utf-8", headers=headers)
        return self._file_body(repo, f)

    def _file_body(self, repo: Repo, f: RepoFile) -> None:
        self._file = f.path
        headers = self._common_headers(repo, f)
        rng = _parse_range(self.headers.get("Range"), f.size) if self.command == "GET" else None
        start, end = rng if rng else (0, f.size - 1)
        length = end - start + 1 if f.size else 0
        ctype = "application/json" if f.path.endswith(".json") else (
            "text/plain; charset=utf-8" if f.path.endswith((".md", ".txt", ".gitattributes"))
            else "application/octet-stream")
        self.send_response(206 if rng else 200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(length))
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{end}/{f.size}")
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self._status = 206 if rng else 200
        if self.command == "HEAD":
            return
        fault = self.hub.take_fault(f.path)
        budget = fault.after_bytes if fault else None
        self._limit = self.hub.throttle.rate
        sent = 0
        with open(repo.root / f.path, "rb") as src:
            src.seek(start)
            left = length
            while left:
                n = min(CHUNK, left)
                if budget is not None:
                    n = min(n, budget - sent)
                    if n <= 0:
                        break
                data = src.read(n)
                self.hub.throttle.take(len(data))
                self.wfile.write(data)
                sent += len(data)
                self._bytes = sent
                left -= len(data)
        if fault is not None and left:
            self._fault_fired = True
            with self.hub.lock:
                self.hub.faults_fired.append(
                    {"file": f.path, "after_bytes": fault.after_bytes, "range_start": start})
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class LabServer(ThreadingHTTPServer):
    """A lab HTTP server served from a background thread (the hub and the package index)."""

    daemon_threads = True
    allow_reuse_address = True
    thread_name = "lab-server"

    def __init__(self, addr: tuple[str, int], handler: type[BaseHTTPRequestHandler]):
        super().__init__(addr, handler)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = host if ":" not in str(host) else f"[{host}]"
        return f"http://{host}:{port}"

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self) -> LabServer:
        self._thread = threading.Thread(target=self.serve_forever, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread:
            self._thread.join(timeout=5)


class HubServer(LabServer):
    thread_name = "lab-hub"

    def __init__(self, addr: tuple[str, int], state: HubState):
        super().__init__(addr, HubHandler)
        self.state = state

    def set_knobs(self, **knobs: Any) -> dict[str, Any]:
        return self.state.apply(knobs)

    def stats(self) -> dict[str, Any]:
        return self.state.stats()


def start_hub(
    bind: str = "127.0.0.1",
    port: int = 0,
    data_dir: Path | str = DEFAULT_DATA_DIR,
    size_mb: int = DEFAULT_SIZE_MB,
    shards: int = DEFAULT_SHARDS,
    bandwidth_bps: int | None = None,
    fault: dict[str, Any] | None = None,
) -> HubServer:
    """Generate (or reuse) the miniature model and serve it from a background thread."""
    repo = prepare_repo(data_dir, size_mb=size_mb, shards=shards)
    state = HubState(
        [repo], bandwidth_bps=bandwidth_bps,
        fault=Fault(fault["file"], int(fault["after_bytes"])) if fault else None,
    )
    return HubServer((bind, port), state).start()


def set_knobs(url: str, **knobs: Any) -> dict[str, Any]:
    """Change the knobs of a running hub over HTTP (see the module docstring)."""
    req = urllib.request.Request(
        url.rstrip("/") + "/_lab/control", data=json.dumps(knobs).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def get_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url.rstrip("/") + "/_lab/stats", timeout=10) as r:
        return json.loads(r.read())


def cli_argv(bind: str, port: int = DEFAULT_PORT, data_dir: Path | str = DEFAULT_DATA_DIR,
             size_mb: int = DEFAULT_SIZE_MB, shards: int = DEFAULT_SHARDS,
             python: str = sys.executable) -> list[str]:
    """argv to run the hub as a daemon (lab.up: Popen it, record its PID, wait_ready)."""
    return [python, "-m", "sparkdeploy.lab.hub", "--bind", bind, "--port", str(port),
            "--data", str(data_dir), "--size-mb", str(size_mb), "--shards", str(shards)]


def wait_ready(url: str, timeout: float = 60.0) -> bool:
    """Poll GET <url>/_lab/health until it answers 200 (True) or timeout passes (False)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/_lab/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def _parse_fault(text: str) -> dict[str, Any]:
    name, sep, n = text.rpartition(":")
    if not sep or not name or not n.isdigit():
        raise argparse.ArgumentTypeError("expected FILE:BYTES")
    return {"file": name, "after_bytes": int(n)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparkdeploy.lab.hub", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bind", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--data", default=str(DEFAULT_DATA_DIR), help="data (cache) directory")
    p.add_argument("--size-mb", type=int, default=DEFAULT_SIZE_MB)
    p.add_argument("--shards", type=int, default=DEFAULT_SHARDS)
    p.add_argument("--bandwidth-bps", type=int, default=None)
    p.add_argument("--fault", type=_parse_fault, default=None, metavar="FILE:BYTES")
    args = p.parse_args(argv)
    try:
        server = start_hub(args.bind, args.port, args.data, args.size_mb, args.shards,
                           args.bandwidth_bps, args.fault)
    except OSError as e:
        print(f"hub: cannot start: {e}", file=sys.stderr)
        return 1
    return serve_until_stopped(server, server.url)


def serve_until_stopped(server: Any, url: str) -> int:
    """A lab daemon's main loop: say READY, serve until interrupted, stop cleanly."""
    print(f"READY {url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


__all__ = [
    "DEFAULT_PORT", "DEFAULT_DATA_DIR", "REPO_ID", "HubServer", "Repo", "prepare_repo",
    "start_hub", "set_knobs", "get_stats", "model_config", "cli_argv", "wait_ready", "serve_until_stopped", "main",
]

if __name__ == "__main__":
    sys.exit(main())
