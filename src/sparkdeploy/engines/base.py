"""What every serving engine shares: the interface each engine kind implements (``Kind``:
everything about a kind, in its own module), per-node container specs, the link environment,
and the ``docker run`` argv built from a spec.

An engine module turns the profile into a ``Launch``: stages of containers, each stage started
on its nodes and then waited on (SGLang's head opens its init port, Ray reports every node with
its GPU) before the next. Everything is decided here, on the controller, from the profile and
a few facts read from each node (``NodeFacts``: the RoCE GID index, whether RDMA devices
exist), so the exact argv and environment are testable without a node.

The link environment is derived from the profile's fast link (FACTS: working two-Spark setups
set all of these to the fast-link interface and addresses):

- ``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``, ``TP_SOCKET_IFNAME``, ``UCX_NET_DEVICES``: the
  node's fast-link interface;
- ``NCCL_IB_HCA``: every RoCE HCA of the link (both twins of the port, else ~3 GB/s),
  ``NCCL_IB_DISABLE=0``, ``NCCL_IB_GID_INDEX``: the RoCE v2 GID index read from the node's
  sysfs (not assumed to be 3). A node without HCAs gets ``NCCL_IB_DISABLE=1`` instead;
- ``MASTER_ADDR``: the head's fast-link address;
- the engine's own host address (``SGLANG_HOST_IP`` / ``VLLM_HOST_IP``, Ray's node IP): the
  node's own fast-link address, so no rank advertises another interface to its peers.

The profile's engine ``env`` overrides any of them; a null value removes a variable.

Secrets: the API key (``SPARKDEPLOY_API_KEY`` on the controller) is never part of a spec's
argv or env, and the profile's engine ``env`` variables whose names say they are secrets
(``redaction.is_secret_name``: ``HF_TOKEN``, ``*_KEY``, ``*_SECRET``, ``*_PASSWORD``, ...) are never
``--env`` arguments: they go with the API key. A spec names the variables it wants
(``secret_env``) and the starter hands the values to ``docker run --env-file /dev/stdin``
through the ssh process's stdin: no secret is in any command line (ps, the journal, ``docker
inspect``'s Args) and no file holds one on the node; ``serve.persist`` refuses a deployment
that has any. ``docker inspect`` does show them under ``Config.Env``, as it shows every
container variable: reading that needs the node's Docker socket, which is root on that node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from sparkdeploy.core import labels as lbl
from sparkdeploy.core.errors import StepFailed
from sparkdeploy.core.redaction import is_secret_name
from sparkdeploy.engines.rules import Pat, Rule, SequenceRule

if TYPE_CHECKING:  # the profile's types only: config.py reads the kinds from the registry
    from sparkdeploy.profile.config import Engine, Node, Profile

PREFIX = "sparkdeploy"
API_KEY_ENV = "SPARKDEPLOY_API_KEY"
"""The controller's environment variable holding the endpoint's API key (optional)."""

_IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")


class EngineError(StepFailed):
    """The profile cannot be turned into containers; ``str()`` is one line."""


STARTUP = ("containers_running", "dist_init", "port_open", "health", "model_listed",
           "first_token")
"""The startup milestones ``serve.up`` times for every kind, in order, each in seconds from the
engine's start: every container running, the engine's distributed init done (its own log line,
``Kind.dist_ready``), the API port open, ``/health`` 200, the model listed in ``/v1/models``,
the first token of the test completion (the first chunk carrying content; the milestone
sparkrun calls time to first token)."""


@dataclass(frozen=True)
class ImageRule:
    """What an image needs to serve the model with a kind's software, by default (the
    profile's ``images.rules`` overrides it: ``config.EngineRule``)."""

    min_version: str
    model_files: tuple[str, ...] = ()
    """Files of the installed software package the image must hold (the model's classes)."""
    require_config: bool = False
    """Whether the image's transformers must parse the model's config."""


