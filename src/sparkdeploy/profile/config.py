"""The deployment profile: one YAML file, one top-level key ``sparkdeploy:``.

``load_profile(path)`` reads the file (and the files it ``extends:``, see ``overlays``),
validates the merged result once and returns typed objects. Every problem becomes a
``ProfileError`` whose message is one line naming the file that set the bad value and the key:

    configs/x.yaml: sparkdeploy.nodes[1].role: must be 'head' or 'worker'
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from sparkdeploy import engines
from sparkdeploy.core import checks
from sparkdeploy.core.redaction import secret_flag
from sparkdeploy.engines import flags as engine_flags
from sparkdeploy.model import fit
from sparkdeploy.profile import recipes as rcp
from sparkdeploy.profile.overlays import Merged, ProfileError, load_merged, parse_dotted


def _port(v: int) -> int:
    if not 1 <= v <= 65535:
        raise ValueError(f"{v} is out of range (1..65535)")
    return v


Port = Annotated[int, AfterValidator(_port)]
Name = Annotated[str, AfterValidator(checks.name)]
"""A node or engine name: safe in host names, paths and container names."""
Url = Annotated[str, AfterValidator(checks.http_url)]
ImageRef = Annotated[str, AfterValidator(checks.image_ref)]
AbsPath = Annotated[str, AfterValidator(checks.abs_path)]
NodePath = Annotated[str, AfterValidator(checks.node_path)]
"""A path on a node: absolute or ``~/...``, plain characters."""
SshPath = Annotated[str, AfterValidator(checks.ssh_path)]
"""A controller file ssh reads through an option: no white space, no leading '-'."""
RelPath = Annotated[str, AfterValidator(checks.relative_path)]
Text = Annotated[str, AfterValidator(checks.no_control)]
"""Free text that still never holds a control character (a newline, an escape)."""
Pattern = Annotated[str, AfterValidator(checks.pattern)]
Unit = Annotated[str, AfterValidator(checks.unit)]
Requirement = Annotated[str, AfterValidator(checks.requirement)]
Version = Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)*([a-z]+[0-9]*)?$")]


DAY = 86400.0


class _Strict(BaseModel):
    # strict: a string is never taken for a number ("30000") nor a bool for one (true)
    # allow_inf_nan=False: nan and inf are refused (they would turn a bound or a gate off)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class Link(_Strict):
    """A node's end of the fast link (the QSFP cable)."""

    interface: Annotated[str, AfterValidator(checks.interface)]
    address: Annotated[str, AfterValidator(checks.link_address)]
    """IPv4 only (the rsync, SGLang and Ray addresses built from it take IPv4)."""
    hcas: list[Annotated[str, AfterValidator(checks.interface)]] = Field(default_factory=list)


class LinkSettings(_Strict):
    """What ``link.check`` holds the fast link to (the nodes' ends are ``nodes[].link``)."""

    expect_gbps: float | None = Field(default=None, gt=0, le=10000)
    """The least bandwidth head -> worker the link must carry (Gb/s, measured with ``iperf3``
    when both nodes have it, else a timed TCP stream); None: measured and shown, not judged."""
    min_mtu: int = Field(default=9000, ge=576, le=65535)
    """The least MTU of the link's interfaces (jumbo frames)."""
    test_port: Port = 5201
    """The port the measurement listens on, on the worker's fast-link address."""
    test_seconds: float = Field(default=2.0, gt=0, le=60)
    """How long the measurement streams."""
    fabric_port: Port = 29511
    """``link.fabric``: the all-reduce's rendezvous port, on the head's fast-link address."""
    fabric_budget_s: float = Field(default=60.0, gt=0, le=3600)
    """``link.fabric``: the seconds the sizes may take; a size that would overrun them is not run."""
    fabric_timeout_s: float = Field(default=300.0, gt=0, le=7200)
    """``link.fabric``: the deadline of the whole test (the ranks joining included); ranks still
    running then are a hang, ended and removed."""
    fabric_max_bytes: int | None = Field(default=None, ge=1 << 20, le=1 << 30)
    """``link.fabric``: the largest size (1 MiB to 1 GiB, x4); None: 1 GiB."""


