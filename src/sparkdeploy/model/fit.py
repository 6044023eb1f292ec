"""Does the model fit? The decision ``model.fit`` makes before a byte is downloaded, as pure
arithmetic over what the hub and the nodes report (no node, no hub here).

For one engine on one node (the figures per GPU from the fit calculator, ``sparkdeploy.model.estimate``,
on the model's config.json under the engine's TP x PP):

- the node's share: the weights' slice of its rank, the KV cache of its stage's layers for the
  engine's context x sequences, and the engine's reserve (``fit.reserve_gib``: CUDA context and
  NCCL buffers, activations at the engine's memory profiling, CUDA graphs), times the GPUs the
  profile gives the node;
- against what the node reports usable (``NodeMemory.gpu_usable`` per GPU: on a GB10 the
  operating system's ``MemAvailable``, never ``MemTotal``);
- and, when the engine's args name a memory fraction (``--gpu-memory-utilization``,
  ``--mem-fraction-static``), fraction x the node's total against the same usable figure: an
  engine that asks for more than the node can give fails at start.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from sparkdeploy.core.errors import UsageError

GIB = 1024 ** 3
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""The files that are weights; when a repo has none of them, every file counts."""
FRACTION_FLAGS = ("--gpu-memory-utilization", "--mem-fraction-static")
RESERVE_GIB = 8.0
"""The default ``fit.reserve_gib`` (``config.Fit``): GiB per GPU beside the weights."""


class FitError(UsageError, ValueError):
    """An engine's args that cannot be read (a fraction that is no number in (0, 1])."""


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def weight_bytes(files: Sequence[dict]) -> int:
    """The bytes of the weight files among ``files`` (``{"path", "size"}``, as the hub's
    metadata lists them); all files' bytes when none is a weight file."""
    weights = [f for f in files if str(f["path"]).endswith(WEIGHT_SUFFIXES)]
    return sum(int(f["size"]) for f in (weights or files))


def arg_value(args: Sequence[str], flags: Sequence[str]) -> tuple[str, str] | None:
    """(flag, value) of the last of ``flags`` that ``args`` set (as argparse reads it: the last
    one wins), in either spelling (``--flag V``, ``--flag=V``); None when they set none."""
    found: tuple[str, str] | None = None
    for i, a in enumerate(args):
        for flag in flags:
            if a == flag and i + 1 < len(args):
                found = (flag, args[i + 1])
            elif a.startswith(flag + "="):
                found = (flag, a[len(flag) + 1:])
    return found


HUMAN_INT_FLAGS = ("--max-model-len",)
"""vLLM reads these as human-readable numbers (``vllm/engine/arg_utils.py``
``human_readable_int``): ``32k`` is 32,000, ``32K`` 32,768, a decimal only with k/m/g/t."""
_SUFFIX = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12,
           "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _count(flag: str, text: str) -> int | None:
    """``text`` as the engine reads ``flag``'s value (None: not a number it takes)."""
    if text.isdigit():
        return int(text)
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([kmgtKMGT])", text.strip())
    if flag not in HUMAN_INT_FLAGS or not m or ("." in m[1] and m[2].isupper()):
        return None
    return int(float(m[1]) * _SUFFIX[m[2]])


def arg_count(args: Sequence[str], flags: Sequence[str]) -> tuple[str, int] | None:
    """(flag, whole number >= 1) the last of ``flags`` sets in ``args``; ``FitError`` when its
    value is not one."""
    found = arg_value(args, flags)
    if found is None:
        return None
    flag, text = found
    n = _count(flag, text)
    if n is None or n < 1:
        raise FitError(f"{flag} {text!r} is not a whole number >= 1")
    return flag, n


def memory_fraction(args: Sequence[str]) -> tuple[str, float] | None:
    """(flag, value) of the memory fraction ``args`` set (the last one wins, as argparse
    reads it); None when they set none. ``FitError`` for a value that is not in (0, 1]."""
    found = arg_value(args, FRACTION_FLAGS)
    if found is None:
        return None
    flag, text = found
    try:
        value = float(text)
    except ValueError:
        raise FitError(f"{flag} {text!r} is not a number") from None
    if not 0 < value <= 1:
        raise FitError(f"{flag} {text} is not a fraction in (0, 1]")
    return flag, value


