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

from sparkdeploy.config import Engine, Profile
from sparkdeploy.engines.base import Launch, NodeFacts, Stage, check_inputs, ordered_nodes, role_of
from sparkdeploy.engines.vllm import API_KEY_VAR, RANK_JOINED, node_spec, serve_argv, single

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
