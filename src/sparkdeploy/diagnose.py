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
4. ``unknown`` when nothing matched, with the last lines of each log as its evidence.

To add a rule, add a line to ``RULES`` (and a real log excerpt under tests/unit/data/engine_logs/).
"""

from __future__ import annotations

import re
import sys
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TextIO

from sparkdeploy.errors import UsageError
from sparkdeploy.files import MB, InputError, read_input

CLASSES = (
    "nccl-init-hang",
    "worker-never-joined",
    "link-misconfigured",
    "ray-worker-missing",
    "ray-version-mismatch",
    "out-of-memory",
    "weights-unreadable",
    "disk-full",
    "arch-unsupported",
    "shm-too-small",
    "cuda-driver-too-old",
    "model-config-unrecognized",
    "image-without-ray",
    "port-in-use",
    "engine-flag-unknown",
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
class Pat:
    """A regular expression guarded by cheap keys: it is tried only on a line whose lowercase text
    contains one of ``keys`` (logs run to hundreds of thousands of lines; most match nothing)."""

    regex: re.Pattern
    keys: tuple[str, ...]

    def search(self, line: str, low: str | None = None) -> bool:
        low = line.lower() if low is None else low
        return any(k in low for k in self.keys) and self.regex.search(line) is not None


def pat(regex: str, *keys: str, icase: bool = True) -> Pat:
    return Pat(re.compile(regex, re.IGNORECASE if icase else 0), keys)


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
    pattern: Pat
    why: str
    context: Pat | None = None
    window: int = 12
    void_after: Pat | None = None


# Distributed init, as the engines print it: stages that begin and must end. A stage ends with its
# own end marker or with any sign that start-up went on past init (weights, KV cache, graphs, API).
PAST_INIT = pat(
    r"Load weight begin|Loading weights|Starting to load model|Loading model weights"
    r"|Model loading took|Loading safetensors checkpoint"
    r"|Memory profiling takes|# GPU blocks|KV cache|Capturing (?:CUDA )?graph|Capture cuda graph"
    r"|Uvicorn running on|Application startup complete|The server is fired up and ready to roll"
    r"|Starting vLLM API server",
    "load weight", "loading weights", "load model", "loading model", "model loading", "safetensors",
    "memory profiling", "gpu blocks", "kv cache", "graph", "uvicorn running", "startup complete", "ready to roll",
    "api server",
)
# SGLang's last line before its cross-node message queue waits (vLLM prints a similar one and goes on).
SPANS_NODES = pat(r"custom ?allreduce is disabled because this process group spans across nodes",
                  "spans across nodes")
TORCH_DIST_ENDS = pat(r"Init torch distributed ends", "init torch distributed ends", icase=False)
# SGLang's end, or vLLM's line at the end of initialize_model_parallel
DIST_ENDS = pat(r"Init torch distributed ends|is assigned as DP rank", "init torch distributed ends",
                "assigned as dp rank", icase=False)


@dataclass(frozen=True)
class Stage:
    name: str
    begin: Pat
    end: Pat


INIT_STAGES: tuple[Stage, ...] = (
    Stage("torch distributed init (SGLang)",
          pat(r"Init torch distributed begin|Init nccl begin", "init torch distributed begin", "init nccl begin",
              icase=False), TORCH_DIST_ENDS),
    Stage("NCCL communicator init",
          pat(r"NCCL INFO .*Init START", "init start", icase=False),
          pat(r"Init COMPLETE", "init complete", icase=False)),
    Stage("distributed init (vLLM)",
          pat(r"distributed_init_method=\S+|(?:sglang|vLLM) is using nccl==", "distributed_init_method",
              "is using nccl", icase=False), DIST_ENDS),
    Stage("the cross-node message queue (after CustomAllreduce)", SPANS_NODES, DIST_ENDS),
)
# vLLM's own multi-node mode (multiproc_executor.py): the head's leader line (world_size above
# local_world_size: other nodes' ranks must join it), the weights loaded on it, what the engine
# prints once it has every worker (KV cache sizing and after), and the store's timeout.
MP_LEADER = pat(r"DP group leader: .*\bworld_size=(\d+), local_world_size=(\d+)", "dp group leader",
                icase=False)
WEIGHTS_LOADED = pat(r"Model loading took", "model loading took", icase=False)
ENGINE_INIT = pat(r"Available KV cache memory|GPU KV cache size|# GPU blocks|init engine \(profile"
                  r"|Memory profiling takes|Starting vLLM API server|Uvicorn running on"
                  r"|Application startup complete",
                  "kv cache", "gpu blocks", "init engine", "memory profiling", "api server",
                  "uvicorn running", "startup complete", icase=False)
STORE_TIMEOUT = pat(r"waiting for clients\. \d+/\d+ clients joined", "clients joined", icase=False)
# A line vLLM's own multiproc executor logged (a worker's traceback comes through it).
MP_EXECUTOR = pat(r"\[multiproc_executor\.py:\d+\]", "multiproc_executor", icase=False)
READY = pat(r"Application startup complete|The server is fired up and ready to roll|Uvicorn running on",
            "startup complete", "ready to roll", "uvicorn running")
CRASH = pat(
    r"Traceback \(most recent call last\)|terminate called after throwing|^\s*\w+(?:\.\w+)*(?:Error|Exception)\b:"
    r"|\bERROR\b.*(?:failed|exception|died)|core dumped|Segmentation fault|exited with code [1-9]",
    "traceback", "terminate called", "error", "exception", "core dumped", "segmentation fault", "exited with code",
    icase=False,
)
# A crash that is the hang's end, not its cause: a watchdog killing the wedged process (SGLang's
# scheduler watchdog kills it after ~300 s: "Rank 0 scheduler died (exit code: -9)").
KILLED = pat(r"exit code:? -9\b|signal 9\b|SIGKILL|watchdog timeout|killed by (?:the )?watchdog",
             "exit code", "signal 9", "sigkill", "watchdog", icase=False)
NCCL_WORKS = pat(r"Init COMPLETE|Connected all rings|Init torch distributed ends",
                 "init complete", "connected all rings", "init torch distributed ends", icase=False)
CONFIG_LOOKUP = pat(r"configuration_auto|CONFIG_MAPPING|AutoConfig|model_type|config_dict\[",
                    "configuration_auto", "config_mapping", "autoconfig", "model_type", "config_dict", icase=False)

RULES: tuple[Rule, ...] = (
    # -- the engine's parser refused its command line (argparse: usage, then this line, exit 2) --
    Rule("engine-flag-unknown", 110,
         pat(r"^\S+: error: (?:unrecognized arguments|argument --[\w-]+: invalid choice|"
             r"argument --[\w-]+: ignored explicit argument|argument --[\w-]+: expected one argument)",
             "error: "),
         "the engine refused a flag of its command line (a flag this engine version lacks, a value "
         "outside its choices, a value given to a switch): check engines[].args against "
         "docs/engine-flags.md"),
    # -- a port the engine (or its rendezvous) needs is taken --
    Rule("port-in-use", 100,
         pat(r"\[Errno 98\]|\berrno:? 98\b|EADDRINUSE|address already in use",
             "errno", "eaddrinuse", "address already in use"),
         "a port it needs is already in use (another engine, a stale container or a host service holds it)"),
    # -- the image has no Ray, but the engine was asked to run on Ray --
    Rule("image-without-ray", 96,
         pat(r"(?:ModuleNotFoundError|ImportError): No module named '?ray'?(?![.\w])|Ray is not installed"
             r"|Failed to import Ray\b|\bray: (?:command )?not found|\"ray\": executable file not found",
             "no module named", "ray is not installed", "failed to import ray", "ray: ", "\"ray\": executable"),
         "the image has no Ray (vLLM's images dropped it as a dependency): use an image with Ray for kind "
         "vllm-ray, or vLLM's own multi-node mode", void_after=READY),
    # -- transformers/the engine does not know the model --
    Rule("model-config-unrecognized", 95,
         pat(r"does not recognize this architecture|Unrecognized model in |Unrecognized configuration class"
             r"|Model architectures \[.*\] are not supported|Model type \S+ not supported"
             r"|Unsupported (?:model )?architectures?:? \[?'?[A-Z]\w*(?:For\w+|Model)\b"
             r"|requires you to execute the configuration file in that repo",
             "recognize", "supported", "configuration file"),
         "the model type or architecture is unknown to the image's transformers/engine (a newer transformers "
         "knows it, e.g. >=5 for qwen3_5_moe)"),
    Rule("model-config-unrecognized", 95, pat(r"\bKeyError: '[A-Za-z][\w.-]*'", "keyerror", icase=False),
         "the image's transformers has no config class for the model type (too old for this model)",
         context=CONFIG_LOOKUP),
    # -- the host's driver is older than the image's CUDA --
    Rule("cuda-driver-too-old", 93,
         pat(r"CUDA driver version is insufficient for CUDA runtime version|cudaErrorInsufficientDriver"
             r"|The NVIDIA driver on your system is too old|requirement error: unsatisfied condition: cuda ?>="
             r"|This container was built for NVIDIA Driver Release [\d.]+ or later",
             "driver version is insufficient", "insufficientdriver", "driver on your system is too old",
             "unsatisfied condition", "built for nvidia driver"),
         "the node's NVIDIA driver is older than the CUDA the image was built for (DGX OS ships the driver: "
         "use an image built for the node's CUDA, see `nvidia-smi`)"),
    # -- /dev/shm too small for NCCL or torch's shared memory (docker's default is 64 MB) --
    Rule("shm-too-small", 91,
         pat(r"Error while creating shared memory segment|posix_fallocate failed|unable to write to file </torch_"
             r"|ncclShmOpen|insufficient shared memory \(shm\)|/dev/shm\S*: No space left on device",
             "shared memory", "posix_fallocate", "</torch_", "shm"),
         "/dev/shm is too small for NCCL's or torch's shared memory (docker gives 64 MB: run the engine with "
         "--ipc=host or a larger --shm-size)"),
    # -- kernels not built for this GPU (GB10 is sm_121) --
    Rule("arch-unsupported", 90,
         pat(r"no kernel image is available for execution|cudaErrorNoKernelImageForDevice"
             r"|ptxas fatal\s*: Value 'sm_\w+' is not defined|PTXASError"
             r"|Unsupported gpu architecture 'compute_\w+'|device kernel image is invalid"
             r"|PTX was compiled with an unsupported toolchain"
             r"|Could not load any common_ops library",
             "kernel image", "nokernelimage", "ptxas", "gpu architecture", "toolchain", "common_ops"),
         "kernels in the image are not built for this GPU (GB10 is sm_121): use an image built for sm_121; "
         "for Triton's ptxas set TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas"),
    Rule("arch-unsupported", 90,
         pat(r"(?:fmha|trtllm|flashinfer|cutlass|kernel|sm_?1\d\d|SM ?1\d\d).*Unsupported architecture\b"
             r"|architecture is not supported|(?:sm_?12[01]a?|SM ?12[01]|capability \(?12[.,] ?1\)?)"
             r".*(?:not supported|unsupported|no kernel)",
             "architecture", "supported", "no kernel"),
         "a kernel library does not support this GPU architecture"),
    Rule("arch-unsupported", 90,
         pat(r"out of resource: shared memory, Required: \d+, Hardware limit: \d+", "out of resource"),
         "a Triton kernel's configuration needs more shared memory per block than this GPU has (GB10: "
         "101376 bytes, like sm_86/sm_120): its tuned configs are for another GPU"),
    # -- a disk ran full (a truncated download then reads as unreadable weights: the disk is the cause) --
    Rule("disk-full", 89,
         pat(r"No space left on device|\[Errno 28\]|\bENOSPC\b|Not enough free disk space to download"
             r"|Disk quota exceeded",
             "no space left", "errno 28", "enospc", "free disk space", "disk quota"),
         "a disk is full (the model path, docker's data root or a cache): free space or point it elsewhere"),
    # -- the weight files are there but cannot be read as weights --
    Rule("weights-unreadable", 87,
         pat(r"SafetensorError|Error while deserializing header|Cannot find any model weights with"
             r"|incomplete metadata, file not fully covered",
             "safetensor", "deserializing header", "model weights", "not fully covered"),
         "the weight files are missing, truncated or corrupt (a broken or partial download): verify them "
         "against the hub (`inv model.verify`) and fetch them again"),
    # -- memory --
    Rule("out-of-memory", 85,
         pat(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|cudaErrorMemoryAllocation"
             r"|Cuda failure 'out of memory'|No available memory for the cache blocks"
             r"|Not enough memory\. Please try to increase --mem-fraction-static"
             r"|larger than the available KV cache memory|is less than desired GPU memory utilization"
             r"|is larger than the maximum number of tokens that can be stored in KV cache"
             r"|on kv cache allocation is less than requested memory for kv"
             r"|NV_ERR_NO_MEMORY|Out of memory: Killed process|oom-kill(?:er)?\b|OOM killer"
             r"|node running low on memory",
             "memory", "oom", "stored in kv cache"),
         "it ran out of memory (GB10's memory is unified: lower --gpu-memory-utilization / "
         "--mem-fraction-static, or free what else holds it)"),
    # -- the nodes run different Ray or Python (different images on head and worker) --
    Rule("ray-version-mismatch", 75,
         pat(r"Version mismatch: The cluster was started with", "version mismatch"),
         "the nodes run different Ray or Python versions (different images): run the same image ID on every "
         "node (`inv image.ship`)"),
    # -- Ray cluster lacks a node or its GPU --
    Rule("ray-worker-missing", 70,
         pat(r"Waiting for creating a placement group of specs"
             r"|required GPUs exceeds the total number of available GPUs"
             r"|Cannot provide a placement group"
             r"|Tensor parallel size \(\d+\) exceeds available GPUs"
             r"|Current node has no GPU available|Ray does not allocate any GPUs on the driver node"
             r"|No available node types can fulfill resource request"
             r"|Could not find any running Ray instance|Failed to connect to GCS at address"
             r"|Unable to connect to GCS at \S+:\d+|Timed out while waiting for GCS to become available"
             r"|Couldn't reconnect to GCS server"
             r"|marked dead because the detector has missed too many heartbeats"
             r"|Every node should have a unique IP address",
             "placement group", "gpus", "gpu available", "node types", "ray instance", "gcs", "heartbeats",
             "unique ip"),
         "the Ray cluster lacks a worker node or its GPU (see `ray status`; VLLM_HOST_IP must be each node's "
         "Ray address)"),
    # -- NCCL or Gloo cannot use the fast link --
    Rule("link-misconfigured", 60,
         pat(r"no socket interface found|no NCCL_SOCKET_IFNAME interface found|No usable listening interface"
             r"|Unable to find (?:address|interface) for|interface or hostname can't be empty"
             r"|socketStartConnect: Connect to .* failed"
             r"|(?:NCCL|WARN|gloo).*\bconnect\w*\b.*\b(?:failed|returned)\b.*(?:refused|timed out|No route to host"
             r"|unreachable|connection abort)"
             r"|is neither AF_INET\(2\) nor AF_INET6|ibv_modify_qp failed|NET/IB : Got async event"
             r"|NET/IBP? ?: ?Got completion (?:from peer \S+ )?with (?:error |status=)\d+"
             r"|\[c10d\].*failed to connect.*(?:No route to host|Network is unreachable)"
             r"|Failed to execute operation Connect from rank|operation=Connect, res=\d+"
             r"|NET/IB.*(?:Unable to open device|No IB device found)"
             r"|gloo.*(?:Connection refused|Connection reset by peer|No route to host|Timed out waiting)"
             r"|Gloo connectFullMesh failed",
             "interface", "connect", "af_inet", "ibv_", "net/ib", "unable to find", "gloo", "got completion",
             "operation"),
         "NCCL/Gloo cannot use the fast link (check NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME, NCCL_IB_HCA, "
         "the RoCE GID index, and that each node's address is on the link)"),
    Rule("link-misconfigured", 55,
         pat(r"NET/IB : No device found|NCCL_IB_DISABLE set by environment to 1", "net/ib", "ib_disable",
             icase=False),
         "NCCL found no RDMA (RoCE) device and fell back to sockets (NCCL_IB_HCA, the RoCE devices in the "
         "container)", void_after=NCCL_WORKS),
    # -- explicit timeouts of distributed init --
    Rule("nccl-init-hang", 40,
         pat(r"Timed out after \d+ seconds waiting for (?:clients|workers)|DistStoreError"
             r"|Watchdog caught collective operation timeout"
             r"|client socket has timed out after \d+m?s while trying to connect"
             r"|client socket has failed to connect to"
             r"|DistNetworkError|Timeout waiting for key|Timeout at NCCL work: \d+"
             r"|Some NCCL operations have failed or timed out|detected by watchdog at work",
             "timed out", "diststore", "watchdog", "client socket", "distnetwork", "timeout waiting for key",
             "timeout at nccl work", icase=False),
         "distributed init timed out: a rank never joined (c10d store or NCCL collective timeout)"),
    # -- weak hints, used only when nothing else matched --
    Rule("arch-unsupported", 15,
         pat(r"with CUDA capability sm_\d+ is not compatible with the current PyTorch installation"
             r"|which is of cuda capability \d+\.\d+\. Minimum and Maximum cuda capability",
             "capability"),
         "PyTorch warns it has no kernels for this GPU (harmless on GB10 when nothing else failed)"),
    Rule("model-config-unrecognized", 12, pat(r"^\s*KeyError: '[a-z][a-z0-9_]*'\s*$", "keyerror", icase=False),
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


@dataclass
class Log:
    """One node's log, cleaned, with each line's lowercase text for the patterns' keys."""

    label: str
    lines: list[str]
    lows: list[str]  # "" for a line no pattern's key occurs in
    candidates: list[int]  # the indices of the others, ascending

    @classmethod
    def of(cls, label: str, raw: str | Iterable[str]) -> Log:
        lines: list[str] = []
        for item in [raw] if isinstance(raw, (str, bytes)) else raw:
            # tolerate a label mapped to one big string (or bytes), or lines with embedded newlines
            text = item.decode("utf-8", errors="replace") if isinstance(item, bytes) else str(item)
            lines += [_clean(piece) for piece in text.split("\n")]
        if isinstance(raw, (str, bytes)) and lines and not lines[-1]:
            lines.pop()  # the text's final newline ends the last line, it opens none
        lows = [line.lower() for line in lines]
        keep = sorted(_candidates(lows, _keys(RULES)))
        kept = set(keep)
        return cls(str(label), lines, [low if i in kept else "" for i, low in enumerate(lows)], keep)

    def hit(self, p: Pat, i: int) -> bool:
        low = self.lows[i]
        return bool(low) and p.search(self.lines[i], low)

    def last(self, p: Pat, start: int = 0) -> int | None:
        """Index of the last line at or after ``start`` matching ``p``."""
        return next((j for j in reversed(self.candidates) if j >= start and self.hit(p, j)), None)

    def ev(self, i: int) -> Evidence:
        return _ev(self.label, i, self.lines[i])


