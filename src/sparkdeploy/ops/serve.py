"""One engine brought up across the nodes (its containers started, the phases waited on), the
run it belongs to, and the files a persisted engine keeps on the nodes: shared by
``serve.up``, ``serve.persist`` and ``serve.watch``."""

from __future__ import annotations

import hashlib
import re
import time
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, RootModel

from sparkdeploy.core import labels
from sparkdeploy.core.files import write_text_atomic
from sparkdeploy.core.outside import OutsideError, last_line
from sparkdeploy.core.records import Attempt
from sparkdeploy.core.wait import Deadline
from sparkdeploy.engines import KINDS, Launch, NodeFacts, Stage, launch
from sparkdeploy.engines.base import STARTUP, run_args, secret_lines
from sparkdeploy.node import endpoint as ep
from sparkdeploy.node.deployment import Deployment
from sparkdeploy.node.hosts import Host
from sparkdeploy.node.nodeops import HelperFailed, docker, inspect_image, run_helper
from sparkdeploy.ops import image as image_ops
from sparkdeploy.ops import serve_preflight
from sparkdeploy.ops.serve_containers import RAY_PROBE
from sparkdeploy.ops.serve_preflight import node_facts
from sparkdeploy.ops.serve_watch import StartFailed, Watch
from sparkdeploy.profile.config import Engine

STEP_UP = "serve.up"


class Run:
    """One ``serve.up``: its directory under the state dir, secrets, the attempts so far."""

    def __init__(self, dep: Deployment):
        self.dep = dep
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.dir = dep.state.path / "runs" / f"{stamp}-serve.up"
        key = ep.api_key()
        self.secrets = {k.api_key_env: key for k in KINDS.values()} if key else {}
        self.attempts: list[Attempt] = []
        self.startup: dict[str, float] | None = None
        """The serving engine's startup milestones (``STARTUP``), once one came up."""

    def save_logs(self, engine: str, logs: dict[str, list[str]]) -> Path:
        d = self.dir / engine
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        for label, lines in logs.items():
            write_text_atomic(d / label, "\n".join(lines) + ("\n" if lines else ""), 0o644)
        return d


def start(dep: Deployment, host: Host, spec: Any, secrets: dict[str, str]) -> None:
    lines = secret_lines(spec, secrets)
    argv = docker(host, *run_args(spec, env_file="/dev/stdin" if lines else None,
                                  started=labels.started(STEP_UP, dep.wall())))
    r = host.run(argv, input=lines if lines else None, timeout=300)
    if not r.ok:
        raise StartFailed(f"{host.name}: docker run {spec.name}: {r.one_line_error()}", "start")


def _dist_port_open(dep: Deployment, lau: Launch) -> bool:
    """The head's init port answers, seen from the first worker over the fast link."""
    worker = next(c.node for c in lau.containers if c.node != lau.head)
    w = dep.host(worker)
    head_addr = dep.profile.node(lau.head).link.address
    try:
        return run_helper(w, serve_preflight.HELPER, [
            "connect", "--addr", head_addr, "--port", str(lau.wait_port), "--source",
            dep.profile.node(worker).link.address], result=_Open, where=f"{worker}: connect",
            timeout=30).open
    except HelperFailed:
        return False


class _Open(BaseModel):
    open: bool = False


class RayNode(BaseModel):
    ip: str
    gpus: float = Field(ge=0, allow_inf_nan=False)


class _RayNodes(RootModel[list[RayNode]]):
    pass


def ray_nodes(stdout: str, node: str) -> list[RayNode]:
    """The nodes the Ray probe lists ([] when its answer is not such a list)."""
    try:
        return last_line(_RayNodes, stdout, f"{node}: the Ray probe").root
    except OutsideError:
        return []


def _ray_nodes(dep: Deployment, lau: Launch, watch: Watch) -> bool:
    head = dep.host(lau.head)
    ray_head = lau.stages[0].containers[0].name
    r = head.run(docker(head, "exec", ray_head, "python3", "-c", RAY_PROBE), change=False, timeout=60)
    seen = ray_nodes(r.stdout, head.name) if r.ok else []
    want = {n.link.address: n.gpus for n in dep.profile.nodes}
    have = {s.ip: s.gpus for s in seen if s.ip in want}
    if len(have) > watch.__dict__.setdefault("_ray_seen", 0):
        watch.__dict__["_ray_seen"] = len(have)
        watch.progress(f"Ray lists {len(have)} of {len(want)} node(s)")
    return all(have.get(a, 0) >= g for a, g in want.items())


def _ranks_joined(stage: Stage, watch: Watch) -> bool:
    """Every container of the stage printed its ``joined`` line (each one new is a step)."""
    rx = re.compile(stage.joined or r"$^")
    names = {c.name for c in stage.containers}
    joined = {f.spec.name for f in watch.followed
              if f.spec.name in names and any(rx.search(line) for line in f.lines)}
    seen = watch.__dict__.setdefault("_joined", set())
    for name in sorted(joined - seen):
        watch.progress(f"{name} joined")
    seen |= joined
    return joined == names


