#!/usr/bin/env python3
"""Write a `docker load` archive of an image holding only the layers a peer lacks, read from
Docker's image store (classic, or containerd's), never from `docker save`.

Standard library only; Python 3.8 or newer.

    python3 layer_export.py --root DOCKER_ROOT --driver overlay2 --image-id sha256:CONFIG \
        --ref REPO:TAG --layers-file L --have N | ssh peer docker load
    python3 layer_export.py --driver containerd --containerd ADDRESS --namespace moby \
        --image-id sha256:TARGET --ref REPO:TAG --layers-file L --have N | ssh peer docker load

Why: `docker save` reads every layer of the image, so shipping a small new layer of a large
image costs the whole image's time. The classic store keeps, per layer, the record Docker itself
rebuilds a layer's tar from (what `docker save` does internally): `tar-split.json.gz` under
``image/<driver>/layerdb/sha256/<chain-id>/`` lists the tar's header and padding bytes verbatim
and, for each file, its name and size; the file's bytes are in the layer's directory
(``overlay2/<cache-id>/diff`` or ``vfs/dir/<cache-id>``, named by ``cache-id``). Joining the two
gives back the exact tar whose sha256 is the layer's diff ID; only the missing layers are read.

With Docker's containerd image store (``--driver containerd``) the layers are blobs in
containerd's content store, as pulled (gzip) or loaded (plain tar): the image ID is its target
(an index or a manifest), whose manifest with this image's diff IDs names the config and one
blob per layer. ``ctr`` (containerd's own client, beside every containerd) reads them through the
daemon's socket. A missing layer's blob goes into the archive as it is stored, checked against
its digest and size; `docker load` unpacks a compressed layer tar itself and checks the diff ID.

The archive is Docker's own `docker save` format without the OCI index (``manifest.json``, the
config as ``<hex>.json``, one ``<diff-id-hex>/layer.tar`` per missing layer): on the classic
store `docker load` skips a manifest layer whose chain the daemon already has, without opening
its file. Layers come first, then the config and ``manifest.json``: if a rebuilt layer's sha256
is not its diff ID, the helper stops before the manifest, so the peer's load fails and tags
nothing.

Everything is checked before the first byte is written (config digest, each layer's record,
its directory; with containerd, the manifest and that every blob to send is in the content
store): a store this helper cannot read exits 6 with no output, and the caller falls
back to `docker save`. Exit status: 0 ok, 2 bad arguments, 6 the store cannot be read (said on
stderr as ``error: ...``), 7 a rebuilt layer differs from its diff ID (output unusable).
Progress: ``progress bytes=N total=T`` lines on stderr; last, a JSON report
``{"bytes_out": N, "layers_sent": K, "layers": M}`` (stdout is the archive: the one exception
to the helpers' dialect, see ``protocol.py``).
"""

import argparse
import base64
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import time

try:  # in the package (the controller, the tests)
    from . import protocol
except ImportError:  # a script: protocol.py beside it (a checkout) or a directory up (staged on a node)
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [_here, os.path.dirname(_here)]
    import protocol  # type: ignore[import-not-found, no-redef]

BLOCK = 512
CHUNK = 1 << 20
DIRS = {"overlay2": ("overlay2", "{id}", "diff"), "vfs": ("vfs", "dir", "{id}")}
"""Where each storage driver keeps a layer's files, under the Docker root (by cache-id)."""
CONTAINERD = "containerd"
"""``--driver`` for Docker's containerd image store: blobs read with ``ctr`` (see above)."""
LAYER_TYPES = {
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
}
"""Layer blobs `docker load` unpacks (it finds the compression from the bytes)."""
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONTENT_ROOTS = ("/var/lib/containerd", "/var/lib/docker/containerd/daemon")
"""Where containerd keeps its content by default: the system containerd Docker's packages run
with, and the one dockerd starts itself when none is given."""


class Unreadable(Exception):
    """The store cannot be read this way (exit 6, nothing written)."""


class Differs(Exception):
    """A rebuilt layer's sha256 is not its diff ID (exit 7)."""