def patterns(rules: Sequence[Rule] | None = None) -> list[Pat]:
    """Every pattern the classifier tries (the rules' and the sequence rules' markers)."""
    pats = [PAST_INIT, READY, CRASH, KILLED, NCCL_WORKS, CONFIG_LOOKUP, MP_LEADER, WEIGHTS_LOADED,
            ENGINE_INIT, STORE_TIMEOUT, MP_EXECUTOR]
    pats += [p for st in INIT_STAGES for p in (st.begin, st.end)]
    for r in RULES if rules is None else rules:
        pats += [p for p in (r.pattern, r.context, r.void_after) if p is not None]
    return pats


def _keys(rules: Sequence[Rule]) -> set[str]:
    pats = patterns(rules)
    keys = {k for p in pats for k in p.keys}
    # a key containing another is found by the shorter one: scan for the shorter only
    return {k for k in keys if not any(o != k and o in k for o in keys)}


def _candidates(lows: list[str], keys: Iterable[str]) -> set[int]:
    """Indices of the lines containing any key: one fast substring scan of the whole log per key
    (trying every pattern on every line costs ~25 us a line; logs run to 10^5 lines)."""
    text = "\n".join(lows)
    starts = list(accumulate((len(low) + 1 for low in lows), initial=0))
    found: set[int] = set()
    for key in keys:
        pos = text.find(key)
        while pos != -1:
            i = bisect_right(starts, pos) - 1
            found.add(i)
            pos = text.find(key, starts[i + 1])
    return found