def bring_up(dep: Deployment, lau: Launch, run: Run, watch: Watch) -> str:
    """Start the stages and wait through the phases; the endpoint URL, or EngineFailed. The
    startup milestones land in ``watch.marks``."""
    s = dep.profile.serve
    left = Deadline(s.ready_timeout_s, dep.clock).left
    if lau.dist_ready:
        watch.marked_by_log["dist_init"] = re.compile(lau.dist_ready)

    for stage in lau.stages:
        for spec in stage.containers:
            host = dep.host(spec.node)
            start(dep, host, spec, run.secrets)
            watch.add(host, spec)
        names = ", ".join(c.name for c in stage.containers)
        watch.phase(f"{names} running", lambda: True, left())
        watch.mark("containers_running", again=True)  # the last stage's
        if stage.wait == "dist-port":
            addr = f"{dep.profile.node(lau.head).link.address}:{lau.wait_port}"
            watch.phase(f"the head's init port {addr}", lambda: _dist_port_open(dep, lau), left())
        elif stage.wait == "ray-nodes":
            watch.phase("Ray listing every node with its GPU",
                        lambda: _ray_nodes(dep, lau, watch), left())
        elif stage.wait == "ranks-joined":
            watch.phase(f"{names}: rank joined", partial(_ranks_joined, stage, watch), left())
    addr = ep.controller_address(dep.host(lau.head))
    url = ep.engine_url(dep.host(lau.head), lau.port)  # the node's address is asked once
    watch.phase(f"port {addr}:{lau.port} open", lambda: ep.port_open(addr, lau.port), left())
    watch.mark("port_open")
    watch.phase(f"{url}/health", lambda: ep.health(url), left())
    watch.mark("health")
    watch.phase(f"/v1/models listing {lau.served_model}",
                lambda: lau.served_model in ep.models(url), left())
    watch.mark("model_listed")
    watch.phase("a streamed chat completion",
                lambda: ep.stream_chat(url, lau.served_model,
                                       on_first=lambda: watch.mark("first_token")), left())
    watch.mark("first_token")  # a server that sent no content chunk: when the answer ended
    return url


def startup(watch: Watch) -> dict[str, float]:
    """The milestones ``watch`` saw, in ``STARTUP`` order."""
    return {k: watch.marks[k] for k in STARTUP if k in watch.marks}


def startup_line(marks: dict[str, float]) -> str:
    """``bring-up 41.0 s (running 3.1 s, dist init 12.0 s, port 40.2 s, ...)``: the milestones
    reached, in order; the bring-up is the last one reached."""
    words = {"containers_running": "running", "dist_init": "dist init", "port_open": "port",
             "health": "health", "model_listed": "listed", "first_token": "first token"}
    got = [(k, marks[k]) for k in STARTUP if k in marks]
    if not got:
        return "bring-up: no milestone reached"
    total = max(v for _, v in got)
    return f"bring-up {total:.1f} s (" + ", ".join(f"{words[k]} {v:.1f} s" for k, v in got) + ")"


def put_file(host: Host, path: str, content: str, mode: str = "0644", *, keep_previous: bool = True,
             private: bool = True) -> bool:
    """Write ``content`` at ``path`` on the node (``Host.put_file``: atomically, through stdin;
    ``private``: under umask 077, else readable by anyone, as the node's records are) unless it
    is already there; True when written. With ``keep_previous``, the version it replaces is kept
    as ``<path>.previous`` until the hand-over ends (``restore_files`` puts it back,
    ``drop_previous`` removes it)."""
    if file_sum(host, path) == hashlib.sha256(content.encode()).hexdigest():
        return False
    host.put_file(path, content, mode=mode, keep_previous=keep_previous, private=private)
    return True


def file_sum(host: Host, path: str) -> str | None:
    """The sha256 of a file on the node (read as root: the specs and the key are 0600)."""
    r = host.run(["sha256sum", "--", path], change=False, sudo=True)
    return r.stdout.split()[0] if r.ok and r.stdout.split() else None


def restore_files(host: Host, paths: list[str]) -> bool:
    """Each of ``paths`` back to the version ``put_file`` kept, or gone when there was none."""
    script = ('for f; do if [ -e "$f.previous" ]; then mv -f -- "$f.previous" "$f"; '
              'else rm -f -- "$f"; fi; done')
    return host.run(["sh", "-c", script, "sh", *paths], sudo=True).ok


def drop_previous(host: Host, paths: list[str]) -> None:
    host.run(["rm", "-f", "--", *(f"{p}.previous" for p in paths)], sudo=True)


def engine_of(dep: Deployment, name: str | None) -> Engine | None:
    """The engine named, else the one ``serve.up`` recorded."""
    if name is None:
        rec = ep.recorded(dep.records)
        name = rec.engine if rec else None
    return next((e for e in dep.profile.engines if e.name == name), None)


def running_launch(dep: Deployment, eng: Engine) -> Launch:
    """The engine's containers as ``serve.up`` starts them on these nodes (their GID index and
    RDMA devices read afresh); EngineError when the profile cannot launch it."""
    facts = {}
    for n in dep.profile.nodes:
        got = node_facts(dep, dep.host(n.name), [], [])
        facts[n.name] = NodeFacts(got["gid"]["index"], bool(got["rdma_devices"]))
    image = inspect_image(dep.host(dep.profile.head.name), eng.image) or {}
    return launch(dep.profile, eng, facts, image_id=image.get("Id"),
                  image_digest=image_ops.engine_digest(dep, eng.name))


