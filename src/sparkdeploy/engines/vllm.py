"""vLLM's own multi-node mode (no Ray): one ``vllm serve`` container per node.

Every node runs ``vllm serve MODEL --tensor-parallel-size T --pipeline-parallel-size P
--distributed-executor-backend mp --nnodes N --node-rank R --master-addr <head fast-link ip>
--master-port <dist_port>``; the head (rank 0) serves the OpenAI API, the workers add
``--headless`` (no API server: they run their GPU workers and take part in every step). The
head starts first; once its rendezvous port (``--master-port``, torch.distributed's TCP store)
answers, the workers start and join it; a worker has joined once its log shows its rank in the
model-parallel groups (``RANK_JOINED``): it has no API to ask. Each node advertises its own fast-link address
(``VLLM_HOST_IP``): a rank advertising another address never joins, and the head waits in
distributed init for it.

One node needs none of this: a single container runs ``vllm serve`` (multiprocessing executor).
The API key, when given, reaches vLLM as ``VLLM_API_KEY`` (never ``--api-key``). The same
pieces (``serve_argv``, ``node_spec``) build vLLM on Ray (``vllm_ray``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from sparkdeploy.engines.base import (
    ContainerSpec,
    ImageRule,
    Kind,
    Launch,
    NodeFacts,
    Stage,
    apply_overrides,
    check_inputs,
    link_env,
    merge_args,
    model_mount,
    ordered_nodes,
    role_of,
)
from sparkdeploy.engines.rules import (
    CRASH,
    DIST_ENDS,
    INIT_STAGES,
    KILLED,
    Finding,
    Log,
    Pat,
    SequenceRule,
    pat,
)

if TYPE_CHECKING:
    from sparkdeploy.profile.config import Engine, Node, Profile

RANK_JOINED = r"rank \d+ in world size \d+ is assigned as DP rank"
"""What every vLLM rank prints once it is in the model-parallel groups (``parallel_state.py``):
a headless worker's sign that it joined the head."""
DEFAULT_MASTER_PORT = 29501
"""vLLM's own default ``--master-port``."""
API_KEY_VAR = "VLLM_API_KEY"
_VALUED = {"--served-model-name", "--host", "--port", "--tensor-parallel-size",
           "--pipeline-parallel-size", "--distributed-executor-backend", "--nnodes",
           "--node-rank", "--master-addr", "--master-port"}


def serve_argv(profile: Profile, engine: Engine, backend: str,
               multinode: list[str] | None = None) -> list[str]:
    """``vllm serve`` with our flags, then the profile's ``args`` (theirs win, once)."""
    ours = ["--served-model-name", profile.model.repo, "--host", "0.0.0.0",
            "--port", str(engine.port), "--tensor-parallel-size", str(engine.tensor_parallel),
            "--pipeline-parallel-size", str(engine.pipeline_parallel),
            "--distributed-executor-backend", backend, *(multinode or [])]
    return ["vllm", "serve", profile.model.path, *merge_args(ours, list(engine.args), _VALUED)]


def node_spec(profile: Profile, engine: Engine, facts: dict[str, NodeFacts], node: Node,
              role: str, rank: int, argv: list[str], ports: tuple[int, ...],
              extra_env: dict[str, str] | None = None, **kw) -> ContainerSpec:
    """A vLLM container on ``node``: the link environment, the node's own ``VLLM_HOST_IP``,
    ``extra_env``, then the profile's overrides."""
    nf = facts.get(node.name, NodeFacts())
    env = link_env(profile, node, nf)
    env["VLLM_HOST_IP"] = node.link.address
    env.update(extra_env or {})
    env = apply_overrides(env, engine.env)
    return ContainerSpec(
        node=node.name, engine=engine.name, role=role, rank=rank, image=engine.image,
        argv=tuple(argv), env=tuple(env.items()), mounts=(model_mount(profile),),
        ports=ports, devices=("/dev/infiniband",) if nf.rdma_devices else (), **kw)


def single(profile: Profile, engine: Engine, facts: dict[str, NodeFacts],
           secret: tuple[str, ...]) -> Launch:
    """One node: one container, ``vllm serve`` with the multiprocessing executor."""
    only = node_spec(profile, engine, facts, profile.head, "head", 0,
                     serve_argv(profile, engine, "mp"), (engine.port,), secret_env=secret)
    return Launch(engine, (Stage((only,)),), profile.head.name, engine.port, profile.model.repo,
                  dist_ready=RANK_JOINED)


def build(profile: Profile, engine: Engine, facts: dict[str, NodeFacts],
          api_key: bool = False) -> Launch:
    check_inputs(profile, engine)
    nodes = ordered_nodes(profile)
    secret = (API_KEY_VAR,) if api_key else ()
    if len(nodes) == 1:
        return single(profile, engine, facts, secret)
    head = profile.head
    port = engine.dist_port or DEFAULT_MASTER_PORT
    specs = []
    for node in nodes:
        role, rank = role_of(profile, node)
        multinode = ["--nnodes", str(len(nodes)), "--node-rank", str(rank),
                     "--master-addr", head.link.address, "--master-port", str(port)]
        if rank:
            multinode.append("--headless")
        specs.append(node_spec(profile, engine, facts, node, role, rank,
                               serve_argv(profile, engine, "mp", multinode),
                               (engine.port, port) if rank == 0 else (),
                               secret_env=secret if rank == 0 else ()))
    stages = (Stage((specs[0],), wait="dist-port"),
              Stage(tuple(specs[1:]), wait="ranks-joined", joined=RANK_JOINED))
    return Launch(engine, stages, head.name, engine.port, profile.model.repo, wait_port=port,
                  dist_ready=RANK_JOINED)