def _rule_findings(log: Log) -> list[Finding]:
    found: dict[int, Finding] = {}  # rule index -> finding
    voids = {r.void_after: log.last(r.void_after) for r in RULES if r.void_after is not None}
    for i in log.candidates:
        for r_i, rule in enumerate(RULES):
            if not log.hit(rule.pattern, i):
                continue
            if rule.context and not any(log.hit(rule.context, j) for j in range(max(0, i - rule.window), i + 1)):
                continue
            void = voids.get(rule.void_after) if rule.void_after is not None else None
            if void is not None and void > i:
                continue
            f = found.setdefault(r_i, Finding(rule.cls, rule.priority, rule.why, []))
            if len(f.evidence) < MAX_EVIDENCE_PER_LOG:
                f.evidence.append(log.ev(i))
    return list(found.values())


# Who printed a line, when one log carries several ranks, most specific first: NCCL's communicator
# and rank, SGLang's "TPn" tag, vLLM/Ray's "pid=N" prefix, NCCL's "host:pid:tid" prefix.
_WHO = (
    re.compile(r"comm (0x[0-9a-f]+) rank (\d+)"),
    re.compile(r"[\[ ](TP\d+)\]"),
    re.compile(r"\bpid=(\d+)"),
    re.compile(r"^(?:\[\w+\]:)?([\w.-]+:\d+):\d+ "),
)


