"""``nox -s perf -- ship``: how much ``image.ship`` sends, and how fast, measured on the lab.

- ``ship.delta_ratio``: bytes received on the peer's fast-link interface while shipping the
  derivative image (the transformers layer) to a peer that has its base, divided by the size of
  the layers the peer lacked (their uncompressed tars, as ``docker save`` writes them).
- ``ship.full_vs_naive``: wall time of sparkdeploy's full ship to an empty peer divided by plain
  ``docker save | ssh peer docker load`` of the same image, alternating in one run (``REPS`` of
  each, the order flipped every round): the median of the per-round ratios, printed next to their
  spread (``full_vs_naive_min``/``_max``) and each side's spread ((max - min) / median). Every run
  is checked: ours must report a full ship that changed the peer (a ship that found the image
  already there does not count), and after the plain pipeline the peer must hold the image.
- ``ship.delta_time_ratio``: wall time of shipping an image whose missing part is a small share
  (a ``DELTA_MB`` layer of random bytes, ``SHIP_DELTA_MB`` or 20, built on the derivative, at most 5 % of an image of at
  least 500 MB, checked) to a peer that has everything below it, divided by the time a raw SSH
  stream of as many bytes takes from the source to the peer over the fast link (``head -c N
  /dev/zero | ssh PEER 'cat >/dev/null'``, the ssh a ship runs), alternating in one run: median
  of the per-round ratios with its min and max. Every delta ship must be partial and read from
  the source's layer store, and the delta is removed from the peer before each.

``SHIP_DOCKERD=containerd,docker26`` measures the same from a source on the containerd image
store (its layers read from containerd's content store) to a classic peer; a layer kept gzip
there crosses the link as it is kept, so its ``delta_ratio`` is under 1 when it compresses.

Needs root and the lab (it brings it up if needed) with the derivative built (it builds it).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shlex
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from sparkdeploy.node.deployment import DEFAULTS, Deployment, load
from sparkdeploy.node.nodeops import docker
from sparkdeploy.steps import images, ship

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "configs" / "lab.yaml"
REPS = 5
DELTA_MB = int(os.environ.get("SHIP_DELTA_MB", "20"))
DELTA_TAG = "sparkdeploy-perf/delta:latest"
DOCKERD = os.environ.get("SHIP_DOCKERD", "docker26")
"""The lab's dockerd flavours (``lab.up --dockerd``): ``containerd,docker26`` measures a source
on the containerd image store shipping to a classic peer."""


def _say(msg: str) -> None:
    print(f"[perf ship] {msg}", file=sys.stderr, flush=True)


def rx_bytes(netns: str, iface: str) -> int:
    out = subprocess.run(["ip", "-n", netns, "-j", "-s", "link", "show", "dev", iface],
                         capture_output=True, text=True, check=True).stdout
    return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])


def _run(dep: Deployment, node: str, argv: list[str]) -> None:
    r = dep.host(node).run(argv)
    if not r.ok:
        raise RuntimeError(f"{node}: {shlex.join(argv)}: {r.one_line_error()}")


def forget(dep: Deployment, node: str, *refs: str) -> None:
    """Make the node's dockerd hold none of ``refs`` nor their layers."""
    h = dep.host(node)
    h.run(docker(h, "image", "rm", "-f", *refs))
    h.run(docker(h, "image", "prune", "-a", "-f"))