def read_small(path, what):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise Unreadable(f"cannot read {what} ({path}): {e.strerror or e}") from None


def entries(path):
    """The tar-split records of one layer, in order (each a dict)."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)
    except (OSError, EOFError, ValueError) as e:
        raise Unreadable(f"cannot read {path}: {e}") from None


def entry_name(e):
    if e.get("name_raw"):
        return base64.b64decode(e["name_raw"]).decode("utf-8", "surrogateescape")
    return e.get("name") or ""


def tar_size(path):
    """The size of the tar a tar-split record rebuilds: its raw segments plus its file bodies."""
    total = 0
    for e in entries(path):
        if e.get("type") == 2:
            total += len(base64.b64decode(e.get("payload") or ""))
        elif e.get("type") == 1:
            total += int(e.get("size") or 0)
        else:
            raise Unreadable(f"{path}: unknown record type {e.get('type')!r}")
    return total


class Layer:
    def __init__(self, root, driver, diff_id, chain_id):
        self.diff_id = self.digest = diff_id  # the tar rebuilt is the blob
        db = os.path.join(root, "image", driver, "layerdb", "sha256", chain_id.split(":", 1)[1])
        recorded = read_small(os.path.join(db, "diff"), "the layer's diff ID").decode().strip()
        if recorded != diff_id:
            raise Unreadable(f"layer {chain_id} records diff ID {recorded}, not {diff_id}")
        cache_id = read_small(os.path.join(db, "cache-id"), "the layer's cache-id").decode().strip()
        if not re.match(r"^[0-9a-zA-Z_-]+$", cache_id):
            raise Unreadable(f"layer {chain_id}: odd cache-id {cache_id!r}")
        self.split = os.path.join(db, "tar-split.json.gz")
        parts = [p.format(id=cache_id) for p in DIRS[driver]]
        self.dir = os.path.realpath(os.path.join(root, *parts))
        if not os.path.isdir(self.dir):
            raise Unreadable(f"layer {diff_id}: no directory {self.dir}")
        self.size = tar_size(self.split)

    def file(self, name):
        """The open file a tar member's body is read from (never outside the layer's directory)."""
        path = os.path.realpath(os.path.join(self.dir, name))
        if not path.startswith(self.dir + os.sep):
            raise Differs(f"layer {self.diff_id}: {name!r} leaves the layer's directory")
        try:
            return open(path, "rb")
        except OSError as e:
            raise Differs(f"layer {self.diff_id}: cannot read {name!r}: {e.strerror}") from None

    def chunks(self):
        """The layer's tar, rebuilt, in chunks; raises Differs when it is not the diff ID's."""
        h = hashlib.sha256()
        for e in entries(self.split):
            if e.get("type") == 2:
                data = base64.b64decode(e.get("payload") or "")
                h.update(data)
                yield data
                continue
            left = int(e.get("size") or 0)
            if not left:
                continue
            name = entry_name(e)
            with self.file(name) as f:
                while left:
                    data = f.read(min(CHUNK, left))
                    if not data:
                        raise Differs(f"layer {self.diff_id}: {name!r} is shorter than recorded")
                    left -= len(data)
                    h.update(data)
                    yield data
        if "sha256:" + h.hexdigest() != self.diff_id:
            raise Differs(f"layer {self.diff_id} rebuilt as sha256:{h.hexdigest()}")


class Ctr:
    """containerd's content store: which blobs a namespace holds, from ``ctr`` through the
    daemon's socket; a blob's bytes from its file under the content store's root when this node
    keeps them where containerd does by default (streaming them through ctr is slow: about 80
    MB/s measured on the lab), else through ctr. Either way checked against the digest."""

    def __init__(self, ctr, address, namespace, roots=CONTENT_ROOTS):
        path = address[len("unix://"):] if address.startswith("unix://") else address
        if path.startswith("/") and not os.path.exists(path):
            # ctr would wait for it (10 s) before saying so
            raise Unreadable(f"no containerd socket at {path}")
        self.base = [ctr, "--address=" + address, "--namespace=" + namespace, "content"]
        self.blobs = [os.path.join(r, "io.containerd.content.v1.content", "blobs", "sha256")
                      for r in roots]

    def argv(self, *args):
        return [*self.base, *args]

    def path(self, digest):
        """The blob's file, where a content store root here has it (digest checked by the
        caller: a sha256 names one content whichever store keeps it)."""
        for d in self.blobs:
            p = os.path.join(d, digest.split(":", 1)[1])
            if os.path.isfile(p):
                return p
        return None

    def digests(self):
        """Every blob the content store holds in this namespace."""
        return set(self.run("ls", "--quiet").decode("utf-8", "replace").split())

    def get(self, digest, what):
        """A small blob (an index, a manifest, a config), checked against its digest."""
        p = self.path(digest)
        data = read_small(p, what) if p else self.run("get", digest)
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise Unreadable(f"{what} {digest} read back as another digest")
        return data

    def run(self, *args):
        try:
            p = subprocess.run(self.argv(*args), stdin=subprocess.DEVNULL, capture_output=True,
                               timeout=120)
        except FileNotFoundError:
            raise Unreadable(f"no {self.base[0]} on this node (containerd's client)") from None
        except subprocess.TimeoutExpired:
            raise Unreadable(f"{self.base[0]} content {args[0]} did not answer in 120 s") from None
        if p.returncode:
            last = (p.stderr.decode("utf-8", "replace").strip().splitlines() or ["no message"])[-1]
            raise Unreadable(f"ctr content {args[0]} failed: {last}")
        return p.stdout


class Blob:
    """A layer as containerd stores it: one blob, sent as it is."""

    def __init__(self, ctr, desc, diff_id):
        self.ctr, self.diff_id = ctr, diff_id
        self.digest, self.size = desc["digest"], desc["size"]

    def chunks(self):
        """The blob's bytes; raises Differs when they are not its digest and size."""
        h, n = hashlib.sha256(), 0
        path, p = self.ctr.path(self.digest), None
        try:
            if path:
                stream = open(path, "rb")
            else:
                p = subprocess.Popen(self.ctr.argv("get", self.digest), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                stream = p.stdout
        except OSError as e:
            raise Differs(f"layer {self.diff_id}: cannot read blob {self.digest}: {e}") from None
        try:
            while n <= self.size:
                data = stream.read(CHUNK)
                if not data:
                    break
                n += len(data)
                h.update(data)
                if n <= self.size:
                    yield data
        finally:
            stream.close()
            if p is not None and p.wait() and n == self.size:
                n = -1
        if n != self.size or "sha256:" + h.hexdigest() != self.digest:
            raise Differs(f"layer {self.diff_id}: blob {self.digest} read back as "
                          f"{max(n, 0)} bytes with sha256:{h.hexdigest()}")


def descriptors(doc):
    """The manifests an index lists, or [the document] when it is a manifest itself."""
    if isinstance(doc, dict) and isinstance(doc.get("manifests"), list):
        return [d for d in doc["manifests"] if isinstance(d, dict)]
    return None


def find_manifest(ctr, image_id, layers, held):
    """(manifest, its bytes, config bytes): the manifest under the image's target whose config lists
    ``layers`` (an index may name other platforms' manifests, not held here, and attestations)."""
    todo, seen = [(image_id, 0)], 0
    while todo:
        digest, depth = todo.pop(0)
        if not (isinstance(digest, str) and protocol.DIGEST_RE.match(digest) and digest in held):
            continue
        seen += 1
        raw = ctr.get(digest, "the image's index or manifest")
        try:
            doc = json.loads(raw)
        except ValueError:
            continue
        listed = descriptors(doc)
        if listed is not None:
            if depth < 2:
                todo += [(d.get("digest"), depth + 1) for d in listed]
            continue
        cfg = doc.get("config") if isinstance(doc, dict) else None
        cfg = cfg.get("digest") if isinstance(cfg, dict) else None
        if not (isinstance(cfg, str) and protocol.DIGEST_RE.match(cfg) and cfg in held):
            continue
        config = ctr.get(cfg, "the image config")
        try:
            diff_ids = json.loads(config)["rootfs"]["diff_ids"]
        except (ValueError, KeyError, TypeError):
            continue
        if diff_ids == layers:
            return doc, raw, config
    if not seen:
        raise Unreadable(f"{image_id} is not in containerd's content store")
    raise Unreadable(f"no manifest under {image_id} in the content store lists these layers")


def held_run(digests, have, holds):
    """How many leading layers the peer holds: ``have``, or fewer where ``holds`` (the blobs in
    the peer's content store, when known) lacks one of the blobs the archive would name."""
    if holds is None:
        return have
    n = 0
    while n < have and digests[n] in holds:
        n += 1
    return n


def content_plan(a, layers, holds):
    """(config digest, config bytes, manifest bytes, layers the peer holds, Blobs to send)
    from containerd's content store."""
    ctr = Ctr(a.ctr, a.containerd, a.namespace, [a.content_root] if a.content_root else CONTENT_ROOTS)
    held = ctr.digests()
    manifest, raw, config = find_manifest(ctr, a.image_id, layers, held)
    descs = manifest.get("layers")
    if not isinstance(descs, list) or len(descs) != len(layers):
        raise Unreadable(f"the manifest of {a.image_id} lists {len(descs or [])} layers, "
                         f"the config {len(layers)}")
    for i, d in enumerate(descs):
        if not (isinstance(d, dict) and protocol.DIGEST_RE.match(str(d.get("digest")))
                and isinstance(d.get("size"), int) and d["size"] >= 0):
            raise Unreadable(f"the manifest of {a.image_id} has an odd layer entry {i}")
    have = held_run([d["digest"] for d in descs], a.have, holds)
    send = []
    for i in range(have, len(layers)):
        d = descs[i]
        if d.get("mediaType") not in LAYER_TYPES:
            raise Unreadable(f"layer {layers[i]} is a {d.get('mediaType')!r} blob, "
                             "not one docker load reads")
        if d["digest"] not in held:
            raise Unreadable(f"layer {layers[i]}'s blob {d['digest']} is not in the content store")
        send.append(Blob(ctr, d, layers[i]))
    return manifest["config"]["digest"], config, raw, have, send


def oci_manifest(config, cfg_digest, layers):
    """An OCI image manifest of a classic-store image: its config and its layers as plain tars
    (a tar's digest is its diff ID)."""
    return json.dumps({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_digest,
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": x.diff_id,
                    "size": x.size} for x in layers]}, separators=(",", ":")).encode()