def _who(line: str) -> str:
    for rx in _WHO:
        m = rx.search(line)
        if m:
            return ":".join(m.groups())
    return ""


def _init_hang(log: Log) -> Finding | None:
    """Distributed init began and neither completed nor crashed: the log stops inside init.
    Begins and ends pair per stage and per rank (one log may carry several ranks)."""
    opened: dict[tuple[str, str], int] = {}  # (stage, who) -> its first begin not followed by its end
    for i in log.candidates:
        if log.hit(PAST_INIT, i):
            opened.clear()
            continue
        for st in INIT_STAGES:
            if log.hit(st.end, i):
                who = _who(log.lines[i])
                for key in [k for k in opened if k[0] == st.name and (not who or k[1] in (who, ""))]:
                    del opened[key]
            elif log.hit(st.begin, i):
                opened.setdefault((st.name, _who(log.lines[i])), i)
    if not opened:
        return None
    begin = min(opened.values())
    if log.last(CRASH, begin + 1) is not None and log.last(KILLED, begin + 1) is None:
        return None  # it died there: a crash, not a hang (the crash rules name it if they can)
    evidence = [log.ev(begin)]
    spans = min((i for (name, _), i in opened.items() if name == INIT_STAGES[-1].name), default=None)
    if spans is not None and spans != begin:
        evidence.append(log.ev(spans))
    last = next((j for j in range(len(log.lines) - 1, begin, -1) if log.lines[j].strip()), None)
    if last is not None and last != spans:
        evidence.append(log.ev(last))
    if spans is not None:
        why = ("distributed init stopped after 'CustomAllreduce is disabled ... spans across nodes' and never "
               "ended: the cross-node message queue never connected (on two Sparks usually SGLANG_HOST_IP "
               "unset, so a rank advertised another interface's address)")
    else:
        stage = min(opened, key=lambda o: opened[o])[0]
        why = f"distributed init began and never completed: {stage} is still waiting"
    return Finding("nccl-init-hang", 30, why, evidence)


