"""Does a model fit N nodes, from its own config.json? ``model.estimate``'s arithmetic: pure, no
node, no hub (the weights' size is given).

For N nodes of M GiB usable each (one GPU per node, as on a GB10), it picks the parallel layout
the engines accept, then per node: the weights' share + the KV cache's share + the engine's
reserve, against M. Every figure says where it came from (a config key, FACTS, an engine's
source).

- **Layout.** TP=N when the engines accept it; else PP=N (layers split); else TP x PP. vLLM
  refuses a TP that does not divide the attention heads (``ModelConfig.
  verify_with_parallel_config``: "Total number of attention heads (H) must be divisible by
  tensor parallel size (T)"), and its ``QKVParallelLinear`` (SGLang's the same) divides the KV
  heads by TP when there are at least TP of them, else replicates them (TP a multiple of the
  KV heads). Linear-attention layers split their heads the same way.
- **KV cache per token.** Full-attention layers: 2 (K and V) x KV heads x head_dim x the KV
  dtype's bytes; per TP rank ``max(1, KV heads / TP)`` heads (replicas count in full). MLA
  (DeepSeek-style): one latent per layer of ``kv_lora_rank + qk_rope_head_dim``, shared by the
  heads and held whole on every TP rank (vLLM's MLA backends). Sliding-window layers hold at
  most the window per sequence. Linear-attention layers (Qwen3-Next, Qwen3.5) hold a fixed
  state per sequence: a conv state of ``(kernel - 1) x (2 x key heads x key dim + value heads x
  value dim)`` and a recurrent state of ``value heads x key dim x value dim`` (vLLM's
  ``MambaStateShapeCalculator.gated_delta_net_state_shape``), split by TP.
- **Per node.** Weights / (TP x PP) (each rank holds one slice), the KV of its stage's layers for C
  tokens x S sequences, the engine's reserve (``fit.reserve_gib``). Under PP the layers split
  evenly, the first ``L mod PP`` stages one more; the heaviest node decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkdeploy.core.errors import UsageError
from sparkdeploy.core.outside import OutsideError, parsed
from sparkdeploy.model import fit
from sparkdeploy.model.fit import GIB

VLLM_MODEL = "https://github.com/vllm-project/vllm/blob/main/vllm/config/model.py"
VLLM_LINEAR = "https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/layers/linear.py"
VLLM_MAMBA = ("https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/layers/mamba/"
              "mamba_utils.py")
SGLANG_LINEAR = "https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/layers/linear.py"

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "bf16": 2,
               "fp16": 2, "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1}
KV_DTYPES = ("auto", "fp8", "bf16")
GB10_USABLE_GIB = 101.0
GB10_SOURCE = "FACTS: a GB10's usable memory, about 101-102 of 121.7 GiB"
NESTED = ("text_config", "llm_config", "language_config")
"""Where a multimodal config keeps its language model's keys."""


class EstimateError(UsageError, ValueError):
    """Input the calculator cannot use; its message is one line for the user."""


@dataclass(frozen=True)
class Figure:
    """A number and where it came from."""

    value: float
    source: str

    def as_json(self) -> dict[str, Any]:
        return {"value": self.value, "source": self.source}


@dataclass(frozen=True)
class Model:
    """What the estimate reads of a config.json (the language model's part)."""

    model_type: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    kinds: tuple[str, ...]
    """Per layer: ``full``, ``sliding`` or ``linear``."""
    window: int | None = None
    mla: tuple[int, int] | None = None
    """(kv_lora_rank, qk_rope_head_dim) for DeepSeek-style attention."""
    linear: dict[str, int] = field(default_factory=dict)
    """Linear-attention dims: key_heads, value_heads, key_dim, value_dim, conv_kernel."""
    dtype: str = "bfloat16"
    checkpoint_kv: str | None = None
    max_context: int | None = None
    sources: dict[str, str] = field(default_factory=dict)


def _int(cfg: dict[str, Any], key: str, where: str) -> int | None:
    v = cfg.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise EstimateError(f"{where}{key}: {v!r} is not a whole number")
    return v