def layer_tar_sizes(dep: Deployment, node: str, ref: str, diff_ids: list[str]) -> dict[str, int]:
    """Exact sizes of the layer tars (uncompressed) of ``diff_ids``, read by streaming ``docker
    save`` once: the classic store writes them as blobs named by diff ID; the containerd store
    writes each as it holds it, a gzip one unpacked here to find its diff ID and size."""
    h = dep.host(node)
    argv = h.wrap(docker(h, "save", ref))
    want = {d.split(":", 1)[1] for d in diff_ids}
    sizes: dict[str, int] = {}
    with subprocess.Popen(argv, stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for m in tar:
                name = m.name.rsplit("/", 1)[-1]
                if not m.name.startswith("blobs/sha256/") or not m.isfile():
                    continue
                if name in want:
                    sizes["sha256:" + name] = m.size
                    continue
                f = tar.extractfile(m)
                assert f is not None
                if f.read(2) != b"\x1f\x8b":
                    continue
                h256, n = hashlib.sha256(), 0
                with gzip.GzipFile(fileobj=_Again(b"\x1f\x8b", f)) as z:
                    while chunk := z.read(1 << 20):
                        h256.update(chunk)
                        n += len(chunk)
                if h256.hexdigest() in want:
                    sizes["sha256:" + h256.hexdigest()] = n
    if set(sizes) != set(diff_ids):
        raise SystemExit(f"{ref}: the save archive does not hold every layer asked for")
    return sizes


class _Again(io.RawIOBase):
    """A stream with ``head`` (bytes already read from it) put back in front."""

    def __init__(self, head: bytes, rest) -> None:
        self.head, self.rest = head, rest

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.head[:len(b)] if self.head else self.rest.read(len(b))
        self.head = self.head[len(data):] if self.head else b""
        b[:len(data)] = data
        return len(data)


def build_delta(dep: Deployment, head: str, base: str) -> None:
    """``DELTA_TAG``: ``base`` plus one layer of ``DELTA_MB`` random bytes (built on the head)."""
    h = dep.host(head)
    dockerfile = (f"FROM {base}\nRUN head -c {DELTA_MB * 1000 * 1000} /dev/urandom > /delta.bin\n")
    r = h.run(docker(h, "build", "-q", "-t", DELTA_TAG, "-"), input=dockerfile, timeout=600)
    if not r.ok:
        raise SystemExit(f"building {DELTA_TAG}: {r.one_line_error()}")


def raw_stream(dep: Deployment, head: str, peer: str, nbytes: int) -> float:
    """Seconds the head takes to stream ``nbytes`` to the peer over ssh on the fast link."""
    addr = dep.profile.node(peer).link.address
    script = f"head -c {nbytes} /dev/zero | " + shlex.join(
        ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "--", addr, "cat >/dev/null"])
    t0 = time.monotonic()
    _run(dep, head, ["bash", "-c", "set -o pipefail; " + script])
    return time.monotonic() - t0


def delta_time(dep: Deployment, head: str, peer: str, base: str) -> dict[str, float]:
    """``ship.delta_time_ratio`` and its parts (see the module's docstring)."""
    build_delta(dep, head, base)
    src = images.inspect_image(dep.host(head), DELTA_TAG)
    below = images.inspect_image(dep.host(head), base)
    assert src and below
    missing = src["RootFS"]["Layers"][len(below["RootFS"]["Layers"]):]
    sizes = layer_tar_sizes(dep, head, DELTA_TAG, missing)
    missing_bytes = sum(sizes.values())
    image_bytes = int(src.get("Size") or 0)
    if image_bytes < 500e6 or missing_bytes > 0.05 * image_bytes:
        raise SystemExit(f"{DELTA_TAG}: {missing_bytes / 1e6:.0f} MB missing of a "
                         f"{image_bytes / 1e6:.0f} MB image: not a small delta of a large image")
    forget_tag(dep, peer, DELTA_TAG)
    r = ship.ship(dep, peer, base)  # the peer holds everything below the delta
    if r[0].failed:
        raise SystemExit(r[0].why)
    ships, raws = [], []
    for i in range(REPS):
        for kind in (("raw", "ship") if i % 2 == 0 else ("ship", "raw")):
            if kind == "raw":
                raws.append(raw_stream(dep, head, peer, missing_bytes))
                _say(f"raw ssh stream of {missing_bytes / 1e6:.1f} MB: {raws[-1]:.2f}s")
                continue
            forget_tag(dep, peer, DELTA_TAG)
            t0 = time.monotonic()
            res = ship.ship(dep, peer, DELTA_TAG)
            ships.append(time.monotonic() - t0)
            d = res[0].details
            if res[0].status != "changed" or d.get("mode") != "partial" or d.get("via") != "store":
                raise SystemExit(f"round {i + 1}: the delta ship was not a partial ship read from "
                                 f"the layer store: {res[0].status}: {res[0].why}")
            _say(f"delta ship: {ships[-1]:.2f}s ({res[0].why})")
    forget_tag(dep, peer, DELTA_TAG)
    forget_tag(dep, head, DELTA_TAG)
    ratios = [s / r for s, r in zip(ships, raws, strict=True)]
    return {"delta_time_ratio": statistics.median(ratios),
            "delta_time_ratio_min": min(ratios), "delta_time_ratio_max": max(ratios),
            "delta_ship_s": statistics.median(ships),
            "delta_ship_s_spread": (max(ships) - min(ships)) / statistics.median(ships),
            "delta_raw_s": statistics.median(raws),
            "delta_raw_s_spread": (max(raws) - min(raws)) / statistics.median(raws),
            "delta_small_mb": missing_bytes / 1e6, "delta_image_mb": image_bytes / 1e6}


def forget_tag(dep: Deployment, node: str, ref: str) -> None:
    """The node loses ``ref`` and the layers only it held (dangling ones pruned)."""
    h = dep.host(node)
    h.run(docker(h, "image", "rm", "-f", ref))
    h.run(docker(h, "image", "prune", "-f"))


