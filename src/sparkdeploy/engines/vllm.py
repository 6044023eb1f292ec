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

One node needs no Ray: a single container runs ``vllm serve`` (multiprocessing executor).
The API key, when given, reaches vLLM as ``VLLM_API_KEY`` (never ``--api-key``).
"""

from __future__ import annotations

from sparkdeploy.config import Engine, Profile
from sparkdeploy.engines.base import (
    ContainerSpec,
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

DEFAULT_RAY_PORT = 6379
RAY_TMP = "/tmp/ray"
_VALUED = {"--served-model-name", "--host", "--port", "--tensor-parallel-size",
           "--pipeline-parallel-size", "--distributed-executor-backend"}


def serve_argv(profile: Profile, engine: Engine, backend: str) -> list[str]:
    ours = ["--served-model-name", profile.model.repo, "--host", "0.0.0.0",
            "--port", str(engine.port), "--tensor-parallel-size", str(engine.tensor_parallel),
            "--pipeline-parallel-size", str(engine.pipeline_parallel),
            "--distributed-executor-backend", backend]
    return ["vllm", "serve", profile.model.path, *merge_args(ours, list(engine.args), _VALUED)]


def build(profile: Profile, engine: Engine, facts: dict[str, NodeFacts],
          api_key: bool = False) -> Launch:
    check_inputs(profile, engine)
    nodes = ordered_nodes(profile)
    head = profile.head
    ray_port = engine.dist_port or DEFAULT_RAY_PORT
    secret = ("VLLM_API_KEY",) if api_key else ()

    def spec(node, role, rank, argv, ports, **kw) -> ContainerSpec:
        nf = facts.get(node.name, NodeFacts())
        env = link_env(profile, node, nf)
        env["VLLM_HOST_IP"] = node.link.address
        if len(nodes) > 1:
            env["RAY_memory_monitor_refresh_ms"] = "0"
        env.update(kw.pop("extra_env", {}))
        env = apply_overrides(env, engine.env)
        return ContainerSpec(
            node=node.name, engine=engine.name, role=role, rank=rank, image=engine.image,
            argv=tuple(argv), env=tuple(env.items()), mounts=(model_mount(profile),),
            ports=ports, devices=("/dev/infiniband",) if nf.rdma_devices else (),
            deployment=profile.name, **kw)

    if len(nodes) == 1:
        only = spec(head, "head", 0, serve_argv(profile, engine, "mp"), (engine.port,),
                    secret_env=secret)
        return Launch(engine, (Stage((only,)),), head.name, engine.port, profile.model.repo)

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
               volumes_from=ray_head.name, pid_from=ray_head.name, secret_env=secret,
               extra_env={"RAY_ADDRESS": f"{head.link.address}:{ray_port}"})
    stages = (Stage((ray_head,)), Stage(tuple(workers), wait="ray-nodes"), Stage((api,)))
    return Launch(engine, stages, head.name, engine.port, profile.model.repo)