# --- its failures ----------------------------------------------------------------------------

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
NCCL_INIT, VLLM_INIT = (next(st for st in INIT_STAGES if st.name == name)
                        for name in ("NCCL communicator init", "distributed init (vLLM)"))


JOIN_FIX = ("check each worker's --master-addr (the head's fast-link address) and that its VLLM_HOST_IP is "
            "its own fast-link address (not 127.0.1.1 from `hostname -i`)")
STORE_CONTEXT = 12  # lines before a store timeout in which vLLM's executor must have logged


def worker_never_joined(log: Log) -> Finding | None:
    """vLLM's own multi-node mode: the head (its leader line says ranks of other nodes belong to
    it) never got to the engine's init (KV cache sizing) and did not crash: it waits for a worker
    rank, at its store on --master-addr:--master-port (before NCCL init, or the store's timeout),
    or, weights loaded, for a worker's message queue it cannot reach at the address the worker
    advertises (VLLM_HOST_IP)."""
    lead = log.last(MP_LEADER)
    if lead is None:
        return executor_store_timeout(log)
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
    elif log.last(NCCL_INIT.begin, lead) is None and log.last(DIST_ENDS, lead) is None:
        where = "the head waits for a worker at its store on --master-addr:--master-port"
        mark = log.last(VLLM_INIT.begin, lead) or lead
    else:
        return None  # inside NCCL init or later: the init-hang rule says where
    evidence = [log.ev(lead)] + ([log.ev(mark)] if mark != lead else [])
    last = next((j for j in range(len(log.lines) - 1, mark, -1) if log.lines[j].strip()), None)
    if last is not None:
        evidence.append(log.ev(last))
    return Finding("worker-never-joined", 45, f"a worker rank never joined vLLM's head: {where}; {fix}",
                   evidence)


def executor_store_timeout(log: Log) -> Finding | None:
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


def ray_backend(args: list[str]) -> bool:
    """Whether ``args`` select vLLM's Ray executor (``--distributed-executor-backend ray``)."""
    flag = "--distributed-executor-backend"
    for i, a in enumerate(args):
        if a == f"{flag}=ray" or (a == flag and args[i + 1:i + 2] == ["ray"]):
            return True
    return False


class VLLM(Kind):
    """vLLM's own multi-node mode: ``vllm serve`` on every node, the workers headless."""

    name = "vllm"
    software = "vllm"
    memory_fraction_flag = "--gpu-memory-utilization"
    """vLLM's engine arguments: "the fraction of GPU memory to be used for the model executor
    ... a per-instance limit" (``gpu_memory_utilization``, default 0.9)."""
    image_rule = ImageRule(
        min_version="0.17.0",
        model_files=("vllm/model_executor/models/qwen3_5.py",
                     "vllm/model_executor/models/qwen3_5_mtp.py"),
        require_config=False)  # vLLM 0.17+ ships its own Qwen3.5 config classes, needs transformers<5
    # what vLLM's import of its CLI needs for real (its pydantic config classes, transformers'
    # config side); the GPU stack and everything else stays faked
    flag_packages = ("packaging", "pydantic", "transformers<5", "fastapi", "openai", "msgspec",
                     "pyyaml", "cloudpickle", "numpy", "regex", "cachetools", "psutil", "pillow",
                     "prometheus_client", "aiohttp", "pyzmq", "requests", "tqdm",
                     "typing_extensions", "filelock", "blake3", "py-cpuinfo", "protobuf",
                     "sentencepiece", "tiktoken", "gguf", "partial-json-parser",
                     "python-json-logger", "cbor2", "ijson", "setproctitle", "einops", "lark",
                     "diskcache", "watchfiles", "pybase64", "openai-harmony", "email-validator")
    dist_ready = RANK_JOINED
    api_key_env = API_KEY_VAR
    sequence_rules: ClassVar[tuple[SequenceRule, ...]] = (worker_never_joined,)
    markers: ClassVar[tuple[Pat, ...]] = (MP_LEADER, WEIGHTS_LOADED, ENGINE_INIT, STORE_TIMEOUT,
                                          MP_EXECUTOR)

    def build(self, profile: Profile, engine: Engine, facts: dict[str, NodeFacts],
              api_key: bool = False) -> Launch:
        return build(profile, engine, facts, api_key)

    def args_problem(self, args: list[str]) -> str | None:
        if ray_backend(args):
            return ("kind vllm is vLLM's own multi-node mode (no Ray); for "
                    "--distributed-executor-backend ray write kind: vllm-ray")
        return None


KIND = VLLM()
