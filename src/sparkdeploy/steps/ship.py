"""``image.ship``: copy an image node to node over the fast link, sending only missing layers.

For each peer: compare the image's diff IDs on the source with every layer the peer's Docker daemon
already holds, check the peer's free disk, then stream a ``docker load`` archive of what the peer
lacks into the peer's Docker daemon over ssh, with no temp file of the image on either side. The
archive comes from one of three places, the first that serves:

1. the source's store (``helpers/layer_export.py``): on a classic-store source, the missing
   layers' tars are rebuilt from Docker's own record of them (tar-split + the layer directory);
   on a containerd-store source, the missing layers' blobs are read from containerd's content
   store as they are kept there (their files, or ``ctr content get``). Either way the time
   follows the missing bytes, not the image;
2. ``docker save IMAGE | save_filter.py``: the whole image read, the layers the peer has dropped
   from the stream (a store the helper cannot read: another storage driver, no ``ctr``, no
   access);
3. the whole ``docker save`` archive (through the filter as a counting pass-through): a peer that
   refused a partial archive, or one on the containerd image store whose content store could
   not be listed.

A containerd-store peer refuses docker save's partial archive (its import wants every layer file
the manifest names), but takes an OCI image layout whose manifest names blobs its content store
already holds: for it the helper writes that layout, sending each layer whose very blob
(``ctr content ls``: the ``containerd.io/uncompressed`` label names its diff ID) it lacks.

Which one ran, and why not an earlier one, is in the result. A ship succeeds only when the peer
lists the image under its tag with the source's diff IDs (and, on the classic store, the same
config digest). ``docker load`` tags only after the whole archive arrived, so a killed transfer
leaves nothing tagged and a re-run completes; nothing listens and nothing runs after the ship.
With several peers the ship is a tree (``sparkdeploy.node.fanout``): peers that have the image serve
the next ones, one each per round, so the holders double each round.
"""

from __future__ import annotations

import json
import shlex
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sparkdeploy.core import threads
from sparkdeploy.core.fingerprint import Fingerprint
from sparkdeploy.core.outcomes import Result
from sparkdeploy.core.outside import parsed
from sparkdeploy.node import fanout
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.fanout import Outcome
from sparkdeploy.node.hosts import CmdResult, Feed, Host, HostError, NodeUnreachable, peer_ssh_argv
from sparkdeploy.node.nodeops import (
    HelperFailed,
    check_staged,
    docker,
    free_space,
    helper_error,
    inspect_image,
    listed_tags,
    parse_progress,
    parse_report,
    stage,
    stage_script,
    tagged,
    verified,
    watched,
)
from sparkdeploy.ops.image import STEP_BUILD, chosen, chosen_image, image_id, pinned
from sparkdeploy.steps.registry import StepContext, step

STEP = "image.ship"
CONTAINERD = "io.containerd.snapshotter.v1"
FILTER_PYTHON = (3, 8)
"""The oldest python3 helpers/save_filter.py runs on (checked on the source before shipping)."""
STAGED_CHANGED = 97
"""Exit status of a pipeline whose staged helper no longer matches its sha256 (not run)."""
MASTER_SH = """d=$(mktemp -d "${TMPDIR:-/tmp}/sparkdeploy-ship.XXXXXXXX") || exit 1
trap 'rm -rf "$d"' EXIT
trap 'exit 143' TERM HUP INT
printf 'socket %s\\n' "$d/m" >&2
a=$1; shift
"$@" -M -S "$d/m" -N -o PermitLocalCommand=yes -o 'LocalCommand=echo ready >&2' -- "$a" &
wait "$!"
"""
"""The source's ssh master connection to the peer (``LinkMaster``), its socket in a private
temporary directory removed when it ends; ``ready`` on stderr once it is connected."""
STORE_DRIVERS = ("overlay2", "vfs")
"""Classic-store drivers whose layers ``layer_export.py`` reads (by cache-id, see the helper)."""
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
"""Where dockerd finds containerd when ``docker info`` does not say (before API 1.46, Docker
27): the ``--containerd`` of the docker.service units of Docker's packages and Debian's."""
CONTAINERD_NAMESPACE = "moby"
CONTAINERD_DRIVER = "containerd"
"""``layer_export.py``'s ``--driver`` for the containerd image store (its blobs, read with ctr)."""


