"""vLLM on a Ray cluster across the nodes.

A Ray head container on the head (``ray start --head --port <dist_port> --node-ip-address
<head fast-link ip> --block``) and a Ray worker container on each worker (``ray start --address
<head fast-link ip>:<dist_port> --node-ip-address <own fast-link ip> --block``), each declaring
its GPUs. Once Ray lists every node alive, at its fast-link address, with its GPUs, ``vllm
serve`` runs on the head in its own container (``api``) that shares the Ray head's ``/tmp/ray``
(``--volumes-from``: the driver reaches the local raylet through its sockets there) and its
process namespace (``--pid=container:``: a Ray 2.x driver finds its node's raylet by looking for
the raylet process, and waits for one forever when it sees none), and names the cluster in
``RAY_ADDRESS``. Its own container gives it its own log and exit status, and lets
systemd see it die.

One node needs no Ray: a single container runs ``vllm serve`` (multiprocessing executor), as
for ``kind: vllm``. The API key, when given, reaches vLLM as ``VLLM_API_KEY`` (never
``--api-key``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparkdeploy.engines.base import Launch, NodeFacts, Stage, check_inputs, ordered_nodes, role_of
from sparkdeploy.engines.rules import READY, Rule, pat
from sparkdeploy.engines.vllm import API_KEY_VAR, RANK_JOINED, VLLM, node_spec, serve_argv, single

if TYPE_CHECKING:
    from sparkdeploy.profile.config import Engine, Profile

DEFAULT_RAY_PORT = 6379
RAY_TMP = "/tmp/ray"


def build(profile: Profile, engine: Engine, facts: dict[str, NodeFacts],
          api_key: bool = False) -> Launch:
    check_inputs(profile, engine)
    nodes = ordered_nodes(profile)
    head = profile.head
    ray_port = engine.dist_port or DEFAULT_RAY_PORT
    secret = (API_KEY_VAR,) if api_key else ()
    if len(nodes) == 1:
        return single(profile, engine, facts, secret)
    ray_env = {"RAY_memory_monitor_refresh_ms": "0"}

    def spec(node, role, rank, argv, ports, extra_env=None, **kw):
        return node_spec(profile, engine, facts, node, role, rank, argv, ports,
                         {**ray_env, **(extra_env or {})}, **kw)

    ray_head = spec(head, "head", 0,
                    ["ray", "start", "--head", "--port", str(ray_port),
                     "--node-ip-address", head.link.address, "--num-gpus", str(head.gpus),
                     "--disable-usage-stats", "--block"],
                    (ray_port,), volumes=(RAY_TMP,))
    workers = []
    for node in nodes[1:]:
        role, rank = role_of(profile, node)
        workers.append(spec(node, role, rank,
                            ["ray", "start", "--address", f"{head.link.address}:{ray_port}",
                             "--node-ip-address", node.link.address, "--num-gpus", str(node.gpus),
                             "--disable-usage-stats", "--block"], ()))
    api = spec(head, "api", 0, serve_argv(profile, engine, "ray"), (engine.port,),
               {"RAY_ADDRESS": f"{head.link.address}:{ray_port}"},
               volumes_from=ray_head.name, pid_from=ray_head.name, secret_env=secret)
    stages = (Stage((ray_head,)), Stage(tuple(workers), wait="ray-nodes"), Stage((api,)))
    return Launch(engine, stages, head.name, engine.port, profile.model.repo,
                  dist_ready=RANK_JOINED)  # the Ray workers' lines reach the API server's log


DIAGNOSIS: tuple[Rule, ...] = (
    # -- the image has no Ray, but the engine was asked to run on Ray --
    Rule("image-without-ray", 96,
         pat(r"(?:ModuleNotFoundError|ImportError): No module named '?ray'?(?![.\w])|Ray is not installed"
             r"|Failed to import Ray\b|\bray: (?:command )?not found|\"ray\": executable file not found",
             "no module named", "ray is not installed", "failed to import ray", "ray: ", "\"ray\": executable"),
         "the image has no Ray (vLLM's images dropped it as a dependency): use an image with Ray for kind "
         "vllm-ray, or vLLM's own multi-node mode", void_after=READY),
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
)
"""What only vLLM on Ray fails with: Ray missing from the image, the nodes' Ray versions apart, a
Ray cluster short of a node or its GPU."""


class VLLMRay(VLLM):
    """vLLM on a Ray cluster: the same vLLM (its image rule, flags, startup line) as ``vllm``."""

    name = "vllm-ray"
    diagnosis = DIAGNOSIS
    sequence_rules = ()  # vLLM's own multi-node mode's (worker-never-joined): not on Ray
    markers = ()

    def build(self, profile: Profile, engine: Engine, facts: dict[str, NodeFacts],
              api_key: bool = False) -> Launch:
        return build(profile, engine, facts, api_key)

    def args_problem(self, args: list[str]) -> str | None:
        return None


KIND = VLLMRay()