class Node(_Strict):
    name: Name
    role: Literal["head", "worker"]
    ssh: Annotated[str, AfterValidator(checks.ssh_alias)] | None = None
    """SSH alias or host name; ``None`` means this machine (run locally)."""
    link: Link
    gpus: int = Field(default=1, ge=0, le=64)
    docker_socket: AbsPath = "/var/run/docker.sock"
    privilege: Literal["sudo", "none"] = "none"
    arch: Literal["arm64", "amd64"] = "arm64"

    @property
    def local(self) -> bool:
        return self.ssh is None


class SshSettings(_Strict):
    config: SshPath | None = None
    """An ssh_config file for every connection (the lab writes one)."""
    known_hosts: SshPath | None = None
    """The known_hosts file sparkdeploy checks host keys against and ``hosts.trust`` writes."""
    control_persist: Annotated[str, AfterValidator(checks.ssh_time)] = "10m"
    connect_timeout: int = Field(default=10, ge=1, le=3600)


class ModelSync(_Strict):
    """How ``model.sync`` copies the weights node to node over the fast link."""

    transport: Literal["rsyncd", "ssh"] = "rsyncd"
    """``rsyncd``: an rsync daemon on the receiver bound to its fast-link address only, with a
    one-time secret handed over SSH, several streams at once (not bound by one SSH cipher
    stream); ``ssh``: plain ``rsync`` over SSH (the fallback)."""
    streams: int = Field(default=4, ge=1, le=64)
    """rsync streams at once per receiving node (and per sending node); the files ready for a
    receiver are spread over its free streams, evenly in bytes."""
    port: Port = 8730
    """First port tried for the rsync daemon on the receiver's fast-link address."""
    stall_timeout_s: int = Field(default=900, ge=10, le=int(DAY))
    """Give up when nothing new arrives on the head and no transfer finishes for this long."""
    bwlimit_mb_s: float | None = Field(default=None, gt=0, le=1e6)
    """Cap each stream at this many MB/s (``rsync --bwlimit``), to leave the link to others;
    None: no cap."""


class Model(_Strict):
    repo: str = Field(pattern=r"^[A-Za-z0-9_][\w.-]*/[A-Za-z0-9_][\w.-]*$")
    """``owner/name`` on the hub, each part starting with a letter, digit or '_' (never '..')."""
    revision: str = Field(default="main", pattern=r"^[A-Za-z0-9_][A-Za-z0-9_./-]{0,254}$")
    path: AbsPath
    """Where the weights live on every node."""
    allow_patterns: list[Pattern] = Field(default_factory=list)
    """Files to fetch beyond the ones the engine loads (``sparkdeploy.model.weights``: the files the
    safetensors index names, configs, tokenizer, chat template): each file a pattern matches
    (fnmatch, e.g. ``original/*``) is added; a pattern never removes one."""
    endpoint: Url | None = None
    """The model hub (``HF_ENDPOINT``); None means huggingface_hub's default (or $HF_ENDPOINT)."""
    trust_http: bool = False
    """Send the HF token to ``endpoint`` although it is plain ``http`` (a hub on a network of
    one's own, as the lab's); an ``https`` hub gets it regardless."""
    token_to_image: bool = False
    """Hand the HF token to the python of a community image (``runtime: container``, run with
    the host's network); by default a download with a token runs in the virtualenv."""
    runtime: Literal["auto", "container", "venv"] = "auto"
    """Where the downloader runs on the node: ``container`` (an image the node has that carries
    huggingface_hub), ``venv`` (a virtualenv of sparkdeploy's own on the node), ``auto`` (a
    container when an image qualifies, else the venv). Never the node's system Python."""
    venv: NodePath = "~/.local/share/sparkdeploy/hf-venv"
    """The virtualenv's directory on the node (``~`` is the SSH user's home there)."""
    index_url: Url = "https://pypi.org/simple"
    """Where the venv gets huggingface_hub from."""
    download_workers: int = Field(default=4, ge=1, le=64)
    """Files downloaded at once (hf_xet parallelises inside a file where the hub offers it)."""
    disk_margin_mb: int = Field(default=2048, ge=0, le=10**8)
    """Free space kept beyond the missing bytes (the disk pre-check)."""
    keep: int = Field(default=1, ge=0, le=1000)
    """Other models' weights ``model.prune`` leaves on the nodes besides the serving model's
    (the most recently written first): a swap back to one of them fetches nothing."""
    sync: ModelSync = Field(default_factory=ModelSync)