class Kind:
    """One engine kind (``engines[].kind``): everything sparkdeploy knows of it, in its own
    module under ``engines/``, found through the registry (``engines.KINDS``).

    - the container specs: ``build``;
    - how its version is read from an image: ``software`` is the Python distribution whose
      installed metadata ``helpers/probe_image.py`` reads (with ``image_rule.model_files``
      checked in that distribution's directory);
    - its image rule: ``image_rule`` (the default of ``images.rules[software]``);
    - its flag manifests: ``data/engine-flags/<software>-<release>.json`` (``engine_flags``),
      made from its real parser with ``flag_packages`` installed for real (``flagmaker``);
      a new version's manifest is a file there, nothing else;
    - its startup lines: ``dist_ready`` (the ``dist_init`` milestone of ``STARTUP``) and the
      ``Launch``'s stage waits;
    - its diagnosis rules: ``diagnosis``, ``sequence_rules`` and their ``markers``
      (``sparkdeploy.engines.diagnose`` runs them with its own);
    - where its API key goes: ``api_key_env``;
    - what its ``args`` may not say: ``args_problem``.
    """

    name: ClassVar[str]
    """The profile's ``engines[].kind``."""
    software: ClassVar[str]
    """The serving software in the image: its distribution's name (the version probe_image
    reads), the candidates' ``engine:``, the key of ``images.rules`` and the flag manifests'
    prefix. Two kinds may run the same software (vLLM with and without Ray)."""
    image_rule: ClassVar[ImageRule]
    flag_packages: ClassVar[tuple[str, ...]] = ()
    """What ``flagmaker`` installs for real beside the wheel to build the engine's parser."""
    dist_ready: ClassVar[str | None] = None
    """The regular expression a line of the engine's own log matches once its distributed init
    is done; None: it prints none we know."""
    diagnosis: ClassVar[tuple[Rule, ...]] = ()
    """Failure classes only this kind's logs show (with real log lines in the tests)."""
    sequence_rules: ClassVar[tuple[SequenceRule, ...]] = ()
    """Rules over the order of one log's lines that only this kind's logs need."""
    markers: ClassVar[tuple[Pat, ...]] = ()
    """The patterns its sequence rules look for (their keys pick a log's candidate lines)."""
    memory_fraction_flag: ClassVar[str]
    """The flag that bounds the share of the GPU's memory one instance takes (per instance: how
    ``serve.add`` places several models on one node)."""
    api_key_env: ClassVar[str] = API_KEY_ENV
    """The container variable the endpoint's API key reaches the engine in (a secret handed
    over through ``--env-file``, never argv)."""

    def build(self, profile: Profile, engine: Engine, facts: dict[str, NodeFacts],
              api_key: bool = False) -> Launch:
        """The containers of ``engine`` on the profile's nodes, in stages (``Launch``)."""
        raise NotImplementedError

    def args_problem(self, args: list[str]) -> str | None:
        """Why the profile's ``args`` cannot run as this kind (one line), None when they can."""
        return None


def pinned(ref: str) -> bool:
    """Whether ``ref`` names its image by digest (``repo[:tag]@sha256:...``). Such a reference
    resolves only where the image came from a registry: ``docker save``/``load`` keep no repo
    digest, so a node that got the image from another node holds it by ID only."""
    return "@sha256:" in ref


@dataclass(frozen=True)
class NodeFacts:
    """What the specs need to know about a node that the profile does not say."""

    gid_index: int | None = None
    """The RoCE v2 GID index of the fast-link address (``/sys/class/infiniband/...``)."""
    rdma_devices: bool = False
    """``/dev/infiniband`` exists: pass it to the containers (NCCL over RoCE needs it)."""


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = True

    def arg(self) -> str:
        return f"--volume={self.source}:{self.target}" + (":ro" if self.read_only else "")


