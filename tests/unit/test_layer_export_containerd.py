"""The layer_export.py helper's ``--driver=containerd`` mode against a fake containerd holding real
images, read through a fake ``ctr``.

The content store is laid out as containerd keeps it: each blob once under
``<root>/io.containerd.content.v1.content/blobs/sha256/<hex>``, and which namespace holds which
blob (containerd's bolt metadata) in ``<root>/namespaces.json``: content is namespaced, so a blob
only another namespace holds is not there for ``moby``. The images are what Docker's containerd
image store holds after a pull or a load: layer tars made with ``tarfile``, stored plain (blob
digest = diff ID) or gzip-compressed (blob digest = sha256 of the gzip bytes), one of each larger
than the helper's 1 MiB read chunk; an OCI config with ``rootfs.diff_ids``; a manifest; an index
that also names an arm64 manifest ``moby`` lacks (a one-platform pull) and, before the image's
own manifest, a held buildx attestation manifest whose config lists other diff IDs (a helper
taking the first manifest it can read takes the wrong one).

The fake ``ctr`` reads its global flags as ctr does (``--address=X`` or ``--address X``, ``-n``),
dials only an address where the socket file is (the store is its directory; otherwise, or with a
``refused`` file there, ctr's own ``failed to dial`` and exit 1), and serves ``content ls
--quiet`` (the namespace's digests, one a line) and ``content get DIGEST`` (the blob's bytes in
chunks; ``ctr: content digest ...: not found`` and exit 1 for a blob the namespace does not hold
or whose file is gone). Anything else fails, so a helper asking ctr something else fails here
too. It logs each ``get`` (what the helper read); a ``fail-<hex>`` file holding N makes it die
after N bytes of that blob. The helper runs as the node runs it: a subprocess, ``--opt=value``
arguments, the archive on stdout.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import random
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparkdeploy.core.packaged import helper

SCRIPT = helper("layer_export.py")
REF = "registry.local/team/app:v7"
BLOCK = 512
CHUNK = 1 << 20
PROGRESS_RE = re.compile(r"^progress bytes=(\d+) total=(\d+)$")
INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA = [
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
]
FOREIGN = "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"

FAKE_CTR = r'''
import json, os, sys

def fail(msg):
    sys.stderr.write("ctr: " + msg + "\n")
    sys.exit(1)

args, opts = sys.argv[1:], {"address": "/run/containerd/containerd.sock", "namespace": "default"}
while args and args[0].startswith("-"):
    flag, eq, value = args.pop(0).lstrip("-").partition("=")
    flag = {"a": "address", "n": "namespace"}.get(flag, flag)
    if flag not in opts or not (eq or args):
        fail("flag provided but not defined: -" + flag)
    opts[flag] = value if eq else args.pop(0)
addr = opts["address"]
root = os.path.dirname(addr)
for gone, why in ((not os.path.exists(addr), "no such file or directory"),
                  (os.path.exists(os.path.join(root, "refused")), "connection refused")):
    if gone:
        fail(f'failed to dial "{addr}": connection error: desc = "transport: error while dialing: '
             f'dial unix {addr}: connect: {why}"')
with open(os.path.join(root, "namespaces.json")) as f:
    held = json.load(f).get(opts["namespace"], [])
if args in (["content", "ls", "--quiet"], ["content", "ls", "-q"]):
    sys.stdout.write("".join(d + "\n" for d in held))
elif len(args) == 3 and args[:2] == ["content", "get"]:
    digest = args[2]
    with open(os.path.join(root, "gets.log"), "a") as log:
        log.write(digest + "\n")
    algo, _, hexd = digest.partition(":")
    try:
        if digest not in held:
            raise OSError
        f = open(os.path.join(root, "io.containerd.content.v1.content", "blobs", algo, hexd), "rb")
    except OSError:
        fail(f"content digest {digest}: not found")
    marker = os.path.join(root, "fail-" + hexd)
    left = int(open(marker).read()) if os.path.exists(marker) else -1
    try:
        while left:
            chunk = f.read(65536 if left < 0 else min(65536, left))
            if not chunk:
                break
            left -= len(chunk) if left > 0 else 0
            sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
    except BrokenPipeError:
        os._exit(1)
    if os.path.exists(marker):
        fail("unexpected EOF")
else:
    fail("unknown command: " + " ".join(args))
'''


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def hexof(digest: str) -> str:
    return digest.split(":", 1)[1]


def make_tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture(scope="module")
def tars() -> list[bytes]:
    rng = random.Random(7)
    return [
        make_tar({"etc/hostname": b"spark-node-1\n", "bin/tool": rng.randbytes(700)}),
        make_tar({"opt/model.bin": rng.randbytes(CHUNK + CHUNK // 2)}),  # gzip, still > 1 MiB
        make_tar({"opt/big.bin": rng.randbytes(CHUNK + 777), "opt/one": b"1"}),  # plain, > 1 MiB
        make_tar({"etc/motd": b"hello\n" * 400}),
    ]


class Containerd:
    """The fake daemon's state: the content store, its namespaces, the socket, and the ctr."""

    def __init__(self, base: Path) -> None:
        self.root = base / "containerd"
        self.blobs = self.root / "io.containerd.content.v1.content" / "blobs" / "sha256"
        self.blobs.mkdir(parents=True)
        self.sock = self.root / "containerd.sock"
        self.sock.touch()
        self.held: dict[str, list[str]] = {"moby": [], "default": []}
        self.save()
        self.ctr = base / "bin" / "ctr"
        self.ctr.parent.mkdir()
        self.ctr.write_text(f"#!{sys.executable} -IS\n{FAKE_CTR}")
        self.ctr.chmod(0o755)

    def save(self) -> None:
        (self.root / "namespaces.json").write_text(json.dumps(self.held))

    def path(self, digest: str) -> Path:
        return self.blobs / hexof(digest)

    def put(self, data: bytes, ns: str = "moby") -> str:
        digest = sha(data)
        self.path(digest).write_bytes(data)
        if digest not in self.held[ns]:
            self.held[ns].append(digest)
            self.save()
        return digest

    def hold(self, digest: str, held: bool = True) -> None:
        """``moby`` holds ``digest`` (with ``held`` false: no longer)."""
        (self.held["moby"].append if held else self.held["moby"].remove)(digest)
        self.save()

    def gets(self) -> list[str]:
        log = self.root / "gets.log"
        return log.read_text().split() if log.exists() else []