if TYPE_CHECKING:
    Software = str
    EngineKind = str
else:  # the kinds' own modules say which there are (engines.KINDS); the profile takes those
    Software = Literal[tuple(engines.software())]
    """The serving software in an image (candidates' ``engine:``, ``images.rules``): both vLLM
    kinds run the same vLLM, so both are judged by the ``vllm`` rule (``Kind.software``)."""
    EngineKind = Literal[tuple(engines.KINDS)]
    """How an engine runs across the nodes (``engines.KINDS``: one module each)."""


def software_of(kind: EngineKind) -> Software:
    """The software an engine kind runs (what its image is probed and judged for)."""
    return engines.kind(kind).software


class Candidate(_Strict):
    ref: ImageRef
    engine: Software


class DerivativeImage(_Strict):
    """The derivative image: a candidate plus a pinned transformers."""

    dockerfile: Annotated[RelPath, AfterValidator(checks.project_dockerfile)] = (
        "docker/transformers.Dockerfile")
    """One of the Dockerfiles sparkdeploy ships (``sparkdeploy/data/docker/``; ``image.build``
    reads nothing else)."""
    base: ImageRef
    requirement: Requirement = "transformers>=5"
    tag: ImageRef
    index_url: Url = "https://pypi.org/simple"
    """Where ``requirement`` is resolved and installed from (credential-free: it is recorded in
    the image history)."""
    nccl: Literal["image", "system"] = "image"
    """Which NCCL the derivative's torch loads: ``image`` (as the base image has it) or
    ``system`` (the system's libnccl2, installed when missing; the nvidia-nccl wheel's
    libnccl.so.2 made a link to it, as vllm#42354 and eugr/spark-vllm-docker's
    use-official-vllm mod do against multi-node hangs on DGX Spark)."""
    override_engine_requirement: bool = False
    """``image.build`` resolves ``requirement`` together with what the base image's engine
    declares of transformers (the newest release satisfying both) and fails when none does;
    true resolves ``requirement`` alone (the engine's declaration is still recorded)."""


class EngineRule(_Strict):
    """What an image needs to serve the model with one engine (judged by the image probe)."""

    min_version: Version
    model_files: list[RelPath] = Field(default_factory=list)
    require_config: bool = False
    """Whether the image's transformers must parse the model's config (SGLang: yes; vLLM 0.17+
    ships its own Qwen3.5 config classes and needs transformers<5: no)."""


def _default_rules() -> dict[Software, EngineRule]:
    """Each software's image rule as its engine kind declares it (``Kind.image_rule``)."""
    return {name: EngineRule(min_version=k.image_rule.min_version,
                             model_files=list(k.image_rule.model_files),
                             require_config=k.image_rule.require_config)
            for name, k in engines.software().items()}


class Images(_Strict):
    candidates: list[Candidate] = Field(min_length=1)
    rules: dict[Software, EngineRule] = Field(default_factory=_default_rules)
    layer: DerivativeImage | None = None
    ship_compression: Literal["none", "zstd"] = "none"


class ServiceSettings(_Strict):
    stop: dict[str, list[Unit]] = Field(default_factory=dict)
    """Units to stop per node name, in stop order."""
    gpu_free_timeout_s: float = Field(default=120, gt=0, le=DAY)
    gpu_poll_s: float = Field(default=2, gt=0, le=3600)