def _kinds(text: dict[str, Any], layers: int, where: str) -> tuple[str, ...]:
    types = text.get("layer_types")
    if isinstance(types, list) and types:
        if len(types) != layers:
            raise EstimateError(f"{where}layer_types names {len(types)} layers, "
                                f"num_hidden_layers {layers}")
        out = []
        for t in types:
            t = str(t)
            out.append("linear" if "linear" in t else "sliding" if "sliding" in t else "full")
        return tuple(out)
    interval = _int(text, "full_attention_interval", where)
    if interval:
        return tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(layers))
    if text.get("sliding_window") and text.get("use_sliding_window"):
        return ("sliding",) * layers
    return ("full",) * layers


def _checkpoint_kv(cfg: dict[str, Any]) -> str | None:
    """The KV cache dtype the checkpoint names (FP8 KV scales), or None."""
    q = cfg.get("quantization_config")
    if not isinstance(q, dict):
        return None
    algo = q.get("kv_cache_quant_algo")
    scheme = q.get("kv_cache_scheme")
    if isinstance(algo, str) and "fp8" in algo.lower():
        return "fp8"
    if isinstance(scheme, dict) and scheme.get("num_bits") == 8:
        return "fp8"
    return None


def load_config(path: Path) -> Any:
    """The parsed JSON of the config.json at ``path`` (``EstimateError``: not JSON)."""
    try:
        body = path.read_bytes()
    except OSError as e:
        raise EstimateError(f"{path}: {e.strerror}") from None
    return parse_config(body, str(path))


def parse_config(body: bytes, where: str) -> Any:
    """The parsed JSON of a config.json read from ``where`` (``EstimateError``: not JSON)."""
    try:
        return parsed(body, where)
    except OutsideError as e:
        raise EstimateError(str(e)) from None


def _scaled_context(scaling: Any, ctx: int | None) -> int:
    """The longest context vLLM derives with RoPE scaling (``_get_and_verify_max_len``): the
    positions (YaRN: its ``original_max_position_embeddings``) x ``factor``; ``llama3``,
    ``longrope`` and ``su`` scaling leave it; 0 when nothing scales."""
    if not ctx or not isinstance(scaling, dict):
        return 0
    kind = scaling.get("rope_type") or scaling.get("type")
    factor = scaling.get("factor")
    if kind in ("llama3", "longrope", "su") or isinstance(factor, bool) \
            or not isinstance(factor, (int, float)) or factor <= 1:
        return 0
    base = scaling.get("original_max_position_embeddings") if kind == "yarn" else None
    return int((base if isinstance(base, int) and base > 0 else ctx) * factor)