def descriptor(media: str, data: bytes, **more) -> dict:
    return {"mediaType": media, "digest": sha(data), "size": len(data), **more}


def config_of(diff_ids: list[str], arch: str = "amd64") -> bytes:
    doc = {"architecture": arch, "os": "linux", "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    return json.dumps(doc).encode()


def manifest_of(config: bytes, layers: list[dict]) -> bytes:
    doc = {"schemaVersion": 2, "mediaType": MANIFEST, "config": descriptor(CONFIG, config), "layers": layers}
    return json.dumps(doc, indent=3).encode()


def index_of(manifests: list[dict]) -> bytes:
    return json.dumps({"schemaVersion": 2, "mediaType": INDEX, "manifests": manifests}, indent=3).encode()


@dataclass
class Image:
    store: Containerd
    tars: list[bytes]
    blobs: list[bytes]
    descs: list[dict]
    config: bytes
    extras: list[dict]  # the index's other manifests: arm64 (not held), an attestation (held)
    read_too: list[str]  # the attestation's manifest and config: read while looking
    layers_file: Path
    manifest: bytes = b""
    target: str = ""

    @property
    def diff_ids(self) -> list[str]:
        return [sha(t) for t in self.tars]

    def publish(self, layers: list[dict]) -> None:
        """A manifest of the config with these layer descriptors, and the index naming it: the
        image's target."""
        self.manifest = manifest_of(self.config, layers)
        self.store.put(self.manifest)
        platform = {"architecture": "amd64", "os": "linux"}
        self.target = self.store.put(index_of([*self.extras, descriptor(MANIFEST, self.manifest, platform=platform)]))

    def declared(self, i: int) -> int:
        return json.loads(self.manifest)["layers"][i]["size"]


@pytest.fixture
def img(tmp_path, tars) -> Image:
    store = Containerd(tmp_path)
    blobs = [gzip.compress(t, mtime=0) if m.endswith("gzip") else t for t, m in zip(tars, MEDIA, strict=True)]
    for b in blobs:
        store.put(b)
    config = config_of([sha(t) for t in tars])
    store.put(config)
    arm = manifest_of(config_of(["sha256:" + "a" * 64], "arm64"), [])
    intoto = b'{"_type": "https://in-toto.io/Statement/v0.1"}'
    att_config = config_of([sha(intoto)], "unknown")
    att = manifest_of(att_config, [descriptor("application/vnd.in-toto+json", intoto)])
    for b in (intoto, att_config, att):
        store.put(b)
    store.put(arm, ns="default")  # another namespace's: not there for moby
    extras = [
        descriptor(MANIFEST, arm, platform={"architecture": "arm64", "os": "linux"}),
        descriptor(MANIFEST, att, platform={"architecture": "unknown", "os": "unknown"},
                   annotations={"vnd.docker.reference.type": "attestation-manifest"}),
    ]
    layers_file = tmp_path / "layers.json"
    layers_file.write_text(json.dumps([sha(t) for t in tars]))
    descs = [descriptor(m, b) for m, b in zip(MEDIA, blobs, strict=True)]
    image = Image(store, tars, blobs, descs, config, extras, [sha(att), sha(att_config)], layers_file)
    image.publish(descs)
    return image


def run(img: Image, have: int, *extra: str, **over: str) -> subprocess.CompletedProcess:
    args = {"driver": "containerd", "containerd": str(img.store.sock), "namespace": "moby",
            "ctr": str(img.store.ctr), "image-id": img.target, "ref": REF,
            "layers-file": str(img.layers_file), "have": str(have)}
    args.update({k.replace("_", "-"): v for k, v in over.items()})
    argv = [sys.executable, str(SCRIPT), *(f"--{k}={v}" for k, v in args.items()), *extra]
    return subprocess.run(argv, capture_output=True, timeout=60)


def archive(out: bytes) -> list[tuple[str, bytes]]:
    """The members of a written archive, in order (a tar that does not parse fails here)."""
    with tarfile.open(fileobj=io.BytesIO(out), mode="r:") as t:
        return [(m.name, t.extractfile(m).read()) for m in t.getmembers()]


def member(diff_id: str) -> str:
    return hexof(diff_id) + "/layer.tar"


def diff_id_of(blob: bytes) -> str:
    """What `docker load` checks: the layer's compression found from its bytes, the tar's sha256."""
    data = gzip.decompress(blob) if blob[:2] == b"\x1f\x8b" else blob
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as t:
        assert t.getmembers()
    return sha(data)


# --- the fake is containerd's ------------------------------------------------------------------


def test_the_fake_ctr_reads_the_store_as_ctr_does(img):
    s = img.store

    def ctr(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(s.ctr), *args], capture_output=True, timeout=30)

    other = s.put(b'{"only": "default"}', ns="default")
    ls = ctr("--address", str(s.sock), "--namespace", "moby", "content", "ls", "--quiet")
    assert ls.returncode == 0 and ls.stdout.decode().split() == s.held["moby"]
    ls = ctr(f"--address={s.sock}", "-n", "default", "content", "ls", "-q")
    assert ls.stdout.decode().split() == s.held["default"] and other in s.held["default"]
    got = ctr(f"--address={s.sock}", "--namespace=moby", "content", "get", img.descs[1]["digest"])
    assert got.returncode == 0 and got.stdout == img.blobs[1]
    gone = ctr(f"--address={s.sock}", "--namespace=moby", "content", "get", other)
    assert gone.returncode == 1 and gone.stdout == b""
    assert gone.stderr.decode() == f"ctr: content digest {other}: not found\n"
    s.sock.unlink()
    dial = ctr(f"--address={s.sock}", "--namespace=moby", "content", "ls", "--quiet")
    assert dial.returncode == 1 and dial.stderr.decode().startswith(f'ctr: failed to dial "{s.sock}"')
    # plain layers are their diff ID; gzip ones are not, and the large ones cross a read chunk
    for tar, blob, d in zip(img.tars, img.blobs, img.descs, strict=True):
        assert d["digest"] == sha(blob) and diff_id_of(blob) == sha(tar)
        assert (blob == tar) != d["mediaType"].endswith("gzip")
    assert len(img.blobs[1]) > CHUNK and len(img.blobs[2]) > CHUNK


