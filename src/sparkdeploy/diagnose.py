"""Why did the engine fail (or hang)? Classify engine logs, one per node, into a failure class.

``classify(logs)`` takes ``{label: lines}`` (a label is a file path or a node name) and returns a
``Diagnosis``: the class, the decisive lines as evidence, and one line of why. ``main(paths, out)``
is the same for files (``inv serve.diagnose``).

How it decides (docs/diagnose.md has the table with the real log lines behind each rule):

1. Every line of every log is matched against ``RULES``, a table of (class, priority, pattern).
   Patterns are written against what vLLM, SGLang, NCCL, PyTorch (c10d, the NCCL watchdog), Ray,
   Triton and transformers really print, not against our stand-ins.
2. Sequence rules look at the order of lines in each log: distributed init that began and never
   ended (and did not crash either) is a hang.
3. The finding with the highest priority wins: a specific cause beats a generic symptom. A crash
   with a named cause (port taken, model type unknown, no kernel for the GPU, out of memory) beats
   the waiting it leaves behind on the other node; Ray's missing worker and a link NCCL or Gloo
   cannot use beat the hang they cause; an init hang is what is left when distributed init
   started and never completed.
4. ``unknown`` when nothing matched.

To add a rule, add a line to ``RULES`` (and a real log excerpt under tests/unit/data/engine_logs/).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

CLASSES = (
    "nccl-init-hang",
    "link-misconfigured",
    "ray-worker-missing",
    "out-of-memory",
    "arch-unsupported",
    "port-in-use",
    "model-config-unrecognized",
    "unknown",
)

MAX_EVIDENCE_PER_LOG = 3
WEAK = 20  # rules below this priority are hints: they decide only when nothing else matched
MAX_TEXT = 400


@dataclass(frozen=True)
class Evidence:
    label: str
    line_no: int  # 1-based
    text: str

    def __str__(self) -> str:
        return f"{self.label}:{self.line_no}: {self.text}"


@dataclass(frozen=True)
class Diagnosis:
    cls: str
    evidence: list[Evidence] = field(default_factory=list)
    summary: str = ""


# --- the pattern table ---------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """A line matching ``pattern`` is evidence of ``cls`` at ``priority`` (higher wins).

    ``context``: the rule holds only when this also matches one of the ``window`` lines before
    (a bare ``KeyError`` is a model type only inside transformers' config lookup).
    ``void_after``: the rule does not hold when this matches a later line of the same log
    (NCCL finding no RDMA device is harmless once NCCL init completed).
    """

    cls: str
    priority: int
    pattern: re.Pattern
    why: str
    context: re.Pattern | None = None
    window: int = 12
    void_after: re.Pattern | None = None


def _re(text: str, flags: int = 0) -> re.Pattern:
    return re.compile(text, flags)


ICASE = re.IGNORECASE

# Markers of distributed init: begins and ends, as the engines print them.
INIT_BEGIN = _re(
    r"Init torch distributed begin"  # SGLang
    r"|NCCL INFO .*Init START"  # NCCL ncclCommInitRank
    r"|distributed_init_method=\S+"  # vLLM worker init
    r"|(?:sglang|vLLM) is using nccl=="  # pynccl starting a communicator
)
INIT_END = _re(
    r"Init torch distributed ends"  # SGLang
    r"|Init COMPLETE"  # NCCL
    r"|is assigned as DP rank"  # vLLM parallel_state, after init_process_group
    r"|Load weight begin|Loading weights|Starting to load model|Loading model weights"
    r"|Model loading took|Loading safetensors checkpoint"
    r"|Memory profiling takes|# GPU blocks|KV cache|Capturing (?:CUDA )?graph|Capture cuda graph"
    r"|Uvicorn running on|Application startup complete|The server is fired up and ready to roll"
    r"|Starting vLLM API server",
    ICASE,
)
# SGLang's last line before its cross-node message queue waits (vLLM prints a similar one).
SPANS_NODES = _re(r"custom ?allreduce is disabled because this process group spans across nodes", ICASE)
READY = _re(r"Application startup complete|The server is fired up and ready to roll|Uvicorn running on", ICASE)
CRASH = _re(
    r"Traceback \(most recent call last\)|terminate called after throwing|^\s*\w+(?:\.\w+)*(?:Error|Exception)\b:"
    r"|\bERROR\b.*(?:failed|exception|died)|core dumped|Segmentation fault|exited with code [1-9]",
)
NCCL_WORKS = _re(r"Init COMPLETE|Connected all rings|Init torch distributed ends")
CONFIG_LOOKUP = _re(r"configuration_auto|CONFIG_MAPPING|AutoConfig|model_type|config_dict\[")

RULES: tuple[Rule, ...] = (
    # -- a port the engine (or its rendezvous) needs is taken --
    Rule("port-in-use", 100, _re(r"\[Errno 98\]|\berrno:? 98\b|EADDRINUSE|address already in use", ICASE),
         "a port it needs is already in use"),
    # -- transformers/the engine does not know the model --
    Rule("model-config-unrecognized", 95,
         _re(r"does not recognize this architecture|Unrecognized model in |Unrecognized configuration class"
             r"|Model architectures \[.*\] are not supported|Model type \S+ not supported"
             r"|Unsupported (?:model )?architectures?:? \[?'?[A-Z]\w*(?:For\w+|Model)\b"
             r"|requires you to execute the configuration file in that repo", ICASE),
         "the model type or architecture is unknown to this transformers/engine version"),
    Rule("model-config-unrecognized", 95, _re(r"\bKeyError: '[A-Za-z][\w.-]*'"),
         "transformers has no config class for the model type", context=CONFIG_LOOKUP),
    # -- kernels not built for this GPU (GB10 is sm_121) --
    Rule("arch-unsupported", 90,
         _re(r"no kernel image is available for execution|cudaErrorNoKernelImageForDevice"
             r"|ptxas fatal\s*: Value 'sm_\w+' is not defined|PTXASError"
             r"|Unsupported gpu architecture 'compute_\w+'|device kernel image is invalid"
             r"|PTX was compiled with an unsupported toolchain"
             r"|Could not load any common_ops library", ICASE),
         "kernels in the image are not built for this GPU architecture"),
    Rule("arch-unsupported", 90,
         _re(r"(?:fmha|trtllm|flashinfer|cutlass|kernel|sm_?1\d\d|SM ?1\d\d).*Unsupported architecture\b"
             r"|architecture is not supported|(?:sm_?12[01]a?|SM ?12[01]|capability \(?12[.,] ?1\)?)"
             r".*(?:not supported|unsupported|no kernel)", ICASE),
         "a kernel library does not support this GPU architecture"),
    # -- memory --
    Rule("out-of-memory", 85,
         _re(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|cudaErrorMemoryAllocation"
             r"|Cuda failure 'out of memory'|No available memory for the cache blocks"
             r"|Not enough memory\. Please try to increase --mem-fraction-static"
             r"|larger than the available KV cache memory|is less than desired GPU memory utilization"
             r"|NV_ERR_NO_MEMORY|Out of memory: Killed process|oom-kill(?:er)?\b|OOM killer"
             r"|node running low on memory", ICASE),
         "it ran out of (unified) memory"),
    # -- Ray cluster lacks a node or its GPU --
    Rule("ray-worker-missing", 70,
         _re(r"Waiting for creating a placement group of specs"
             r"|required GPUs exceeds the total number of available GPUs"
             r"|Cannot provide a placement group"
             r"|Tensor parallel size \(\d+\) exceeds available GPUs"
             r"|Current node has no GPU available|Ray does not allocate any GPUs on the driver node"
             r"|No available node types can fulfill resource request"
             r"|Could not find any running Ray instance|Failed to connect to GCS|Unable to connect to GCS"
             r"|marked dead because the detector has missed too many heartbeats"
             r"|Every node should have a unique IP address", ICASE),
         "the Ray cluster lacks a worker node or its GPU"),
    # -- NCCL or Gloo cannot use the fast link --
    Rule("link-misconfigured", 60,
         _re(r"no socket interface found|no NCCL_SOCKET_IFNAME interface found|No usable listening interface"
             r"|Unable to find (?:address|interface) for|interface or hostname can't be empty"
             r"|socketStartConnect: Connect to .* failed"
             r"|(?:NCCL|WARN|gloo).*\bconnect\w*\b.*\b(?:failed|returned)\b.*(?:refused|timed out|No route to host"
             r"|unreachable|connection abort)"
             r"|is neither AF_INET\(2\) nor AF_INET6|ibv_modify_qp failed|NET/IB : Got async event"
             r"|NET/IB.*(?:Unable to open device|No IB device found)"
             r"|gloo.*(?:Connection refused|Connection reset by peer|No route to host|Timed out waiting)", ICASE),
         "NCCL/Gloo cannot reach the peer over the configured link interface"),
    Rule("link-misconfigured", 55, _re(r"NET/IB : No device found|NCCL_IB_DISABLE set by environment to 1"),
         "NCCL found no RDMA (RoCE) device and fell back to sockets", void_after=NCCL_WORKS),
    # -- explicit timeouts of distributed init --
    Rule("nccl-init-hang", 40,
         _re(r"Timed out after \d+ seconds waiting for (?:clients|workers)|DistStoreError"
             r"|Watchdog caught collective operation timeout"
             r"|client socket has timed out after \d+m?s while trying to connect"
             r"|client socket has failed to connect to"
             r"|DistNetworkError"),
         "the ranks never all joined distributed init (store/collective timeout)"),
    # -- weak hints, used only when nothing else matched --
    Rule("arch-unsupported", 15,
         _re(r"with CUDA capability sm_\d+ is not compatible with the current PyTorch installation"
             r"|which is of cuda capability \d+\.\d+\. Minimum and Maximum cuda capability", ICASE),
         "PyTorch warns it has no kernels for this GPU (harmless on GB10 when nothing else failed)"),
    Rule("model-config-unrecognized", 12, _re(r"^\s*KeyError: '[a-z][a-z0-9_]*'\s*$"),
         "a KeyError naming what looks like a model type"),
)

# --- findings ---------------------------------------------------------------------------


@dataclass
class Finding:
    cls: str
    priority: int
    why: str
    evidence: list[Evidence]


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _clean(line: str) -> str:
    line = _ANSI.sub("", line)
    if "\r" in line:  # progress bars redraw with \r: what stayed on screen is the last part
        parts = [p for p in line.split("\r") if p.strip()]
        line = parts[-1] if parts else ""
    return line.rstrip()


def _ev(label: str, i: int, text: str) -> Evidence:
    text = text.strip()
    if len(text) > MAX_TEXT:
        text = text[: MAX_TEXT - 3] + "..."
    return Evidence(label, i + 1, text)


def _last_index(lines: Sequence[str], pattern: re.Pattern) -> int:
    return next((j for j in range(len(lines) - 1, -1, -1) if pattern.search(lines[j])), -1)


def _rule_findings(label: str, lines: Sequence[str]) -> list[Finding]:
    found: dict[int, Finding] = {}  # rule index -> finding
    voids = {r.void_after: _last_index(lines, r.void_after) for r in RULES if r.void_after is not None}
    for i, line in enumerate(lines):
        if not line:
            continue
        for r_i, rule in enumerate(RULES):
            if not rule.pattern.search(line):
                continue
            if rule.context and not any(
                rule.context.search(prev) for prev in lines[max(0, i - rule.window): i + 1]
            ):
                continue
            if rule.void_after is not None and voids[rule.void_after] > i:
                continue
            f = found.setdefault(r_i, Finding(rule.cls, rule.priority, rule.why, []))
            if len(f.evidence) < MAX_EVIDENCE_PER_LOG:
                f.evidence.append(_ev(label, i, line))
    return list(found.values())


def _last_meaningful(lines: Sequence[str], start: int) -> int | None:
    for j in range(len(lines) - 1, start - 1, -1):
        if lines[j].strip():
            return j
    return None


def _init_hang(label: str, lines: Sequence[str]) -> Finding | None:
    """Distributed init began and neither completed nor crashed: the log stops inside init."""
    begin = None  # the first begin not followed by an end
    for i, line in enumerate(lines):
        if INIT_END.search(line):
            begin = None
        elif begin is None and (INIT_BEGIN.search(line) or SPANS_NODES.search(line)):
            begin = i
    if begin is None:
        return None
    tail = lines[begin + 1:]
    if any(CRASH.search(line) for line in tail):
        return None  # it died there: a crash, not a hang (the crash rules name it if they can)
    evidence = [_ev(label, begin, lines[begin])]
    spans = next((j for j in range(len(lines) - 1, -1, -1) if SPANS_NODES.search(lines[j])), None)
    if spans is not None and spans != begin and spans > begin:
        evidence.append(_ev(label, spans, lines[spans]))
    last = _last_meaningful(lines, begin + 1)
    if last is not None and last not in (begin, spans):
        evidence.append(_ev(label, last, lines[last]))
    if SPANS_NODES.search(lines[begin]) or spans is not None:
        why = ("distributed init stopped after 'CustomAllreduce is disabled ... spans across nodes' and never "
               "ended (a rank advertised an address its peer cannot reach, e.g. SGLANG_HOST_IP unset)")
    else:
        why = "distributed init began and never completed"
    return Finding("nccl-init-hang", 30, why, evidence)


SequenceRule = Callable[[str, Sequence[str]], "Finding | None"]
SEQUENCE_RULES: tuple[SequenceRule, ...] = (_init_hang,)


# --- classification ---------------------------------------------------------------------


def _lines(raw: Iterable[str]) -> list[str]:
    out: list[str] = []
    for item in raw:
        # tolerate a label mapped to one big string or to lines with embedded newlines
        for piece in str(item).split("\n") if "\n" in str(item) else (str(item),):
            out.append(_clean(piece))
    return out


def classify(logs: Mapping[str, Sequence[str]]) -> Diagnosis:
    """Classify engine logs (``{label: lines}``, one per node) into one failure class."""
    findings: list[Finding] = []
    ready: list[Evidence] = []
    total = 0
    for label, raw in logs.items():
        lines = _lines([raw] if isinstance(raw, str) else raw)
        total += len(lines)
        findings += _rule_findings(str(label), lines)
        for rule in SEQUENCE_RULES:
            f = rule(str(label), lines)
            if f:
                findings.append(f)
        ready += [_ev(str(label), i, line) for i, line in enumerate(lines) if READY.search(line)][:1]
    if ready:  # a weak hint (a warning many healthy runs print) says nothing once the engine is up
        findings = [f for f in findings if f.priority >= WEAK]
    if not findings:
        if ready:
            return Diagnosis("unknown", ready, "no failure pattern; the engine reported ready")
        return Diagnosis("unknown", [], f"no known failure pattern in {len(logs)} log(s), {total} line(s)")
    top = max(f.priority for f in findings)
    best = [f for f in findings if f.priority == top]
    cls = best[0].cls
    # every finding of the winning class contributes evidence, strongest first, in log order
    order = {label: n for n, label in enumerate(logs)}
    chosen = sorted((f for f in findings if f.cls == cls), key=lambda f: -f.priority)
    seen: set[tuple[str, int]] = set()
    evidence: list[Evidence] = []
    for f in chosen:
        for e in f.evidence:
            if (e.label, e.line_no) not in seen:
                seen.add((e.label, e.line_no))
                evidence.append(e)
    evidence.sort(key=lambda e: (order.get(e.label, 0), e.line_no))
    where = sorted({e.label for e in best[0].evidence}, key=lambda x: order.get(x, 0))
    summary = f"{best[0].why} ({', '.join(where)})" if where else best[0].why
    if cls == "nccl-init-hang" and any(
        "Watchdog caught" in e.text for e in evidence
    ) and ready:
        summary += "; note: the engine had reported ready, so a collective wedged while serving"
    return Diagnosis(cls, evidence, _one_line(summary))


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


# --- files ------------------------------------------------------------------------------


class LogError(Exception):
    """A log file that cannot be read as text; ``str()`` is the one line to print."""


def read_log(path: str) -> list[str]:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise LogError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise LogError(f"{path}: is a directory, not a log file") from None
    except OSError as e:
        raise LogError(f"{path}: cannot read: {e.strerror or e}") from None
    if b"\x00" in data[:65536]:
        raise LogError(f"{path}: binary file, not a text log")
    return data.decode("utf-8", errors="replace").splitlines()


def main(paths: list[str], out: TextIO | None = None) -> int:
    """Print ``class: NAME`` then ``FILE:LINE: text`` per evidence line; 2 on an unreadable file."""
    out = out or sys.stdout
    if not paths:
        print("diagnose: give at least one log file (--log FILE)", file=sys.stderr)
        return 2
    logs: dict[str, list[str]] = {}
    for p in paths:
        try:
            logs[p] = read_log(p)
        except LogError as e:
            print(f"diagnose: {e}", file=sys.stderr)
            return 2
    d = classify(logs)
    print(f"class: {d.cls}", file=out)
    for e in d.evidence:
        print(str(e), file=out)
    print(f"why: {d.summary}", file=sys.stderr)
    return 0