def read_config(cfg: Any) -> Model:
    """A config.json (parsed) as a ``Model``; ``EstimateError`` when it is no model config."""
    if not isinstance(cfg, dict):
        raise EstimateError(f"not a model config: a JSON {type(cfg).__name__}, not an object")
    nest = next((k for k in NESTED if isinstance(cfg.get(k), dict)), None)
    text = cfg[nest] if nest else cfg
    where = f"{nest}." if nest else ""
    layers = _int(text, "num_hidden_layers", where)
    heads = _int(text, "num_attention_heads", where)
    for key, v in (("num_hidden_layers", layers), ("num_attention_heads", heads)):
        if v == 0:
            raise EstimateError(f"{where}{key}: 0: a model has at least one")
    if not layers or not heads:
        missing = [k for k, v in (("num_hidden_layers", layers), ("num_attention_heads", heads))
                   if not v]
        raise EstimateError(f"not a model config: no {' or '.join(where + k for k in missing)}")
    src = {"layers": f"config {where}num_hidden_layers", "heads": f"config {where}num_attention_heads"}
    kv = _int(text, "num_key_value_heads", where)
    if kv == 0:
        raise EstimateError(f"{where}num_key_value_heads: 0: attention has at least one KV head "
                            "(a config without the key is multi-head attention)")
    src["kv_heads"] = f"config {where}num_key_value_heads" if kv else \
        f"config {where}num_attention_heads (no num_key_value_heads: multi-head attention)"
    kv = kv or heads
    head_dim = _int(text, "head_dim", where)
    if head_dim:
        src["head_dim"] = f"config {where}head_dim"
    else:
        hidden = _int(text, "hidden_size", where)
        if not hidden:
            raise EstimateError(f"not a model config: no {where}head_dim or {where}hidden_size")
        head_dim = hidden // heads
        src["head_dim"] = f"config {where}hidden_size / num_attention_heads"
    mla = None
    rank = _int(text, "kv_lora_rank", where)
    if rank:
        mla = (rank, _int(text, "qk_rope_head_dim", where) or 0)
        src["mla"] = f"config {where}kv_lora_rank + {where}qk_rope_head_dim"
    kinds = _kinds(text, layers, where)
    src["kinds"] = (f"config {where}layer_types" if text.get("layer_types") else
                    f"config {where}full_attention_interval" if text.get("full_attention_interval")
                    else "every layer full attention (no layer_types)")
    linear: dict[str, int] = {}
    if "linear" in kinds:
        keys = {"key_heads": "linear_num_key_heads", "value_heads": "linear_num_value_heads",
                "key_dim": "linear_key_head_dim", "value_dim": "linear_value_head_dim",
                "conv_kernel": "linear_conv_kernel_dim"}
        for name, key in keys.items():
            v = _int(text, key, where)
            if not v:
                raise EstimateError(f"linear-attention layers without {where}{key}")
            linear[name] = v
        src["linear"] = f"config {where}linear_* ({VLLM_MAMBA})"
    window = _int(text, "sliding_window", where) if "sliding" in kinds else None
    if "sliding" in kinds:
        if not window:
            raise EstimateError(f"sliding-window layers without {where}sliding_window")
        src["window"] = f"config {where}sliding_window"
    dtype = next((str(d) for d in (text.get("dtype"), text.get("torch_dtype"), cfg.get("dtype"),
                                   cfg.get("torch_dtype")) if d), None)
    src["dtype"] = "config dtype/torch_dtype" if dtype else "no dtype in config: bfloat16 assumed"
    dtype = dtype or "bfloat16"
    if dtype not in DTYPE_BYTES:
        raise EstimateError(f"config dtype {dtype!r} is not one of {', '.join(sorted(DTYPE_BYTES))}")
    ctx = _int(text, "max_position_embeddings", where)
    scaled = _scaled_context(text.get("rope_scaling") or cfg.get("rope_scaling"), ctx)
    if ctx and scaled > ctx:
        ctx = scaled
        src["max_context"] = f"config {where}max_position_embeddings x rope_scaling.factor"
    return Model(model_type=str(cfg.get("model_type") or text.get("model_type") or "?"),
                 layers=layers, heads=heads, kv_heads=kv, head_dim=head_dim, kinds=kinds,
                 window=window, mla=mla, linear=linear, dtype=dtype,
                 checkpoint_kv=_checkpoint_kv(cfg), max_context=ctx, sources=src)


def kv_dtype(model: Model, choice: str) -> Figure:
    """The KV cache's bytes per element for ``--kv-dtype`` ``choice``."""
    if choice == "fp8":
        return Figure(1, "--kv-dtype fp8")
    if choice == "bf16":
        return Figure(2, "--kv-dtype bf16")
    if choice != "auto":
        raise EstimateError(f"--kv-dtype: {choice!r} is not one of {', '.join(KV_DTYPES)}")
    if model.checkpoint_kv:
        return Figure(DTYPE_BYTES[model.checkpoint_kv],
                      "auto: the checkpoint's quantization_config names an fp8 KV cache")
    return Figure(DTYPE_BYTES[model.dtype], f"auto: the model's dtype {model.dtype} "
                  f"({model.sources['dtype']}; vLLM's --kv-cache-dtype auto)")


# --- layouts ---------------------------------------------------------------------------------