def full_name(ref):
    """The name containerd's image store gives ``ref``: Docker's normalisation (distribution's
    ``splitDockerDomain``): a first part without ``.`` or ``:``, not ``localhost`` and lower case
    is no registry, so the name is Docker Hub's; ``index.docker.io`` is ``docker.io``; a one-part
    name on Docker Hub is under ``library/``."""
    name, _, tag = ref.rpartition(":")
    if "/" in tag or not name:
        name, tag = ref, "latest"
    domain, slash, rest = name.partition("/")
    if not slash or not ("." in domain or ":" in domain or domain == "localhost"
                         or domain.lower() != domain):
        domain, rest = "docker.io", name
    if domain == "index.docker.io":
        domain = "docker.io"
    if domain == "docker.io" and "/" not in rest:
        rest = "library/" + rest
    return f"{domain}/{rest}:{tag}"


def header(name, size):
    """The tar header of a member (a pax record too for a size of 8 GiB or more)."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = 0
    return info.tobuf(format=tarfile.PAX_FORMAT)


def member_size(name, size):
    """Bytes the member takes in the archive: its header and its body padded to a block."""
    return len(header(name, size)) + -(-size // BLOCK) * BLOCK


class Out:
    """The archive on stdout, with progress on stderr at most every ``every`` seconds."""

    def __init__(self, stream, total, every):
        self.stream, self.total, self.every = stream, total, every
        self.n = 0
        self.last = 0.0

    def write(self, data):
        self.stream.write(data)
        self.n += len(data)
        now = time.monotonic()
        if self.every and now - self.last >= self.every:
            self.last = now
            protocol.progress(sys.stderr, bytes=self.n, total=self.total)

    def member(self, name, size, chunks):
        self.write(header(name, size))
        for data in chunks:
            self.write(data)
        if size % BLOCK:
            self.write(b"\0" * (BLOCK - size % BLOCK))


def layer_name(layer):
    return layer.diff_id.split(":", 1)[1] + "/layer.tar"


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="", help="the Docker root dir (docker info; classic store)")
    p.add_argument("--driver", required=True,
                   help="the storage driver (docker info), or containerd for that image store")
    p.add_argument("--containerd", default="/run/containerd/containerd.sock",
                   help="containerd's socket (with --driver containerd)")
    p.add_argument("--namespace", default="moby", help="Docker's containerd namespace")
    p.add_argument("--ctr", default="ctr", help="containerd's client")
    p.add_argument("--content-root", default="",
                   help="containerd's root, if not where it is by default (blobs read from it)")
    p.add_argument("--image-id", required=True,
                   help="the image's ID: its config digest (classic), its target (containerd)")
    p.add_argument("--ref", required=True, help="the repo:tag the peer's load gives the image")
    p.add_argument("--layers-file", required=True, help="JSON list: the image's diff IDs in order")
    p.add_argument("--have", type=int, required=True,
                   help="how many leading layers the peer holds (as one chain)")
    p.add_argument("--format", choices=("docker", "oci"), default="docker",
                   help="docker: docker save's manifest.json (a classic-store peer skips the "
                        "layers it holds); oci: an OCI image layout (a containerd-store peer "
                        "takes the blobs it holds from its own content store)")
    p.add_argument("--peer-holds", default="",
                   help="JSON list: the blobs in the peer's content store (with --format oci: "
                        "a layer among the first --have is sent when the peer lacks its blob)")
    p.add_argument("--check", action="store_true", help="check the store can be read, write nothing")
    p.add_argument("--progress", type=float, default=1.0, help="seconds between progress lines")
    return p.parse_args(argv)


def read_holds(path):
    """The blobs in the peer's content store (``--peer-holds``), or None when not given."""
    if not path:
        return None
    with open(path, encoding="utf-8") as f:
        holds = json.load(f)
    if not isinstance(holds, list) or not all(isinstance(x, str) for x in holds):
        raise Unreadable(f"{path}: not a list of blob digests")
    return set(holds)