class Engine(_Strict):
    name: Name
    """Part of the container names (``sparkdeploy-<name>-<role>``)."""
    kind: EngineKind
    image: ImageRef
    port: Port
    dist_port: Port | None = None
    """SGLang's --dist-init-addr port, vLLM's --master-port, or the Ray GCS port for vLLM on
    Ray."""
    tensor_parallel: int = Field(default=1, ge=1, le=1024)
    pipeline_parallel: int = Field(default=1, ge=1, le=1024)
    args: list[Text] = Field(default_factory=list)
    env: dict[str, Text | None] = Field(default_factory=dict)
    """Overrides of the environment the engine sets; a null value removes a variable."""

    @field_validator("args")
    @classmethod
    def _no_secret_in_args(cls, v: list[str], info: ValidationInfo) -> list[str]:
        # a flag's value there would be on the nodes' command lines, in labels and records
        kind = info.data.get("kind")
        for a in v:
            flag = secret_flag(a)
            if flag is not None and (kind is None or engine_flags.carries_secret(software_of(kind), flag)):
                raise ValueError(f"{flag} carries a secret and is refused in args: {_secret_way(flag)}")
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str | None]) -> dict[str, str | None]:
        for k in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise ValueError(f"{k!r} is not an environment variable name")
        return v

    @model_validator(mode="after")
    def _args_of_its_kind(self) -> Engine:
        problem = engines.kind(self.kind).args_problem(list(self.args))
        if problem:
            raise ValueError(problem)
        return self

    @property
    def software(self) -> Software:
        return software_of(self.kind)


def _secret_way(flag: str) -> str:
    """How a secret an engine flag would carry reaches the engine instead."""
    if flag.endswith(("api-key", "api_key")):
        return ("set SPARKDEPLOY_API_KEY in the controller's environment (the engines get the "
                "API key from there, never on a command line)")
    if "token" in flag.lower():
        return ("set HF_TOKEN in the controller's environment (model.download uses it; the engines "
                "load the weights from the nodes' disks)")
    return "give it in the engine's env (a secret-named variable goes to the node in an env file)"


class Serve(_Strict):
    """How ``serve.up`` waits: a phase with no new log line and no readiness step for
    ``stall_s`` is a hang; ``ready_timeout_s`` bounds the whole bring-up of one engine."""

    stall_s: float = Field(default=300, gt=0, le=DAY)
    ready_timeout_s: float = Field(default=1800, gt=0, le=7 * DAY)
    poll_s: float = Field(default=2, gt=0, le=3600)
    group_port: Port = 29990
    """Where the persisted units' supervisors publish their state on the fast link."""
    watch_s: float = Field(default=30, ge=1, le=DAY)
    """The watchdog (the persisted supervisors, ``serve.watch``): a canary this often."""
    canary_s: float = Field(default=30, ge=1, le=3600)
    """The canary's deadline for its first token; none in time is a wedge."""
    max_restarts: int = Field(default=3, ge=0, le=100)
    """Restarts of the whole deployment within ``restart_window_s`` before the watchdog gives up."""
    restart_window_s: float = Field(default=3600, gt=0, le=7 * DAY)
    restart_backoff_s: float = Field(default=30, ge=0, le=DAY)
    """The second restart in a window waits this long after the first, each next one twice as long."""
    restart_backoff_max_s: float = Field(default=600, ge=0, le=DAY)


class Fit(_Strict):
    """``model.fit``: what an engine needs per GPU beside its slice of the weights."""

    reserve_gib: float = Field(default=fit.RESERVE_GIB, ge=0, le=4096)
    """GiB per GPU beside the weights: CUDA context and NCCL buffers (~1.5), the activations of
    the engine's memory profiling run (~3), CUDA graphs (~1.5), a minimal KV cache (~2). An
    estimate to refuse what cannot work, not a measurement."""
    engines: dict[str, Annotated[float, Field(ge=0, le=4096)]] = Field(default_factory=dict)
    """``reserve_gib`` per engine name, where one engine needs another figure."""

    def reserve(self, engine: str) -> float:
        return self.engines.get(engine, self.reserve_gib)


