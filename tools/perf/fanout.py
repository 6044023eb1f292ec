"""``nox -s perf -- fanout``: the tree fan-out on four nodes against two, measured on the lab.

The lab's fast link has no rate of its own: its veths are as fast as this machine's two cores,
which every node shares, so an unshaped fan-out measures the CPU, not the link a fan-out is
about. For the run, every port of the fast-link switch is capped at ``RATE_MBIT`` in each
direction (``tc tbf`` on each node's fast interface and on the switch's port towards it), as a
real switch's ports are; the caps go when the run ends. ``FANOUT_RATE_MBIT=0`` runs unshaped.

With the lab at four nodes, the same files are sent in the same run to the pair (configs/lab.yaml:
spark1 -> spark2) and to four (configs/lab-4nodes.yaml: spark1 -> spark2..4), in alternating
rounds (2, 4, 4, 2, 2, 4 ...: ``REPS`` of each), the workers emptied before each round:

- ``fanout.n4_over_n2``: ``model.sync`` then ``model.verify`` of ``SIZE_MB`` of weights in
  ``SHARDS`` files (``FANOUT_SHARDS``; a checkpoint's shards are each a small part of it, and
  the last file's relay is the tail this figure pays: 8 shards give 1.42 here, 24 give 1.19)
  (downloaded once on the head from a hub of its own), wall time until every
  node holds them verified, four over two: the median of the per-round ratios, with their
  ``_min``/``_max``, and each side's median seconds and spread ((max - min) / median).
- ``fanout.image_n4_over_n2``: the same for ``image.ship`` of a one-layer image of
  ``IMAGE_MB`` random bytes built on the head (every worker then holds its ID, checked).
- ``fanout.lab_up_2_to_4_s``, ``fanout.lab_4_extra_mb``: what two more nodes cost this machine
  (lab.up from the pair; memory in use, MemTotal - MemAvailable, after over before).

A star from the head would give about 3 (the head's port sends everything three times); a tree
of whole items about 2 (two rounds against one); a per-file tree whose workers relay what they
received while the head sends on (model.sync) tends to 1.

Needs root and the lab; it grows it to four nodes and leaves the pair.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from sparkdeploy.node.deployment import DEFAULTS, Deployment, load
from sparkdeploy.node.nodeops import docker, inspect_image
from sparkdeploy.steps import model, model_sync, model_verify, ship

ROOT = Path(__file__).resolve().parents[2]
PROFILES = {2: ROOT / "configs" / "lab.yaml", 4: ROOT / "configs" / "lab-4nodes.yaml"}
PATH = "/srv/models/perf-fanout"
SIZE_MB = 200
SHARDS = int(os.environ.get("FANOUT_SHARDS", "24"))
IMAGE_MB = 150
IMAGE = "sparkdeploy-perf/fanout:1"
RATE_MBIT = int(os.environ.get("FANOUT_RATE_MBIT", "160"))
REPS = 3
PORT = 8903


def _say(msg: str) -> None:
    print(f"[perf fanout] {msg}", file=sys.stderr, flush=True)


def _must(results, what: str) -> None:
    bad = [r for r in results if r.failed]
    if bad:
        raise SystemExit(f"{what} failed: {bad[0].node or ''} {bad[0].why}")


def shape(nodes: list[str], rate_mbit: int | None) -> None:
    """Cap each switch port at ``rate_mbit`` both ways (None: remove the caps)."""
    from sparkdeploy.lab import layout

    for x in nodes:
        for netns, dev in ((layout.netns_name(x), layout.FAST_IF),
                           (layout.FAST_NETNS, layout.fast_peer_veth(x))):
            tc = ["ip", "netns", "exec", netns, "tc", "qdisc"]
            if rate_mbit is None:
                subprocess.run([*tc, "del", "dev", dev, "root"], capture_output=True)
                continue
            subprocess.run([*tc, "replace", "dev", dev, "root", "tbf", "rate",
                            f"{rate_mbit}mbit", "burst", "1mb", "latency", "200ms"],
                           check=True, capture_output=True)


def shaped(nodes: list[str]) -> bool:
    """Whether every port still has its cap (another lab user's ``lab.fault none`` removes a
    tbf it finds on a node's link)."""
    from sparkdeploy.lab import layout

    for x in nodes:
        for netns, dev in ((layout.netns_name(x), layout.FAST_IF),
                           (layout.FAST_NETNS, layout.fast_peer_veth(x))):
            out = subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "show", "dev", dev],
                                 capture_output=True, text=True).stdout
            if " tbf " not in f" {out}":
                return False
    return True