def plan(a):
    """(config digest, config bytes, layers, manifest bytes (oci), layers to send): every check
    before a byte is written."""
    if a.driver not in DIRS and a.driver != CONTAINERD:
        raise Unreadable(f"storage driver {a.driver} keeps layers where this helper does not read")
    if not protocol.DIGEST_RE.match(a.image_id):
        raise Unreadable(f"--image-id {a.image_id!r} is not a sha256 digest")
    with open(a.layers_file, encoding="utf-8") as f:
        layers = json.load(f)
    if not isinstance(layers, list) or not all(isinstance(x, str) and protocol.DIGEST_RE.match(x)
                                               for x in layers):
        raise Unreadable(f"{a.layers_file}: not a list of diff IDs")
    if not 0 <= a.have <= len(layers):
        raise Unreadable(f"--have {a.have} is not between 0 and {len(layers)}")
    holds = read_holds(a.peer_holds)
    if a.driver == CONTAINERD:
        cfg_digest, config, raw, have, send = content_plan(a, layers, holds)
        return cfg_digest, config, layers, raw if a.format == "oci" else None, send
    if not a.root:
        raise Unreadable("--root is needed to read the classic store")
    hexid = a.image_id.split(":", 1)[1]
    config = read_small(os.path.join(a.root, "image", a.driver, "imagedb", "content", "sha256",
                                     hexid), "the image config")
    if hashlib.sha256(config).hexdigest() != hexid:
        raise Unreadable(f"the stored config of {a.image_id} does not match its digest")
    try:
        diff_ids = json.loads(config)["rootfs"]["diff_ids"]
    except (ValueError, KeyError, TypeError):
        raise Unreadable(f"the config of {a.image_id} names no diff IDs") from None
    if diff_ids != layers:
        raise Unreadable(f"the config of {a.image_id} lists other layers than --layers-file")
    chains = protocol.chain_ids(layers)
    have = held_run(layers, a.have, holds)
    if a.format == "oci":  # the manifest names every layer's size: each layer's record is read
        every = [Layer(a.root, a.driver, layers[i], chains[i]) for i in range(len(layers))]
        return a.image_id, config, layers, oci_manifest(config, a.image_id, every), every[have:]
    send = [Layer(a.root, a.driver, layers[i], chains[i]) for i in range(have, len(layers))]
    return a.image_id, config, layers, None, send