def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_tps(model: Model) -> list[int]:
    """Every TP the engines accept for this model."""
    return [t for t in divisors(model.heads) if tp_refusal(model, t) is None]


def tp_refusal(model: Model, tp: int) -> str | None:
    """Why the engines refuse TP=``tp`` for ``model`` (None: they accept it)."""
    if model.heads % tp:
        return (f"{model.heads} attention heads do not divide by {tp} (vLLM: \"Total number of "
                f"attention heads ({model.heads}) must be divisible by tensor parallel size "
                f"({tp})\", {VLLM_MODEL})")
    if model.mla is None and model.kv_heads % tp and tp % model.kv_heads:
        return (f"{model.kv_heads} KV heads neither divide by {tp} nor divide it (vLLM and "
                f"SGLang QKVParallelLinear: {VLLM_LINEAR}, {SGLANG_LINEAR})")
    for name in ("key_heads", "value_heads"):
        n = model.linear.get(name)
        if n and n % tp:
            return (f"{n} linear-attention {name.replace('_', ' ')} do not divide by {tp} "
                    f"({VLLM_MAMBA})")
    return None


def layout_refusal(model: Model, tp: int, pp: int) -> str | None:
    why = tp_refusal(model, tp) if tp > 1 else None
    if why:
        return f"TP={tp}: {why}"
    if pp > model.layers:
        return f"PP={pp}: more stages than the model's {model.layers} layers"
    return None