@dataclass
class DockerDaemon:
    """A node's Docker daemon as shipping sees it: its image store, root dir and layers."""

    containerd_store: bool
    root_dir: str
    driver: str = ""
    chains: list[list[str]] = field(default_factory=list)
    """The layer list (diff IDs, base first) of every image the daemon holds."""
    containerd_address: str = CONTAINERD_SOCKET
    containerd_namespace: str = CONTAINERD_NAMESPACE
    """Where the containerd image store's content is read (``docker info``'s ``Containerd``)."""

    blobs: list[str] | None = None
    """On the containerd store: the blobs in its content store that unpack to a layer the image
    names (a partial archive's manifest may name them; None when they could not be listed)."""
    blobs_why: str = ""

    @property
    def store(self) -> str:
        """What ``layer_export.py`` reads the layers from, in words."""
        return "content store" if self.containerd_store else "layer store"


def daemon_facts(host: Host, layers: bool = True) -> DockerDaemon:
    """The daemon's store, root dir and driver (``docker info``) and, with ``layers``, the layer
    list of every image it holds (asked at the same time)."""
    with threads.pool(2) as p:
        info_run = p.submit(host.run, docker(host, "info", "--format", "{{json .}}"), change=False)
        layers_run = p.submit(lambda: layers_on(host) if layers else [])
    r, chains = info_run.result(), layers_run.result()
    if not r.ok:
        raise HostError(f"{host.name}: docker info failed: {r.one_line_error()}")
    info = parsed(r.stdout, f"{host.name}: docker info")
    status = info.get("DriverStatus") or []
    containerd = any(CONTAINERD in str(v) for pair in status for v in pair)
    got = info.get("Containerd")
    ctd = got if isinstance(got, dict) else {}
    got = ctd.get("Namespaces")
    spaces = got if isinstance(got, dict) else {}
    return DockerDaemon(containerd, info.get("DockerRootDir") or "/var/lib/docker",
                        str(info.get("Driver") or ""), chains,
                        str(ctd.get("Address") or CONTAINERD_SOCKET),
                        str(spaces.get("Containers") or CONTAINERD_NAMESPACE))


def peer_facts(host: Host, layers: list[str]) -> DockerDaemon:
    """``daemon_facts`` and, on the containerd store, which of the image's layers its content
    store holds: ``ctr content ls``, whose ``containerd.io/uncompressed`` label names the diff ID
    a blob unpacks to, and where a blob's digest is a diff ID, a plain tar of it (under ``sudo``
    where the node needs it for containerd's socket)."""
    facts = daemon_facts(host)
    if not facts.containerd_store:
        return facts
    r = host.run(["ctr", f"--address={facts.containerd_address}",
                  f"--namespace={facts.containerd_namespace}", "content", "ls"],
                 change=False, sudo=True)
    if not r.ok:
        facts.blobs_why = r.one_line_error()
        return facts
    want, blobs = set(layers), set()
    for line in r.stdout.splitlines()[1:]:
        words = line.split()
        if words and words[0] in want:
            # a plain tar's digest is its diff ID; such a blob is not always labelled (an import
            # whose layer was unpacked already, from another blob, adds none)
            blobs.add(words[0])
        for label in (words[-1].split(",") if len(words) > 1 else []):
            key, _, value = label.partition("=")
            if key == "containerd.io/uncompressed" and value in want:
                blobs.add(words[0])
    facts.blobs = sorted(blobs)
    return facts


def source_store(host: Host, info: dict) -> DockerDaemon:
    """The source's store as far as reading its layers needs it: on overlay2 the image's own
    ``GraphDriver`` names the driver and, in its ``UpperDir``, the Docker root
    (``<root>/overlay2/<cache-id>/diff``), which spares a ``docker info`` (the slowest probe of a
    small delta's ship); otherwise ``docker info`` says."""
    graph = info.get("GraphDriver") or {}
    upper = str((graph.get("Data") or {}).get("UpperDir") or "")
    if graph.get("Name") == "overlay2" and "/overlay2/" in upper and upper.startswith("/"):
        return DockerDaemon(False, upper.rsplit("/overlay2/", 1)[0], "overlay2")
    return daemon_facts(host, layers=False)