@dataclass(frozen=True)
class Check:
    """One engine on one node: what it needs and what the node gives (bytes, whole node)."""

    node: str
    engine: str
    weights: float
    reserve: float
    usable: int
    total: int
    fraction: tuple[str, float] | None = None
    kv: float = 0.0
    kv_for: str = ""
    """What the KV cache is sized for, in words (``32768 tokens x 1 sequence(s)``)."""

    @property
    def need(self) -> float:
        return self.weights + self.kv + self.reserve

    @property
    def asks(self) -> float | None:
        """What the memory fraction asks of the node (None: the args set none)."""
        return self.fraction[1] * self.total if self.fraction else None

    @property
    def weights_fit(self) -> bool:
        return self.need <= self.usable

    @property
    def fraction_fits(self) -> bool:
        asks = self.asks
        return asks is None or asks <= self.usable

    @property
    def fits(self) -> bool:
        return self.weights_fit and self.fraction_fits

    def parts(self) -> str:
        """The need's parts: weights, KV cache (when sized), reserve."""
        kv = f" + {gib(self.kv)} KV cache for {self.kv_for}" if self.kv_for else ""
        return f"{gib(self.weights)} of weights{kv} + {gib(self.reserve)} reserve"

    def demands(self) -> str:
        """What the engine needs here, in words."""
        out = f"{gib(self.need)} needed ({self.parts()})"
        if self.fraction:
            flag, value = self.fraction
            out += f", {flag} {value:g} x {gib(self.total)} = {gib(value * self.total)}"
        return out

    def line(self) -> str:
        """One line: fits or not, both numbers of each comparison that fails."""
        if self.fits:
            return (f"{self.node}: {self.engine} fits: {self.demands()}; {gib(self.usable)} "
                    f"usable of {gib(self.total)}")
        short = []
        if not self.weights_fit:
            short.append(f"{gib(self.need)} needed ({self.parts()}) > {gib(self.usable)} usable")
        if self.fraction and not self.fraction_fits:
            flag, value = self.fraction
            short.append(f"{flag} {value:g} x {gib(self.total)} = {gib(value * self.total)} > "
                         f"{gib(self.usable)} usable")
        return f"{self.node}: {self.engine} does not fit: {'; '.join(short)}"


def check(node: str, engine: str, *, gpus: int, weights: float, kv: float = 0.0,
          kv_for: str = "", reserve: float, gpu_usable: int, gpu_total: int,
          args: Sequence[str] = ()) -> Check:
    """``engine`` (``args``) on ``node`` (``gpus`` of them in the profile): ``weights``, ``kv``
    and ``reserve`` are one rank's bytes (the fit calculator's), ``gpu_usable`` / ``gpu_total``
    per GPU as the node reports them."""
    return Check(node=node, engine=engine, weights=weights * gpus, kv=kv * gpus, kv_for=kv_for,
                 reserve=reserve * gpus, usable=gpu_usable * gpus, total=gpu_total * gpus,
                 fraction=memory_fraction(args))


def verdict(checks: dict[str, list[Check]]) -> tuple[str | None, list[Check]]:
    """{engine: its check on every node, in profile order} -> (the first engine that fits on
    every node, or None; the checks to report: per node, that engine's, or, when none fits,
    the first engine's: the one ``serve.up`` tries first)."""
    if not checks:
        return None, []
    fitting = next((e for e, cs in checks.items() if all(c.fits for c in cs)), None)
    return fitting, list(checks[fitting or next(iter(checks))])


CONTEXT_FLAGS = ("--context-length", "--max-model-len")
"""The context length: SGLang's ``ServerArgs``, vLLM's ``EngineArgs`` (data/engine-flags/)."""
SEQS_FLAGS = ("--max-running-requests", "--max-num-seqs")
"""The sequences held at once: SGLang's, vLLM's (data/engine-flags/)."""
KV_DTYPE_FLAGS = ("--kv-cache-dtype",)
"""Both engines' KV cache dtype; its choices (data/engine-flags/): auto, bf16/bfloat16,
fp8/fp8_e4m3/fp8_e5m2/fp8_inc/fp8_ds_mla, SGLang 0.5.10's fp4_e2m1."""


def kv_choice(args: Sequence[str]) -> tuple[str, str]:
    """(the calculator's ``--kv-dtype``: auto, fp8 or bf16; where it came from) for an engine's
    args. fp4 counts as fp8 (an upper bound)."""
    found = arg_value(args, KV_DTYPE_FLAGS)
    if found is None:
        return "auto", "no --kv-cache-dtype in the engine's args"
    flag, value = found
    v = value.lower()
    kind = "auto" if v == "auto" else "fp8" if v.startswith(("fp8", "fp4")) else \
        "bf16" if v in ("bf16", "bfloat16", "fp16", "float16", "half") else None
    if kind is None:
        raise FitError(f"{flag} {value!r} is not a KV cache dtype the fit knows "
                       "(auto, bf16, bfloat16, fp8*, fp4*)")
    return kind, f"{flag} {value} in the engine's args"