@dataclass(frozen=True)
class ContainerSpec:
    """One engine container on one node."""

    node: str
    engine: str
    role: str
    """``head``, ``worker`` (``worker1``, ``worker2``, ... with several) or ``api``."""
    rank: int
    image: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    mounts: tuple[Mount, ...] = ()
    ports: tuple[int, ...] = ()
    """Host ports the container listens on (host networking): checked free before starting."""
    gpus: bool = True
    devices: tuple[str, ...] = ()
    volumes: tuple[str, ...] = ()
    """Anonymous volumes (container paths), shared with ``volumes_from`` containers."""
    volumes_from: str | None = None
    pid_from: str | None = None
    """A container whose process namespace this one joins (``--pid=container:NAME``)."""
    secret_env: tuple[str, ...] = ()
    """Variables whose values come from the controller's secrets when the container starts."""
    labels: tuple[tuple[str, str], ...] = ()
    """What the container says about itself on the node (``sparkdeploy.core.labels``): set for
    every engine kind by ``engines.launch``."""
    entrypoint: str | None = None
    """The image's entrypoint replaced (``link.fabric``'s rank runs ``python3`` in the engine's
    image); None: the image's own."""

    @property
    def name(self) -> str:
        return f"{PREFIX}-{self.engine}-{self.role}"

    @property
    def environment(self) -> dict[str, str]:
        return dict(self.env)

    @property
    def engine_args(self) -> tuple[str, ...] | None:
        """What the engine's own argument parser reads (``vllm serve ARGS``, SGLang's
        ``launch_server ARGS``), None for a container that runs no engine (``ray start``)."""
        if self.argv[:2] == ("vllm", "serve"):
            return self.argv[2:]
        if self.argv[:3] == ("python3", "-m", "sglang.launch_server") or (
                self.argv[:2] == ("python3", "-c")):
            return self.argv[3:]
        return None


@dataclass(frozen=True)
class Stage:
    """Containers started together, then a wait before the next stage (``None``: none)."""

    containers: tuple[ContainerSpec, ...]
    wait: str | None = None
    """``dist-port``: the head's init port answers; ``ray-nodes``: Ray lists every node with
    its GPUs at its fast-link address; ``ranks-joined``: every container of the stage printed
    ``joined`` (containers without an API: their rank joined the head, read from their log)."""
    joined: str | None = None
    """The regular expression a ``ranks-joined`` container's log line matches once it joined."""


@dataclass(frozen=True)
class Launch:
    engine: Engine
    stages: tuple[Stage, ...]
    head: str
    port: int
    served_model: str
    wait_port: int | None = None
    """The port of the ``dist-port`` wait (on the head's fast-link address)."""
    dist_ready: str | None = None
    """The regular expression a line of the engine's own log matches once its distributed
    init is done (the startup timing ``dist_init``); None: the engine prints none we know."""

    @property
    def containers(self) -> list[ContainerSpec]:
        return [c for s in self.stages for c in s.containers]

    def on(self, node: str) -> list[ContainerSpec]:
        return [c for c in self.containers if c.node == node]


# --- the environment ----------------------------------------------------------------------


def link_env(profile: Profile, node: Node, facts: NodeFacts) -> dict[str, str]:
    """The fast-link environment of one node (before the engine's and the profile's)."""
    iface = node.link.interface
    env = {
        "NCCL_SOCKET_IFNAME": iface,
        "GLOO_SOCKET_IFNAME": iface,
        "TP_SOCKET_IFNAME": iface,
        "UCX_NET_DEVICES": iface,
    }
    if node.link.hcas:
        env["NCCL_IB_HCA"] = ",".join(node.link.hcas)
        env["NCCL_IB_DISABLE"] = "0"
        if facts.gid_index is not None:
            env["NCCL_IB_GID_INDEX"] = str(facts.gid_index)
    else:
        env["NCCL_IB_DISABLE"] = "1"
    env["MASTER_ADDR"] = profile.head.link.address
    return env