def layers_on(host: Host) -> list[list[str]]:
    """The layer list of every image the node's Docker daemon holds."""
    ids = host.run(docker(host, "image", "ls", "-a", "-q", "--no-trunc"), change=False)
    uniq = sorted({x for x in ids.stdout.split() if x}) if ids.ok else []
    if not uniq:
        return []
    r = host.run(docker(host, "image", "inspect", "--format", "{{json .RootFS.Layers}}", *uniq),
                 change=False)
    chains: list[list[str]] = []
    for line in r.stdout.splitlines():
        line = line.strip()
        if line and line != "null":
            chains.append(parsed(line, f"{host.name}: docker image inspect"))
    return chains


def layer_sizes(host: Host, ref: str, layers: list[str], total: int) -> list[int]:
    """Uncompressed size per layer, oldest first (from ``docker history``); a proportional guess
    when history and layers do not line up."""
    r = host.run(docker(host, "history", "--no-trunc", "--human=false", "--format", "{{.Size}}", ref),
                 change=False)
    sizes = [int(x) for x in r.stdout.split() if x.isdigit() and int(x) > 0] if r.ok else []
    sizes.reverse()
    if len(sizes) == len(layers):
        return sizes
    return [total // max(len(layers), 1)] * len(layers)


def python_version(host: Host) -> tuple[int, int] | None:
    """The node's ``python3`` version, or None when it has none that runs."""
    r = host.run(["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                 change=False)
    try:
        major, minor = r.stdout.strip().split(".")
        return (int(major), int(minor)) if r.ok else None
    except ValueError:
        return None


def have_prefix(layers: list[str], chains: list[list[str]]) -> int:
    """How many leading layers the peer holds as one chain: docker load skips a layer only when
    the peer has the layer's whole chain (every layer below it, in order), so the prefix is the
    longest one an image on the peer shares with ``layers``."""
    best = 0
    for chain in chains:
        n = 0
        for mine, theirs in zip(layers, chain, strict=False):
            if mine != theirs:
                break
            n += 1
        best = max(best, n)
    return best


def pipeline(src: Host, peer: Host, ref: str, filter_path: str | None, layers_file: str | None,
             have_file: str | None, compression: str, control: str | None = None) -> list[str]:
    """The argv (``bash -c``) the source runs to stream ``docker save`` of the image, filtered,
    into the peer's Docker daemon."""
    stages = [docker(src, "save", ref)]
    staged: list[str] = []
    if filter_path:
        staged = [p for p in (filter_path, layers_file, have_file) if p]
        lists = [*(["--layers-file", layers_file] if layers_file else []),
                 *(["--have-file", have_file] if have_file else [])]
        # without lists the filter drops nothing: a byte-for-byte pass-through that counts
        stages.append(["python3", filter_path, *lists, "--progress", "1"])
    return _into_peer(peer, stages, staged, compression, control)


def export_argv(src: Host, export_path: str, layers_file: str, facts: DockerDaemon, image_id: str,
                ref: str, have: int, *, check: bool = False, holds: str | None = None) -> list[str]:
    """``layer_export.py`` on the source: the archive of the layers after the first ``have``
    (``check``: only whether the store can be read). Values ride in ``--opt=value`` form, so none
    is read as an option; under ``sudo`` where the node needs it to read the Docker root. ``-I
    -S``: the helper is standard library only, so Python skips the environment and site-packages
    (a quarter of its start-up time on a small delta's ship)."""
    store = ([f"--driver={CONTAINERD_DRIVER}", f"--containerd={facts.containerd_address}",
              f"--namespace={facts.containerd_namespace}"] if facts.containerd_store
             else [f"--root={facts.root_dir}", f"--driver={facts.driver}"])
    argv = ["python3", "-I", "-S", export_path, *store, f"--image-id={image_id}",
            f"--ref={tagged(ref)}", f"--layers-file={layers_file}",
            f"--have={have}",
            # a containerd-store peer: an OCI layout naming the blobs it holds (``holds``)
            *(["--format=oci", f"--peer-holds={holds}"] if holds else []),
            *(["--check"] if check else ["--progress=1"])]
    return ["sudo", "-n", "--", *argv] if src.node.privilege == "sudo" else argv


def export_pipeline(src: Host, peer: Host, export_path: str, layers_file: str,
                    facts: DockerDaemon, image_id: str, ref: str, have: int,
                    compression: str, control: str | None = None,
                    holds: str | None = None) -> list[str]:
    """The argv (``bash -c``) the source runs to stream the missing layers, read from its layer
    store, into the peer's Docker daemon."""
    stages = [export_argv(src, export_path, layers_file, facts, image_id, ref, have, holds=holds)]
    staged = [export_path, layers_file, *([holds] if holds else [])]
    return _into_peer(peer, stages, staged, compression, control)


class LinkMaster:
    """An ssh master connection from the source to the peer's link address, opened while the
    ship asks both nodes what it needs, so that the transfer's ssh skips its handshake (a fifth
    of a small delta's ship here). It lives only as long as the ship: a watched job on the
    source, ended by ``close`` or by the controller's end. If it is not ready in time, or fails,
    the transfer connects by itself and meets the same error, if any."""

    def __init__(self, src: Host, peer: Host) -> None:
        self._feed = Feed()
        self._path: str | None = None
        self.socket: str | None = None
        self._ready = threading.Event()
        argv = watched(["bash", "-c", MASTER_SH, "master", peer.node.link.address, *peer_ssh_argv()])
        self._thread = threading.Thread(target=self._run, args=(src, argv), daemon=True)
        self._thread.start()

    def _run(self, src: Host, argv: list[str]) -> None:
        try:
            src.run(argv, input=self._feed, on_stderr=self._line, timeout=6 * 3600)
        except (HostError, NodeUnreachable):
            pass  # the ship's own commands meet it and say so
        finally:
            self._ready.set()

    def _line(self, line: str) -> None:
        if line.startswith("socket "):
            self._path = line.removeprefix("socket ").strip()
        elif line.strip() == "ready" and self._path:
            self.socket = self._path
            self._ready.set()

    def wait(self, timeout: float = 5.0) -> str | None:
        """The master's socket once it is connected, else None (the transfer connects itself)."""
        self._ready.wait(timeout)
        return self.socket

    def end(self) -> None:
        """Tell the master to end (``close`` waits for it)."""
        self._feed.close()

    def close(self) -> None:
        self._feed.close()
        self._thread.join(60)


def _into_peer(peer: Host, stages: list[list[str]], staged: list[str], compression: str,
               control: str | None = None) -> list[str]:
    # the staged helpers and their lists run only as staged (their sha256 checked first)
    checks = "".join(check_staged(p) + "; " for p in staged)
    remote = shlex.join(docker(peer, "load"))
    if compression == "zstd":
        stages = [*stages, ["zstd", "-q", "-T0", "-3", "-c"]]
        remote = f"zstd -q -d -c | {remote}"
    # through the master connection when there is one (no handshake of its own)
    via = ["-o", "ControlMaster=no", "-S", control] if control else []
    stages = [*stages, [*peer_ssh_argv(), *via, "--", peer.node.link.address, remote]]
    return ["bash", "-c", checks + "set -o pipefail; " + " | ".join(shlex.join(s) for s in stages)]


class SaveReport(BaseModel):
    """The report ``save_filter.py`` writes last on stderr (its stdout is the archive)."""

    model_config = ConfigDict(extra="allow")
    bytes_in: int = Field(0, ge=0)
    bytes_out: int = Field(0, ge=0)


def _report(stderr: str) -> dict[str, Any]:
    """The filter's last report that fits ``SaveReport`` (as set), else {} (it said none)."""
    for line in reversed(stderr.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return parse_report(SaveReport, line, "save_filter.py").model_dump(exclude_unset=True)
            except HelperFailed:
                continue
    return {}


def verify(peer: Host, ref: str, src_info: dict, by_id: bool, info: dict | None,
           tags: set[str]) -> str | None:
    """None when the peer holds the image as the source does (``info``: its ``docker image
    inspect`` of ``ref``; ``tags``: every tag it lists; ``by_id``: both ends on the classic
    store, where the image ID is the config digest), else what differs."""
    want_layers = src_info["RootFS"]["Layers"]
    if info is None:
        return f"{peer.name} has no {ref}"
    got_layers = info.get("RootFS", {}).get("Layers")
    if got_layers != want_layers:
        return f"diff IDs differ: source {want_layers}, {peer.name} {got_layers}"
    if by_id and info["Id"] != src_info["Id"]:
        return f"config digest differs: source {src_info['Id']}, {peer.name} {info['Id']}"
    if ref.startswith("sha256:"):
        return None  # an image shipped by ID (a digest pin): no tag to list
    if tagged(ref) not in tags:
        return f"{peer.name} does not list {tagged(ref)} (an incomplete image?)"
    return None


def ship_one(ctx: StepContext, src: Host, peer: Host, ref: str, src_info: dict,
             src_is_head: bool = True, master: LinkMaster | None = None) -> Result:
    """Ship ``ref`` from ``src`` to ``peer``; one result, reported as soon as it is known (a
    node that cannot be reached is left to the fan-out: one failed result for it)."""
    with ctx.failing(HostError, node=peer.name) as caught:  # never a node that cannot be reached
        return _ship_one(ctx, src, peer, ref, src_info, src_is_head, master)
    assert caught.result is not None
    return caught.result


def store_read(src: Host, export_path: str, layers_file: str, facts: DockerDaemon, image_id: str,
               ref: str, have: int) -> str | None:
    """None when ``layer_export.py`` can read the missing layers from the source's layer store,
    else why not (its own ``error:`` line)."""
    r = src.run(verified([export_path, layers_file],
                         export_argv(src, export_path, layers_file, facts, image_id, ref, have,
                                     check=True)), change=False)
    if r.ok:
        return None
    if r.exit_code == STAGED_CHANGED:
        raise HostError(f"{src.name}: {r.one_line_error()}")
    return helper_error(r.stderr, r.one_line_error())


def _ship_one(ctx: StepContext, src: Host, peer: Host, ref: str, src_info: dict,
              src_is_head: bool, master: LinkMaster | None) -> Result:
    # the source connects to the peer while both are asked what the ship needs (unless the
    # connection was opened earlier still)
    if master is None and not ctx.dep.dry:
        master = LinkMaster(src, peer)
    try:
        return _ship(ctx, src, peer, ref, src_info, src_is_head, master)
    finally:
        if master is not None:
            master.close()


@dataclass
class Plan:
    """What one ship will send, and how: decided from both nodes' answers."""

    prefix: int
    """Leading layers the peer holds as one chain (not sent)."""
    by_id: bool
    """Both ends on the classic store: the image ID is the config digest on both."""
    filter_runs: bool
    src_facts: DockerDaemon
    layers_file: str
    export_path: str | None
    """The staged ``layer_export.py`` when the layers are read from the source's store."""
    why_full: str
    why_save: str
    what: str
    peer_blobs: list[str] | None = None
    """A containerd-store peer's blobs of the image's layers: the archive is an OCI layout."""


def _ship(ctx: StepContext, src: Host, peer: Host, ref: str, src_info: dict, src_is_head: bool,
          master: LinkMaster | None) -> Result:
    dep = ctx.dep
    plan = _plan(ctx, src, peer, ref, src_info, src_is_head)
    if isinstance(plan, Result):
        return plan
    if dep.dry:
        return ctx.skipped(f"would send {ref} from {src.name} to {peer.name}: {plan.what}",
                       peer.name)
    started = dep.clock()
    ctx.log(peer.name, f"sending {ref} from {src.name}: {plan.what}")
    r, way, notes, read = _send(ctx, src, peer, ref, src_info, plan,
                                master.wait() if master else None)
    if master is not None:
        master.end()  # no more transfers: it ends while the peer is checked
    note = "".join(f"; {n}" for n in notes)
    if notes and r.ok:
        note += f", sent it {'whole' if way == 'full' else 'through docker save'}"
    if r.exit_code == STAGED_CHANGED:
        return ctx.failed(f"{src.name}: {r.one_line_error()}", src.name)
    if not r.ok:
        return ctx.failed(f"transfer to {peer.name} failed: {r.one_line_error()}{note}", peer.name)
    report = _report(r.stderr)
    if read:
        done = int(report.get("bytes_out" if way == "store" else "bytes_in") or read)
        ctx.progress(peer.name, done, done, "B", f"from {src.name}")
    ctx.log(peer.name, f"checking {ref} on {peer.name}")
    with threads.pool(2) as p:
        held_run, tags_run = p.submit(inspect_image, peer, ref), p.submit(listed_tags, peer)
    held, tags = held_run.result(), tags_run.result()
    problem = verify(peer, ref, src_info, plan.by_id, held, tags)
    if problem:
        return ctx.failed(f"after the transfer: {problem}{note}", peer.name)
    return _sent(ctx, src, peer, ref, src_info, plan, way, report, dep.clock() - started, note,
                 notes)


def _plan(ctx: StepContext, src: Host, peer: Host, ref: str, src_info: dict,
          src_is_head: bool) -> Plan | Result:
    """Ask both nodes (at once: a small delta's ship is mostly these round trips) and decide
    what to send and how; a result instead when there is nothing to send or no room for it."""
    layers = src_info["RootFS"]["Layers"]
    with threads.pool(8) as p:
        asked = (p.submit(peer_facts, peer, layers), p.submit(inspect_image, peer, ref),
                 p.submit(listed_tags, peer), p.submit(python_version, src),
                 p.submit(layer_sizes, src, ref, layers, int(src_info.get("Size") or 0)),
                 # a peer serving the next reads its own store, not the head's
                 p.submit(lambda: source_store(src, src_info if src_is_head else
                                               inspect_image(src, ref) or {})),
                 p.submit(stage, src, "layers.json", json.dumps(layers)),
                 p.submit(stage_script, src, "layer_export.py"))
    # each answer in that order (the first error among them raised once all have ended)
    facts, held, tags, py = (asked[0].result(), asked[1].result(), asked[2].result(),
                             asked[3].result())
    sizes, src_facts, layers_file, staged_export = (asked[4].result(), asked[5].result(),
                                                    asked[6].result(), asked[7].result())
    # an image's ID is its config digest on the classic store, its manifest's on containerd's
    by_id = not (facts.containerd_store or src_facts.containerd_store)
    if verify(peer, ref, src_info, by_id, held, tags) is None:
        return ctx.ok(f"{peer.name} already has {ref} ({src_info['Id'][:19]})", peer.name)
    # a containerd-store peer takes a partial archive only as an OCI layout naming blobs it holds
    listed = not facts.containerd_store or facts.blobs is not None
    prefix = have_prefix(layers, facts.chains) if listed else 0
    # the helpers run on the source: its python3 must be new enough (else: send it whole, and
    # without the filter's byte count)
    filter_runs = py is not None and py >= FILTER_PYTHON
    old_python = ""
    if prefix and not filter_runs:
        have = "no python3" if py is None else f"python3 {py[0]}.{py[1]}"
        old_python = (f"{src.name} has {have}, the ship's helpers need "
                      f"{FILTER_PYTHON[0]}.{FILTER_PYTHON[1]}+")
        prefix = 0
    missing = sum(sizes[prefix:])
    got = free_space(peer, facts.root_dir)
    free = got[0] if got else None
    need = 2 * missing  # the archive is unpacked to a temp dir, then applied
    if free is not None and free < need:
        return ctx.failed(f"{peer.name} has {free / 1e9:.1f} GB free in {facts.root_dir}, needs "
                      f"about {need / 1e9:.1f} GB for {ref}", peer.name)
    why_full = (f"the peer uses the containerd image store, whose content could not be listed: "
                f"{facts.blobs_why}" if not listed
                else old_python or ("the peer has none of its layers" if prefix == 0 else ""))
    export_path, why_save = _store_or_why(ctx, src, ref, src_info, src_facts, staged_export,
                                          layers_file, prefix, listed and filter_runs)
    via = (f"read from {src.name}'s {src_facts.store}" if export_path
           else f"through docker save: {why_save}" if prefix else "")
    what = (f"{prefix} of {len(layers)} layers already there, ~{missing / 1e6:.0f} MB, {via}"
            if prefix else f"whole ({why_full}), ~{missing / 1e6:.0f} MB"
            + (f", {via}" if export_path else ""))
    return Plan(prefix, by_id, filter_runs, src_facts, layers_file, export_path,
                why_full, why_save, what, facts.blobs if facts.containerd_store else None)


def _store_or_why(ctx: StepContext, src: Host, ref: str, src_info: dict, src_facts: DockerDaemon,
                  staged_export: str, layers_file: str, prefix: int,
                  applies: bool) -> tuple[str | None, str]:
    """(the staged helper, "") when the ship reads its layers from the source's store (a ship to
    a classic-store peer: faster than docker save, and only the missing ones), else (None, why
    not; "" when it does not apply)."""
    if not applies:
        return None, ""
    if not src_facts.containerd_store and src_facts.driver not in STORE_DRIVERS:
        return None, f"{src.name}'s storage driver {src_facts.driver or '?'} is not read directly"
    if ctx.dep.dry:
        # a real run learns it from the export itself (which falls back on its own)
        why = store_read(src, staged_export, layers_file, src_facts, src_info["Id"], ref, prefix)
        if why:
            return None, why
    return staged_export, ""


def _send(ctx: StepContext, src: Host, peer: Host, ref: str, src_info: dict, plan: Plan,
          control: str | None) -> tuple[CmdResult, str, list[str], int]:
    """Send by the best way, each that fails handing over to the next: (the last run, its way,
    a note per way that failed, the bytes its progress counted)."""
    compression = ctx.dep.profile.images.ship_compression
    prefix, layers = plan.prefix, src_info["RootFS"]["Layers"]
    estimate = [int(src_info.get("Size") or 0)]
    read = [0]

    def on_line(line: str) -> None:
        if (p := parse_progress(line)) is not None:
            read[0] = int(p.get("bytes", 0))
            if "total" in p:
                estimate[0] = int(p["total"])
            # the image's size is an estimate of the archive's (tar headers add a little): past
            # it, the total is unknown until the archive ends
            total = estimate[0] if read[0] <= estimate[0] else None
            ctx.progress(peer.name, read[0], total, "B", f"from {src.name}")

    ways: list[tuple[str, Callable[[], list[str]]]] = []
    if plan.export_path:
        export = plan.export_path

        def from_store() -> list[str]:
            holds = (None if plan.peer_blobs is None
                     else stage(src, "peer-blobs.json", json.dumps(plan.peer_blobs)))
            return export_pipeline(src, peer, export, plan.layers_file, plan.src_facts,
                                   src_info["Id"], ref, prefix, compression, control, holds)
        ways.append(("store", from_store))
    if prefix and plan.peer_blobs is None:  # (a containerd-store peer refuses docker save's)
        def filtered() -> list[str]:
            have_file = stage(src, "have.json", json.dumps(layers[:prefix]))
            return pipeline(src, peer, ref, stage_script(src, "save_filter.py"), plan.layers_file,
                            have_file, compression, control)
        ways.append(("save", filtered))
    # the filter runs on full ships too, as a pass-through, so that they show progress
    ways.append(("full", lambda: pipeline(
        src, peer, ref, stage_script(src, "save_filter.py") if plan.filter_runs else None, None,
        None, compression, control)))
    notes: list[str] = []
    for way, argv in ways:
        read[0] = 0
        # stdin stays open while the ship runs: its end (this controller or its connection gone)
        # ends the pipeline on the source, so the peer's load gets a cut archive and tags nothing
        feed = Feed()
        try:
            r = src.run(watched(argv()), on_stderr=on_line, input=feed, timeout=6 * 3600)
        finally:
            feed.close()
        if r.ok or r.exit_code == STAGED_CHANGED or way == "full":
            return r, way, notes, read[0]
        if way == "save":
            what_failed = "the peer refused the partial archive"
        elif any(ln.startswith("error: ") for ln in r.stderr.splitlines()):
            what_failed = f"reading the {plan.src_facts.store}"  # the helper said why
        else:
            what_failed = f"the peer refused the {plan.src_facts.store}'s archive"
        notes.append(f"{what_failed} ({helper_error(r.stderr, r.one_line_error())})")
    raise AssertionError("the whole archive is always the last way")


def _sent(ctx: StepContext, src: Host, peer: Host, ref: str, src_info: dict, plan: Plan, way: str,
          report: dict[str, Any], secs: float, note: str, notes: list[str]) -> Result:
    """The result of a ship that arrived and checked out."""
    sent = report.get("bytes_out")
    if way == "store":
        sent_txt = f"{(sent or 0) / 1e6:.0f} MB read from {src.name}'s {plan.src_facts.store}"
    elif way == "save":
        why = f" ({plan.why_save})" if plan.why_save and not notes else ""
        sent_txt = (f"{(sent or 0) / 1e6:.0f} MB of {report.get('bytes_in', 0) / 1e6:.0f} MB "
                    f"through docker save{why}")
    else:
        sent_txt = f"{sent / 1e6:.0f} MB" if sent else "whole"
    layers = src_info["RootFS"]["Layers"]
    skipped = plan.prefix
    if way == "store" and isinstance(report.get("layers_sent"), int):
        # the helper sends a held layer too when the peer's content store lacks its very blob
        skipped = len(layers) - report["layers_sent"]
    mode = "full" if way == "full" or not skipped else "partial"
    why_full = plan.why_full or (f"{peer.name} holds none of its blobs" if plan.prefix else "")
    reason = f" ({why_full})" if mode == "full" and why_full and not note else ""
    return ctx.changed(f"sent {ref} {src.name} -> {peer.name}: {mode}{reason}, {sent_txt}, "
                   f"{skipped}/{len(layers)} layers already there, {secs:.1f}s{note}",
                   peer.name, mode=mode, via=way, seconds=secs,
                   bytes_in=report.get("bytes_in"), bytes_out=sent, layers_skipped=skipped,
                   source=src.name)


def default_image(dep: Deployment) -> str:
    """The image image.probe chose to serve, else the first engine's image."""
    return chosen_image(dep) or dep.profile.engines[0].image


def chosen_tag(dep: Deployment) -> dict[str, Any]:
    return {"image": chosen(dep).get("serve_image")}


def held_by_every_node(dep: Deployment) -> dict[str, Any]:
    """The chosen image by ID on the head and on every worker (asks every node): unchanged
    since a finished ship means every worker still holds what the head serves."""
    ref = chosen(dep).get("serve_image")
    fp: dict[str, Any] = {"image_id": image_id(dep, ref)}
    for n in dep.profile.workers:
        fp[f"on[{n.name}]"] = image_id(dep, ref, n.name)
    return fp


@step(STEP, needs=(STEP_BUILD,), long=True, reuse=True,
      fingerprint=Fingerprint(also=chosen_tag, asks=held_by_every_node))
def ship(ctx: StepContext, to: str = "all", image: str | None = None) -> None:
    """Copy an image (default: the chosen one) from the head to peers over the fast link,
    sending only the layers a peer lacks; as a tree: peers that have it serve the next ones
    (``fanout``), and a peer that fails leaves the others to other sources."""
    dep = ctx.dep
    ref = image or default_image(dep)
    head = dep.host(dep.profile.head.name)
    peers = [h for h in dep.select(to) if h.name != head.name] if to != "all" else \
        [dep.host(n.name) for n in dep.profile.workers]
    if not peers:
        ctx.ok("no peer to ship to")
        return
    hosts = {h.name: h for h in [head, *peers]}
    plan = fanout.FanOut(head.name, [p.name for p in peers])
    # the first round's connections open while the head is asked for the image
    first = fanout.FanOut(head.name, [p.name for p in peers]).next_round()  # a plan's first round
    early = {} if dep.dry else {pair: LinkMaster(hosts[pair[0]], hosts[pair[1]]) for pair in first}
    try:
        src_info = inspect_image(head, ref)
        if src_info is None:
            ctx.failed(f"{head.name} has no image {ref}", head.name)
            return
        if pinned(ref):
            # docker load keeps no repo digest: the pin travels as the ID it resolved to on the
            # head, and each peer is checked by that ID (config digest) and its diff IDs
            ctx.log(head.name, f"{ref} is {src_info['Id']} here: shipped and checked by that ID")
            ref = src_info["Id"]
        _fan_out(ctx, plan, hosts, head, ref, src_info, early)
    finally:
        for m in early.values():
            m.close()  # those no ship took (a ship closes its own)


def _fan_out(ctx: StepContext, plan: fanout.FanOut, hosts: dict[str, Host], head: Host, ref: str,
             src_info: dict, early: dict[tuple[str, str], LinkMaster]) -> None:
    def transfer(src: str, dst: str) -> tuple[Outcome, str]:
        try:
            res = ship_one(ctx, hosts[src], hosts[dst], ref, src_info, src == head.name,
                           early.pop((src, dst), None))
        except NodeUnreachable as e:
            ctx.unreachable(e)
            return (Outcome.SOURCE if e.node == src else Outcome.TARGET), str(e)
        if res.status in ("ok", "changed", "skipped"):  # skipped: a dry run's "would send"
            return Outcome.OK, res.why
        return (Outcome.SOURCE if res.node == src else Outcome.TARGET), res.why

    fan = fanout.run(plan, transfer, lambda fn, pairs: ctx.each(pairs, fn, parallel=True))
    for target in fan.stranded:
        ctx.failed(fan.failed[target], target)
