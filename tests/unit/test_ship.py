"""image.ship against scripted engines that behave like the real ones where it matters.

The fake node keeps the files staged on it and a file system of its own (a tmp directory), and
a transfer pipeline is carried out the way the nodes would, after the sha256 checks of the
staged files it names:

- the source's ``docker info`` and ``docker image inspect`` answer what Docker 26 answers
  (overlay2: ``Driver``, ``DockerRootDir``, the image's ``GraphDriver`` with its ``UpperDir``;
  vfs, btrfs and the containerd image store: no ``Data``);
- the source's classic layer store is a real one under its ``DockerRootDir``, written from the
  layer tars with their tar-split records (``test_layer_export``'s builders), and the staged
  ``layer_export.py`` runs on it (``sys.executable``), its stdout the peer's archive;
- the source's ``docker save`` is a real archive of the image (OCI or legacy layout), and the
  staged ``save_filter.py`` runs on it with the staged layers and have files;
- the peer's ``docker load`` accepts a layer left out of the archive only when it holds that
  layer's whole chain, then tags the image with the config it was given; an archive that does
  not parse (a helper that wrote nothing) fails the load."""

import copy
import gzip
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest
from invoke import Result as RunResult

from sparkdeploy.core.events import Echo, Log, Progress
from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.core.packaged import helper
from sparkdeploy.node import nodeops
from sparkdeploy.node.hosts import Feed
from sparkdeploy.steps import ship
from tests.unit import test_layer_export as tle
from tests.unit import test_save_filter as tsf
from tests.unit.fakes import FakeContext, deployment
from tests.unit.profiles import SEED, seed_data, write_profile

ADDR = {"spark1": "192.168.100.10", "spark2": "192.168.100.11", "spark3": "192.168.100.12",
        "spark4": "192.168.100.13"}
SOCK = "unix:///var/run/docker.sock"
MASTER_SOCKET = "/tmp/sparkdeploy-ship.Xq3TZ9aA/m"
STAGE = "/tmp/sparkdeploy-stage-0"
CONTAINERD = "io.containerd.snapshotter.v1"
EMPTY_LOAD = "Error response from daemon: unexpected EOF"
"""What the peer's load says of an archive that is no tar (a helper that wrote nothing)."""


def _layer(i: int) -> bytes:
    return tsf.layer_tar(f"layer-{i}", (b"%d" % i) * (2000 + 500 * i))


LAYERS = [_layer(i) for i in range(4)] + [tsf.layer_tar("layer-big", b"B" * 3_000_000)]
DIFF = [tsf.sha(t) for t in LAYERS]
_SPLITS: dict[int, bytes] = {}


def split_record(i: int) -> bytes:
    """LAYERS[i]'s tar-split.json.gz (computed once: the CRC-64 of 3 MB takes a quarter second)."""
    if i not in _SPLITS:
        _SPLITS[i] = tle.split_bytes(tle.tar_split(LAYERS[i]))
    return _SPLITS[i]


_WORD = re.compile(r"(?:[^\s'\"]+|'[^']*'|\"[^\"]*\")+")
_PART = re.compile(r"[^'\"]+|'[^']*'|\"[^\"]*\"")


def split(command: str) -> list[str]:
    """``shlex.split`` for what ``shlex.join`` writes, at regex speed: a staged helper travels
    in argv, and under a mutation tester it is a large file."""
    return ["".join(p[1:-1] if p[0] in "'\"" else p for p in _PART.findall(w))
            for w in _WORD.findall(command)]