class Bench(_Strict):
    concurrency: list[Annotated[int, Field(ge=1, le=checks.MAX_CONCURRENCY)]] = Field(
        default_factory=lambda: [1, 8])
    requests: int = Field(default=16, ge=1, le=checks.MAX_REQUESTS)
    input_tokens: int = Field(default=512, ge=1, le=checks.MAX_TOKENS)
    output_tokens: int = Field(default=256, ge=2, le=checks.MAX_TOKENS)
    warmup: int = Field(default=1, ge=0, le=checks.MAX_WARMUP)
    baseline_decode_tok_s: float = Field(default=27.0, gt=0, le=1e7)
    baseline_tolerance_pct: float = Field(default=10.0, ge=0, lt=100)
    """``bench.run --check-baseline``: the allowed shortfall of the concurrency-1 median decode
    rate against ``baseline_decode_tok_s``."""
    timeout_s: float = Field(default=120.0, gt=0, le=DAY)
    """Seconds without a byte before a request fails (a stalled stream)."""
    deadline_s: float = Field(default=1800.0, gt=0, le=DAY)
    """Seconds the whole of one request may take (a server that trickles bytes ends on time)."""


class Metrics(_Strict):
    """``metrics.up``: Prometheus on the head scraping every engine's ``/metrics`` and an exporter
    on every node (the deployment, the node's memory and link counters, the watchdog's restarts,
    the last fabric and bench figures); started, kept and removed with the deployment."""

    enabled: bool = True
    prometheus: Literal["package", "image"] = "package"
    """``package``: the head's own ``prometheus`` (Debian and Ubuntu: ``apt install
    prometheus``), found on its PATH; ``image``: ``prometheus_image`` run by the head's Docker."""
    prometheus_image: ImageRef = "prom/prometheus:v3.7.3"
    """Prometheus' own image (hub.docker.com/r/prom/prometheus: amd64 and arm64)."""
    port: Port = 9090
    """Prometheus' port on the head (its default)."""
    exporter_port: Port = 9408
    """The exporter's port on every node (9400 is NVIDIA's dcgm-exporter's)."""
    status_port: Port = 9480
    """The status page's port on the head."""
    scrape_s: float = Field(default=15, ge=1, le=300)
    """How often Prometheus scrapes and evaluates its recording rules (its default is 60 s;
    15 s is what Grafana's dashboards expect of a rate over 1 m)."""
    retention_days: int = Field(default=15, ge=1, le=3650)
    """How long Prometheus keeps what it scraped (Prometheus' default: 15 days)."""

    @model_validator(mode="after")
    def _ports_differ(self) -> Metrics:
        ports = {"port": self.port, "exporter_port": self.exporter_port,
                 "status_port": self.status_port}
        for a, b in (("port", "exporter_port"), ("port", "status_port"),
                     ("exporter_port", "status_port")):
            if ports[a] == ports[b]:
                raise ValueError(f"{a} and {b} are both {ports[a]}")
        return self


class Gateway(_Strict):
    """``serve.add``'s one endpoint: the gateway on the head (``helpers/gateway.py``) in front of
    every model placed on the cluster, routing each request by the ``model`` it names."""

    port: Port = 8888
    """The gateway's port on the head: the address ``serve.add`` prints as ``endpoint:``."""
    ready_s: float = Field(default=30, gt=0, le=3600)
    """How long the gateway may take to list every placed model after a (re)start."""
    on_demand_gib: float | None = Field(default=None, gt=0, le=4096)
    """What the models on demand may hold together at once on the head (GiB; None: what the
    head's room beside the models always loaded allows). Past it, a load evicts the least
    recently used."""
    wait_s: float = Field(default=60, gt=0, le=3600)
    """How long a request for a model on demand waits for its load before a 503 with
    ``Retry-After`` (the load goes on)."""
    load_s: float = Field(default=900, gt=0, le=7200)
    """A load's own deadline: its unit started and the engine listing the model (the weights
    read from disk: minutes for a large model); past it the load failed and the unit stops."""


class Placement(_Strict):
    """What ``serve.add`` placed beside the profile's own deployment: set by ``serve.add`` (and read
    back from the nodes' labels), never in a profile file."""

    of: str
    """The profile's deployment this model is placed beside."""
    recipe: Text
    nodes: list[Name] = Field(min_length=1)
    offset: int = Field(ge=1, le=1000)
    """Added to every port of the recipe's engines (API, init, the supervisors' group)."""
    fraction: float | None = Field(default=None, gt=0, le=1)
    """The memory fraction its engines were given (None: the recipe's own args)."""
    on_demand: bool = False
    """Registered but loaded only by a request through the gateway (``serve.add --on-demand``):
    its unit is installed on the head, not started or enabled."""