def main(argv=None):
    if sys.version_info < (3, 8):  # noqa: UP036 (the node's python3, not ours)
        print("error: layer_export.py needs Python 3.8 or newer", file=sys.stderr)
        return 2
    a = parse(argv)
    try:
        cfg_digest, config, layers, manifest, send = plan(a)
    except (Unreadable, OSError, ValueError) as e:
        return protocol.fail(str(e), 6)
    if a.check:
        protocol.answer({"layers_sent": len(send), "bytes": sum(x.size for x in send)})
        return 0
    if manifest is None:
        names = [layer_name(x) for x in send]
        meta = docker_meta(a, cfg_digest, config, layers)
    else:
        names = ["blobs/sha256/" + x.digest.split(":", 1)[1] for x in send]
        meta = oci_meta(a, cfg_digest, config, manifest)
    members = [*((names[i], x.size) for i, x in enumerate(send)), *((n, len(d)) for n, d in meta)]
    total = sum(member_size(name, size) for name, size in members) + 2 * BLOCK
    out = Out(sys.stdout.buffer, total, a.progress)
    try:
        for i, layer in enumerate(send):
            out.member(names[i], layer.size, layer.chunks())
    except Differs as e:
        # no manifest: the peer's load fails and tags nothing
        sys.stdout.buffer.flush()
        return protocol.fail(str(e), 7)
    for name, data in meta:
        out.member(name, len(data), [data])
    out.write(b"\0" * (2 * BLOCK))
    sys.stdout.buffer.flush()
    # the data stream's exception to the dialect: progress and the report on stderr
    protocol.progress(sys.stderr, bytes=out.n, total=out.n)
    protocol.answer({"bytes_out": out.n, "layers_sent": len(send), "layers": len(layers)}, sys.stderr)
    return 0


