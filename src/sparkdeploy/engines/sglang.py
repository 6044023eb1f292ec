"""SGLang across the nodes: one container per node, ``python3 -m sglang.launch_server`` with
``--nnodes N --node-rank R --dist-init-addr <head fast-link ip>:<dist_port>``.

The head (rank 0) starts first; its init port must answer before the workers start. Rank 0
serves the OpenAI API. Each node advertises its own fast-link address (``SGLANG_HOST_IP``):
without it SGLang picks an address by itself, and on a Spark pair that was the Wi-Fi, which
hung NCCL init (FACTS).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparkdeploy.engines.base import (
    API_KEY_ENV,
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

if TYPE_CHECKING:
    from sparkdeploy.profile.config import Engine, Profile

DEFAULT_DIST_PORT = 20000
_VALUED = {"--model-path", "--served-model-name", "--tp-size", "--pp-size", "--nnodes", "--node-rank",
           "--dist-init-addr", "--host", "--port"}
# SGLang takes the key only as --api-key. It reaches the container as a variable handed over
# through --env-file; this launcher, run by the image's python3, appends it to sys.argv and runs
# sglang.launch_server in the same process (what `python3 -m` does). The process's command line
# (/proc/PID/cmdline: ps on the node, docker top, docker inspect Args) is what exec gave it,
# so the key is in no argv anywhere, and not in the environment of the engine's own children.
_WITH_KEY = ("import os, runpy, sys; "
             f"sys.argv += ['--api-key', os.environ.pop('{API_KEY_ENV}')]; "
             "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)")


DIST_READY = r"Init torch distributed ends\."
"""What every SGLang rank logs once torch.distributed and NCCL are up, one node or several
(``ModelRunner.init_torch_distributed`` in python/sglang/srt/model_executor/model_runner.py:
``Init torch distributed ends. elapsed=... s, mem usage=... GB``; older releases print no
``elapsed``)."""


def build(profile: Profile, engine: Engine, facts: dict[str, NodeFacts],
          api_key: bool = False) -> Launch:
    check_inputs(profile, engine)
    nodes = ordered_nodes(profile)
    head = profile.head
    dist_port = engine.dist_port or DEFAULT_DIST_PORT
    specs = []
    for node in nodes:
        role, rank = role_of(profile, node)
        nf = facts.get(node.name, NodeFacts())
        ours = ["--model-path", profile.model.path, "--served-model-name", profile.model.repo,
                "--tp-size", str(engine.tensor_parallel)]  # in full: --tp is only a prefix (FACTS)
        if engine.pipeline_parallel > 1:
            ours += ["--pp-size", str(engine.pipeline_parallel)]
        if len(nodes) > 1:
            ours += ["--nnodes", str(len(nodes)), "--node-rank", str(rank),
                     "--dist-init-addr", f"{head.link.address}:{dist_port}"]
        ours += ["--host", "0.0.0.0", "--port", str(engine.port)]
        run = ["-c", _WITH_KEY] if api_key and rank == 0 else ["-m", "sglang.launch_server"]
        argv = ["python3", *run, *merge_args(ours, list(engine.args), _VALUED)]
        secret = (API_KEY_ENV,) if api_key and rank == 0 else ()
        env = link_env(profile, node, nf)
        env["SGLANG_HOST_IP"] = node.link.address
        env = apply_overrides(env, engine.env)
        ports = (engine.port, dist_port) if rank == 0 and len(nodes) > 1 else \
            (engine.port,) if rank == 0 else ()
        specs.append(ContainerSpec(
            node=node.name, engine=engine.name, role=role, rank=rank, image=engine.image,
            argv=tuple(argv), env=tuple(env.items()), mounts=(model_mount(profile),),
            ports=ports, devices=("/dev/infiniband",) if nf.rdma_devices else (),
            secret_env=secret))
    if len(specs) == 1:
        stages: tuple[Stage, ...] = (Stage((specs[0],)),)
    else:
        stages = (Stage((specs[0],), wait="dist-port"), Stage(tuple(specs[1:])))
    return Launch(engine, stages, head.name, engine.port, profile.model.repo,
                  wait_port=dist_port if len(specs) > 1 else None, dist_ready=DIST_READY)


class SGLang(Kind):
    """SGLang: ``python3 -m sglang.launch_server`` on every node."""

    name = "sglang"
    software = "sglang"
    memory_fraction_flag = "--mem-fraction-static"
    """SGLang's server arguments: the fraction of the GPU's memory for the weights and the KV
    cache pool of this server."""
    image_rule = ImageRule(
        min_version="0.5.9",
        model_files=("sglang/srt/models/qwen3_5.py", "sglang/srt/models/qwen3_5_mtp.py"),
        require_config=True)
    flag_packages = ("packaging",)
    dist_ready = DIST_READY

    def build(self, profile: Profile, engine: Engine, facts: dict[str, NodeFacts],
              api_key: bool = False) -> Launch:
        return build(profile, engine, facts, api_key)


KIND = SGLang()