# --- the archive -------------------------------------------------------------------------------


@pytest.mark.parametrize("have", [0, 1, 2, 3, 4])
def test_the_archive_holds_the_missing_blobs_as_stored(img, have):
    p = run(img, have)
    assert p.returncode == 0, p.stderr
    assert len(p.stdout) % BLOCK == 0 and p.stdout.endswith(b"\0" * (2 * BLOCK))
    members = archive(p.stdout)
    cfg = hexof(sha(img.config)) + ".json"
    assert [n for n, _ in members] == [*map(member, img.diff_ids[have:]), cfg, "manifest.json"]
    assert [d for _, d in members[:-2]] == img.blobs[have:]
    assert members[-2][1] == img.config
    assert json.loads(members[-1][1]) == [{"Config": cfg, "RepoTags": [REF], "Layers": [*map(member, img.diff_ids)]}]
    report = json.loads(p.stderr.decode().splitlines()[-1])
    assert report == {"bytes_out": len(p.stdout), "layers_sent": 4 - have, "layers": 4}


@pytest.mark.parametrize("have", [0, 2])
def test_docker_load_finds_each_sent_layer_s_diff_id(img, have):
    members = dict(archive(run(img, have).stdout))
    manifest = json.loads(members["manifest.json"])[0]
    diff_ids = json.loads(members[manifest["Config"]])["rootfs"]["diff_ids"]
    assert diff_ids == img.diff_ids and len(manifest["Layers"]) == 4
    sent = [(diff, name) for diff, name in zip(diff_ids, manifest["Layers"], strict=True) if name in members]
    assert sent == [(d, member(d)) for d in img.diff_ids[have:]]
    assert all(diff_id_of(members[name]) == diff for diff, name in sent)