JOIN_FIX = ("check each worker's --master-addr (the head's fast-link address) and that its VLLM_HOST_IP is "
            "its own fast-link address (not 127.0.1.1 from `hostname -i`)")
STORE_CONTEXT = 12  # lines before a store timeout in which vLLM's executor must have logged


def _worker_never_joined(log: Log) -> Finding | None:
    """vLLM's own multi-node mode: the head (its leader line says ranks of other nodes belong to
    it) never got to the engine's init (KV cache sizing) and did not crash: it waits for a worker
    rank, at its store on --master-addr:--master-port (before NCCL init, or the store's timeout),
    or, weights loaded, for a worker's message queue it cannot reach at the address the worker
    advertises (VLLM_HOST_IP)."""
    lead = log.last(MP_LEADER)
    if lead is None:
        return _executor_store_timeout(log)
    m = MP_LEADER.regex.search(log.lines[lead])
    if m is None or int(m.group(1)) <= int(m.group(2)) or log.last(ENGINE_INIT, lead) is not None:
        return None  # one node's ranks only, or the head got past waiting for its workers
    fix = JOIN_FIX
    timeout = log.last(STORE_TIMEOUT, lead)
    if timeout is not None:
        return Finding("worker-never-joined", 45, "a worker rank never joined vLLM's head: the store on "
                       f"--master-addr:--master-port timed out waiting for it; {fix}",
                       [log.ev(lead), log.ev(timeout)])
    if log.last(CRASH, lead + 1) is not None and log.last(KILLED, lead + 1) is None:
        return None  # it died: the crash rules name why
    loaded = log.last(WEIGHTS_LOADED, lead)
    if loaded is not None:
        where, mark = ("the head loaded the weights and waits for a worker's message queue, which it "
                       "cannot reach at the address the worker advertises"), loaded
    elif log.last(INIT_STAGES[1].begin, lead) is None and log.last(DIST_ENDS, lead) is None:
        where = "the head waits for a worker at its store on --master-addr:--master-port"
        mark = log.last(INIT_STAGES[2].begin, lead) or lead
    else:
        return None  # inside NCCL init or later: the init-hang rule says where
    evidence = [log.ev(lead)] + ([log.ev(mark)] if mark != lead else [])
    last = next((j for j in range(len(log.lines) - 1, mark, -1) if log.lines[j].strip()), None)
    if last is not None:
        evidence.append(log.ev(last))
    return Finding("worker-never-joined", 45, f"a worker rank never joined vLLM's head: {where}; {fix}",
                   evidence)