def image(diff_ids: list[str], tag: str) -> dict:
    config = json.dumps({"architecture": "arm64", "os": "linux",
                         "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    return {"Id": tsf.sha(config), "RootFS": {"Layers": list(diff_ids)}, "Size": 1_000_000 * len(diff_ids),
            "Architecture": "arm64", "Os": "linux", "_config": config, "_tag": tag}


BASE_IMG = image(DIFF[:2], "base:1")
IMG = image(DIFF[:3], "img:1")
OTHER = image([DIFF[0], DIFF[3], DIFF[2]], "other:1")  # holds DIFF[2], but on another chain


GZIP_LAYERS = {DIFF[2]}
"""Layers a containerd-store engine keeps gzip (as pulled); the rest plain tars (as loaded)."""
CONTENT = "/var/lib/containerd/io.containerd.content.v1.content/blobs/sha256"
CTD_SOCK = "/run/containerd/containerd.sock"
FAKE_CTR = f"""#!{sys.executable}
# containerd's client as the helper runs it: ``ctr --address=A --namespace=N content ls --quiet``
# and ``content get DIGEST``, answered by the "daemon" at A (here: a JSON file naming its
# content root and the digests each namespace holds), from containerd's on-disk content store
import json, os, sys
args, opts = [], {{}}
for a in sys.argv[1:]:
    if a.startswith("--") and "=" in a:
        k, v = a[2:].split("=", 1)
        opts[k] = v
    else:
        args.append(a)
addr, ns = opts.get("address", "/run/containerd/containerd.sock"), opts.get("namespace", "default")
try:
    daemon = json.load(open(addr))
except OSError:
    sys.exit(f'ctr: failed to dial "{{addr}}": context deadline exceeded')
held = daemon["namespaces"].get(ns, [])
if args == ["content", "ls", "--quiet"]:
    print("\\n".join(held))
elif args[:2] == ["content", "get"] and len(args) == 3:
    if args[2] not in held:
        sys.exit(f"ctr: content digest {{args[2]}}: not found")
    with open(os.path.join(daemon["root"], args[2].split(":")[1]), "rb") as f:
        while chunk := f.read(65536):
            sys.stdout.buffer.write(chunk)
else:
    sys.exit(f"ctr: unexpected {{args}}")
"""


def blob(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True).encode()


def content_of(img: dict) -> tuple[str, dict[str, bytes]]:
    """(target digest, blobs) of ``img`` in a containerd content store: an index naming an
    arm64 manifest not held here and the image's own manifest (config, one blob per layer)."""
    blobs = {tsf.sha(img["_config"]): img["_config"]}
    descs = []
    for d in img["RootFS"]["Layers"]:
        tar = LAYERS[DIFF.index(d)]
        data = gzip.compress(tar, mtime=0) if d in GZIP_LAYERS else tar
        kind = "tar+gzip" if d in GZIP_LAYERS else "tar"
        blobs[tsf.sha(data)] = data
        descs.append({"mediaType": f"application/vnd.oci.image.layer.v1.{kind}",
                      "digest": tsf.sha(data), "size": len(data)})
    manifest = blob({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                     "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                "digest": tsf.sha(img["_config"]), "size": len(img["_config"])},
                     "layers": descs})
    blobs[tsf.sha(manifest)] = manifest
    other = {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": "sha256:" + "a" * 64,
             "size": 999, "platform": {"architecture": "amd64", "os": "linux"}}
    index = blob({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                  "manifests": [other, {"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                        "digest": tsf.sha(manifest), "size": len(manifest),
                                        "platform": {"architecture": "arm64", "os": "linux"}}]})
    blobs[tsf.sha(index)] = index
    return tsf.sha(index), blobs


def tagged(ref: str) -> str:
    """The name docker lists a reference under (``:latest`` when it names no tag)."""
    return ref if ":" in ref.rsplit("/", 1)[-1] else ref + ":latest"


PROTOCOL_SHA = hashlib.sha256(helper("protocol.py").read_bytes()).hexdigest()
PROTOCOL = f"{STAGE}/{PROTOCOL_SHA}/protocol.py"
"""Where the node keeps the protocol every staged helper imports (a directory above each)."""


def staged_path(name: str, data: bytes, helper: bool = False) -> str:
    under = f"{STAGE}/{PROTOCOL_SHA}" if helper else STAGE
    return f"{under}/{hashlib.sha256(data).hexdigest()}/{name}"


EXPORT = staged_path("layer_export.py", helper("layer_export.py").read_bytes(), helper=True)
LAYERS_JSON = staged_path("layers.json", json.dumps(DIFF[:3]).encode())

DRIVER_STATUS = {
    "overlay2": [["Backing Filesystem", "extfs"], ["Supports d_type", "true"],
                 ["Using metacopy", "false"], ["Native Overlay Diff", "true"], ["userxattr", "false"]],
    "vfs": [],
    "btrfs": [["Btrfs", ""]],
}


class Engine:
    def __init__(self, images=(), containerd=False, refuse_partial=False, free=10**12,
                 layout="oci", python="3.11", load_rewrites_config=False, load_untagged=False,
                 root_dir="/var/lib/docker", history=None, info_fails=False, unreachable=False,
                 load_error=None, dies_serving=False, driver="overlay2", master_fails=None,
                 no_containerd_socket=False):
        self.images = {img["_tag"]: img for img in images}
        self.no_containerd_socket = no_containerd_socket
        self.info_extra: dict = {}  # more docker info fields (Docker 27's Containerd)
        self.containerd_at, self.namespace = CTD_SOCK, "moby"  # where containerd listens
        self.damaged_blobs: dict[str, bytes] = {}  # blob digest -> what is on disk instead
        self.master_fails = master_fails  # why the source's master connection fails, if it does
        self.dies_serving = dies_serving  # the node goes away as it starts sending an image
        self.root_dir = root_dir
        self.driver = driver  # the classic store's storage driver (unless containerd)
        self.history = history  # `docker history` sizes, newest first (default: 1 GB a layer)
        self.info_fails = info_fails
        self.unreachable = unreachable
        self.load_error = load_error
        self.containerd = containerd
        self.refuse_partial = refuse_partial
        self.free = free
        self.layout = layout
        self.python = python
        self.load_rewrites_config = load_rewrites_config
        self.load_untagged = load_untagged
        self.files: dict[str, bytes] = {}
        self.loaded: list[str] = []  # archive members each load applied (layer paths)
        self.fs: Path | None = None  # the node's file system (a tmp directory, set by `make`)
        self.written: set[str] = set()  # chain IDs and configs already in the layer store
        self.loaded_blobs: dict[str, bytes] = {}  # blobs an OCI load added to the content store
        self.unlabelled: set[str] = set()  # blobs ctr content ls shows without labels
        self.lock = threading.Lock()

    def has_chain(self, chain: list[str]) -> bool:
        return any(img["RootFS"]["Layers"][: len(chain)] == chain for img in self.images.values())

    # -- what docker info and docker image inspect say -------------------------------------------
    def info(self) -> dict:
        if self.containerd:
            driver, status = "overlayfs", [["driver-type", CONTAINERD]]
        else:
            driver, status = self.driver, DRIVER_STATUS[self.driver]
        return {"ID": "f00d", "Containers": 0, "Images": len(self.images), "Driver": driver,
                "DriverStatus": status, "DockerRootDir": self.root_dir, "ServerVersion": "26.1.4",
                "OperatingSystem": "Ubuntu 24.04.1 LTS", "Architecture": "aarch64",
                **self.info_extra}

    def cache_id(self, chain: str) -> str:
        return hashlib.sha256(f"{self.driver} {chain}".encode()).hexdigest()

    def graph_driver(self, img: dict) -> dict:
        if self.containerd:
            return {"Data": None, "Name": "overlayfs"}
        layers = img["RootFS"]["Layers"]
        if self.driver != "overlay2" or not layers:
            return {"Data": None, "Name": self.driver}
        dirs = [f"{self.root_dir}/overlay2/{self.cache_id(c)}" for c in tle.chain_ids(layers)]
        data = {"MergedDir": dirs[-1] + "/merged", "UpperDir": dirs[-1] + "/diff",
                "WorkDir": dirs[-1] + "/work"}
        if len(dirs) > 1:
            data["LowerDir"] = ":".join(d + "/diff" for d in reversed(dirs[:-1]))
        return {"Data": dict(sorted(data.items())), "Name": "overlay2"}

    def inspect(self, ref: str) -> dict:
        img = self.images[ref]
        info = {k: v for k, v in img.items() if not k.startswith("_")}
        if self.containerd:
            info["Id"] = content_of(img)[0]  # the image's target (an index), not its config
        info["GraphDriver"] = self.graph_driver(img)
        return info

    # -- the node's file system and its classic layer store --------------------------------------
    def node_path(self, path: str) -> Path:
        assert self.fs is not None and path.startswith("/"), path
        return self.fs / path.lstrip("/")

    def layerdb(self, chain: str) -> Path:
        return self.node_path(self.root_dir) / "image" / self.driver / "layerdb" / "sha256" / chain.split(":")[1]

    def layer_dir(self, chain: str) -> Path:
        root = self.node_path(self.root_dir)
        if self.driver == "overlay2":
            return root / "overlay2" / self.cache_id(chain) / "diff"
        return root / "vfs" / "dir" / self.cache_id(chain)

    def write_store(self) -> Path:
        """The layer store as Docker keeps it, for every image the engine holds (each layer and
        config written once: a test may damage the store after)."""
        assert not self.containerd and self.driver in ("overlay2", "vfs")
        root = self.node_path(self.root_dir)
        with self.lock:
            for img in self.images.values():
                diffs = img["RootFS"]["Layers"] or []
                chains = tle.chain_ids(diffs) if diffs else []
                for n, (diff, chain) in enumerate(zip(diffs, chains, strict=True)):
                    if chain in self.written:
                        continue
                    self.written.add(chain)
                    i = DIFF.index(diff)
                    db = self.layerdb(chain)
                    db.mkdir(parents=True)
                    (db / "diff").write_text(diff)
                    (db / "cache-id").write_text(self.cache_id(chain))
                    (db / "size").write_text(str(sum(m.size for m in tle.members_of(LAYERS[i]))))
                    if n:
                        (db / "parent").write_text(chains[n - 1])
                    (db / "tar-split.json.gz").write_bytes(split_record(i))
                    d = self.layer_dir(chain)
                    if self.driver == "vfs" and n:  # a vfs layer's directory is the whole root fs
                        shutil.copytree(self.layer_dir(chains[n - 1]), d, symlinks=True)
                    d.mkdir(parents=True, exist_ok=True)
                    tle.extract(LAYERS[i], d, self.driver)
                if img["Id"] not in self.written:
                    self.written.add(img["Id"])
                    conf = (root / "image" / self.driver / "imagedb" / "content" / "sha256"
                            / img["Id"].split(":")[1])
                    conf.parent.mkdir(parents=True, exist_ok=True)
                    conf.write_bytes(img["_config"])
        return root

    def write_content(self) -> None:
        """containerd's content store (every image's blobs, in the moby namespace), its socket
        and ctr, as a node on the containerd image store has them."""
        root = self.node_path(CONTENT)
        root.mkdir(parents=True, exist_ok=True)
        held: set[str] = set()
        for img in self.images.values():
            for digest, data in content_of(img)[1].items():
                (root / digest.split(":")[1]).write_bytes(self.damaged_blobs.get(digest, data))
                held.add(digest)
        sock = self.node_path(self.containerd_at)
        sock.parent.mkdir(parents=True, exist_ok=True)
        if not self.no_containerd_socket:
            sock.write_text(json.dumps({"root": str(root),
                                        "namespaces": {self.namespace: sorted(held)}}))
        ctr = self.node_path("/usr/bin/ctr")
        ctr.parent.mkdir(parents=True, exist_ok=True)
        ctr.write_text(FAKE_CTR)
        ctr.chmod(0o755)

    def write_staged(self) -> None:
        for path, data in self.files.items():
            p = self.node_path(path)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)

    # -- docker save, as the real engine writes it ---------------------------------------------
    def save(self, ref: str) -> bytes:
        img = self.images[tagged(ref)]
        diff_ids = img["RootFS"]["Layers"]
        tars = [LAYERS[DIFF.index(d)] for d in diff_ids]
        if self.layout == "legacy":
            (_, raw), _ = tsf.legacy_archive(tars, diff_ids, img["_config"], tag=tagged(ref))
        else:
            _, raw = tsf.oci_archive(dict(zip(diff_ids, tars, strict=True)), img["_config"],
                                     ["blobs/sha256/" + d.split(":")[1] for d in diff_ids],
                                     tag=tagged(ref))
        return raw

    # -- docker load, with the classic store's chain rule -----------------------------------------
    def held_blobs(self) -> dict[str, bytes]:
        """The containerd store's content: every image's blobs, and what loads added."""
        out = dict(self.loaded_blobs)
        for img in self.images.values():
            out.update(content_of(img)[1])
        return out

    def content_ls(self) -> str:
        """``ctr content ls`` as containerd 1.6 prints it (sizes rounded, labels last)."""
        lines = ["DIGEST\tSIZE\tAGE\tLABELS"]
        for digest, data in sorted(self.held_blobs().items()):
            try:
                tar = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
                label = (f"containerd.io/uncompressed={tsf.sha(tar)}"
                         if tsf.sha(tar) in DIFF else "containerd.io/gc.ref.content.l.0=sha256:00")
                if digest in self.unlabelled:
                    label = ""  # an import whose layer was unpacked already labels nothing
            except OSError:
                label = "-"
            lines.append(f"{digest}\t{len(data) / 1000:.2f}kB\t2 minutes\t{label}")
        return "\n".join(lines) + "\n"

    def load_oci(self, t: tarfile.TarFile) -> tuple[int, str]:
        """containerd's import of an OCI layout (a blob the archive lacks is taken from the
        content store), then the unpack: each layer's diff ID checked."""
        blobs = {m.name.split("/")[-1]: t.extractfile(m).read() for m in t.getmembers()
                 if m.name.startswith("blobs/sha256/") and m.isfile()}
        have = self.held_blobs()
        index = json.loads(t.extractfile("index.json").read())
        [desc] = index["manifests"]
        manifest = json.loads(blobs[desc["digest"].split(":")[1]])
        config = blobs[manifest["config"]["digest"].split(":")[1]]
        diff_ids = json.loads(config)["rootfs"]["diff_ids"]
        for layer, diff in zip(manifest["layers"], diff_ids, strict=True):
            hexd = layer["digest"].split(":")[1]
            data = blobs.get(hexd, have.get(layer["digest"]))
            if data is None:
                return 1, (f"Error response from daemon: failed to extract layer {diff}: content "
                           f"digest {layer['digest']}: not found")
            assert len(data) == layer["size"] and tsf.sha(data) == layer["digest"]
            tar = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
            assert tsf.sha(tar) == diff, f"{layer['digest']} is not layer {diff}"
            if hexd in blobs:
                self.loaded.append(f"blobs/sha256/{hexd}")
        self.loaded_blobs.update({"sha256:" + h: b for h, b in blobs.items()})
        name = desc["annotations"]["io.containerd.image.name"]
        tag = name.removeprefix("docker.io/").removeprefix("library/")
        self.images[tag] = image(diff_ids, tag)
        return 0, f"Loaded image: {tag}\n"

    def load(self, raw: bytes) -> tuple[int, str]:
        if self.load_error:
            return 1, self.load_error
        try:
            t = tarfile.open(fileobj=io.BytesIO(raw))
            if self.containerd and "index.json" in t.getnames() and "manifest.json" not in t.getnames():
                with t:
                    return self.load_oci(t)
            manifest = json.loads(t.extractfile("manifest.json").read())[0]
        except (tarfile.TarError, KeyError):
            return 1, EMPTY_LOAD
        with t:
            members = {m.name.rstrip("/"): m for m in t.getmembers()}
            config = t.extractfile(manifest["Config"]).read()
            diff_ids = json.loads(config)["rootfs"]["diff_ids"]
            missing = [p for p in manifest["Layers"] if p not in members]
            if missing and (self.refuse_partial or self.containerd):
                return 1, "Error processing tar file: unexpected EOF"
            for i, (path, diff) in enumerate(zip(manifest["Layers"], diff_ids, strict=True)):
                if path in members:
                    m = members[path]
                    if m.issym():
                        m = members[str(Path(path).parent / m.linkname)]
                    data = t.extractfile(m).read()
                    if data[:2] == b"\x1f\x8b":  # docker load unpacks a compressed layer tar
                        data = gzip.decompress(data)
                    assert tsf.sha(data) == diff, f"{path} is not layer {diff}"
                    self.loaded.append(path)
                elif not self.has_chain(diff_ids[: i + 1]):
                    return 1, (f"open /var/lib/docker/tmp/docker-import-1/{path}: "
                               "no such file or directory")
        loaded = image(diff_ids, manifest["RepoTags"][0])
        if self.load_rewrites_config:
            loaded["Id"] = "sha256:" + "e" * 64
        if not self.load_untagged:
            self.images[loaded["_tag"]] = loaded
        return 0, f"Loaded image: {loaded['_tag']}\n"