def wipe(dep: Deployment, nodes: list[str], head_too: bool = False) -> None:
    """The perf image off ``nodes``, their copy of the weights removed (the head's too)."""
    for x in nodes:
        h = dep.host(x)
        h.run(docker(h, "image", "rm", "-f", IMAGE))
        if head_too or x != dep.profile.head.name:
            r = h.run(["rm", "-rf", "--", PATH])
            if not r.ok:
                raise SystemExit(f"{x}: cannot empty {PATH}: {r.one_line_error()}")


def weights_round(dep: Deployment) -> float:
    """Seconds until every worker of ``dep`` holds the weights verified (the workers emptied)."""
    workers = [n.name for n in dep.profile.workers]
    for x in workers:
        dep.host(x).run(["rm", "-rf", "--", PATH])
    t0 = time.monotonic()
    sent = model_sync.sync(dep)
    _must(sent, "model.sync")
    _must(model_verify.verify(dep), "model.verify")
    took = time.monotonic() - t0
    if sent[0].status.value != "changed":
        raise SystemExit(f"model.sync sent nothing, the round does not count: {sent[0].why}")
    _say(f"weights to {len(workers)} worker(s): {took:.1f}s ({sent[0].why})")
    return took


def image_round(dep: Deployment, image_id: str) -> float:
    """Seconds until every worker of ``dep`` holds the image, its ID checked (workers emptied)."""
    workers = [n.name for n in dep.profile.workers]
    for x in workers:
        h = dep.host(x)
        h.run(docker(h, "image", "rm", "-f", IMAGE))
    t0 = time.monotonic()
    res = ship.ship(dep, "all", IMAGE)
    took = time.monotonic() - t0
    _must(res, "image.ship")
    sent = sorted(r.node or "" for r in res if r.status.value == "changed")
    if sent != sorted(workers):
        raise SystemExit(f"image.ship changed {sent}, not every worker: the round does not "
                         f"count ({'; '.join(r.why for r in res)})")
    for r in res:
        _say(f"  {r.node}: {r.why}")
    for x in workers:
        got = inspect_image(dep.host(x), IMAGE)
        if not got or got["Id"] != image_id:
            raise SystemExit(f"{x} does not hold {IMAGE} {image_id} after image.ship")
    _say(f"image to {len(workers)} worker(s): {took:.1f}s")
    return took


def make_image(dep: Deployment) -> str:
    """A one-layer image of IMAGE_MB random bytes on the head; its ID."""
    head = dep.host(dep.profile.head.name)
    script = (f"set -e; d=$(mktemp -d); head -c {IMAGE_MB * 1_000_000} /dev/urandom > $d/blob; "
              f"tar -C $d -c blob | docker import - {IMAGE} >/dev/null; rm -rf $d")
    r = head.run(["sh", "-c", script], timeout=600)
    info = inspect_image(head, IMAGE) if r.ok else None
    if not info:
        raise SystemExit(f"cannot build {IMAGE} on the head: {r.one_line_error()}")
    return info["Id"]