def _executor_store_timeout(log: Log) -> Finding | None:
    """No leader line (an excerpt of the head's log, or a vLLM that prints none): the rendezvous
    store timed out waiting for clients inside a worker of vLLM's own multiproc executor (its
    traceback, logged by ``multiproc_executor.py``, just before the timeout). In that executor the
    clients that never came are ranks of another node: a local worker that dies takes the executor
    down at once, long before the store's timeout. Not so for a bare c10d, SGLang or Ray store
    timeout, which stays a generic init hang."""
    timeout = log.last(STORE_TIMEOUT)
    if timeout is None:
        return None
    window = range(timeout, max(-1, timeout - 1 - STORE_CONTEXT), -1)
    executor = next((j for j in window if log.hit(MP_EXECUTOR, j)), None)
    if executor is None:
        return None
    evidence = [log.ev(j) for j in sorted({executor, timeout})]
    return Finding("worker-never-joined", 45, "a worker rank never joined vLLM's head: the store on "
                   "--master-addr:--master-port timed out waiting for it (in vLLM's multiproc executor); "
                   f"{JOIN_FIX}", evidence)


SequenceRule = Callable[[Log], "Finding | None"]
SEQUENCE_RULES: tuple[SequenceRule, ...] = (_init_hang, _worker_never_joined)