class Profile(_Strict):
    name: Annotated[str, AfterValidator(checks.profile_name)]
    """The deployment's name: in unit descriptions, state-dir file names and container labels."""
    recipe: Text | None = None
    """The recipe the model part comes from (``recipes``); the profile's own values win."""
    recipes: list[Text] = Field(default_factory=list)
    """Owners' recipe directories, looked up before the package's (absolute once loaded)."""
    ssh: SshSettings = Field(default_factory=SshSettings)
    link: LinkSettings = Field(default_factory=LinkSettings)
    nodes: list[Node] = Field(min_length=1)
    model: Model
    images: Images
    services: ServiceSettings = Field(default_factory=ServiceSettings)
    engines: list[Engine] = Field(min_length=1)
    bench: Bench = Field(default_factory=Bench)
    serve: Serve = Field(default_factory=Serve)
    fit: Fit = Field(default_factory=Fit)
    metrics: Metrics = Field(default_factory=Metrics)
    gateway: Gateway = Field(default_factory=Gateway)
    placement: Placement | None = None
    """Set on the profile ``serve.add`` derives for a placed model (``ops.placement``)."""
    endpoint: Url | None = None
    """The deployed OpenAI-compatible endpoint, when known (bench's default target)."""

    @property
    def head(self) -> Node:
        return next(n for n in self.nodes if n.role == "head")

    @property
    def workers(self) -> list[Node]:
        return [n for n in self.nodes if n.role == "worker"]

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ProfileError(f"no node named {name!r} (nodes: {', '.join(self.names)})")

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]


# --- errors as one line -----------------------------------------------------------------


def _loc(parts: tuple[Any, ...] | list[Any]) -> str:
    out = "sparkdeploy"
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


MISSING = "required key is missing"


def _message(err: ErrorDetails) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return MISSING
    if kind == "literal_error":
        return "must be " + ctx.get("expected", "one of the allowed values")
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return f"must be an integer, not {err.get('input')!r}"
    if kind == "finite_number":
        return f"must be a finite number, not {err.get('input')!r}"
    if kind in ("float_parsing", "float_type"):
        return f"must be a number, not {err.get('input')!r}"
    if kind in ("string_type",):
        return f"must be a string, not {err.get('input')!r}"
    if kind in ("list_type",):
        return "must be a list"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return "must be a mapping"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        op = {"greater_than_equal": ">=", "less_than_equal": "<=", "greater_than": ">",
              "less_than": "<"}[kind]
        bound = next(iter(ctx.values()), "?")
        return f"{err.get('input')!r} is out of range (must be {op} {bound})"
    if kind == "too_short":
        return "must not be empty"
    if kind == "string_pattern_mismatch":
        return f"{err.get('input')!r} is not of the form {ctx.get('pattern')}"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    return err["msg"]


def _first_error(exc: ValidationError) -> tuple[str, str]:
    errors = exc.errors()
    # pydantic reports both branches of an Optional; keep the most specific one
    def where(err: ErrorDetails) -> str:
        return _loc(tuple(p for p in err["loc"]
                          if not (isinstance(p, str) and p.startswith(("function-", "literal[")))))

    others = list(dict.fromkeys(where(x) for x in errors[1:]))
    shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
    extra = f" (and {len(errors) - 1} more: {shown})" if len(errors) > 1 else ""
    return where(errors[0]), _message(errors[0]) + extra