def candidates(nodes: int) -> list[tuple[int, int]]:
    """(TP, PP) for ``nodes`` nodes in order of preference: TP=N, PP=N, then TP x PP."""
    first = [(nodes, 1)] + ([(1, nodes)] if nodes > 1 else [])
    mixed = [(t, nodes // t) for t in divisors(nodes)[1:-1]]
    mixed.sort(key=lambda tp_pp: -tp_pp[0])
    return first + mixed


def stages(layers: int, pp: int) -> list[range]:
    """The layers of each pipeline stage: an even split, the first ``layers mod pp`` one more."""
    base, extra = divmod(layers, pp)
    out, start = [], 0
    for i in range(pp):
        n = base + (1 if i < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


# --- KV cache --------------------------------------------------------------------------------

def kv_heads_per_rank(model: Model, tp: int) -> int:
    """KV heads one TP rank holds: its share, or one replica when TP exceeds them."""
    return max(1, model.kv_heads // tp)


def layer_token_bytes(model: Model, tp: int, dtype_bytes: float) -> float:
    """KV bytes per token of one full or sliding-window attention layer on one TP rank (a
    linear-attention layer holds a state per sequence instead: ``linear_state_bytes``)."""
    if model.mla is not None:
        rank, rope = model.mla
        return (rank + rope) * dtype_bytes
    return 2 * kv_heads_per_rank(model, tp) * model.head_dim * dtype_bytes


def linear_state_bytes(model: Model, tp: int, state_bytes: float) -> float:
    """One linear-attention layer's state per sequence on one TP rank."""
    d = model.linear
    conv = (d["conv_kernel"] - 1) * (2 * d["key_heads"] * d["key_dim"]
                                     + d["value_heads"] * d["value_dim"])
    recurrent = d["value_heads"] * d["key_dim"] * d["value_dim"]
    return (conv + recurrent) * state_bytes / tp


@dataclass(frozen=True)
class Stage:
    """One node's share (one rank: TP ranks of a stage are alike)."""

    layers: int
    weights: float
    kv: float
    reserve: float
    usable: float

    @property
    def need(self) -> float:
        return self.weights + self.kv + self.reserve

    @property
    def fits(self) -> bool:
        return self.need <= self.usable


@dataclass(frozen=True)
class Estimate:
    model: Model
    tp: int
    pp: int
    nodes: int
    context: Figure
    seqs: int
    kv_dtype: Figure
    weights: Figure
    reserve: Figure
    usable: Figure
    kv_bytes_per_token: float
    """Whole model, before TP: what each token of context adds in the full-attention layers."""
    sliding_bytes_per_token: float
    linear_bytes_per_seq: float
    stages: tuple[Stage, ...]
    refused: tuple[str, ...]

    @property
    def worst(self) -> Stage:
        return max(self.stages, key=lambda s: s.need)

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    def why(self) -> str:
        w = self.worst
        verdict = "fits" if self.fits else "does not fit"
        cmp = "<=" if w.fits else ">"
        return (f"TP={self.tp} x PP={self.pp} on {self.nodes} node(s) {verdict}: "
                f"{fit.gib(w.need)} per node ({fit.gib(w.weights)} of weights + {fit.gib(w.kv)} "
                f"KV cache for {int(self.context.value)} tokens x {self.seqs} sequence(s) + "
                f"{fit.gib(w.reserve)} reserve) {cmp} {fit.gib(w.usable)} usable")

    def lines(self) -> list[str]:
        """The estimate in words, each figure with its source, the verdict last."""
        m, w = self.model, self.worst
        counts = {k: m.kinds.count(k) for k in ("full", "sliding", "linear") if k in m.kinds}
        kinds = ", ".join(f"{n} {k}" for k, n in counts.items())
        attn = (f"MLA latent {m.mla[0]} + rope {m.mla[1]} ({m.sources['mla']})" if m.mla else
                f"{m.kv_heads} KV heads ({m.sources['kv_heads']}), head_dim {m.head_dim} "
                f"({m.sources['head_dim']})")
        out = [f"model: {m.model_type}: {m.layers} layers ({kinds}; {m.sources['kinds']}), "
               f"{m.heads} attention heads, {attn}",
               f"layout: TP={self.tp} x PP={self.pp} on {self.nodes} node(s)"]
        out += [f"  not {r}" if ALSO in r else f"  refused: {r}" for r in self.refused]
        kvd = f"{self.kv_dtype.value:g} byte(s) per element ({self.kv_dtype.source})"
        out.append(f"KV cache: {self.kv_bytes_per_token:,.0f} bytes per token in the "
                   f"full-attention layers, {kvd}")
        if self.sliding_bytes_per_token:
            out.append(f"  sliding-window layers: {self.sliding_bytes_per_token:,.0f} bytes per "
                       f"token, at most {m.window} tokens per sequence ({m.sources['window']})")
        if self.linear_bytes_per_seq:
            out.append(f"  linear-attention layers: {self.linear_bytes_per_seq:,.0f} bytes of "
                       f"state per sequence ({m.sources['linear']})")
        out.append(f"context: {int(self.context.value)} tokens ({self.context.source}) x "
                   f"{self.seqs} sequence(s)")
        split = (f" x {w.layers}/{m.layers} layers" if self.pp > 1 else "") + (
            f" / {self.tp}" if self.tp > 1 or self.pp == 1 else "")
        out.append(f"per node ({w.layers} layers): weights {fit.gib(w.weights)} "
                   f"({fit.gib(self.weights.value)} from {self.weights.source}{split})"
                   f", KV cache {fit.gib(w.kv)}, reserve {fit.gib(w.reserve)} "
                   f"({self.reserve.source}), usable {fit.gib(w.usable)} ({self.usable.source})")
        out.append(self.why())
        return out

    def as_json(self) -> dict[str, Any]:
        w = self.worst
        return {
            "fits": self.fits,
            "layout": {"tp": self.tp, "pp": self.pp, "nodes": self.nodes},
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "sliding_bytes_per_token": self.sliding_bytes_per_token,
            "linear_state_bytes_per_sequence": self.linear_bytes_per_seq,
            "per_node_gib": round(w.need / GIB, 3),
            "per_node": {"weights_gib": round(w.weights / GIB, 3), "kv_gib": round(w.kv / GIB, 3),
                         "reserve_gib": round(w.reserve / GIB, 3),
                         "usable_gib": round(w.usable / GIB, 3), "layers": w.layers},
            "why": self.why(),
            "refused": list(self.refused),
            "sources": {
                "weights": self.weights.source, "context": self.context.source,
                "kv_dtype": self.kv_dtype.source, "reserve": self.reserve.source,
                "usable": self.usable.source, **self.model.sources,
            },
            "inputs": {"weights_bytes": self.weights.value, "context": self.context.value,
                       "seqs": self.seqs, "kv_dtype_bytes": self.kv_dtype.value,
                       "layers": self.model.layers, "heads": self.model.heads,
                       "kv_heads": self.model.kv_heads, "head_dim": self.model.head_dim},
        }


def stage_share(model: Model, layers: range, tp: int, pp: int, *, weights: float,
                context: int, seqs: int, kv_bytes: float, reserve: float,
                usable: float) -> Stage:
    """One node of the stage holding ``layers``: its weights, KV cache, reserve."""
    kv = 0.0
    for i in layers:
        kind = model.kinds[i]
        if kind == "linear":
            kv += seqs * linear_state_bytes(model, tp, DTYPE_BYTES[model.dtype])
        elif kind == "sliding":
            kv += seqs * min(context, model.window or context) * \
                layer_token_bytes(model, tp, kv_bytes)
        else:
            kv += seqs * context * layer_token_bytes(model, tp, kv_bytes)
    # a stage holds its layers' share of the weights: the heaviest stage more than weights / PP
    share = weights * len(layers) / model.layers if pp > 1 else weights
    return Stage(layers=len(layers), weights=share / tp, kv=kv, reserve=reserve, usable=usable)


LIGHTER_GIB = 0.05
"""Less than this lighter per node is no lighter (the figures are shown to a tenth of a GiB)."""
ALSO = "also accepted"
"""What a note on a layout the engines accept but the estimate did not choose says."""


def choose_layout(accepted: dict[tuple[int, int], tuple[Stage, ...]]
                  ) -> tuple[tuple[int, int], list[str]]:
    """The layout to use among ``accepted`` (in order of preference, each with its stages) and a
    note on each other: the first that fits (TP before PP: tensor parallelism works on each
    token on every node, pipeline stages take turns), else the lightest; a lighter one passed
    over says so, with why."""
    def need(a: tuple[int, int]) -> float:
        return max(s.need for s in accepted[a])

    fitting = [a for a in accepted if all(s.fits for s in accepted[a])]
    chosen = fitting[0] if fitting else min(accepted, key=need)
    name = f"TP={chosen[0]} x PP={chosen[1]}"
    notes = []
    for t, p in accepted:
        if (t, p) == chosen:
            continue
        if need((t, p)) < need(chosen) - LIGHTER_GIB * GIB:
            notes.append(f"TP={t} x PP={p}: {ALSO} and lighter ({fit.gib(need((t, p)))} per node, "
                         f"not {fit.gib(need(chosen))}), {name} preferred: it fits, and tensor "
                         "parallelism works on each token on every node where pipeline stages "
                         "take turns")
        elif not fitting:
            notes.append(f"TP={t} x PP={p}: {ALSO}, {name} chosen: neither fits, it is the "
                         f"lightest ({fit.gib(need(chosen))} per node)")
        else:
            notes.append(f"TP={t} x PP={p}: {ALSO}, {name} preferred")
    return chosen, notes


def estimate(cfg: Any, *, weights_bytes: float, weights_source: str = "--weights-gb",
             nodes: int, memory_gib: float, memory_source: str = "--memory-gib",
             context: int | None = None, seqs: int = 1, kv: str = "auto",
             reserve_gib: float | None = None, tp: int | None = None) -> Estimate:
    """The estimate for ``cfg`` (a parsed config.json) on ``nodes`` nodes of ``memory_gib``
    usable each; ``tp`` forces a tensor-parallel size (``EstimateError`` when refused)."""
    model = read_config(cfg)
    if nodes < 1:
        raise EstimateError(f"--nodes: must be >= 1, not {nodes}")
    if seqs < 1:
        raise EstimateError(f"--seqs: must be >= 1, not {seqs}")
    if weights_bytes <= 0:
        raise EstimateError(f"the weights' size must be > 0, not {weights_bytes}")
    if memory_gib <= 0:
        raise EstimateError(f"--memory-gib: must be > 0, not {memory_gib}")
    if context is not None:
        ctx = Figure(context, "--context")
    elif model.max_context:
        ctx = Figure(model.max_context, "config max_position_embeddings (vLLM's default "
                     "--max-model-len)")
    else:
        raise EstimateError("--context: the config names no max_position_embeddings; give one")
    if ctx.value < 1:
        raise EstimateError(f"--context: must be >= 1, not {ctx.value}")
    if model.max_context and ctx.value > model.max_context:
        longest = model.sources.get("max_context", "config max_position_embeddings")
        raise EstimateError(f"--context: {int(ctx.value)} tokens is more than the model's "
                            f"{model.max_context} ({longest}): vLLM and SGLang refuse a longer "
                            "context length")
    kvd = kv_dtype(model, kv)
    rg = fit.RESERVE_GIB if reserve_gib is None else reserve_gib
    reserve = Figure(rg * GIB, "the profile's fit.reserve_gib (sparkdeploy.profile.config.Fit)"
                     if reserve_gib is None else "reserve given")
    usable = Figure(memory_gib * GIB, memory_source)
    refused: list[str] = []
    chosen: tuple[int, int] | None = None

    def shares_of(t: int, p: int) -> tuple[Stage, ...]:
        return tuple(stage_share(model, layers, t, p, weights=weights_bytes,
                                 context=int(ctx.value), seqs=seqs, kv_bytes=kvd.value,
                                 reserve=reserve.value, usable=usable.value)
                     for layers in stages(model.layers, p))

    if tp is not None:
        if tp < 1 or nodes % tp:
            raise EstimateError(f"--tp: {tp} does not divide the {nodes} node(s)")
        why = tp_refusal(model, tp) if tp > 1 else None
        if why:
            raise EstimateError(f"TP={tp} refused: {why}; valid TPs: "
                                f"{', '.join(map(str, valid_tps(model)))}")
        if nodes // tp > model.layers:
            raise EstimateError(f"--tp: {tp} on {nodes} node(s) leaves PP={nodes // tp}: more "
                                f"stages than the model's {model.layers} layers")
        chosen = (tp, nodes // tp)
    else:
        accepted = []
        for t, p in candidates(nodes):
            why = layout_refusal(model, t, p)
            if why:
                refused.append(why)
            else:
                accepted.append((t, p))
        if not accepted:
            raise EstimateError(f"no layout for {nodes} node(s): {'; '.join(refused)}; valid TPs: "
                                f"{', '.join(map(str, valid_tps(model)))}")
        chosen, notes = choose_layout({a: shares_of(*a) for a in accepted})
        refused += notes
    assert chosen is not None
    t, p = chosen
    shares = shares_of(t, p)
    full = model.kinds.count("full") * layer_token_bytes(model, 1, kvd.value)
    sliding = model.kinds.count("sliding") * layer_token_bytes(model, 1, kvd.value)
    linear = sum(linear_state_bytes(model, 1, DTYPE_BYTES[model.dtype])
                 for k in model.kinds if k == "linear")
    return Estimate(model=model, tp=t, pp=p, nodes=nodes, context=ctx, seqs=seqs, kv_dtype=kvd,
                    weights=Figure(weights_bytes, weights_source), reserve=reserve, usable=usable,
                    kv_bytes_per_token=full, sliding_bytes_per_token=sliding,
                    linear_bytes_per_seq=linear, stages=shares, refused=tuple(refused))


def min_nodes(cfg: Any, *, weights_bytes: float, memory_gib: float, most: int = 8,
              **kw: Any) -> Estimate | None:
    """The estimate on the fewest nodes (1..``most``) where the model fits, or None."""
    for n in range(1, most + 1):
        try:
            e = estimate(cfg, weights_bytes=weights_bytes, nodes=n, memory_gib=memory_gib, **kw)
        except EstimateError:
            continue
        if e.fits:
            return e
    return None