# --- classification ---------------------------------------------------------------------


def classify(logs: Mapping[str, Sequence[str]]) -> Diagnosis:
    """Classify engine logs (``{label: lines}``, one per node) into one failure class."""
    findings: list[Finding] = []
    ready: list[Evidence] = []
    tails: list[Evidence] = []
    total = 0
    for label, raw in logs.items():
        log = Log.of(label, raw)
        total += len(log.lines)
        tails += _tail(log)
        findings += _rule_findings(log)
        for rule in SEQUENCE_RULES:
            f = rule(log)
            if f:
                findings.append(f)
        first_ready = next((i for i in log.candidates if log.hit(READY, i)), None)
        if first_ready is not None:
            ready.append(log.ev(first_ready))
    if ready:  # a weak hint (a warning many healthy runs print) says nothing once the engine is up
        findings = [f for f in findings if f.priority >= WEAK]
    if not findings:
        if ready:
            return Diagnosis("unknown", ready, "no failure pattern; the engine reported ready")
        return Diagnosis("unknown", tails, f"no known failure pattern in {len(logs)} log(s), {total} line(s); "
                         "the last lines of each are the evidence")
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
    where = sorted({e.label for f in best if f.cls == cls for e in f.evidence}, key=lambda x: order.get(x, 0))
    summary = f"{best[0].why} ({', '.join(where)})" if where else best[0].why
    if cls == "nccl-init-hang" and any("watchdog" in e.text.lower() for e in evidence) and ready:
        summary += "; note: the engine had reported ready, so a collective wedged while serving"
    return Diagnosis(cls, evidence, _one_line(summary))


def _tail(log: Log) -> list[Evidence]:
    """A log's last non-blank lines (what it said before it stopped), oldest first."""
    last = [i for i in range(len(log.lines) - 1, -1, -1) if log.lines[i].strip()][:MAX_EVIDENCE_PER_LOG]
    return [log.ev(i) for i in reversed(last)]


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


# --- files ------------------------------------------------------------------------------


class LogError(UsageError):
    """A log file that cannot be read as text; ``str()`` is the one line to print."""


MAX_LOG_BYTES = 256 * MB
"""An engine log read whole is at most this big (a day of a chatty engine is far less)."""


def read_log(path: str) -> list[str]:
    try:
        data = read_input(path, limit=MAX_LOG_BYTES, what="log file")
    except InputError as e:
        raise LogError(str(e)) from None
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
    for ev in d.evidence:
        print(str(ev), file=out)
    print(f"why: {d.summary}", file=sys.stderr)
    return 0