def _cross_checks(p: Profile) -> tuple[str, str] | None:
    heads = [i for i, n in enumerate(p.nodes) if n.role == "head"]
    if len(heads) != 1:
        where = heads[1] if heads else 0
        what = "two or more heads" if heads else "no head"
        return f"sparkdeploy.nodes[{where}].role", f"{what}: exactly one node must be 'head'"
    seen: dict[str, int] = {}
    for i, n in enumerate(p.nodes):
        if n.name in seen:
            return (f"sparkdeploy.nodes[{i}].name",
                    f"duplicate node name {n.name!r} (also nodes[{seen[n.name]}])")
        seen[n.name] = i
    addrs: dict[str, int] = {}
    for i, n in enumerate(p.nodes):
        if n.link.address in addrs:
            return (
                f"sparkdeploy.nodes[{i}].link.address",
                f"{n.link.address} is also nodes[{addrs[n.link.address]}]'s address",
            )
        addrs[n.link.address] = i
    for unit_node in p.services.stop:
        if unit_node not in seen:
            return f"sparkdeploy.services.stop.{unit_node}", "no node by that name"
    gpus = sum(n.gpus for n in p.nodes)
    names: dict[str, int] = {}
    for i, e in enumerate(p.engines):
        if e.name in names:
            return f"sparkdeploy.engines[{i}].name", f"duplicate engine name {e.name!r}"
        names[e.name] = i
        want = e.tensor_parallel * e.pipeline_parallel
        if want != gpus:
            return (
                f"sparkdeploy.engines[{i}].tensor_parallel",
                f"tensor_parallel x pipeline_parallel = {want}, but the nodes declare {gpus} GPUs",
            )
        if e.dist_port is not None and e.dist_port == e.port:
            return f"sparkdeploy.engines[{i}].dist_port", "must differ from port"
    for name in p.fit.engines:
        if name not in names:
            return f"sparkdeploy.fit.engines.{name}", "no engine by that name"
    if p.placement is not None:
        return "sparkdeploy.placement", "set by serve.add on the nodes, not in a profile"
    return None


def load_profile(path: str | Path, recipe: str | None = None,
                 recipe_dirs: tuple[str, ...] = ()) -> Profile:
    """Read, merge (``extends:``, ``recipe:``) and validate a profile; raise ``ProfileError``
    with one line. ``recipe``: deploy this recipe instead of the profile's model part;
    ``recipe_dirs``: owners' recipe directories beside the profile's ``recipes:``."""
    return load_layered(path, recipe, recipe_dirs)[0]


def load_placed(path: str | Path, recipe: str, nodes: list[str],
                recipe_dirs: tuple[str, ...] = ()) -> Profile:
    """The profile with ``recipe``'s model part on ``nodes`` only (in the profile's order, the
    first of them the head), the engines' layouts filled for those nodes' GPUs: what
    ``serve.add`` derives a placed model's deployment from (``ops.placement.derive``)."""
    merged = load_merged(path)
    body = merged.body
    listed = body.get("nodes")
    keep = [dict(n) for n in (listed if isinstance(listed, list) else [])
            if isinstance(n, dict) and n.get("name") in nodes]
    for i, n in enumerate(keep):
        n["role"] = "head" if i == 0 else "worker"
    body["nodes"] = keep
    services = body.get("services")
    if isinstance(services, dict):
        services.pop("stop", None)  # the owner's units are the profile's deployment's business
    return _validated(with_recipe(merged, recipe, recipe_dirs))


def _blame(merged: Merged, key: str, msg: str) -> ProfileError:
    """One line naming the file that set ``key`` (and the profile, when that is another)."""
    where = merged.file_of(parse_dotted(key))
    via = f" (via {merged.top})" if where != merged.top else ""
    return ProfileError(f"{where}: {key}: {msg}{via}")


def load_layered(path: str | Path, recipe: str | None = None,
                 recipe_dirs: tuple[str, ...] = ()) -> tuple[Profile, Merged]:
    """The validated profile and how it was merged (files, provenance, overrides)."""
    merged = with_recipe(load_merged(path), recipe, recipe_dirs)
    return _validated(merged), merged


def _validated(merged: Merged) -> Profile:
    """The merged profile validated: its schema, then the checks across keys; ``ProfileError``
    naming the file that set the key at fault."""
    try:
        profile = Profile.model_validate(merged.body)
    except ValidationError as e:
        raise _blame(merged, *_first_error(e)) from None
    problem = _cross_checks(profile)
    if problem:
        raise _blame(merged, *problem)
    return profile


# --- recipes -------------------------------------------------------------------------------


class RecipeWeights(_Strict):
    bytes: int = Field(gt=0, le=10**15)
    """The bytes of the files the engine loads (the safetensors files the index names)."""
    source: Text


class RecipeContext(_Strict):
    tokens: int = Field(ge=1, le=10**8)
    """The context length the engines' args give (``--max-model-len``, ``--context-length``)."""
    source: Text