def alternate(deps: dict[int, Deployment], one) -> tuple[list[float], list[float]]:
    """``one(dep)`` for two and four nodes in alternating rounds: (two's seconds, four's)."""
    two: list[float] = []
    four: list[float] = []
    nodes = [x.name for x in deps[4].profile.nodes]
    for i in range(REPS):
        for n in ((2, 4) if i % 2 == 0 else (4, 2)):
            if RATE_MBIT:
                shape(nodes, RATE_MBIT)  # again: a cap taken away by someone else comes back
            took = one(deps[n])
            if RATE_MBIT and not shaped(nodes):
                raise SystemExit("a port lost its cap during the round (another user of the "
                                 "lab, e.g. lab.fault none): the round does not count")
            (two if n == 2 else four).append(took)
    return two, four


def figures(prefix: str, two: list[float], four: list[float]) -> dict[str, float]:
    ratios = [b / a for a, b in zip(two, four, strict=True)]
    out = {f"{prefix}n4_over_n2": statistics.median(ratios),
           f"{prefix}n4_over_n2_min": min(ratios), f"{prefix}n4_over_n2_max": max(ratios)}
    for n, ts in ((2, two), (4, four)):
        med = statistics.median(ts)
        out[f"{prefix}n{n}_s"] = med
        out[f"{prefix}n{n}_s_spread"] = (max(ts) - min(ts)) / med
    return out


def deployments(url: str) -> dict[int, Deployment]:
    deps = {}
    for n, prof in PROFILES.items():
        dep = load(prof, ROOT / DEFAULTS["state_dir"] / f"perf-fanout-{n}")
        m = dep.profile.model.model_copy(update={"path": PATH, "endpoint": url})
        dep.profile = dep.profile.model_copy(update={"model": m})
        deps[n] = dep
    return deps


def used_mb() -> float:
    """Memory in use on this machine (MemTotal - MemAvailable), in MB."""
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) / 1024


def grow(lifecycle, layout) -> dict[str, float]:
    """The pair, then four nodes: what the two more cost (seconds of lab.up, memory)."""
    def up(n: int) -> None:
        bad = [r for r in lifecycle.up(nodes=n, flavor=layout.DEFAULT_DOCKERD) if r.failed]
        if bad:
            raise SystemExit(f"lab.up --nodes {n} failed: " + "; ".join(r.why for r in bad))

    up(2)
    before, t0 = used_mb(), time.monotonic()
    up(4)
    took, more = time.monotonic() - t0, used_mb() - before
    _say(f"lab.up --nodes 4 from the pair: {took:.1f}s, {more:.0f} MB more in use")
    return {"lab_up_2_to_4_s": took, "lab_4_extra_mb": more}


def run() -> dict[str, float]:
    from sparkdeploy.lab import hub, layout, lifecycle

    why = lifecycle.preflight()
    if why:
        raise SystemExit(f"perf fanout needs the lab: {why}")
    cost = grow(lifecycle, layout)
    nodes = layout.node_names(4)
    controller = urlsplit(load(PROFILES[2], ROOT / DEFAULTS["state_dir"] / "perf-fanout-2")
                          .profile.model.endpoint or "").hostname or "127.0.0.1"
    srv = hub.start_hub(bind=controller, port=PORT, size_mb=SIZE_MB, shards=SHARDS)
    deps = deployments(srv.url)
    try:
        return {**measure(deps, nodes), **cost}
    finally:
        shape(nodes, None)
        srv.stop()
        try:
            wipe(deps[4], nodes, head_too=True)
        finally:
            _say("back to the pair")
            lifecycle.up(nodes=2, flavor=layout.DEFAULT_DOCKERD)


def measure(deps: dict[int, Deployment], nodes: list[str]) -> dict[str, float]:
    wipe(deps[4], nodes)
    _must(model.download(deps[4]), "model.download")
    image_id = make_image(deps[4])
    if RATE_MBIT:
        shape(nodes, RATE_MBIT)
        _say(f"every switch port capped at {RATE_MBIT} Mbit/s each way")
    out = figures("", *alternate(deps, weights_round))
    out.update(figures("image_", *alternate(deps, lambda d: image_round(d, image_id))))
    out["rate_mbit"] = float(RATE_MBIT)
    out["rounds"] = float(REPS)
    return out