def docker_meta(a, cfg_digest, config, layers):
    """The members after the layers in docker save's format: the config, ``manifest.json``."""
    hexid = cfg_digest.split(":", 1)[1]
    manifest = json.dumps([{"Config": f"{hexid}.json", "RepoTags": [a.ref],
                            "Layers": [d.split(":", 1)[1] + "/layer.tar" for d in layers]}]).encode()
    return [(f"{hexid}.json", config), ("manifest.json", manifest)]


def oci_meta(a, cfg_digest, config, manifest):
    """The members after the layers in an OCI image layout: the config and manifest blobs,
    ``oci-layout``, and ``index.json`` last (naming the image: without it nothing is tagged)."""
    kind = json.loads(manifest).get("mediaType") or OCI_MANIFEST
    tag = full_name(a.ref)
    index = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                        "manifests": [{"mediaType": kind, "size": len(manifest),
                                       "digest": "sha256:" + hashlib.sha256(manifest).hexdigest(),
                                       "annotations": {"io.containerd.image.name": tag,
                                                       "org.opencontainers.image.ref.name":
                                                           tag.rpartition(":")[2]}}]}).encode()
    return [("blobs/sha256/" + cfg_digest.split(":", 1)[1], config),
            ("blobs/sha256/" + hashlib.sha256(manifest).hexdigest(), manifest),
            ("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index)]


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        sys.exit(1)