@pytest.mark.parametrize("target", ["manifest", "index in an index", "arm64 manifest held, not its config"])
def test_the_manifest_is_found_under_any_target(img, target):
    if target == "manifest":
        img.target = sha(img.manifest)
    elif target == "index in an index":
        inner = img.store.path(img.target).read_bytes()
        img.target = img.store.put(index_of([descriptor(INDEX, inner)]))
    else:
        img.store.hold(img.extras[0]["digest"])
    p = run(img, 1)
    assert p.returncode == 0, p.stderr
    assert [d for _, d in archive(p.stdout)][:-1] == [*img.blobs[1:], img.config]


def test_odd_entries_under_the_target_are_passed_over(img):
    """A held manifest whose config is no object and index entries whose digest is no string
    are skipped, as an unreadable platform's are: the image's own manifest is still found."""
    odd = img.store.put(json.dumps({"schemaVersion": 2, "config": "sha256:" + "b" * 64,
                                    "layers": []}).encode())
    img.target = img.store.put(index_of([{"mediaType": MANIFEST, "digest": ["x"], "size": 1},
                                         {"mediaType": MANIFEST, "digest": odd, "size": 1},
                                         descriptor(MANIFEST, img.manifest)]))
    p = run(img, 1)
    assert p.returncode == 0, p.stderr
    assert [d for _, d in archive(p.stdout)][:-1] == [*img.blobs[1:], img.config]