class RecipeLayout(_Strict):
    """A layout a public recipe ran: TP x PP on ``nodes`` nodes of one GPU each."""

    nodes: int = Field(ge=1, le=64)
    tp: int = Field(ge=1, le=64)
    pp: int = Field(ge=1, le=64)
    source: Text

    @model_validator(mode="after")
    def _whole(self) -> RecipeLayout:
        if self.tp * self.pp != self.nodes:
            raise ValueError(f"tp x pp = {self.tp * self.pp}, not the {self.nodes} node(s)")
        return self


class RecipeSources(_Strict):
    """Where the recipe's parts come from (a working Spark recipe, a launcher's, a model card)."""

    model: Text
    images: Text
    engines: Text
    config: Text
    """Where the config.json shipped beside the recipe was copied from."""


class GateAnswer(_Strict):
    prompt: Text
    answer: str
    """What the model answers, as it answers it (random weights answer control bytes)."""


class RecipeGate(_Strict):
    """The coherence gate of a model that cannot answer the bench's fixed prompts (random
    weights, a base model): the greedy answers its weights give (``recipes.gates``)."""

    max_tokens: int = Field(ge=1, le=64)
    source: Text
    answers: list[GateAnswer] = Field(min_length=1)


class About(_Strict):
    """What a recipe knows beyond the profile's model part."""

    title: Text
    config: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*\.json$")
    """The model's config.json, a file beside the recipe."""
    weights: RecipeWeights
    context: RecipeContext
    layouts: list[RecipeLayout] = Field(default_factory=list)
    sources: RecipeSources
    gate: RecipeGate | None = None


class RecipeFile(_Strict):
    about: About
    model: Model
    images: Images
    engines: list[Engine] = Field(min_length=1)


def read_recipe(name: str, dirs: list[Path] | None = None,
                where: str = "--recipe") -> rcp.Recipe:
    """Recipe ``name`` (owners' ``dirs`` first, then the package's) over the base, validated:
    ``ProfileError`` naming the file and the key."""
    recipe = rcp.read(name, dirs if dirs is not None else rcp.directories(), where)
    try:
        valid = RecipeFile.model_validate(recipe.merged.body)
    except ValidationError as e:
        key, msg = _first_error(e)
        if msg.startswith(MISSING):  # a key the recipe lacks: its own file is where it goes
            raise rcp.RecipeError(f"{recipe.path}: {key}: {msg}") from None
        raise _blame(recipe.merged, key, msg) from None
    for i, eng in enumerate(valid.engines):  # as profile.check and deploy.all check them
        try:
            engine_flags.check_args_any(eng.software, list(eng.args), f"recipe {name}")
        except engine_flags.FlagError as e:
            raise _blame(recipe.merged, f"sparkdeploy.engines[{i}].args", str(e)) from None
    if not recipe.config_path().is_file():
        raise rcp.RecipeError(f"{recipe.path}: sparkdeploy.about.config: "
                              f"{recipe.about['config']}: no such file beside the recipe")
    return recipe


def with_recipe(merged: Merged, recipe: str | None = None,
                recipe_dirs: tuple[str, ...] = ()) -> Merged:
    """``merged`` over the recipe it names (or ``recipe``, replacing its model part)."""
    rcp.check_dirs(list(recipe_dirs), "--recipes")
    given = rcp.profile_dirs(merged)
    rcp.check_dirs(given, f"{merged.file_of(('recipes',))}: sparkdeploy.recipes")
    own = [str(Path(d).resolve()) for d in given]
    dirs = [*(str(Path(d).resolve()) for d in recipe_dirs), *own]
    if dirs:  # what reads the recipe again later (model.fit: its config.json) finds it too
        merged.body["recipes"] = list(dict.fromkeys(dirs))
    name = recipe if recipe is not None else merged.body.get("recipe")
    if name is None:
        return merged
    where = "--recipe" if recipe is not None else \
        f"{merged.file_of(('recipe',))}: sparkdeploy.recipe"
    found = read_recipe(name, rcp.directories(dirs), where)
    return rcp.apply(merged, found, override=recipe is not None)
