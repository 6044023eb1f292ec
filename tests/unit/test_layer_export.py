"""The layer_export.py helper against a fake classic image store built from real layer tars.

Each layer is a tar made with ``tarfile`` (files of 0 bytes, of whole blocks, of more than 1 MiB,
a directory, a symlink, a hardlink, a whiteout, a name longer than 100 characters, a name that
is not UTF-8). The store is written the way Docker's classic store keeps it: per layer
``image/<driver>/layerdb/sha256/<chain-id-hex>/{diff,cache-id,tar-split.json.gz}``, the tar-split
record as vbatts/tar-split writes it (gzip JSON lines; type 2 the header and padding bytes
verbatim, type 1 one per member with its name, body size and CRC-64/ISO), the members extracted
under ``overlay2/<cache-id>/diff/`` (whiteouts as 0/0 character devices) or ``vfs/dir/<cache-id>/``
(each layer's directory the whole root file system up to that layer), and the image config under
``image/<driver>/imagedb/content/sha256/<hex>``. The helper runs as the node runs it: a
subprocess of its own, writing the archive on stdout.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import random
import re
import shutil
import stat
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
BIG = (1 << 20) + 777  # more than one of the helper's 1 MiB read chunks
NON_UTF8 = b"data/caf\xe9.txt".decode("utf-8", "surrogateescape")
LONG_NAME = "opt/" + "d" * 120 + "/f.txt"
PROGRESS_RE = re.compile(r"^progress bytes=(\d+) total=(\d+)$")


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def chain_ids(diff_ids: list[str]) -> list[str]:
    out = [diff_ids[0]]
    for d in diff_ids[1:]:
        out.append(sha(f"{out[-1]} {d}".encode()))
    return out


def _crc64_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0xD800000000000000 if c & 1 else c >> 1
        table.append(c)
    return table


CRC64_ISO = _crc64_table()


def crc64(data: bytes) -> bytes:
    """Go's crc64.Checksum(data, crc64.MakeTable(crc64.ISO)), big-endian: tar-split's payload."""
    c = 0xFFFFFFFFFFFFFFFF
    for b in data:
        c = CRC64_ISO[(c ^ b) & 0xFF] ^ (c >> 8)
    return (c ^ 0xFFFFFFFFFFFFFFFF).to_bytes(8, "big")


def test_crc64_is_gos_iso_checksum():
    assert crc64(b"123456789").hex() == "b90956c775a41001"


# --- layer tars -------------------------------------------------------------------------------


def make_tar(members: list[tuple], fmt: int = tarfile.GNU_FORMAT) -> bytes:
    """A layer tar: ``("file", name, data[, mode])``, ``("dir", name)``, ``("symlink", name,
    target)``, ``("hardlink", name, target)``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, encoding="utf-8", errors="surrogateescape") as t:
        for kind, name, *rest in members:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            info.uid = info.gid = 0
            data = None
            if kind == "file":
                data = rest[0]
                info.size = len(data)
                info.mode = rest[1] if len(rest) > 1 else 0o644
            elif kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            elif kind == "symlink":
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, rest[0], 0o777
            elif kind == "hardlink":
                info.type, info.linkname, info.mode = tarfile.LNKTYPE, rest[0], 0o644
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def members_of(tar: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(tar), encoding="utf-8", errors="surrogateescape") as t:
        return t.getmembers()


def tar_split(tar: bytes) -> list[dict]:
    """The tar-split record of ``tar``, entry by entry as vbatts/tar-split's disassembler writes
    it: the raw bytes read since the last body (padding, extended headers, the header) as a
    segment, then the member (a body's bytes are not in the record), and last the end-of-archive
    blocks and everything after them."""
    out: list[dict] = []

    def add(entry: dict) -> None:
        out.append({**entry, "position": len(out)})

    pos = 0
    for m in members_of(tar):
        if m.offset_data > pos:
            add({"type": 2, "payload": base64.b64encode(tar[pos : m.offset_data]).decode()})
        entry: dict = {"type": 1}
        raw = m.name.encode("utf-8", "surrogateescape")
        try:
            entry["name"] = raw.decode("utf-8")
        except UnicodeDecodeError:
            entry["name_raw"] = base64.b64encode(raw).decode()
        body = tar[m.offset_data : m.offset_data + m.size]
        if m.size:
            entry["size"] = m.size
        entry["payload"] = base64.b64encode(crc64(body)).decode() if m.size else None
        add(entry)
        pos = m.offset_data + m.size
    add({"type": 2, "payload": base64.b64encode(tar[pos:]).decode()})
    return out


