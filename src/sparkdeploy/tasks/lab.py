"""`inv lab.*`: the rehearsal lab (Linux, root): simulated Spark nodes on this machine."""

from invoke import Collection
from invoke.exceptions import Exit

from sparkdeploy.lab import faults, layout, lifecycle
from sparkdeploy.steps.registry import StepContext, run_one
from sparkdeploy.tasks import _flags as flags
from sparkdeploy.tasks._common import drive
from sparkdeploy.tasks._flags import task


@task(help={"nodes": "how many nodes (spark1..sparkN; default 2)",
            "seed_worker": "also give the workers the derivative's base image (delta-ship tests)",
            "dockerd": "each node's Docker daemon: docker26 (default), classic20 (bookworm's "
                       "20.10) or containerd (Docker 26 on the containerd image store); or one "
                       "per node, comma-separated",
            "mgmt_net": "the management /24: 'fallback' forces the first fallback, or one of "
                        + ", ".join(layout.MGMT_CANDIDATES)
                        + " (default: the recorded one; a lab on another is moved in place)",
            "real_engine": "also build the real vLLM (0.32.0, built for the CPU) on the head, for "
                           "the lab-tiny recipe (about 1.5 GB of wheels and 3 min the first time)"})
def up(c, nodes=None, dockerd=layout.DEFAULT_DOCKERD, seed_worker=False, mgmt_net=None,
       real_engine=False):
    """Bring the lab up, or check it is up (idempotent; says what changed as it goes)."""
    n = flags.integer("--nodes", nodes, default=2, min=1, max=9)
    try:
        layout.node_dockerds(dockerd, n)
    except ValueError as e:
        raise Exit(str(e), code=2) from None
    if mgmt_net not in (None, "fallback", *layout.MGMT_CANDIDATES):
        raise Exit(f"--mgmt-net: must be 'fallback' or one of {', '.join(layout.MGMT_CANDIDATES)}, "
                   f"not {mgmt_net!r}", code=2)
    drive(c, "lab.up", lambda dep, events: lifecycle.up(
        nodes=n, flavor=dockerd, seed_worker=seed_worker, mgmt_net=mgmt_net, events=events,
        real_engine=real_engine),
        deployment="none")


@task(default=True)
def status(c):
    """Show the lab's nodes, addresses, daemons and images per node."""
    drive(c, "lab.status", lambda dep, events: lifecycle.status(events=events),
          deployment="none")


@task
def down(c):
    """Stop what the lab started and remove its namespaces, links, mounts and data (keeps caches)."""
    drive(c, "lab.down", lambda dep, events: lifecycle.down(events=events), deployment="none")


@task(help={"name": "sglang-hang (SGLang's ranks hang in init even when all is right), "
                    "engine-hang (every engine serving --model hangs in init), "
                    "oom-at-load (engines run out of GPU memory loading weights), rank-wedged "
                    "(SIGSTOP a node's engine containers now), rank-exit (SIGKILL their engine "
                    "process now), memory-small (the node reports 1 GiB usable memory), the "
                    "link faults mtu-mismatch, address-missing, twin-down, link-throttled, "
                    "second-interface, interface-down (docs/link.md), or none to clear every fault",
            "nodes": "the node rank-wedged, rank-exit, memory-small and the link faults act on "
                     "(default: the last node)", "node": "deprecated: --nodes",
            "model": "the model engine-hang hangs (its hub repo, as the profile's model.repo)"})
def fault(c, name, nodes=None, node=None, model=None):
    """Force a failure the lab's stand-ins show until `inv lab.fault none` (lasts across lab.up)."""
    names = [*faults.FAULTS, *faults.ACTIONS]
    if name != "none" and name not in names:
        raise flags.usage("NAME", f"unknown fault {name!r} (one of none, {', '.join(names)})")
    if (name == "engine-hang") != bool(model):
        raise flags.usage("--model", "engine-hang needs it (the model's hub repo, as the "
                          "profile's model.repo), and only engine-hang takes it")
    flag, node = flags.nodes(nodes, node=node)
    if node is not None and (name not in faults.ACTIONS or node not in faults.nodes()):
        raise flags.usage(flag, f"{node!r}: only with {' or '.join(faults.ACTIONS)}, and one "
                          f"of the lab's nodes ({', '.join(faults.nodes()) or 'none'})")
    if node is not None and flag != flags.NODES:
        flags.deprecated(flag, node)
    def body(ctx: StepContext) -> None:
        for r in faults.set_fault(name, node=node, model=model or None):
            ctx.report(r)

    drive(c, "lab.fault", lambda dep, events: run_one(None, "lab.fault", events=events, body=body),
          deployment="none", live=False)


ns = Collection("lab", up, status, down, fault)
