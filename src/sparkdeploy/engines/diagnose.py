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

To add a rule, add a line to ``_RULES`` (and a real log excerpt under tests/unit/data/engine_logs/);
a failure only one engine kind shows goes to that kind's module (``Kind.diagnosis``,
``Kind.sequence_rules``: vLLM's own multi-node mode's worker that never joined is
``engines/vllm.py``'s). The words they are written in: ``engines/rules.py``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from sparkdeploy.core.errors import UsageError
from sparkdeploy.core.files import MB, InputError, read_input
from sparkdeploy.engines import KINDS
from sparkdeploy.engines.rules import (
    CRASH,
    INIT_STAGES,
    KILLED,
    PAST_INIT,
    READY,
    Evidence,
    Finding,
    Log,
    Pat,
    Rule,
    SequenceRule,
    pat,
)

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


@dataclass(frozen=True)
class Diagnosis:
    cls: str
    evidence: list[Evidence] = field(default_factory=list)
    summary: str = ""


# --- the pattern table ---------------------------------------------------------------------


NCCL_WORKS = pat(r"Init COMPLETE|Connected all rings|Init torch distributed ends",
                 "init complete", "connected all rings", "init torch distributed ends", icase=False)
CONFIG_LOOKUP = pat(r"configuration_auto|CONFIG_MAPPING|AutoConfig|model_type|config_dict\[",
                    "configuration_auto", "config_mapping", "autoconfig", "model_type", "config_dict", icase=False)

_RULES: tuple[Rule, ...] = (
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
RULES: tuple[Rule, ...] = tuple(sorted(
    (*_RULES, *(r for kind in KINDS.values() for r in kind.diagnosis)), key=lambda r: -r.priority))
"""The engine's own rules (``_RULES``) and every engine kind's (``Kind.diagnosis``), highest
priority first."""

# --- findings ---------------------------------------------------------------------------


def patterns(rules: Sequence[Rule] | None = None) -> list[Pat]:
    """Every pattern the classifier tries (the rules' and the sequence rules' markers)."""
    pats = [PAST_INIT, READY, CRASH, KILLED, NCCL_WORKS, CONFIG_LOOKUP,
            *(p for kind in KINDS.values() for p in kind.markers)]
    pats += [p for st in INIT_STAGES for p in (st.begin, st.end)]
    for r in RULES if rules is None else rules:
        pats += [p for p in (r.pattern, r.context, r.void_after) if p is not None]
    return pats


def _keys(rules: Sequence[Rule]) -> set[str]:
    pats = patterns(rules)
    keys = {k for p in pats for k in p.keys}
    # a key containing another is found by the shorter one: scan for the shorter only
    return {k for k in keys if not any(o != k and o in k for o in keys)}


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


SEQUENCE_RULES: tuple[SequenceRule, ...] = tuple(dict.fromkeys(
    (_init_hang, *(r for kind in KINDS.values() for r in kind.sequence_rules))))
"""The init hang every engine can show, then each engine kind's own (``Kind.sequence_rules``)."""


# --- classification ---------------------------------------------------------------------


def classify(logs: Mapping[str, Sequence[str]]) -> Diagnosis:
    """Classify engine logs (``{label: lines}``, one per node) into one failure class."""
    findings: list[Finding] = []
    ready: list[Evidence] = []
    tails: list[Evidence] = []
    total = 0
    for label, raw in logs.items():
        log = Log.of(label, raw, _keys(RULES))
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