def run() -> dict[str, float]:
    from sparkdeploy.lab import layout, lifecycle

    why = lifecycle.preflight()
    if why:
        raise SystemExit(f"perf ship needs the lab: {why}")
    _say("lab.up")
    bad = [r for r in lifecycle.up(nodes=2, flavor=DOCKERD) if r.failed]
    if bad:
        raise SystemExit("lab.up failed: " + "; ".join(r.why for r in bad))
    dep = load(PROFILE, ROOT / DEFAULTS["state_dir"] / "perf")
    layer = dep.profile.images.layer
    assert layer is not None
    _say("image.build (the derivative)")
    built = images.build(dep)
    if built[0].failed:
        raise SystemExit(f"image.build failed: {built[0].why}")
    head, peer = dep.profile.head.name, dep.profile.workers[0].name
    iface = dep.profile.node(peer).link.interface
    netns = f"lab-{peer}"
    src = images.inspect_image(dep.host(head), layer.tag)
    base = images.inspect_image(dep.host(head), layer.base)
    assert src and base
    figures: dict[str, float] = {}

    # -- delta: the peer has the base, not the derivative
    forget(dep, peer, layer.tag, layer.base)
    _say(f"shipping the base {layer.base} to {peer}")
    r = ship.ship(dep, peer, layer.base)
    if r[0].failed:
        raise SystemExit(r[0].why)
    missing = src["RootFS"]["Layers"][len(base["RootFS"]["Layers"]):]
    sizes = layer_tar_sizes(dep, head, layer.tag, missing)
    missing_bytes = sum(sizes.get(d, 0) for d in missing)
    before = rx_bytes(netns, iface)
    r = ship.ship(dep, peer, layer.tag)
    after = rx_bytes(netns, iface)
    if r[0].failed or r[0].details.get("mode") != "partial":
        raise SystemExit(f"delta ship did not ship partially: {r[0].why}")
    _say(r[0].why)
    figures["delta_ratio"] = (after - before) / missing_bytes
    figures["delta_missing_mb"] = missing_bytes / 1e6
    figures["delta_rx_mb"] = (after - before) / 1e6
    figures["image_mb"] = float(src.get("Size") or 0) / 1e6

    figures.update(delta_time(dep, head, peer, layer.tag))

    # -- full ship vs naive, alternating, the peer emptied before each
    peer_addr = dep.profile.node(peer).link.address
    naive = ["bash", "-c", "set -o pipefail; " + shlex.join(docker(dep.host(head), "save", layer.tag))
             + " | " + shlex.join(["ssh", "-o", "BatchMode=yes", peer_addr,
                                   shlex.join(docker(dep.host(peer), "load"))])]
    ours_t, naive_t = [], []
    for i in range(REPS):
        for kind in (("naive", "ours") if i % 2 == 0 else ("ours", "naive")):
            forget(dep, peer, layer.tag, layer.base)
            t0 = time.monotonic()
            if kind == "naive":
                _run(dep, head, naive)
                naive_t.append(time.monotonic() - t0)
                got = images.inspect_image(dep.host(peer), layer.tag)
                # (an image's ID is its manifest's digest on the containerd store)
                if not got or got["RootFS"]["Layers"] != src["RootFS"]["Layers"]:
                    raise SystemExit(f"round {i + 1}: the plain pipeline left no {layer.tag} on {peer}")
            else:
                res = ship.ship(dep, peer, layer.tag)
                took = time.monotonic() - t0
                if res[0].status != "changed" or res[0].details.get("mode") != "full":
                    raise SystemExit(f"round {i + 1}: not a full ship, does not count: "
                                     f"{res[0].status}: {res[0].why}")
                ours_t.append(took)
            _say(f"{kind}: {time.monotonic() - t0:.1f}s")
    # leave the worker as lab.up left it: the lab base image, no community image
    forget(dep, peer, layer.tag, layer.base)
    ship.ship(dep, peer, layout.BASE_IMAGE)
    ratios = [o / n for o, n in zip(ours_t, naive_t, strict=True)]
    figures["full_vs_naive"] = statistics.median(ratios)
    figures["full_vs_naive_min"] = min(ratios)
    figures["full_vs_naive_max"] = max(ratios)
    figures["full_s"] = statistics.median(ours_t)
    figures["full_s_spread"] = (max(ours_t) - min(ours_t)) / statistics.median(ours_t)
    figures["naive_s"] = statistics.median(naive_t)
    figures["naive_s_spread"] = (max(naive_t) - min(naive_t)) / statistics.median(naive_t)
    figures["rounds"] = float(REPS)
    return figures