@pytest.mark.parametrize("have", [1, 2, 3])
def test_layers_the_peer_has_are_never_read(img, have):
    """Their blobs are still listed but their files are gone: reading one would fail."""
    for blob in img.blobs[:have]:
        img.store.path(sha(blob)).unlink()
    p = run(img, have)
    assert p.returncode == 0, p.stderr
    assert [d for _, d in archive(p.stdout)][:-2] == img.blobs[have:]
    looked = [img.target, *img.read_too, sha(img.manifest), sha(img.config)]
    assert sorted(img.store.gets()) == sorted([*looked, *(d["digest"] for d in img.descs[have:])])


def test_a_ref_that_looks_like_an_option_is_the_tag(img):
    p = run(img, 4, ref="--check")
    assert p.returncode == 0, p.stderr
    assert json.loads(dict(archive(p.stdout))["manifest.json"])[0]["RepoTags"] == ["--check"]


# --- --check and progress ----------------------------------------------------------------------


@pytest.mark.parametrize("have", [0, 1, 4])
def test_check_counts_the_stored_blobs_and_reads_none(img, have):
    p = run(img, have, "--check")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"layers_sent": 4 - have, "bytes": sum(map(len, img.blobs[have:]))}
    assert sum(map(len, img.blobs)) != sum(map(len, img.tars))  # blob sizes, not the tars'
    assert not set(img.store.gets()) & {d["digest"] for d in img.descs}


@pytest.mark.parametrize("have", [0, 3, 4])
def test_progress_total_is_the_archive_length_from_the_first_line(img, have):
    p = run(img, have, "--progress=0.000001")
    assert p.returncode == 0, p.stderr
    lines = p.stderr.decode().splitlines()
    counts = [tuple(map(int, PROGRESS_RE.match(line).groups())) for line in lines[:-1]]
    assert counts[0] == (BLOCK, len(p.stdout))
    assert {t for _, t in counts} == {len(p.stdout)} and counts[-1][0] == len(p.stdout)
    assert [n for n, _ in counts] == sorted(n for n, _ in counts)
    assert json.loads(lines[-1]) == {"bytes_out": len(p.stdout), "layers_sent": 4 - have, "layers": 4}


# --- what cannot be read: exit 6, nothing written ----------------------------------------------


def spoil(img: Image, case: str) -> tuple[dict, str]:
    """The store or the arguments spoilt one way: (arguments changed, what the error names)."""
    store, descs, diff_ids = img.store, img.descs, img.diff_ids
    if case == "no ctr":
        return {"ctr": "/nonexistent/ctr"}, "no /nonexistent/ctr"
    if case == "socket absent":  # said by the helper: ctr would wait 10 s before failing to dial
        store.sock.unlink()
        return {}, f"no containerd socket at {store.sock}"
    if case == "ctr cannot dial":  # a socket file left by a containerd that is gone
        (store.root / "refused").touch()
        return {}, f'ctr content ls failed: ctr: failed to dial "{store.sock}"'
    if case == "target in another namespace":
        index = store.path(img.target).read_bytes() + b"\n"
        return {"image_id": store.put(index, ns="default")}, "is not in containerd's content store"
    if case == "layers file differs":
        img.layers_file.write_text(json.dumps(diff_ids[::-1]))
        return {}, f"no manifest under {img.target} in the content store lists these layers"
    if case == "manifest not held":
        store.hold(sha(img.manifest), False)
        return {}, f"no manifest under {img.target} in the content store lists these layers"
    if case == "config not its digest":
        store.path(sha(img.config)).write_bytes(img.config.replace(b"amd64", b"arm64"))
        return {}, f"the image config {sha(img.config)} read back as another digest"
    if case == "layer blob missing":
        store.hold(descs[2]["digest"], False)
        return {}, f"{diff_ids[2]}'s blob {descs[2]['digest']} is not in the content store"
    if case == "layer media type unknown":
        img.publish([*descs[:3], {**descs[3], "mediaType": FOREIGN}])
        return {}, f"layer {diff_ids[3]} is a '{FOREIGN}' blob"
    if case == "layer count differs":
        img.publish(descs[:3])
        return {}, "lists 3 layers, the config 4"
    if case == "image id not a digest":
        return {"image_id": hexof(img.target)}, "is not a sha256 digest"
    have = {"have too many": "5", "have negative": "-1"}[case]
    return {"have": have}, f"--have {have} is not between 0 and 4"