def layer_tar_name(diff: str) -> str:
    return diff.split(":")[1] + "/layer.tar"


def checks_pass(src: Engine, script: str) -> tuple[int, str] | None:
    """None when every staged file the script checks still matches its sha256, else exit 97."""
    for digest, path in re.findall(r"printf '([0-9a-f]{64})  (\S+)\\n' \| sha256sum", script):
        if hashlib.sha256(src.files.get(path, b"")).hexdigest() != digest:
            return 97, f"{path} differs from its sha256: not run"
    return None


class Ctx(FakeContext):
    """Answers the docker/df/python3 commands per node and carries out staging and pipelines."""

    def __init__(self, engines, dry=False):
        super().__init__(dry)
        self._set("engines", engines)
        self._set("pipelines", [])  # (source, peer)
        self._set("haves", [])  # what each filter run was told the peer has
        self._set("filters", [])  # the options of each filter run
        self._set("exports", [])  # the argv of each layer_export.py run (--check ones too)
        self._set("compressed", [])  # whether each pipeline compressed the archive
        self._set("masters", [])  # (source, peer) of each master connection opened
        self._set("through_master", [])  # whether each pipeline's ssh went through one
        self._set("checked", [])  # the staged files each pipeline checks before it runs

    def answer(self, alias, argv, stdin, command, kw):
        e = self.engines[alias]
        out, code, err = "", 0, ""
        if e.unreachable:  # ssh itself fails, for every command (the reachability check too)
            return RunResult(stdout="", stderr=f"ssh: connect to host {alias} port 22: No route to host",
                             exited=255, command=command)
        if argv[:1] == ["docker"]:
            assert argv[1:3] == ["-H", SOCK]
            argv = argv[3:]
        ids = sorted({v["Id"] for v in e.images.values()})
        if argv[:4] == ["image", "inspect", "--format", "{{json .RootFS.Layers}}"]:
            assert argv[4:] == ids and ids  # every image the engine holds, by full ID
            out = "".join(json.dumps(img["RootFS"]["Layers"]) + "\n" for img in e.images.values())
        elif argv[:4] == ["image", "inspect", "--format", "{{json .}}"] and len(argv) == 5:
            ref = tagged(argv[4])
            if ref in e.images:
                out = json.dumps(e.inspect(ref))
            else:
                code, err = 1, f"Error: No such image: {argv[4]}"
        elif argv == ["image", "ls", "-a", "-q", "--no-trunc"]:
            out = "\n".join(ids)
        elif argv == ["image", "ls", "--format", "{{.Repository}}:{{.Tag}}"]:
            out = "\n".join(e.images)
        elif argv == ["info", "--format", "{{json .}}"]:
            out = json.dumps(e.info())
            if e.info_fails:
                out, code, err = "", 1, "Cannot connect to the Docker daemon. Is the docker daemon running?"
        elif argv[:5] == ["history", "--no-trunc", "--human=false", "--format", "{{.Size}}"] and len(argv) == 6:
            if e.history is not None:
                out = "".join(f"{x}\n" for x in e.history)
            else:
                out = "".join(f"{1_000_000_000}\n" for _ in e.images[tagged(argv[-1])]["RootFS"]["Layers"])
        elif argv[:2] == ["sh", "-c"] and "df -P -B1" in argv[2] and argv[3:] == ["sh", e.root_dir]:
            out = f"Filesystem 1-blocks Used Available Capacity Mounted\n/dev/x 1 1 {e.free} 1% /\n"
        elif argv == ["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]:
            if e.python is None:
                code, err = 127, "sh: 1: python3: not found"
            else:
                out = e.python + "\n"
        elif argv[:2] == ["sh", "-c"] and argv[2].endswith('; exec "$@"') and argv[3] == "sh":
            # a staged helper run only as staged (nodeops.verified): layer_export.py --check
            code, err = checks_pass(e, argv[2]) or (0, "")
            if not code:
                code, raw, err = self.export(e, argv[4:])
                out = raw.decode()
        elif argv[:2] == ["sh", "-c"]:  # staging: the node writes the file and says where
            digest, name, encoded = argv[4], argv[5], argv[6]
            import base64

            data = base64.b64decode(encoded)
            assert hashlib.sha256(data).hexdigest() == digest
            under = STAGE
            if len(argv) > 8:  # a helper: its protocol goes a directory above it
                proto = base64.b64decode(argv[10])
                assert argv[8:10] == [hashlib.sha256(proto).hexdigest(), "protocol.py"]
                under = f"{STAGE}/{argv[8]}"
                e.files[f"{under}/protocol.py"] = proto
            path = f"{under}/{digest}/{name}"
            e.files[path] = data
            out = path + "\n"
        elif argv == ["sudo", "-n", "--", "ctr", f"--address={e.containerd_at}",
                      f"--namespace={e.namespace}", "content", "ls"]:
            if e.no_containerd_socket:
                code, err = 1, f'ctr: failed to dial "{e.containerd_at}": context deadline exceeded'
            else:
                out = e.content_ls()
        elif argv == ["true"]:  # after an exit of 255: does the node still answer? (it does)
            pass
        elif argv[:4] == ship.watched([]) and argv[4:7] == ["bash", "-c", ship.MASTER_SH]:
            # the source's master connection to the peer: connected at once, then open until
            # the ship closes its stdin (as watched does on the node)
            assert argv[7:] == ["master", argv[8],
                                "ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes"]
            stream = kw["in_stream"]
            if e.master_fails:  # ssh to the peer fails: the master ends at once, never ready
                self.masters.append((alias, argv[8]))
                return RunResult(stdout="", stderr=f"socket {MASTER_SOCKET}\n{e.master_fails}\n",
                                 exited=255, command=command)
            kw["err_stream"].write(f"socket {MASTER_SOCKET}\nready\n")
            self.masters.append((alias, argv[8]))
            while stream.read() != "":
                time.sleep(0.002)
            code, err = 143, ""
        elif argv[:4] == ship.watched([]):
            # the pipeline runs watched: ended on the node when the controller's stdin closes,
            # so it is given a stdin that stays open while it runs
            assert argv[4:6] == ["bash", "-c"] and len(argv) == 7, argv
            assert isinstance(kw.get("in_stream"), Feed) and stdin is None
            code, err = self.pipeline(alias, argv[6])
            if kw.get("err_stream") is not None:
                kw["err_stream"].write(err)  # stderr as it streams in (the helpers' progress)
        else:
            raise AssertionError(argv)
        return RunResult(stdout=out, stderr=err, exited=code, command=command)

    @staticmethod
    def _peer_of(addr: str) -> str:
        return next(n for n, a in ADDR.items() if a == addr)

    def pipeline(self, alias: str, script: str) -> tuple[int, str]:
        src = self.engines[alias]
        if src.dies_serving:
            src.unreachable = True
            return 255, f"ssh: connect to host {alias} port 22: No route to host"
        checks, _, body = script.rpartition("set -o pipefail; ")
        self.checked.append(re.findall(r"printf '[0-9a-f]{64}  (\S+)\\n' \| sha256sum", checks))
        if changed := checks_pass(src, checks):
            return changed
        lex = shlex.shlex(body, posix=True, punctuation_chars="|")
        lex.whitespace_split = True
        stages, cur = [], []
        for tok in lex:
            if tok == "|":
                stages.append(cur)
                cur = []
            else:
                cur.append(tok)
        stages.append(cur)
        first, *middle, remote = stages
        # each stage reads what the one before wrote, whatever its exit status (pipefail: the
        # pipeline's status is the last one that failed)
        if first[:4] == ["docker", "-H", SOCK, "save"]:
            assert len(first) == 5
            codes, data, stderr = [0], src.save(first[4]), ""
        else:
            code, data, stderr = self.export(src, first)
            codes = [code]
        for st in middle:
            if st[0] == "python3":
                code, data, err = self.filter(src, st, data)
                codes.append(code)
                stderr += err
            else:
                assert st == ["zstd", "-q", "-T0", "-3", "-c"]
        assert remote[:5] == ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes"]
        if remote[5:9] == ["-o", "ControlMaster=no", "-S", MASTER_SOCKET]:
            self.through_master.append(True)
            remote = [*remote[:5], *remote[9:]]
        else:
            self.through_master.append(False)
        assert remote[5] == "--"
        peer_name = next(n for n, a in ADDR.items() if a == remote[6])
        want = "docker -H unix:///var/run/docker.sock load"
        assert remote[7] in (want, "zstd -q -d -c | " + want) and len(remote) == 8
        assert ("zstd" in remote[7]) == any(st[0] == "zstd" for st in middle)
        self.pipelines.append((alias, peer_name))
        self.compressed.append("zstd" in remote[7])
        code, out = self.engines[peer_name].load(data)
        codes.append(code)
        if code:
            stderr += out if out.endswith("\n") else out + "\n"
        return next((c for c in reversed(codes) if c), 0), stderr

    def export(self, src: Engine, argv: list[str]) -> tuple[int, bytes, str]:
        """Run the staged layer_export.py on the source's layer store, as the node would (under
        sudo or not, the same here: the store is the test's)."""
        self.exports.append(argv)
        if argv[:3] == ["sudo", "-n", "--"]:
            argv = argv[3:]
        assert argv[:3] == ["python3", "-I", "-S"], argv
        script, opts = argv[3], argv[4:]
        assert script in src.files, script
        # every value rides in --opt=value form
        assert all(re.fullmatch(r"--[a-z-]+=\S+", o) for o in opts if o != "--check"), opts
        if not src.containerd and src.driver in ("overlay2", "vfs"):
            src.write_store()
        if src.containerd:
            src.write_content()
        src.write_staged()
        local = []
        for o in opts:
            k, eq, v = o.partition("=")
            local.append(f"{k}={src.node_path(v)}" if eq and v.startswith("/") else o)
        env = {**os.environ, "PATH": f"{src.node_path('/usr/bin')}:{os.environ['PATH']}"}
        cp = subprocess.run([sys.executable, "-I", "-S", str(src.node_path(script)), *local],
                            capture_output=True, timeout=60, check=False, env=env)
        return cp.returncode, cp.stdout, cp.stderr.decode()

    def filter(self, src: Engine, argv: list[str], data: bytes, tmp=None) -> tuple[int, bytes, str]:
        """Run the staged filter with the staged lists, as the source node would."""
        import tempfile

        script, rest = argv[1], argv[2:]
        with tempfile.TemporaryDirectory() as d:
            local = []
            for a in rest:
                if a in src.files:
                    p = Path(d) / Path(a).name
                    p.write_bytes(src.files[a])
                    local.append(str(p))
                else:
                    local.append(a)
            f = Path(d) / "filter" / "save_filter.py"  # its protocol a directory above, as staged
            f.parent.mkdir()
            f.write_bytes(src.files[script])
            (Path(d) / "protocol.py").write_bytes(src.files[nodeops.staged_files(script)[1]])
            self.filters.append([a if a not in src.files else Path(a).name for a in rest])
            if "--have-file" in rest:
                self.haves.append(json.loads(src.files[rest[rest.index("--have-file") + 1]]))
            cp = subprocess.run([sys.executable, str(f), *local], input=data, capture_output=True,
                                timeout=60, check=False)
        return cp.returncode, cp.stdout, cp.stderr.decode()


def profile_with(tmp_path, n_nodes: int, compression: str | None = None,
                 privilege: str | None = None):
    d = seed_data()
    if compression is not None:
        d["sparkdeploy"]["images"]["ship_compression"] = compression
    nodes = d["sparkdeploy"]["nodes"]
    for i in range(3, n_nodes + 1):
        n = copy.deepcopy(nodes[1])
        n["name"] = f"spark{i}"
        n["ssh"] = f"spark{i}"
        n["link"]["address"] = ADDR[f"spark{i}"]
        nodes.append(n)
    if privilege is not None:
        for n in nodes:
            n["privilege"] = privilege
    for e in d["sparkdeploy"]["engines"]:
        e["tensor_parallel"] = n_nodes
    return write_profile(tmp_path, d)


@pytest.fixture
def make(tmp_path):
    def _make(*peers: Engine, source: Engine | None = None, dry: bool = False,
              compression: str | None = None, privilege: str | None = None):
        engines = {"spark1": source or Engine([IMG, BASE_IMG])}
        for i, e in enumerate(peers):
            engines[f"spark{i + 2}"] = e
        for name, e in engines.items():
            e.fs = tmp_path / "nodes" / name
        ctx = Ctx(engines, dry=dry)
        path = (profile_with(tmp_path, len(engines), compression, privilege)
                if len(engines) > 2 or compression or privilege else SEED)
        return deployment(path, tmp_path / "state", ctx, dry=dry), ctx
    return _make



def test_peer_with_the_base_gets_only_the_top_layer_read_from_the_store(make):
    peer = Engine([BASE_IMG])
    dep, ctx = make(peer)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED, res.why
    assert (res.details["mode"], res.details["via"], res.details["layers_skipped"]) == ("partial", "store", 2)
    # no docker save, no filter: the helper read the one missing layer from spark1's store
    assert ctx.filters == [] and ctx.haves == []
    assert [x[-2:] for x in ctx.exports] == [["--have=2", "--progress=1"]]
    assert ctx.pipelines == [("spark1", "spark2")] and ctx.compressed == [False]
    assert peer.loaded == [layer_tar_name(DIFF[2])]  # only the top layer crossed
    assert peer.images["img:1"]["Id"] == IMG["Id"]
    assert res.details["bytes_in"] is None and res.details["bytes_out"] > len(LAYERS[2])
    # what the source ran: its image inspect (whose GraphDriver names its store: no docker
    # info), python3's version, the layer history, two files staged, the pipeline; no docker save
    ran = [a[3:5] if a[0] == "docker" else a[:1] for alias, a in ctx.calls if alias == "spark1"]
    assert sorted(ran) == [["bash"], ["bash"], ["history", "--no-trunc"], ["image", "inspect"],
                           ["python3"], ["sh"], ["sh"]]
    # the two bash: the master connection to spark2, opened while both nodes were asked, then
    # the pipeline through it
    assert ctx.masters == [("spark1", "192.168.100.11")] and ctx.through_master == [True]


@pytest.mark.parametrize("layout", ["oci", "legacy"])
def test_a_source_whose_store_is_not_read_filters_docker_save(make, layout):
    """btrfs keeps layers where layer_export.py does not read: the filtered save, on either
    layout of docker save."""
    peer = Engine([BASE_IMG])
    dep, ctx = make(peer, source=Engine([IMG, BASE_IMG], layout=layout, driver="btrfs"))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED, res.why
    assert (res.details["mode"], res.details["via"], res.details["layers_skipped"]) == ("partial", "save", 2)
    assert ctx.exports == []
    assert ctx.haves == [DIFF[:2]]  # the staged have-file the filter read: the present prefix
    assert ctx.filters == [["--layers-file", "layers.json", "--have-file", "have.json", "--progress", "1"]]
    assert ctx.pipelines == [("spark1", "spark2")] and ctx.compressed == [False]
    assert len(peer.loaded) == 1  # only the top layer crossed
    assert peer.images["img:1"]["Id"] == IMG["Id"]
    assert res.details["bytes_out"] < res.details["bytes_in"]


def test_a_layer_held_on_another_chain_is_still_sent(make):
    """The peer holds DIFF[0] and DIFF[2] but not DIFF[1]: only the first layer is skipped."""
    peer = Engine([OTHER])
    dep, ctx = make(peer)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED, res.why
    assert res.details["mode"] == "partial" and res.details["layers_skipped"] == 1
    assert [x[-2:] for x in ctx.exports] == [["--have=1", "--progress=1"]]
    assert peer.loaded == [layer_tar_name(d) for d in DIFF[1:3]]
    assert peer.images["img:1"]["RootFS"]["Layers"] == DIFF[:3]


def test_layers_held_but_not_as_one_chain_are_sent(make):
    """The peer holds DIFF[0] (base image) and DIFF[1] (on another chain): only DIFF[0] is
    skipped, as docker load needs the chain DIFF[0], DIFF[1] to skip DIFF[1]."""
    peer = Engine([image(DIFF[:1], "a:1"), image([DIFF[3], DIFF[1]], "b:1")])
    dep, ctx = make(peer)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED, res.why
    assert res.details["mode"] == "partial" and res.details["layers_skipped"] == 1
    assert [x[-2:] for x in ctx.exports] == [["--have=1", "--progress=1"]]
    assert len(ctx.pipelines) == 1 and len(peer.loaded) == 2


def test_empty_peer_gets_the_whole_image_read_from_the_store(make):
    """A classic peer holding none of the layers: every layer rebuilt from the source's store
    (--have=0), no docker save."""
    peer = Engine()
    dep, ctx = make(peer)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED, res.why
    assert (res.details["mode"], res.details["via"]) == ("full", "store")
    assert [x[-2:] for x in ctx.exports] == [["--have=0", "--progress=1"]] and ctx.filters == []
    assert len(peer.loaded) == 3 and peer.images["img:1"]["Id"] == IMG["Id"]
    assert re.fullmatch(r"sent img:1 spark1 -> spark2: full \(the peer has none of its layers\), "
                        r"0 MB read from spark1's layer store, 0/3 layers already there, \d+\.\ds",
                        res.why), res.why


def test_empty_peer_gets_the_whole_image_through_the_filter_as_a_counter(make):
    """Where the store is not read (here btrfs), the whole docker save goes through the filter,
    which only counts."""
    peer = Engine()
    dep, ctx = make(peer, source=Engine([IMG, BASE_IMG], driver="btrfs"))
    with dep.events.collect() as events:
        [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED and res.details["mode"] == "full"
    # no lists: the filter drops nothing, it only counts, so a full ship shows progress too
    assert ctx.filters == [["--progress", "1"]]
    assert ctx.haves == [] and len(peer.loaded) == 3
    assert "(the peer has none of its layers)" in res.why
    assert res.details["bytes_out"] == res.details["bytes_in"]
    progress = [e for e in events if isinstance(e, Progress)]
    assert progress and progress[-1] == Progress("image.ship", "spark2", res.details["bytes_in"],
                                                 res.details["bytes_in"], "B", "from spark1")


@pytest.mark.parametrize("held", [[], [BASE_IMG]], ids=["full", "partial"])
def test_a_ship_reports_progress_phases_and_its_result_once(make, held):
    dep, _ = make(Engine(held))  # a fresh peer each run (a shared one would already have it)
    with dep.events.collect() as events:
        [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED, res.why
    assert [e for e in events if isinstance(e, Result)] == [res]
    assert {(e.step, e.node) for e in events if isinstance(e, Log)} == {("image.ship", "spark2")}
    logs = [e.text for e in events if isinstance(e, Log)]
    assert len(logs) == 2 and logs[0].startswith("sending img:1 from spark1: ")
    assert logs[1] == "checking img:1 on spark2"
    progress = [e for e in events if isinstance(e, Progress)]
    assert {(p.step, p.node, p.unit, p.note) for p in progress} == {("image.ship", "spark2", "B", "from spark1")}
    # the layer store's helper knows its archive's size before it writes it, full or partial
    sent = res.details["bytes_out"]
    want_total = sent
    assert progress[:-1] and {p.total for p in progress[:-1]} == {want_total}
    # bytes read only grow; the last one is complete (the renderers always show it)
    assert [p.done for p in progress] == sorted(p.done for p in progress)
    assert progress[-1].done == progress[-1].total == sent
    # in order: sending, the progress, checking, the result
    kinds = [type(e).__name__ for e in events if not isinstance(e, Echo)]
    assert kinds[0] == "Log" and kinds[-2:] == ["Log", "Result"]
    assert set(kinds[1:-2]) == {"Progress"}


def test_peer_that_has_the_image_is_ok_and_nothing_is_sent(make):
    dep, ctx = make(Engine([IMG]))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert (res.step, res.status, res.node) == ("image.ship", Status.OK, "spark2")
    assert res.why == f"spark2 already has img:1 ({IMG['Id'][:19]})"
    assert ctx.pipelines == []


def test_a_containerd_peer_gets_an_oci_layout_of_the_blobs_it_lacks(make):
    """A classic source sends plain tars (a tar's digest is its diff ID): the peer's content
    store holds the base's plain blobs, so only the top layer crosses, as an OCI layout whose
    manifest names the rest."""
    peer = Engine([BASE_IMG], containerd=True)
    dep, ctx = make(peer)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED and res.details["via"] == "store", res.why
    assert res.details["mode"] == "partial" and res.details["layers_skipped"] == 2, res.why
    holds = staged_path("peer-blobs.json", json.dumps(DIFF[:2]).encode())
    assert ctx.exports == [["sudo", "-n", "--", "python3", "-I", "-S", EXPORT,
                            "--root=/var/lib/docker", "--driver=overlay2", f"--image-id={IMG['Id']}",
                            "--ref=img:1", f"--layers-file={LAYERS_JSON}", "--have=2",
                            "--format=oci", f"--peer-holds={holds}", "--progress=1"]]
    assert peer.loaded == ["blobs/sha256/" + DIFF[2].split(":")[1]]
    assert peer.images["img:1"]["RootFS"]["Layers"] == DIFF[:3]
    assert ctx.haves == [] and ctx.filters == []
    # the list is checked before the helper runs, like the helper and the layer list
    assert ctx.checked == [[EXPORT, PROTOCOL, LAYERS_JSON, holds]]


def test_only_the_images_own_layers_blobs_travel_in_the_peer_list(make):
    """A content store holds many blobs; the list staged on the source (in argv, so it must
    stay small) names only those of this image's layers."""
    peer = Engine([BASE_IMG, image([DIFF[3]], "three:1")], containerd=True)
    dep, ctx = make(peer)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.details["layers_skipped"] == 2, res.why
    holds = staged_path("peer-blobs.json", json.dumps(DIFF[:2]).encode())
    assert f"--peer-holds={holds}" in ctx.exports[0]


def test_a_containerd_peer_holding_every_layer_under_another_blob_gets_it_whole(make, monkeypatch):
    """The peer pulled the base gzip; the classic source's are plain tars: nothing it holds can
    be named, so every layer is sent, and the result says why."""
    monkeypatch.setitem(globals(), "GZIP_LAYERS", {DIFF[0], DIFF[2]})
    peer = Engine([BASE_IMG], containerd=True)
    dep, ctx = make(peer)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.details["mode"] == "full" and res.details["layers_skipped"] == 0, res.why
    assert "full (spark2 holds none of its blobs)" in res.why
    assert peer.loaded == ["blobs/sha256/" + d.split(":")[1] for d in DIFF[:3]]


def test_a_source_the_helper_cannot_read_sends_a_containerd_peer_the_whole_save(make):
    """docker save's partial archive is refused by a containerd-store peer: not tried."""
    peer = Engine([BASE_IMG], containerd=True)
    dep, ctx = make(peer, source=Engine([IMG, BASE_IMG], driver="btrfs"))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED and res.details["via"] == "full", res.why
    assert ctx.haves == [] and len(ctx.pipelines) == 1 and "refused" not in res.why


def test_a_layer_the_containerd_peer_holds_under_another_blob_is_sent_again(make):
    """The peer holds DIFF[2] gzip (as pulled); the classic source's is a plain tar, which the
    peer's content store lacks: the helper sends it too, and the result says 2 layers were
    there, not the 3 the peer's images list."""
    four = image(DIFF[:4], "four:1")
    peer = Engine([IMG], containerd=True)
    dep, ctx = make(peer, source=Engine([four, IMG]))
    [res] = ship.ship(dep, "spark2", "four:1")
    assert res.status is Status.CHANGED and res.details["via"] == "store", res.why
    assert "--have=3" in ctx.exports[0]
    assert res.details["layers_skipped"] == 2 and "2/4 layers already there" in res.why, res.why
    assert peer.loaded == ["blobs/sha256/" + d.split(":")[1] for d in DIFF[2:4]]
    assert peer.images["four:1"]["RootFS"]["Layers"] == DIFF[:4]


def test_a_plain_blob_without_a_label_counts_as_held(make):
    """containerd labels a blob with the diff ID it unpacks to only when it unpacked it: a plain
    tar imported for a layer already unpacked from another blob has no label, and its digest
    (its diff ID) says what it is."""
    peer = Engine([BASE_IMG], containerd=True)
    peer.unlabelled = set(DIFF[:2])
    dep, ctx = make(peer)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.details["layers_skipped"] == 2 and res.details["mode"] == "partial", res.why
    assert peer.loaded == ["blobs/sha256/" + DIFF[2].split(":")[1]]


def test_containerd_to_containerd_sends_only_the_blob_the_peer_lacks(make):
    peer = Engine([BASE_IMG], containerd=True)
    dep, ctx = make(peer, source=Engine([IMG, BASE_IMG], containerd=True))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.details["via"] == "store" and res.details["layers_skipped"] == 2, res.why
    gz = gzip.compress(LAYERS[2], mtime=0)
    assert peer.loaded == ["blobs/sha256/" + tsf.sha(gz).split(":")[1]]
    assert peer.images["img:1"]["RootFS"]["Layers"] == DIFF[:3]


def test_a_containerd_peer_whose_content_cannot_be_listed_gets_the_whole_archive(make):
    peer = Engine([BASE_IMG], containerd=True, no_containerd_socket=True)
    dep, ctx = make(peer)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED and res.details["mode"] == "full", res.why
    assert ("(the peer uses the containerd image store, whose content could not be listed: ctr: "
            'failed to dial "/run/containerd/containerd.sock": context deadline exceeded)') in res.why
    assert ctx.exports == [] and ctx.haves == [] and ctx.filters == [["--progress", "1"]]


def test_peer_refusing_the_partial_archive_gets_a_full_one(make):
    peer = Engine([BASE_IMG], refuse_partial=True)
    dep, ctx = make(peer)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED
    # the store's archive, then the filtered save, then the whole archive
    assert len(ctx.exports) == 1 and ctx.haves == [DIFF[:2]] and len(ctx.pipelines) == 3
    assert "the peer refused the partial archive" in res.why and "sent it whole" in res.why
    assert (res.details["mode"], res.details["via"]) == ("full", "full")
    assert len(peer.loaded) == 3


def test_not_enough_disk_fails_before_sending(make):
    dep, ctx = make(Engine([BASE_IMG], free=10**9))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert (res.step, res.status, res.node) == ("image.ship", Status.FAILED, "spark2")
    # one missing layer of 1 GB: the archive lands in a temp dir, then is applied
    assert res.why == "spark2 has 1.0 GB free in /var/lib/docker, needs about 2.0 GB for img:1"
    assert ctx.pipelines == []


def test_not_enough_disk_fails_in_a_dry_run_too(make):
    dep, ctx = make(Engine([BASE_IMG], free=10**9), dry=True)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.FAILED and res.why.startswith("spark2 has 1.0 GB free")


def test_missing_source_image_fails(make):
    dep, _ = make(Engine())
    [res] = ship.ship(dep, "spark2", "nope:1")
    assert res.status is Status.FAILED and res.why == "spark1 has no image nope:1"


def test_a_load_with_another_config_fails_the_ship(make):
    """Same diff IDs, other config digest: only the post-transfer check can tell."""
    dep, _ = make(Engine([BASE_IMG], load_rewrites_config=True))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.FAILED
    assert res.why == (f"after the transfer: config digest differs: source {IMG['Id']}, "
                       f"spark2 sha256:{'e' * 64}")


def test_a_load_that_tags_nothing_fails_the_ship(make):
    dep, _ = make(Engine([BASE_IMG], load_untagged=True))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert (res.step, res.status, res.node) == ("image.ship", Status.FAILED, "spark2")
    assert res.why == "after the transfer: spark2 has no img:1"


def test_dry_run_sends_nothing(make):
    peer = Engine([BASE_IMG])
    dep, ctx = make(peer, dry=True)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert (res.step, res.status, res.node) == ("image.ship", Status.SKIPPED, "spark2")
    # the size comes from the layer history (1 GB per layer here), read in the dry run too
    assert res.why == ("would send img:1 from spark1 to spark2: 2 of 3 layers already there, "
                       "~1000 MB, read from spark1's layer store")
    assert ctx.pipelines == [] and peer.files == {} and "img:1" not in peer.images
    # the store was only checked: layer_export.py --check
    assert [x[-2:] for x in ctx.exports] == [["--have=2", "--check"]]


def test_later_peers_ship_from_earlier_ones(make):
    peers = [Engine(), Engine(), Engine()]
    dep, ctx = make(*peers)
    results = ship.ship(dep, "all", "img:1")
    assert [r.status for r in results] == [Status.CHANGED] * 3
    # spark2 from the head; then spark3 from spark2 and spark4 from the head, at once
    assert ctx.pipelines[0] == ("spark1", "spark2")
    assert sorted(ctx.pipelines[1:]) == [("spark1", "spark4"), ("spark2", "spark3")]
    assert {r.node: r.details["source"] for r in results} == {
        "spark2": "spark1", "spark3": "spark2", "spark4": "spark1"}
    assert all(p.images["img:1"]["Id"] == IMG["Id"] for p in peers)


def test_a_peer_that_fails_leaves_the_next_ones_to_other_sources(make):
    # spark2 has no room: it fails before anything is sent, and serves no one
    peers = [Engine(free=10), Engine(), Engine()]
    dep, ctx = make(*peers)
    results = ship.ship(dep, "all", "img:1")
    assert [(r.node, r.status) for r in results] == [
        ("spark2", Status.FAILED), ("spark3", Status.CHANGED), ("spark4", Status.CHANGED)]
    assert ctx.pipelines == [("spark1", "spark3"), ("spark3", "spark4")]
    assert "img:1" not in peers[0].images
    assert all(p.images["img:1"]["Id"] == IMG["Id"] for p in peers[1:])


def test_a_source_lost_while_sending_leaves_its_receiver_to_another(make):
    # spark2 gets the image, then goes away as it starts sending it to spark3: spark4 (from the
    # head, beside it) serves spark3 in the next round
    peers = [Engine(dies_serving=True), Engine(), Engine()]
    dep, ctx = make(*peers)
    results = ship.ship(dep, "all", "img:1")
    assert sorted((r.node, r.status.value, r.details.get("source")) for r in results) == [
        ("spark2", "changed", "spark1"), ("spark2", "failed", None),
        ("spark3", "changed", "spark4"), ("spark4", "changed", "spark1")]
    assert [r.why for r in results if r.failed] == [
        "unreachable: ssh: connect to host spark2 port 22: No route to host"]
    assert ctx.pipelines == [("spark1", "spark2"), ("spark1", "spark4"), ("spark4", "spark3")]
    assert all(p.images["img:1"]["Id"] == IMG["Id"] for p in peers[1:])


def test_an_old_python_on_the_source_sends_the_image_whole_and_says_why(make):
    peer = Engine([BASE_IMG])
    dep, ctx = make(peer, source=Engine([IMG, BASE_IMG], python="3.6"))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED and res.details["mode"] == "full"
    assert "(spark1 has python3 3.6, the ship's helpers need 3.8+)" in res.why
    assert res.details["layers_skipped"] == 0 and ", 0/3 layers already there, " in res.why
    assert ctx.haves == [] and ctx.filters == [] and ctx.exports == [] and len(peer.loaded) == 3
    assert res.details["via"] == "full"


def test_no_python_on_the_source_sends_the_image_whole(make):
    dep, _ = make(Engine([BASE_IMG]), source=Engine([IMG, BASE_IMG], python=None))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.details["mode"] == "full" and "(spark1 has no python3, the ship's helpers need 3.8+)" in res.why


@pytest.mark.parametrize(("driver", "name"), [("overlay2", "layer_export.py"), ("btrfs", "save_filter.py")])
def test_a_staged_helper_changed_on_the_source_is_not_run(make, monkeypatch, driver, name):
    src = Engine([IMG, BASE_IMG], driver=driver)
    peer = Engine([BASE_IMG])
    dep, ctx = make(peer, source=src)
    real_stage = ship.stage_script

    def stage_then_tamper(host, script):
        path = real_stage(host, script)
        if script == name:
            src.files[path] += b"\nimport os  # someone else's line\n"
        return path

    monkeypatch.setattr(ship, "stage_script", stage_then_tamper)
    res, stranded = ship.ship(dep, "spark2", "img:1")
    assert (res.step, res.status, res.node) == ("image.ship", Status.FAILED, "spark1")
    assert res.why.startswith("spark1: /tmp/sparkdeploy-stage-0/")
    assert res.why.endswith(f"/{name} differs from its sha256: not run")
    # the only source is out: the peer is left without one, and says so
    assert (stranded.status, stranded.node) == (Status.FAILED, "spark2")
    assert stranded.why == f"no node left to send from (spark1: {res.why})"
    assert ctx.haves == [] and ctx.exports == [] and ctx.pipelines == [] and "img:1" not in peer.images


def test_the_ship_checks_the_python_the_filter_states():
    assert ship.FILTER_PYTHON == tsf.sf.MIN_PYTHON


def test_an_old_python_ship_reports_no_byte_count(make):
    """Without the filter nothing counts the bytes: no progress is made up."""
    dep, _ = make(Engine([BASE_IMG]), source=Engine([IMG, BASE_IMG], python="3.6"))
    with dep.events.collect() as events:
        [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED
    assert [e for e in events if isinstance(e, Progress)] == []


@pytest.mark.parametrize(("driver", "via"), [("overlay2", "store"), ("btrfs", "save")])
def test_python_3_8_on_the_source_runs_the_helpers(make, driver, via):
    dep, ctx = make(Engine([BASE_IMG]), source=Engine([IMG, BASE_IMG], python="3.8", driver=driver))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert (res.details["mode"], res.details["via"]) == ("partial", via)
    assert len(ctx.exports) == (via == "store") and ctx.haves == ([DIFF[:2]] if via == "save" else [])


def test_a_containerd_peer_that_has_the_image_is_ok(make):
    """On the containerd store the image ID is the manifest's digest: not compared."""
    dep, ctx = make(Engine([IMG], containerd=True))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.OK and ctx.pipelines == []


def test_zstd_compression_from_the_profile(make):
    peer = Engine([BASE_IMG])
    dep, ctx = make(peer, compression="zstd")
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED, res.why
    assert ctx.compressed == [True] and peer.images["img:1"]["Id"] == IMG["Id"]


def test_the_disk_check_reads_the_engines_own_data_root(make):
    dep, _ = make(Engine([BASE_IMG], free=10**9, root_dir="/data/docker"))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.why == "spark2 has 1.0 GB free in /data/docker, needs about 2.0 GB for img:1"


def test_a_dry_run_to_an_empty_peer_says_whole_and_why(make):
    dep, _ = make(Engine(), dry=True)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.why == ("would send img:1 from spark1 to spark2: whole (the peer has none of its "
                       "layers), ~3000 MB, read from spark1's layer store")


def test_layer_sizes_skip_the_empty_history_entries(make):
    """`docker history` lists metadata steps (0 B) too: only the sized ones are layers."""
    src = Engine([IMG, BASE_IMG], history=[0, 5_000_000, 0, 0, 2_000_000, 1_000_000, 0])
    dep, _ = make(Engine([BASE_IMG]), source=src, dry=True)
    [res] = ship.ship(dep, "spark2", "img:1")
    # the top layer's 5 MB
    assert res.why.endswith(": 2 of 3 layers already there, ~5 MB, read from spark1's layer store")


@pytest.mark.parametrize("history", [[], [7, 8]], ids=["none", "not-one-per-layer"])
def test_layer_sizes_guessed_from_the_image_size_when_history_does_not_fit(make, history):
    src = Engine([IMG, BASE_IMG], history=history)
    dep, _ = make(Engine([BASE_IMG]), source=src, dry=True)
    [res] = ship.ship(dep, "spark2", "img:1")
    # 3 MB image / 3 layers
    assert res.why.endswith(": 2 of 3 layers already there, ~1 MB, read from spark1's layer store")


def test_a_one_layer_image_without_history_is_sized_whole(make):
    one = image(DIFF[:1], "one:1")
    dep, _ = make(Engine(), source=Engine([one], history=[]), dry=True)
    [res] = ship.ship(dep, "spark2", "one:1")
    assert res.why.endswith(": whole (the peer has none of its layers), ~1 MB, read from spark1's "
                            "layer store")


def test_a_peer_image_without_layers_is_no_chain(make):
    """`docker image inspect` prints null for an image with no layers."""
    empty = image([], "empty:1")
    empty["RootFS"]["Layers"] = None
    peer = Engine([BASE_IMG, empty])
    dep, ctx = make(peer)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED, res.why
    assert res.details["layers_skipped"] == 2 and [x[-2:] for x in ctx.exports] == [["--have=2", "--progress=1"]]
    assert peer.loaded == [layer_tar_name(DIFF[2])]


def test_an_untagged_reference_is_checked_as_latest(make):
    """The post-transfer check looks for the name docker lists, also behind a registry port."""
    ref = "registry.local:5000/img"
    src_img, base = image(DIFF[:3], ref + ":latest"), image(DIFF[:2], "base:1")
    peer = Engine([base])
    dep, _ = make(peer, source=Engine([src_img, base]))
    [res] = ship.ship(dep, "spark2", ref)
    assert res.status is Status.CHANGED, res.why
    assert ref + ":latest" in peer.images


def test_a_peer_whose_docker_fails_is_one_failed_result(make):
    dep, ctx = make(Engine([BASE_IMG], info_fails=True))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert (res.step, res.status, res.node) == ("image.ship", Status.FAILED, "spark2")
    assert res.why == ("spark2: docker info failed: Cannot connect to the Docker daemon. "
                       "Is the docker daemon running?")
    assert ctx.pipelines == []


def test_an_unreachable_peer_is_one_failed_result(make):
    dep, ctx = make(Engine(unreachable=True))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert (res.step, res.status, res.node) == ("image.ship", Status.FAILED, "spark2")
    assert res.why == "unreachable: ssh: connect to host spark2 port 22: No route to host"


def test_a_partial_ship_says_what_crossed(make):
    dep, _ = make(Engine([BASE_IMG]))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert (res.step, res.status, res.node) == ("image.ship", Status.CHANGED, "spark2")
    assert re.fullmatch(r"sent img:1 spark1 -> spark2: partial, 0 MB read from spark1's layer store, "
                        r"2/3 layers already there, \d+\.\ds", res.why), res.why
    assert 0 <= res.details["seconds"] < 60


def test_a_refused_partial_archive_is_reported_once_per_way(make):
    """The store's archive and the filtered save's are both partial: each refusal is a note,
    then the whole archive (counted by the filter) goes."""
    dep, _ = make(Engine([BASE_IMG], refuse_partial=True))
    [res] = ship.ship(dep, "spark2", "img:1")
    refused = r"\(Error processing tar file: unexpected EOF\)"
    assert re.fullmatch(r"sent img:1 spark1 -> spark2: full, 0 MB, 2/3 layers already there, "
                        rf"\d+\.\ds; the peer refused the layer store's archive {refused}; the peer refused the "
                        rf"partial archive {refused}, sent it whole", res.why), res.why


def test_the_whole_archive_after_a_refusal_is_compressed_too(make):
    dep, ctx = make(Engine([BASE_IMG], refuse_partial=True), compression="zstd")
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED and ctx.compressed == [True, True, True]


def test_a_failed_load_fails_the_ship(make):
    err = "write /var/lib/docker/tmp/x: no space left on device"
    dep, _ = make(Engine(load_error=err))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert (res.step, res.status, res.node) == ("image.ship", Status.FAILED, "spark2")
    # the store's archive, then the whole docker save: both refused
    assert res.why == (f"transfer to spark2 failed: {err}; the peer refused the layer store's "
                       f"archive ({err})")


def test_a_ship_of_megabytes_says_how_many_crossed(make):
    big = image([DIFF[0], DIFF[4]], "big:1")
    peer = Engine([BASE_IMG])
    dep, _ = make(peer, source=Engine([big, BASE_IMG]))
    [res] = ship.ship(dep, "spark2", "big:1")
    assert re.fullmatch(r"sent big:1 spark1 -> spark2: partial, 3 MB read from spark1's layer store, "
                        r"1/2 layers already there, \d+\.\ds", res.why), res.why
    assert 3_000_000 < res.details["bytes_out"] < 3_020_000 and peer.loaded == [layer_tar_name(DIFF[4])]


def test_past_the_image_size_the_total_is_unknown_until_the_end(make):
    small = dict(IMG, Size=1000)  # an estimate below the archive's size (docker save's path)
    dep, _ = make(Engine(), source=Engine([small], driver="btrfs"))
    with dep.events.collect() as events:
        [res] = ship.ship(dep, "spark2", "img:1")
    progress = [e for e in events if isinstance(e, Progress)]
    assert res.status is Status.CHANGED and len(progress) >= 2
    assert {p.total for p in progress[:-1]} == {None}
    assert progress[-1].total == progress[-1].done == res.details["bytes_in"]


# --- the source's layer store, and the ways back to docker save ----------------------------------


def check(path: str) -> str:
    """The sha256 check a pipeline makes of a staged file before it runs."""
    if path.count("/") == 5:  # a helper: its protocol is checked with it
        return check_one(path) + check_one(PROTOCOL)
    return check_one(path)


def check_one(path: str) -> str:
    digest = path.split("/")[-2]
    return (f"printf '{digest}  {path}\\n' | sha256sum -c --status || "
            f"{{ echo '{path} differs from its sha256: not run' >&2; exit 97; }}; ")


def runs(ctx: Ctx, node: str, argv: list[str]) -> int:
    return sum(1 for alias, a in ctx.calls if alias == node and a == argv)


DOCKER_INFO = ["docker", "-H", SOCK, "info", "--format", "{{json .}}"]


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("privilege", ["sudo", "none"])
def test_the_export_pipeline_is_exact(make, privilege, compression):
    """python3 -I -S, every value in --opt=value form, under sudo -n -- only where the node's
    privilege is sudo, the staged helper and layers list checked first, zstd when the profile
    says, into the peer's docker load over the fast link; run watched."""
    peer = Engine([BASE_IMG])
    dep, ctx = make(peer, compression=compression, privilege=privilege)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED and res.details["via"] == "store", res.why
    [argv] = [a for alias, a in ctx.calls
              if alias == "spark1" and a[:1] == ["bash"] and ship.MASTER_SH not in a]
    export = (["sudo", "-n", "--"] if privilege == "sudo" else []) + [
        "python3", "-I", "-S", EXPORT, "--root=/var/lib/docker", "--driver=overlay2",
        f"--image-id={IMG['Id']}", "--ref=img:1", f"--layers-file={LAYERS_JSON}", "--have=2",
        "--progress=1"]
    load = "docker -H unix:///var/run/docker.sock load"
    ssh = (f"ssh -o BatchMode=yes -o StrictHostKeyChecking=yes -o ControlMaster=no "
           f"-S {MASTER_SOCKET} -- 192.168.100.11")
    tail = (f" | zstd -q -T0 -3 -c | {ssh} 'zstd -q -d -c | {load}'" if compression == "zstd"
            else f" | {ssh} '{load}'")
    script = check(EXPORT) + check(LAYERS_JSON) + "set -o pipefail; " + " ".join(export) + tail
    assert argv == [*ship.watched([]), "bash", "-c", script]
    assert ctx.exports == [export] and ctx.compressed == [compression == "zstd"]
    assert peer.loaded == [layer_tar_name(DIFF[2])] and peer.images["img:1"]["Id"] == IMG["Id"]


def test_a_store_the_helper_cannot_read_falls_back_to_the_filtered_save(make):
    src, peer = Engine([IMG, BASE_IMG]), Engine([BASE_IMG])
    dep, ctx = make(peer, source=src)
    src.write_store()
    gone = src.layerdb(tle.chain_ids(DIFF[:3])[2]) / "cache-id"
    gone.unlink()
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED, res.why
    assert (res.details["mode"], res.details["via"], res.details["layers_skipped"]) == ("partial", "save", 2)
    # the helper refused (exit 6, nothing written: the peer's load got no archive), then docker
    # save with the present layers dropped by the filter
    err = f"cannot read the layer's cache-id ({gone}): No such file or directory"
    assert re.fullmatch(r"sent img:1 spark1 -> spark2: partial, 0 MB of 0 MB through docker save, "
                        r"2/3 layers already there, \d+\.\ds; "
                        rf"reading the layer store \({re.escape(err)}\), sent it through docker save",
                        res.why), res.why
    assert len(ctx.exports) == 1 and ctx.haves == [DIFF[:2]] and len(ctx.pipelines) == 2
    assert len(peer.loaded) == 1 and peer.images["img:1"]["Id"] == IMG["Id"]
    assert 0 < res.details["bytes_out"] < res.details["bytes_in"]


def test_a_layer_changed_in_the_store_is_caught_and_the_save_serves(make):
    """A file of the layer changed under the store (same size): the rebuilt tar is not the diff
    ID's, the helper stops before the manifest (exit 7), the peer tags nothing from it."""
    src, peer = Engine([IMG, BASE_IMG]), Engine([BASE_IMG])
    dep, ctx = make(peer, source=src)
    src.write_store()
    f = src.layer_dir(tle.chain_ids(DIFF[:3])[2]) / "layer-2"
    f.write_bytes(b"X" * f.stat().st_size)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED and res.details["via"] == "save", res.why
    assert re.search(rf"; reading the layer store \(layer {DIFF[2]} rebuilt as sha256:[0-9a-f]{{64}}\), "
                     r"sent it through docker save$", res.why), res.why
    assert len(peer.loaded) == 1 and peer.images["img:1"]["Id"] == IMG["Id"]


CTD_EXPORT = ["python3", "-I", "-S", EXPORT, "--driver=containerd", f"--containerd={CTD_SOCK}",
              "--namespace=moby"]


def test_a_containerd_source_reads_the_missing_blobs_from_its_content_store(make):
    src, peer = Engine([IMG, BASE_IMG], containerd=True), Engine([BASE_IMG])
    dep, ctx = make(peer, source=src)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED and res.details["via"] == "store", res.why
    # its image has no overlay2 GraphDriver: docker info says the store (and, before Docker 27,
    # not where containerd listens: Docker's own default)
    assert runs(ctx, "spark1", DOCKER_INFO) == 1
    assert ctx.exports == [["sudo", "-n", "--", *CTD_EXPORT, f"--image-id={content_of(IMG)[0]}",
                            "--ref=img:1", f"--layers-file={LAYERS_JSON}", "--have=2",
                            "--progress=1"]]
    assert ctx.haves == [] and len(ctx.pipelines) == 1
    # only the top layer crossed, as containerd keeps it (gzip), and docker load unpacked it
    gz = gzip.compress(LAYERS[2], mtime=0)
    assert peer.loaded == [layer_tar_name(DIFF[2])]
    assert peer.images["img:1"]["RootFS"]["Layers"] == DIFF[:3]
    assert re.fullmatch(r"sent img:1 spark1 -> spark2: partial, 0 MB read from spark1's content "
                        r"store, 2/3 layers already there, \d+\.\ds", res.why), res.why
    assert len(gz) < res.details["bytes_out"] < len(gz) + 6 * 512 + len(IMG["_config"]) + 1000


def test_containerd_tells_where_it_listens_on_docker_27(make):
    src = Engine([IMG, BASE_IMG], containerd=True)
    src.info_extra = {"Containerd": {"Address": "/run/docker/containerd/containerd.sock",
                                     "Namespaces": {"Containers": "moby2", "Plugins": "plugins.moby"}}}
    src.containerd_at, src.namespace = "/run/docker/containerd/containerd.sock", "moby2"
    dep, ctx = make(Engine([BASE_IMG]), source=src)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.details["via"] == "store", res.why
    assert ctx.exports[0][8:10] == ["--containerd=/run/docker/containerd/containerd.sock",
                                   "--namespace=moby2"]


def test_a_containerd_source_whose_socket_is_elsewhere_falls_back_to_docker_save(make):
    src, peer = Engine([IMG, BASE_IMG], containerd=True, no_containerd_socket=True), Engine([BASE_IMG])
    dep, ctx = make(peer, source=src)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED and res.details["via"] == "save", res.why
    sock = src.node_path(CTD_SOCK)
    assert res.why.endswith(f"; reading the content store (no containerd socket at {sock}), sent "
                            "it through docker save"), res.why
    assert ctx.haves == [DIFF[:2]] and peer.images["img:1"]["RootFS"]["Layers"] == DIFF[:3]


def test_a_changed_blob_in_the_content_store_is_caught_and_the_save_serves(make):
    src, peer = Engine([IMG, BASE_IMG], containerd=True), Engine([BASE_IMG])
    gz = gzip.compress(LAYERS[2], mtime=0)
    src.damaged_blobs[tsf.sha(gz)] = gz[:-1] + bytes([gz[-1] ^ 1])
    dep, ctx = make(peer, source=src)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED and res.details["via"] == "save", res.why
    assert re.search(rf"; reading the content store \(layer {DIFF[2]}: blob {tsf.sha(gz)} read back "
                     r"as \d+ bytes with sha256:[0-9a-f]{64}\), sent it through docker save$",
                     res.why), res.why
    assert len(ctx.pipelines) == 2 and peer.images["img:1"]["RootFS"]["Layers"] == DIFF[:3]


def test_a_containerd_source_sends_a_whole_image_from_its_content_store(make):
    peer = Engine([])
    dep, ctx = make(peer, source=Engine([IMG, BASE_IMG], containerd=True))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.details["via"] == "store" and res.details["mode"] == "full", res.why
    assert ctx.exports[0][-2:] == ["--have=0", "--progress=1"]
    assert peer.loaded == [layer_tar_name(d) for d in DIFF[:3]]


def test_a_driver_the_helper_does_not_read_says_so(make):
    peer = Engine([BASE_IMG])
    dep, ctx = make(peer, source=Engine([IMG, BASE_IMG], driver="btrfs"))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert re.fullmatch(r"sent img:1 spark1 -> spark2: partial, 0 MB of 0 MB through docker save "
                        r"\(spark1's storage driver btrfs is not read directly\), 2/3 layers already "
                        r"there, \d+\.\ds", res.why), res.why
    assert runs(ctx, "spark1", DOCKER_INFO) == 1 and ctx.exports == [] and ctx.haves == [DIFF[:2]]


@pytest.mark.parametrize(("source", "damaged", "via", "checked"), [
    ({}, False, "read from spark1's layer store", True),
    ({"driver": "vfs"}, False, "read from spark1's layer store", True),
    ({}, True, "through docker save: cannot read the layer's cache-id ({gone}): No such file or "
     "directory", True),
    ({"driver": "btrfs"}, False, "through docker save: spark1's storage driver btrfs is not read "
     "directly", False),
    ({"containerd": True}, False, "read from spark1's content store", True),
], ids=["overlay2", "vfs", "unreadable", "btrfs", "containerd"])
def test_a_dry_run_says_which_way_it_would_send(make, source, damaged, via, checked):
    src, peer = Engine([IMG, BASE_IMG], **source), Engine([BASE_IMG])
    dep, ctx = make(peer, source=src, dry=True)
    gone = src.layerdb(tle.chain_ids(DIFF[:3])[2]) / "cache-id"
    if damaged:
        src.write_store()
        gone.unlink()
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.SKIPPED
    assert res.why == ("would send img:1 from spark1 to spark2: 2 of 3 layers already there, "
                       f"~1000 MB, {via.format(gone=gone)}")
    driver = source.get("driver", "overlay2")
    store = (CTD_EXPORT if source.get("containerd") else
             ["python3", "-I", "-S", EXPORT, "--root=/var/lib/docker", f"--driver={driver}"])
    image_id = content_of(IMG)[0] if source.get("containerd") else IMG["Id"]
    assert ctx.exports == ([[
        "sudo", "-n", "--", *store, f"--image-id={image_id}", "--ref=img:1",
        f"--layers-file={LAYERS_JSON}", "--have=2", "--check"]] if checked else [])
    assert ctx.pipelines == [] and ctx.filters == [] and peer.loaded == [] and "img:1" not in peer.images


@pytest.mark.parametrize(("driver", "root", "info_runs"), [
    ("overlay2", "/data/docker", 0), ("vfs", "/srv/docker", 1)])
def test_the_source_store_from_the_image_or_docker_info(make, driver, root, info_runs):
    """overlay2: the image's GraphDriver names the driver and, in its UpperDir, the Docker root,
    so the source is not asked docker info; vfs gives no directory there: docker info says."""
    peer = Engine([BASE_IMG])
    dep, ctx = make(peer, source=Engine([IMG, BASE_IMG], driver=driver, root_dir=root))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED and res.details["via"] == "store", res.why
    assert runs(ctx, "spark1", DOCKER_INFO) == info_runs
    assert runs(ctx, "spark2", DOCKER_INFO) == 1  # the peer's store and root, always asked
    [export] = ctx.exports
    assert export[7:9] == [f"--root={root}", f"--driver={driver}"]
    assert peer.loaded == [layer_tar_name(DIFF[2])] and peer.images["img:1"]["Id"] == IMG["Id"]


def test_a_peer_refusing_every_archive_fails_with_every_note(make):
    err = "write /var/lib/docker/tmp/x: no space left on device"
    peer = Engine([BASE_IMG], load_error=err)
    dep, ctx = make(peer)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert (res.step, res.status, res.node) == ("image.ship", Status.FAILED, "spark2")
    assert res.why == (f"transfer to spark2 failed: {err}; the peer refused the layer store's "
                       f"archive ({err}); the peer refused the partial archive ({err})")
    assert len(ctx.exports) == 1 and ctx.haves == [DIFF[:2]] and ctx.filters[-1] == ["--progress", "1"]
    assert len(ctx.pipelines) == 3 and "img:1" not in peer.images


def test_a_ship_through_docker_save_counts_both_sides(make):
    """A fallback to the filtered save says how much docker save read and how much crossed."""
    big_base = image(DIFF[4:5], "big-base:1")
    top = image([DIFF[4], DIFF[2]], "top:1")  # a small layer on a big one the peer holds
    src, peer = Engine([top, big_base]), Engine([big_base])
    dep, ctx = make(peer, source=src)
    src.write_store()
    split = src.layerdb(tle.chain_ids(top["RootFS"]["Layers"])[1]) / "tar-split.json.gz"
    split.unlink()
    [res] = ship.ship(dep, "spark2", "top:1")
    assert res.status is Status.CHANGED and res.details["via"] == "save", res.why
    err = f"cannot read {split}: [Errno 2] No such file or directory: '{split}'"
    assert re.fullmatch(r"sent top:1 spark1 -> spark2: partial, 0 MB of 3 MB through docker save, "
                        r"1/2 layers already there, \d+\.\ds; "
                        rf"reading the layer store \({re.escape(err)}\), sent it through docker save",
                        res.why), res.why
    assert peer.loaded and peer.images["top:1"]["Id"] == top["Id"]
    assert res.details["bytes_out"] < 100_000 < 3_000_000 < res.details["bytes_in"]


def test_a_peer_serving_the_next_reads_its_own_layer_store(make):
    """spark2 (Docker root /data/docker) gets the image from the head, then serves spark3."""
    peers = [Engine([BASE_IMG], root_dir="/data/docker"), Engine([BASE_IMG]), Engine([BASE_IMG])]
    dep, ctx = make(*peers)
    results = ship.ship(dep, "all", "img:1")
    assert [r.status for r in results] == [Status.CHANGED] * 3
    assert ("spark2", "spark3") in ctx.pipelines
    served = {r.node: r for r in results}["spark3"]
    assert served.details["via"] == "store", served.why


def test_a_master_connection_that_fails_leaves_the_transfer_to_connect_by_itself(make):
    src = Engine([IMG, BASE_IMG], master_fails="Host key verification failed.")
    dep, ctx = make(Engine([BASE_IMG]), source=src)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED and res.details["via"] == "store", res.why
    assert ctx.masters == [("spark1", "192.168.100.11")] and ctx.through_master == [False]


def test_every_pair_of_a_tree_ship_has_its_own_master_and_none_outlives_the_ship(make):
    dep, ctx = make(Engine([BASE_IMG]), Engine([BASE_IMG]), Engine([BASE_IMG]))
    before = threading.active_count()
    results = ship.ship(dep, "all", "img:1")
    assert [r.status for r in results] == [Status.CHANGED] * 3
    assert sorted(ctx.masters) == sorted((src, ADDR[dst]) for src, dst in ctx.pipelines)
    assert ctx.through_master == [True] * 3
    assert threading.active_count() == before  # each master's thread ended with its ship


def test_a_dry_run_opens_no_master_connection(make):
    dep, ctx = make(Engine([BASE_IMG]), dry=True)
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.SKIPPED and ctx.masters == []


def test_the_master_lives_in_a_private_temporary_directory_removed_when_it_ends():
    script = ship.MASTER_SH
    assert script.startswith('d=$(mktemp -d "${TMPDIR:-/tmp}/sparkdeploy-ship.XXXXXXXX") || exit 1')
    assert "trap 'rm -rf \"$d\"' EXIT" in script
    assert '"$@" -M -S "$d/m" -N' in script and '-- "$a" &' in script


def test_a_head_without_the_image_closes_the_master_it_opened(make):
    """The first round's connection opens while the head is asked for the image (so before it
    answers): when it has none, the connection is closed and nothing is left running."""
    dep, ctx = make(Engine([BASE_IMG]), source=Engine([BASE_IMG]))
    before = threading.active_count()
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.FAILED and res.why == "spark1 has no image img:1"
    assert ctx.masters == [("spark1", "192.168.100.11")] and ctx.pipelines == []
    assert threading.active_count() == before


@pytest.mark.parametrize("held", [[], [BASE_IMG]], ids=["full", "partial"])
def test_docker_saves_ways_go_through_the_master_and_count_against_the_image_size(make, held):
    """A source whose store is not read (btrfs): the filtered or whole docker save, through the
    master connection too, its progress counted against the image's size."""
    dep, ctx = make(Engine(held), source=Engine([IMG, BASE_IMG], driver="btrfs"))
    with dep.events.collect() as events:
        [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED and res.details["via"] == ("save" if held else "full")
    assert ctx.through_master == [True]
    progress = [e for e in events if isinstance(e, Progress)]
    assert progress[:-1] and {p.total for p in progress[:-1]} == {IMG["Size"]}
    assert progress[-1].done == progress[-1].total == res.details["bytes_in"]


def test_a_refused_store_archive_hands_over_through_the_master(make):
    dep, ctx = make(Engine([BASE_IMG], refuse_partial=True))
    [res] = ship.ship(dep, "spark2", "img:1")
    assert res.status is Status.CHANGED and res.details["via"] == "full"
    assert ctx.through_master == [True, True, True]


@pytest.mark.parametrize(("graph", "expected"), [
    ({"Name": "overlay2", "Data": {"UpperDir": "/var/lib/docker/overlay2/abc/diff"}},
     ("/var/lib/docker", "overlay2")),
    # a Docker root that has /overlay2/ in its own path: the last one is the driver's
    ({"Name": "overlay2", "Data": {"UpperDir": "/srv/overlay2/docker/overlay2/abc/diff"}},
     ("/srv/overlay2/docker", "overlay2")),
    ({"Name": "overlay2", "Data": {"UpperDir": "relative/overlay2/abc/diff"}}, "asked"),
    ({"Name": "overlay2", "Data": {"UpperDir": "/var/lib/docker/btrfs/abc"}}, "asked"),
    ({"Name": "overlay2", "Data": None}, "asked"),
    ({"Name": "vfs", "Data": {"UpperDir": "/var/lib/docker/overlay2/abc/diff"}}, "asked"),
    ({"Name": "overlayfs"}, "asked"),
    ({}, "asked"),
])
def test_the_source_store_from_the_image_inspect(monkeypatch, graph, expected):
    """Only an overlay2 GraphDriver with an absolute UpperDir under .../overlay2/ names the root;
    anything else asks docker info, without the layer listing the peer's facts need."""
    asked = []
    facts = ship.DockerDaemon(False, "/from/info", "vfs")
    monkeypatch.setattr(ship, "daemon_facts", lambda host, layers=True: asked.append(layers) or facts)
    got = ship.source_store(None, {"GraphDriver": graph})
    if expected == "asked":
        assert got is facts and asked == [False]
    else:
        assert (got.root_dir, got.driver, got.containerd_store, asked) == (*expected, False, [])