def apply_overrides(env: dict[str, str], overrides: dict[str, str | None]) -> dict[str, str]:
    """The profile's engine ``env`` over the tool's: a value replaces, null removes."""
    out = dict(env)
    for k, v in overrides.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def merge_args(ours: list[str], theirs: list[str], flags_with_value: set[str]) -> list[str]:
    """Our flags, minus any the profile's ``args`` set itself (the profile wins), then theirs."""
    given = {a.split("=", 1)[0] for a in theirs if a.startswith("-")}
    out: list[str] = []
    i = 0
    while i < len(ours):
        a = ours[i]
        takes = a in flags_with_value
        if a.startswith("-") and a in given:
            i += 2 if takes else 1
            continue
        out.append(a)
        if takes:
            out.append(ours[i + 1])
            i += 2
        else:
            i += 1
    return [*out, *theirs]


def check_inputs(profile: Profile, engine: Engine) -> None:
    if not _IMAGE.match(engine.image):
        raise EngineError(f"engines.{engine.name}.image: {engine.image!r} is not an image reference")
    if not profile.model.path.startswith("/"):
        raise EngineError(f"model.path: {profile.model.path!r} must be an absolute path")


def role_of(profile: Profile, node: Node) -> tuple[str, int]:
    """(role, rank): the head is rank 0; workers 1.. in profile order, suffixed when several."""
    if node.role == "head":
        return "head", 0
    workers = profile.workers
    rank = workers.index(node) + 1
    return ("worker" if len(workers) == 1 else f"worker{rank}"), rank


def ordered_nodes(profile: Profile) -> list[Node]:
    """The head first, then the workers in profile order (the ranks)."""
    return [profile.head, *profile.workers]


def model_mount(profile: Profile) -> Mount:
    return Mount(profile.model.path, profile.model.path, read_only=True)


# --- docker argv ------------------------------------------------------------------------


def run_args(spec: ContainerSpec, *, detach: bool = True, remove: bool = False,
             env_file: str | None = None, started: dict[str, str] | None = None) -> list[str]:
    """``docker run`` arguments (after ``docker -H ...``) for a spec.

    ``env_file`` is where docker reads the secret variables (``/dev/stdin`` when serve.up
    pipes them in); ``started``: the labels saying when and by what (``labels.started``; a
    persisted unit's supervisor adds its own when it starts the container); single-argument
    ``--flag=value`` forms so no value is read as a flag."""
    argv = ["run"]
    if detach:
        argv.append("--detach")
    if remove:
        argv.append("--rm")
    argv += [
        f"--name={spec.name}",
        *lbl.args({**dict(spec.labels), **(started or {})}),
        "--network=host",
        "--ipc=host",
        "--ulimit=memlock=-1",
        "--ulimit=stack=67108864",
    ]
    if spec.gpus:
        argv.append("--gpus=all")
    argv += [f"--device={d}" for d in spec.devices]
    argv += [m.arg() for m in spec.mounts]
    argv += [f"--volume={v}" for v in spec.volumes]
    if spec.volumes_from:
        argv.append(f"--volumes-from={spec.volumes_from}")
    if spec.pid_from:
        argv.append(f"--pid=container:{spec.pid_from}")
    if env_file and (spec.secret_env or profile_secrets(spec)):
        argv.append(f"--env-file={env_file}")
    argv += [f"--env={k}={v}" for k, v in spec.env if not is_secret_name(k)]
    if spec.entrypoint:
        argv.append(f"--entrypoint={spec.entrypoint}")
    return [*argv, spec.image, *spec.argv]


def profile_secrets(spec: ContainerSpec) -> dict[str, str]:
    """The secret variables the profile's engine ``env`` gives a spec."""
    return {k: v for k, v in spec.env if is_secret_name(k)}


def secret_lines(spec: ContainerSpec, secrets: dict[str, str]) -> str:
    """The ``--env-file`` content for a spec's secret variables (only those that are set): the
    profile's engine ``env`` secrets, and the controller's secrets the spec names."""
    values = {**profile_secrets(spec), **{k: secrets[k] for k in spec.secret_env if secrets.get(k)}}
    return "".join(f"{k}={v}\n" for k, v in values.items())