@pytest.mark.parametrize("check", [False, True], ids=["export", "check"])
@pytest.mark.parametrize(
    "case",
    ["no ctr", "socket absent", "ctr cannot dial", "target in another namespace", "layers file differs",
     "manifest not held", "config not its digest", "layer blob missing", "layer media type unknown",
     "layer count differs", "image id not a digest", "have too many", "have negative"],
)
def test_what_cannot_be_read_is_refused_before_any_byte(img, case, check):
    over, cause = spoil(img, case)
    have = int(over.pop("have", "0"))
    p = run(img, have, *(["--check"] if check else []), **over)
    assert p.returncode == 6 and p.stdout == b"", p.stderr
    lines = p.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and cause in lines[0], lines
    assert not set(img.store.gets()) & {d["digest"] for d in img.descs}


# --- a blob that is not what the manifest says: exit 7, no manifest ----------------------------


def change(img: Image, i: int, case: str) -> None:
    """Layer ``i``'s blob made other than its descriptor says, one way."""
    path, size = img.store.path(img.descs[i]["digest"]), img.descs[i]["size"]
    if case == "corrupt":  # its length, other bytes
        data = bytearray(path.read_bytes())
        data[size // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif case in ("truncated", "lengthened"):
        path.write_bytes(path.read_bytes()[:-1000] if case == "truncated" else path.read_bytes() + b"\0" * 10)
    elif case in ("declared shorter", "declared longer"):  # the blob is its digest; the size is not
        delta = -1 if case == "declared shorter" else 1
        img.publish([{**d, "size": d["size"] + delta} if j == i else d for j, d in enumerate(img.descs)])
    else:  # ctr fails after half of the blob, or after all of it
        (img.store.root / f"fail-{path.name}").write_text(str(size // 2 if case == "ctr dies midway" else size))


@pytest.mark.parametrize("i", [1, 2], ids=["gzip", "plain"])
@pytest.mark.parametrize(
    "case",
    ["corrupt", "truncated", "lengthened", "declared shorter", "declared longer", "ctr dies midway",
     "ctr fails after every byte"],
)
def test_a_blob_that_differs_stops_the_archive_before_its_manifest(img, case, i):
    change(img, i, case)
    p = run(img, 0)
    assert p.returncode == 7, p.stderr
    lines = p.stderr.decode().splitlines()
    assert lines[-1].startswith("error: ") and img.diff_ids[i] in lines[-1], lines
    assert not any(line.startswith("{") for line in lines)  # no success report
    assert b"manifest.json" not in p.stdout and hexof(sha(img.config)).encode() + b".json" not in p.stdout
    # the layers before went out whole; of this one, never more than its header declared
    assert all(blob in p.stdout for blob in img.blobs[:i])
    body_at = sum(BLOCK + -(-img.declared(j) // BLOCK) * BLOCK for j in range(i)) + BLOCK
    assert len(p.stdout) <= body_at + img.declared(i)


# --- --format=oci: an OCI image layout for a peer on the containerd image store -----------------

OCI_LAYOUT = b'{"imageLayoutVersion":"1.0.0"}'
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"


def blob_name(digest: str) -> str:
    return "blobs/sha256/" + hexof(digest)


def oci_index_of(manifest: bytes, media: str = MANIFEST) -> dict:
    annotations = {"io.containerd.image.name": REF, "org.opencontainers.image.ref.name": "v7"}
    return {"schemaVersion": 2, "mediaType": INDEX,
            "manifests": [{"mediaType": media, "size": len(manifest), "digest": sha(manifest),
                           "annotations": annotations}]}


def holds_file(img: Image, digests: list[str]) -> str:
    path = img.store.root.parent / "holds.json"
    path.write_text(json.dumps(digests))
    return str(path)


@pytest.mark.parametrize("have", [0, 1, 2, 3, 4])
def test_the_oci_layout_holds_the_missing_blobs_as_stored_and_the_source_manifest(img, have):
    p = run(img, have, "--format=oci")
    assert p.returncode == 0, p.stderr
    assert len(p.stdout) % BLOCK == 0 and p.stdout.endswith(b"\0" * (2 * BLOCK))
    members = archive(p.stdout)
    assert [n for n, _ in members] == [*(blob_name(d["digest"]) for d in img.descs[have:]), blob_name(sha(img.config)),
                                       blob_name(sha(img.manifest)), "oci-layout", "index.json"]
    assert [d for _, d in members[:-4]] == img.blobs[have:]  # gzip stays gzip
    assert [b[:2] == b"\x1f\x8b" for b in img.blobs] == [False, True, False, True]
    assert members[-4][1] == img.config
    assert members[-3][1] == img.manifest  # the source's bytes (indented), not a rewrite
    assert members[-2][1] == OCI_LAYOUT
    assert json.loads(members[-1][1]) == oci_index_of(img.manifest)
    lines = p.stderr.decode().splitlines()
    assert {int(PROGRESS_RE.match(line)[2]) for line in lines[:-1]} == {len(p.stdout)}
    assert json.loads(lines[-1]) == {"bytes_out": len(p.stdout), "layers_sent": 4 - have, "layers": 4}


@pytest.mark.parametrize("media", [DOCKER_MANIFEST, None], ids=["docker v2", "no media type"])
def test_the_oci_index_names_the_manifest_s_own_media_type(img, media):
    """A Docker schema 2 manifest is listed as one; a manifest naming none as an OCI one."""
    doc = json.loads(img.manifest)
    if media:
        doc["mediaType"] = media
    else:
        del doc["mediaType"]
    manifest = json.dumps(doc).encode()
    img.target = img.store.put(manifest)
    p = run(img, 4, "--format=oci")
    assert p.returncode == 0, p.stderr
    members = archive(p.stdout)
    assert members[-3] == (blob_name(sha(manifest)), manifest)
    assert json.loads(members[-1][1]) == oci_index_of(manifest, media or MANIFEST)


@pytest.mark.parametrize("held, have", [(0, 4), (1, 4), (2, 3), (3, 4), (4, 4), (4, 2), (2, 1)])
def test_peer_holds_lowers_have_to_the_leading_blobs_the_peer_holds(img, held, have):
    """The peer holds the first ``held`` layers' blobs, the last one's after a gap (sent anyway),
    and blobs of no layer; ``have`` is lowered to the run held, never raised."""
    gap = [img.descs[3]["digest"]] if held < 3 else []
    digests = [d["digest"] for d in img.descs[:held]] + [*gap, sha(img.config), img.target]
    holds = holds_file(img, digests)
    first = min(held, have)
    p = run(img, have, "--format=oci", f"--peer-holds={holds}")
    assert p.returncode == 0, p.stderr
    members = archive(p.stdout)
    assert [n for n, _ in members[:-4]] == [blob_name(d["digest"]) for d in img.descs[first:]]
    assert [d for _, d in members[:-4]] == img.blobs[first:]
    assert json.loads(p.stderr.decode().splitlines()[-1])["layers_sent"] == 4 - first
    assert not {d["digest"] for d in img.descs[:first]} & set(img.store.gets())
    check = run(img, have, "--format=oci", f"--peer-holds={holds}", "--check")
    assert json.loads(check.stdout) == {"layers_sent": 4 - first, "bytes": sum(map(len, img.blobs[first:]))}


def test_a_layer_the_peer_holds_only_as_its_plain_tar_is_sent_again_as_stored(img):
    """Layer 1 is a gzip blob here; the peer holds its diff ID (the plain tar's blob), not the
    gzip blob the manifest names: from layer 1 on everything is sent."""
    assert img.descs[1]["digest"] != img.diff_ids[1]
    holds = holds_file(img, [img.descs[0]["digest"], img.diff_ids[1], *(d["digest"] for d in img.descs[2:])])
    p = run(img, 4, "--format=oci", f"--peer-holds={holds}")
    assert p.returncode == 0, p.stderr
    members = archive(p.stdout)
    assert members[:-4] == [(blob_name(d["digest"]), b) for d, b in zip(img.descs[1:], img.blobs[1:], strict=True)]
    assert members[-3][1] == img.manifest
    assert json.loads(p.stderr.decode().splitlines()[-1])["layers_sent"] == 3
    check = run(img, 4, "--format=oci", f"--peer-holds={holds}", "--check")
    assert json.loads(check.stdout) == {"layers_sent": 3, "bytes": sum(map(len, img.blobs[1:]))}


@pytest.mark.parametrize("i", [1, 2], ids=["gzip", "plain"])
@pytest.mark.parametrize("case", ["corrupt", "truncated", "ctr dies midway"])
def test_a_blob_that_differs_stops_the_oci_layout_before_its_index(img, case, i):
    change(img, i, case)
    p = run(img, 0, "--format=oci")
    assert p.returncode == 7, p.stderr
    lines = p.stderr.decode().splitlines()
    assert lines[-1].startswith("error: ") and img.diff_ids[i] in lines[-1], lines
    assert not any(line.startswith("{") for line in lines)
    for name in (b"index.json", b"oci-layout", hexof(sha(img.config)).encode(), hexof(sha(img.manifest)).encode()):
        assert name not in p.stdout
    assert img.config not in p.stdout and img.manifest not in p.stdout
    assert all(blob in p.stdout for blob in img.blobs[:i])


# --- blobs read from the content store's own files -----------------------------------------


def test_blobs_are_read_from_the_content_roots_files_when_it_has_them(img):
    """Where containerd keeps its content (``--content-root``; by default its two usual homes)
    the blobs are read from their files: the same archive, and no ``ctr content get`` at all
    (ctr streams about 80 MB/s); which blobs the namespace holds still comes from ``ctr``."""
    through_ctr = run(img, 1)
    (img.store.root / "gets.log").unlink()
    direct = run(img, 1, content_root=str(img.store.root))
    assert direct.returncode == 0, direct.stderr
    assert direct.stdout == through_ctr.stdout
    assert img.store.gets() == []


def test_a_file_under_the_content_root_is_checked_like_ctrs_bytes(img):
    path = img.store.path(img.descs[2]["digest"])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    p = run(img, 1, content_root=str(img.store.root))
    assert p.returncode == 7
    assert f"layer {img.diff_ids[2]}: blob {img.descs[2]['digest']} read back as" in p.stderr.decode()
    assert b"index.json" not in p.stdout and b"manifest.json" not in p.stdout


def test_a_file_the_namespace_does_not_hold_is_not_sent(img):
    """A blob file on disk that ``moby`` does not hold (another namespace's) is not this
    image's: refused before any byte, as through ctr."""
    img.store.hold(img.descs[3]["digest"], held=False)
    p = run(img, 1, content_root=str(img.store.root))
    assert p.returncode == 6 and p.stdout == b""
    assert f"blob {img.descs[3]['digest']} is not in the content store" in p.stderr.decode()


def test_a_blob_missing_under_the_root_comes_through_ctr(img, tmp_path):
    """Another root (an empty one here) holds none of the blobs: each comes through ctr."""
    empty = tmp_path / "elsewhere"
    (empty / "io.containerd.content.v1.content" / "blobs" / "sha256").mkdir(parents=True)
    p = run(img, 3, content_root=str(empty))
    assert p.returncode == 0, p.stderr
    assert img.descs[3]["digest"] in img.store.gets()