def split_bytes(records: list[dict]) -> bytes:
    return gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode())


def extract(tar: bytes, dest: Path, driver: str) -> None:
    """The members of ``tar`` on disk under ``dest``, as the storage driver keeps them (names are
    joined as they are: a name that leaves the layer lands outside, as the hostile tests want)."""
    for m in members_of(tar):
        path = os.path.join(dest, m.name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        base = os.path.basename(m.name)
        if base.startswith(".wh."):
            hidden = os.path.join(os.path.dirname(path), base[4:])
            if os.path.lexists(hidden):
                os.unlink(hidden)
            if driver == "overlay2":
                try:
                    os.mknod(hidden, stat.S_IFCHR | 0o600, os.makedev(0, 0))
                except PermissionError:
                    pass  # not root: no whiteout device, the helper never opens one anyway
            continue
        if os.path.lexists(path) and not os.path.isdir(path):
            os.unlink(path)
        if m.isdir():
            os.makedirs(path, exist_ok=True)
        elif m.issym():
            os.symlink(m.linkname, path)
        elif m.islnk():
            os.link(os.path.join(dest, m.linkname), path)
        else:
            with open(path, "wb") as f:
                f.write(tar[m.offset_data : m.offset_data + m.size])


def base_layers() -> list[bytes]:
    rng = random.Random(1234)
    layer0 = make_tar(
        [
            ("dir", "etc"),
            ("file", "etc/hostname", b"spark-node-1\n"),
            ("file", "etc/empty", b""),
            ("file", "etc/block", rng.randbytes(2 * BLOCK)),  # whole blocks, no padding
            ("symlink", "etc/link", "hostname"),
            ("hardlink", "etc/hard", "etc/hostname"),
            ("dir", "bin"),
            ("file", "bin/tool", rng.randbytes(700), 0o755),
            ("file", "x", b"old"),
        ]
    )
    layer1 = make_tar(
        [
            ("file", ".wh.x", b""),
            ("dir", "opt"),
            ("file", "opt/big.bin", rng.randbytes(BIG)),
            ("file", LONG_NAME, rng.randbytes(300)),
            ("file", "opt/one", b"1"),
        ],
        fmt=tarfile.PAX_FORMAT,
    )
    layer2 = make_tar(
        [
            ("dir", "data"),
            ("file", NON_UTF8, b"not utf-8 named\n" * 3),
            ("file", "data/readme", rng.randbytes(5000)),
        ]
    )
    return [layer0, layer1, layer2]


@pytest.fixture(scope="module")
def layers() -> list[tuple[bytes, list[dict]]]:
    return [(tar, tar_split(tar)) for tar in base_layers()]


# --- the store --------------------------------------------------------------------------------


@dataclass
class Store:
    root: Path
    driver: str
    tars: list[bytes]
    diff_ids: list[str]
    cache_ids: list[str]
    config: bytes
    layers_file: Path

    @property
    def image_id(self) -> str:
        return sha(self.config)

    @property
    def hexid(self) -> str:
        return self.image_id.split(":", 1)[1]

    @property
    def chains(self) -> list[str]:
        return chain_ids(self.diff_ids)

    def layerdb(self, i: int) -> Path:
        return self.root / "image" / self.driver / "layerdb" / "sha256" / self.chains[i].split(":", 1)[1]

    def layer_dir(self, i: int) -> Path:
        if self.driver == "overlay2":
            return self.root / "overlay2" / self.cache_ids[i] / "diff"
        return self.root / "vfs" / "dir" / self.cache_ids[i]

    def config_path(self) -> Path:
        return self.root / "image" / self.driver / "imagedb" / "content" / "sha256" / self.hexid


def write_store(base: Path, driver: str, layers: list[tuple[bytes, list[dict]]]) -> Store:
    root = base / "docker"
    tars = [t for t, _ in layers]
    diff_ids = [sha(t) for t in tars]
    chains = chain_ids(diff_ids)
    cache_ids = [hashlib.sha256(f"{driver} {c}".encode()).hexdigest() for c in chains]
    config = json.dumps(
        {
            "architecture": "arm64",
            "os": "linux",
            "config": {"Cmd": ["/bin/tool"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        },
        separators=(",", ":"),
    ).encode()
    store = Store(root, driver, tars, diff_ids, cache_ids, config, base / "layers.json")
    for i, (tar, records) in enumerate(layers):
        db = store.layerdb(i)
        db.mkdir(parents=True)
        (db / "diff").write_text(diff_ids[i])
        (db / "cache-id").write_text(cache_ids[i])
        (db / "size").write_text(str(sum(m.size for m in members_of(tar))))
        if i:
            (db / "parent").write_text(chains[i - 1])
        (db / "tar-split.json.gz").write_bytes(split_bytes(records))
        d = store.layer_dir(i)
        if driver == "vfs" and i:
            shutil.copytree(store.layer_dir(i - 1), d, symlinks=True)
        d.mkdir(parents=True, exist_ok=True)
        extract(tar, d, driver)
        if driver == "overlay2":
            (d.parent / "link").write_text(cache_ids[i][:26].upper())
    store.config_path().parent.mkdir(parents=True)
    store.config_path().write_bytes(config)
    store.layers_file.write_text(json.dumps(diff_ids))
    return store


@pytest.fixture(params=["overlay2", "vfs"])
def store(request, tmp_path, layers) -> Store:
    return write_store(tmp_path, request.param, layers)


@pytest.fixture
def overlay(tmp_path, layers) -> Store:
    return write_store(tmp_path, "overlay2", layers)


def run(store: Store, have: int, *extra: str, **over: str) -> subprocess.CompletedProcess:
    args = {
        "root": str(store.root),
        "driver": store.driver,
        "image-id": store.image_id,
        "ref": REF,
        "layers-file": str(store.layers_file),
        "have": str(have),
    }
    args.update({k.replace("_", "-"): v for k, v in over.items()})
    argv = [sys.executable, str(SCRIPT)]
    for k, v in args.items():
        argv += [f"--{k}", v]
    return subprocess.run([*argv, *extra], capture_output=True, timeout=30)


def archive(out: bytes) -> list[tuple[str, bytes]]:
    """The members of a written archive, in order (a tar that does not parse fails here)."""
    with tarfile.open(fileobj=io.BytesIO(out), mode="r:") as t:
        return [(m.name, t.extractfile(m).read()) for m in t.getmembers()]


def stderr_lines(p: subprocess.CompletedProcess) -> list[str]:
    return p.stderr.decode().splitlines()


def assert_refused(p: subprocess.CompletedProcess, rc: int = 6) -> str:
    lines = stderr_lines(p)
    assert p.returncode == rc, p.stderr
    assert p.stdout == b""
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# --- the fake store is Docker's ---------------------------------------------------------------


def test_the_fake_store_holds_what_the_helper_must_join(layers, tmp_path):
    """The record and the directory rebuild each tar byte for byte (a check of the fixture, so
    that a failure below is the helper's): segments plus bodies read from the layer directory."""
    s = write_store(tmp_path, "overlay2", layers)
    records = [r for _, recs in layers for r in recs]
    assert any("name_raw" in r for r in records)
    assert any(r.get("name") == LONG_NAME for r in records)
    assert any(r.get("size") == BIG for r in records)
    assert {"etc/empty", ".wh.x", "etc/link", "etc/hard"} <= {r.get("name") for r in records if not r.get("size")}
    for i, (tar, recs) in enumerate(layers):
        rebuilt = b""
        for r in recs:
            if r["type"] == 2:
                rebuilt += base64.b64decode(r["payload"])
            elif r.get("size"):
                raw = base64.b64decode(r["name_raw"]) if "name_raw" in r else r["name"].encode()
                body = (s.layer_dir(i) / os.fsdecode(raw)).read_bytes()
                assert base64.b64decode(r["payload"]) == crc64(body)
                rebuilt += body
        assert rebuilt == tar
        assert [r["position"] for r in recs] == list(range(len(recs)))
    assert (s.layer_dir(0) / "etc" / "hard").stat().st_ino == (s.layer_dir(0) / "etc" / "hostname").stat().st_ino
    assert os.readlink(s.layer_dir(0) / "etc" / "link") == "hostname"


# --- the archive ------------------------------------------------------------------------------


@pytest.mark.parametrize("have", [0, 1, 2, 3])
def test_archive_is_docker_load_format_with_the_exact_missing_layers(store, have):
    p = run(store, have)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert len(out) % BLOCK == 0 and out.endswith(b"\0" * (2 * BLOCK))
    members = archive(out)
    sent = [d.split(":", 1)[1] + "/layer.tar" for d in store.diff_ids[have:]]
    assert [n for n, _ in members] == [*sent, f"{store.hexid}.json", "manifest.json"]
    for (name, data), tar, diff in zip(members, store.tars[have:], store.diff_ids[have:], strict=False):
        assert sha(data) == diff == "sha256:" + name.split("/")[0]
        assert data == tar
    assert members[-2][1] == store.config
    assert json.loads(members[-1][1]) == [
        {
            "Config": f"{store.hexid}.json",
            "RepoTags": [REF],
            "Layers": [d.split(":", 1)[1] + "/layer.tar" for d in store.diff_ids],
        }
    ]
    report = json.loads(stderr_lines(p)[-1])
    assert report == {"bytes_out": len(out), "layers_sent": 3 - have, "layers": 3}


def test_the_ref_given_is_the_tag_the_load_gives(overlay):
    p = run(overlay, 3, ref="other/name:latest")
    assert p.returncode == 0, p.stderr
    manifest = json.loads(dict(archive(p.stdout))["manifest.json"])
    assert manifest[0]["RepoTags"] == ["other/name:latest"]


def test_layers_the_peer_has_are_never_read(overlay):
    """With --have 2, the first two layers' records and directories may be gone."""
    for i in (0, 1):
        shutil.rmtree(overlay.layerdb(i))
        shutil.rmtree(overlay.layer_dir(i))
    p = run(overlay, 2)
    assert p.returncode == 0, p.stderr
    names = [n for n, _ in archive(p.stdout)]
    assert names[0] == overlay.diff_ids[2].split(":", 1)[1] + "/layer.tar"
    assert dict(archive(p.stdout))[names[0]] == overlay.tars[2]


def test_a_name_raw_record_names_the_file_by_its_bytes(overlay, layers):
    """tar-split keeps a name that is not UTF-8 only as base64 ``name_raw`` (no ``name``): the
    helper reads the file of those very bytes."""
    rec = next(r for r in layers[2][1] if "name_raw" in r)
    assert "name" not in rec and base64.b64decode(rec["name_raw"]) == b"data/caf\xe9.txt"
    assert os.path.isfile(os.fsencode(overlay.layer_dir(2)) + b"/data/caf\xe9.txt")
    p = run(overlay, 2)
    assert p.returncode == 0, p.stderr
    assert archive(p.stdout)[0][1] == overlay.tars[2]


def test_name_raw_wins_over_name(tmp_path, layers):
    """A record with both: the raw bytes are the file's name (the ``name`` is a decoy here)."""
    tar, recs = layers[2]
    recs = [dict(r, name="data/readme") if "name_raw" in r else r for r in recs]
    s = write_store(tmp_path, "overlay2", [*layers[:2], (tar, recs)])
    p = run(s, 2)
    assert p.returncode == 0, p.stderr
    assert archive(p.stdout)[0][1] == tar


# --- --check ----------------------------------------------------------------------------------


@pytest.mark.parametrize("have", [0, 1, 3])
def test_check_writes_no_archive_and_counts_the_rebuilt_bytes(store, have):
    p = run(store, have, "--check")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"layers_sent": 3 - have, "bytes": sum(len(t) for t in store.tars[have:])}
    assert b"layer.tar" not in p.stdout and b"manifest" not in p.stdout


def test_check_refuses_what_the_export_refuses(overlay):
    shutil.rmtree(overlay.layer_dir(2))
    assert_refused(run(overlay, 0, "--check"))


# --- progress and the report ------------------------------------------------------------------


@pytest.mark.parametrize("have", [0, 2, 3])
def test_progress_total_is_the_exact_archive_length_before_the_first_byte(overlay, have):
    p = run(overlay, have)
    assert p.returncode == 0, p.stderr
    lines = stderr_lines(p)
    progress = [PROGRESS_RE.match(line) for line in lines[:-1]]
    assert progress and all(progress), lines
    counts = [(int(m[1]), int(m[2])) for m in progress]
    # the first line comes with the first header written, its total already the archive's length
    assert counts[0] == (BLOCK, len(p.stdout))
    assert all(t == len(p.stdout) for _, t in counts)
    assert [b for b, _ in counts] == sorted(b for b, _ in counts)
    assert counts[-1] == (len(p.stdout), len(p.stdout))
    assert json.loads(lines[-1]) == {"bytes_out": len(p.stdout), "layers_sent": 3 - have, "layers": 3}


def test_progress_lines_come_as_often_as_asked(overlay):
    p = run(overlay, 0, "--progress", "0.000001")
    assert p.returncode == 0, p.stderr
    lines = stderr_lines(p)
    counts = [tuple(map(int, PROGRESS_RE.match(line).groups())) for line in lines[:-1]]
    assert len(counts) > 10  # a line per write: headers, chunks, padding
    assert {t for _, t in counts} == {len(p.stdout)}
    assert json.loads(lines[-1])["bytes_out"] == len(p.stdout)


# --- a layer whose files changed: exit 7, no manifest ------------------------------------------


def change_content(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1)


def remove(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize("change", [change_content, truncate, remove])
@pytest.mark.parametrize("name", ["opt/big.bin", LONG_NAME])
def test_a_changed_file_stops_the_archive_before_its_manifest(store, change, name):
    change(store.layer_dir(1) / name)
    p = run(store, 0)
    assert p.returncode == 7, p.stderr
    lines = stderr_lines(p)
    assert lines[-1].startswith("error: ") and store.diff_ids[1] in lines[-1], lines
    if change is not change_content:
        assert repr(name) in lines[-1]  # the file that is short or gone, not just a wrong sha256
    assert not any(line.startswith("{") for line in lines)  # no success report
    assert b"manifest.json" not in p.stdout
    assert f"{store.hexid}.json".encode() not in p.stdout
    # the first layer went out whole; the peer's load fails for the want of a manifest
    first = store.diff_ids[0].split(":", 1)[1] + "/layer.tar"
    assert p.stdout.startswith(tarfile.TarInfo(first).tobuf(format=tarfile.PAX_FORMAT)[:100])
    assert store.tars[0] in p.stdout


def test_a_changed_file_in_a_layer_the_peer_has_does_not_matter(overlay):
    change_content(overlay.layer_dir(0) / "etc" / "block")
    p = run(overlay, 1)
    assert p.returncode == 0, p.stderr
    assert [d for n, d in archive(p.stdout)][:2] == overlay.tars[1:]


def test_a_changed_small_file_of_the_last_layer(overlay):
    (overlay.layer_dir(2) / "data" / "readme").write_bytes(b"\0" * 5000)
    p = run(overlay, 2)
    assert p.returncode == 7
    assert overlay.diff_ids[2] in stderr_lines(p)[-1]
    assert b"manifest.json" not in p.stdout


# --- a store the helper cannot read: exit 6, nothing written -----------------------------------


def refuse_driver(s: Store) -> dict:
    return {"driver": "btrfs"}


def refuse_missing_layerdb(s: Store) -> dict:
    shutil.rmtree(s.layerdb(1))
    return {}


def refuse_missing_tar_split(s: Store) -> dict:
    (s.layerdb(2) / "tar-split.json.gz").unlink()
    return {}


def refuse_corrupt_tar_split(s: Store) -> dict:
    path = s.layerdb(2) / "tar-split.json.gz"
    path.write_bytes(path.read_bytes()[:-10])
    return {}


def refuse_unknown_record_type(s: Store) -> dict:
    path = s.layerdb(2) / "tar-split.json.gz"
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    path.write_bytes(gzip.compress(("\n".join(lines) + '\n{"type":3,"position":99}\n').encode()))
    return {}


def refuse_missing_cache_id(s: Store) -> dict:
    (s.layerdb(1) / "cache-id").unlink()
    return {}


def refuse_odd_cache_id(s: Store) -> dict:
    # a path to the very directory: a helper that joined it as it is would read the layer well
    (s.layerdb(1) / "cache-id").write_text("../overlay2/" + s.cache_ids[1])
    return {}


def refuse_layerdb_of_another_layer(s: Store) -> dict:
    (s.layerdb(1) / "diff").write_text(s.diff_ids[2])
    return {}


def refuse_missing_layer_dir(s: Store) -> dict:
    shutil.rmtree(s.layer_dir(1))
    return {}


def refuse_config_not_its_digest(s: Store) -> dict:
    s.config_path().write_bytes(s.config + b" ")
    return {}


def refuse_missing_config(s: Store) -> dict:
    s.config_path().unlink()
    return {}


def refuse_config_without_rootfs(s: Store) -> dict:
    config = json.dumps({"os": "linux"}).encode()
    path = s.config_path().parent / hashlib.sha256(config).hexdigest()
    path.write_bytes(config)
    return {"image_id": sha(config)}


def refuse_image_id_not_a_digest(s: Store) -> dict:
    return {"image_id": s.hexid}


def refuse_layers_file_reordered(s: Store) -> dict:
    s.layers_file.write_text(json.dumps([s.diff_ids[1], s.diff_ids[0], s.diff_ids[2]]))
    return {}


def refuse_layers_file_short(s: Store) -> dict:
    s.layers_file.write_text(json.dumps(s.diff_ids[:2]))
    return {"have": "0"}


def refuse_layers_file_not_digests(s: Store) -> dict:
    s.layers_file.write_text(json.dumps([d.split(":", 1)[1] for d in s.diff_ids]))
    return {}


def refuse_layers_file_missing(s: Store) -> dict:
    return {"layers_file": str(s.layers_file) + ".gone"}


def refuse_layers_file_not_json(s: Store) -> dict:
    s.layers_file.write_text("[sha256:")
    return {}


def refuse_have_too_many(s: Store) -> dict:
    return {"have": "4"}


def refuse_have_negative(s: Store) -> dict:
    return {"have": "-1"}


@pytest.mark.parametrize(
    "spoil",
    [
        refuse_driver,
        refuse_missing_layerdb,
        refuse_missing_tar_split,
        refuse_corrupt_tar_split,
        refuse_unknown_record_type,
        refuse_missing_cache_id,
        refuse_odd_cache_id,
        refuse_layerdb_of_another_layer,
        refuse_missing_layer_dir,
        refuse_config_not_its_digest,
        refuse_missing_config,
        refuse_config_without_rootfs,
        refuse_image_id_not_a_digest,
        refuse_layers_file_reordered,
        refuse_layers_file_short,
        refuse_layers_file_not_digests,
        refuse_layers_file_missing,
        refuse_layers_file_not_json,
        refuse_have_too_many,
        refuse_have_negative,
    ],
    ids=lambda f: f.__name__.removeprefix("refuse_"),
)
def test_a_store_it_cannot_read_is_refused_before_any_byte(overlay, spoil):
    over = spoil(overlay)
    have = int(over.pop("have", "0"))
    assert_refused(run(overlay, have, **over))


def test_a_driver_it_does_not_know_is_refused_even_laid_out_like_one_it_knows(tmp_path, layers):
    """A btrfs store laid out as overlay2 under the btrfs name is still not read."""
    s = write_store(tmp_path, "overlay2", layers)
    shutil.copytree(s.root / "image" / "overlay2", s.root / "image" / "btrfs")
    line = assert_refused(run(s, 0, driver="btrfs"))
    assert "btrfs" in line


def test_bad_arguments_exit_2(overlay):
    p = subprocess.run([sys.executable, str(SCRIPT), "--root", str(overlay.root)], capture_output=True, timeout=30)
    assert p.returncode == 2 and p.stdout == b""


# --- names that leave the layer's directory: exit 7, never read -------------------------------


def escaping_store(tmp_path: Path, layers, name: str) -> tuple[Store, bytes]:
    """A store whose last layer holds ``name`` (its bytes in the tar, and a file of the same bytes
    where the name leads on disk: a helper that followed it would rebuild the layer exactly)."""
    secret = b"outside the layer\n" * 40
    tar = make_tar([("dir", "data"), ("file", "data/ok", b"fine"), ("file", name, secret)])
    s = write_store(tmp_path, "overlay2", [*layers[:2], (tar, tar_split(tar))])
    return s, secret


def test_a_name_through_a_symlinked_directory_is_not_followed_out(tmp_path, layers):
    s, secret = escaping_store(tmp_path, layers, "data/sub/secret")
    assert run(s, 2).returncode == 0  # the store as written is fine
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(secret)
    shutil.rmtree(s.layer_dir(2) / "data" / "sub")
    (s.layer_dir(2) / "data" / "sub").symlink_to(outside)
    p = run(s, 2)
    assert p.returncode == 7, p.stderr
    line = stderr_lines(p)[-1]
    assert line.startswith("error: ") and s.diff_ids[2] in line and "data/sub/secret" in line
    assert b"manifest.json" not in p.stdout and secret not in p.stdout


def test_a_symlink_inside_the_layer_is_followed(tmp_path, layers):
    """A directory symlinked to another directory of the same layer stays inside: read."""
    s, secret = escaping_store(tmp_path, layers, "data/sub/secret")
    d = s.layer_dir(2) / "data"
    (d / "real").mkdir()
    (d / "real" / "secret").write_bytes(secret)
    shutil.rmtree(d / "sub")
    (d / "sub").symlink_to("real")
    p = run(s, 2)
    assert p.returncode == 0, p.stderr
    assert archive(p.stdout)[0][1] == s.tars[2]


@pytest.mark.parametrize("name", ["../escape", "data/../../escape", "ABS"])
def test_a_name_that_climbs_out_is_not_read(tmp_path, layers, name):
    if name == "ABS":
        name = str(tmp_path / "abs-secret")
    s, secret = escaping_store(tmp_path, layers, name)
    target = os.path.normpath(os.path.join(s.layer_dir(2), name))
    assert not target.startswith(str(s.layer_dir(2)) + os.sep)
    assert Path(target).read_bytes() == secret  # there to be read, if the helper went there
    p = run(s, 2)
    assert p.returncode == 7, p.stderr
    line = stderr_lines(p)[-1]
    assert line.startswith("error: ") and s.diff_ids[2] in line and "leaves" in line
    assert b"manifest.json" not in p.stdout and secret not in p.stdout


# --- the progress total of a layer of 8 GiB or more ---------------------------------------------


@pytest.mark.parametrize(
    "size",
    [1, (8 << 30) - 1, 8 << 30, 9 << 30],
)
def test_the_total_counts_the_header_written_even_for_a_layer_of_8_gib(size):
    from sparkdeploy.helpers import layer_export as le

    info = tarfile.TarInfo("a" * 64 + "/layer.tar")
    info.size, info.mode, info.mtime = size, 0o644, 0
    written = len(info.tobuf(format=tarfile.PAX_FORMAT)) + -(-size // BLOCK) * BLOCK
    assert le.member_size("a" * 64 + "/layer.tar", size) == written


# --- --format=oci: an OCI image layout for a peer on the containerd image store -----------------

OCI = "--format=oci"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_TAR = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYOUT = b'{"imageLayoutVersion":"1.0.0"}'


def blob_name(digest: str) -> str:
    return "blobs/sha256/" + digest.split(":", 1)[1]


def oci_manifest_of(store: Store) -> dict:
    """The manifest a classic-store image gets: every layer (held ones too) as its plain tar."""
    return {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": store.image_id, "size": len(store.config)},
        "layers": [
            {"mediaType": OCI_TAR, "digest": d, "size": len(t)} for d, t in zip(store.diff_ids, store.tars, strict=True)
        ],
    }


def oci_index_of(manifest: bytes, name: str, tag: str) -> dict:
    return {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [
            {
                "mediaType": OCI_MANIFEST,
                "size": len(manifest),
                "digest": sha(manifest),
                "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag},
            }
        ],
    }


def holds_file(store: Store, digests: list[str]) -> str:
    path = store.root.parent / "holds.json"
    path.write_text(json.dumps(digests))
    return str(path)


@pytest.mark.parametrize("have", [0, 1, 2, 3])
def test_oci_layout_holds_the_missing_tars_then_config_manifest_layout_and_index_last(store, have):
    p = run(store, have, OCI)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert len(out) % BLOCK == 0 and out.endswith(b"\0" * (2 * BLOCK))
    members = archive(out)
    names = [n for n, _ in members]
    manifest = members[-3][1]
    assert names == [
        *map(blob_name, store.diff_ids[have:]),
        blob_name(store.image_id),
        blob_name(sha(manifest)),
        "oci-layout",
        "index.json",
    ]
    assert [d for _, d in members[: 3 - have]] == store.tars[have:]
    assert all(sha(data) == "sha256:" + name.rsplit("/", 1)[1] for name, data in members if name.startswith("blobs/"))
    assert members[-4][1] == store.config
    assert json.loads(manifest) == oci_manifest_of(store)
    assert members[-2][1] == OCI_LAYOUT
    assert json.loads(members[-1][1]) == oci_index_of(manifest, REF, "v7")
    lines = stderr_lines(p)
    progress = [PROGRESS_RE.match(line) for line in lines[:-1]]
    assert progress and all(progress) and {int(m[2]) for m in progress} == {len(out)}, lines
    assert json.loads(lines[-1]) == {"bytes_out": len(out), "layers_sent": 3 - have, "layers": 3}


def test_oci_layout_never_reads_the_files_of_held_layers(store):
    """The manifest names each held layer's size (from its tar-split record), never its bytes."""
    change_content(store.layer_dir(0) / "etc" / "block")
    change_content(store.layer_dir(1) / "opt" / "big.bin")
    (store.layer_dir(1) / "opt" / "one").unlink()
    p = run(store, 2, OCI)
    assert p.returncode == 0, p.stderr
    members = archive(p.stdout)
    assert members[0] == (blob_name(store.diff_ids[2]), store.tars[2])
    assert json.loads(members[-3][1]) == oci_manifest_of(store)


def test_oci_layout_needs_the_tar_split_record_of_every_layer(overlay):
    """A held layer's record gone: its size cannot be named, refused (docker save's format, which
    names no size, still does without it)."""
    (overlay.layerdb(1) / "tar-split.json.gz").unlink()
    line = assert_refused(run(overlay, 2, OCI))
    assert str(overlay.layerdb(1)) in line
    assert_refused(run(overlay, 2, OCI, "--check"))
    assert run(overlay, 2).returncode == 0


@pytest.mark.parametrize(
    "held, have, sent",
    [(0, 3, 3), (1, 3, 2), (1, 2, 2), (2, 3, 1), (2, 1, 2), (3, 3, 0), (3, 2, 1), (3, 0, 3)],
)
def test_peer_holds_lowers_have_to_the_leading_layers_whose_blob_the_peer_holds(store, held, have, sent):
    """The first ``held`` layers' blobs (a plain tar's is its diff ID) and, after a gap, the last
    one's (not a chain: sent all the same), and blobs of no layer."""
    digests = [*store.diff_ids[:held], *([store.diff_ids[2]] if held < 2 else []), store.image_id, sha(b"x")]
    holds = holds_file(store, digests)
    p = run(store, have, OCI, peer_holds=holds)
    assert p.returncode == 0, p.stderr
    members = archive(p.stdout)
    sent_blobs = [(blob_name(d), t) for d, t in zip(store.diff_ids, store.tars, strict=True)][3 - sent :]
    assert members[: sent + 1] == [*sent_blobs, (blob_name(store.image_id), store.config)]
    assert json.loads(members[-3][1]) == oci_manifest_of(store)
    assert json.loads(stderr_lines(p)[-1]) == {"bytes_out": len(p.stdout), "layers_sent": sent, "layers": 3}
    check = run(store, have, OCI, "--check", peer_holds=holds)
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout) == {"layers_sent": sent, "bytes": sum(map(len, store.tars[3 - sent :]))}


def test_peer_holds_with_nothing_held_sends_every_layer(overlay):
    holds = holds_file(overlay, [])
    p = run(overlay, 3, OCI, peer_holds=holds)
    assert p.returncode == 0, p.stderr
    assert [d for _, d in archive(p.stdout)][:3] == overlay.tars
    assert json.loads(run(overlay, 3, OCI, "--check", peer_holds=holds).stdout)["layers_sent"] == 3


@pytest.mark.parametrize(
    "content",
    ["null", "3", '"sha256:abc"', '{"sha256:abc": 1}', '[["sha256:abc"]]', "[1]", "[sha256:"],
    ids=["null", "number", "string", "object", "nested list", "number in list", "not json"],
)
def test_a_peer_holds_file_that_is_no_list_of_digests_is_refused(overlay, content):
    path = overlay.root.parent / "holds.json"
    path.write_text(content)
    line = assert_refused(run(overlay, 1, OCI, peer_holds=str(path)))
    assert "holds.json" in line or "Expecting" in line


@pytest.mark.parametrize("change", [change_content, truncate, remove])
def test_a_changed_file_stops_the_oci_layout_before_its_config_manifest_and_index(store, change):
    ok = run(store, 0, OCI)
    assert ok.returncode == 0, ok.stderr
    tail = [n for n, _ in archive(ok.stdout)][-4:]  # config, manifest, oci-layout, index.json
    change(store.layer_dir(1) / "opt" / "big.bin")
    p = run(store, 0, OCI)
    assert p.returncode == 7, p.stderr
    lines = stderr_lines(p)
    assert lines[-1].startswith("error: ") and store.diff_ids[1] in lines[-1], lines
    assert not any(line.startswith("{") for line in lines)
    assert all(name.encode() not in p.stdout for name in tail)
    assert b"index.json" not in p.stdout and store.config not in p.stdout
    assert store.tars[0] in p.stdout


@pytest.mark.parametrize(
    "ref, name",
    [
        ("img:1", "docker.io/library/img:1"),
        ("img", "docker.io/library/img:latest"),
        ("team/app:v7", "docker.io/team/app:v7"),
        ("team/app", "docker.io/team/app:latest"),
        ("registry.local/team/app:v7", "registry.local/team/app:v7"),
        ("localhost/app:1", "localhost/app:1"),
        ("host:5000/app:2", "host:5000/app:2"),
        ("host:5000/app", "host:5000/app:latest"),
        ("docker.io/img:1", "docker.io/library/img:1"),
        ("docker.io/team/app:v7", "docker.io/team/app:v7"),
        ("index.docker.io/team/app:v7", "docker.io/team/app:v7"),
        ("index.docker.io/img", "docker.io/library/img:latest"),
        ("Reg/app:1", "Reg/app:1"),  # a first part in upper case is a registry's name
    ],
)
def test_the_index_names_the_image_as_docker_normalises_the_ref(overlay, ref, name):
    p = run(overlay, 3, OCI, ref=ref)
    assert p.returncode == 0, p.stderr
    members = archive(p.stdout)
    assert [n for n, _ in members][-1] == "index.json"
    assert json.loads(members[-1][1]) == oci_index_of(members[-3][1], name, name.rpartition(":")[2])
