"""The save_filter.py helper against synthetic `docker save` archives of both layouts.

The archives mimic what Docker 20.10 (legacy) and Docker 26 (OCI) write: members in lexical name
order (manifest.json and index.json after the layers), v1 IDs computed as Docker does, uncompressed
layer blobs named by their diff ID.  Most tests run the filter's ``main`` in process on byte
streams: a mutation tester's mutants of the script run only there.  The pipe tests (the same
result as in process, bounded memory, progress lines) run it as the ship does.
"""

import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import threading

import pytest

from sparkdeploy.core.packaged import helper
from sparkdeploy.helpers import save_filter as sf

SCRIPT = helper("save_filter.py")


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def layer_tar(name: str, payload: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as t:
        info = tarfile.TarInfo(name)
        info.size = len(payload)
        info.mtime = 1
        t.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


class Archive:
    """A tar written member by member, remembering each member's raw byte span."""

    def __init__(self, fmt=tarfile.USTAR_FORMAT):
        self.buf = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buf, mode="w", format=fmt)
        self.spans = {}  # name -> (start, end)

    def add(self, name, data=None, *, kind=tarfile.REGTYPE, link=""):
        start = self.tar.offset
        info = tarfile.TarInfo(name)
        info.type = kind
        info.mtime = 1700000000
        info.linkname = link
        if kind == tarfile.REGTYPE:
            info.size = len(data)
            self.tar.addfile(info, io.BytesIO(data))
        else:
            info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o777
            self.tar.addfile(info)
        self.spans[name] = (start, self.tar.offset)

    def close(self) -> bytes:
        self.tar.close()
        self.end = self.spans and max(e for _, e in self.spans.values())
        return self.buf.getvalue()

    def without(self, raw: bytes, dropped) -> bytes:
        """The expected filter output: the archive minus the raw spans of the dropped members."""
        out, pos = [], 0
        for name, (s, e) in sorted(self.spans.items(), key=lambda kv: kv[1]):
            if name in dropped:
                out.append(raw[pos:s])
                pos = e
        out.append(raw[pos:])
        return b"".join(out)


def image(n_layers=3, payloads=None):
    payloads = payloads or [os.urandom(3000 + 1000 * i) for i in range(n_layers)]
    layers = [layer_tar("f-" + sha(p)[7:19], p) for p in payloads]
    diff_ids = [sha(t) for t in layers]
    config = json.dumps(
        {"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    ).encode()
    return layers, diff_ids, config


def legacy_archive(layers, diff_ids, config, tag="sdderiv:1"):
    """Docker 20.10's layout, in its order (lexical); duplicates become symlinks as in Docker."""
    v1 = sf.legacy_v1_ids(diff_ids)
    top = hashlib.sha256(b"top layer: its v1 id embeds the whole image config").hexdigest()
    v1.append(top)
    cfg_name = hashlib.sha256(config).hexdigest() + ".json"
    members = {}
    first_path = {}
    for i, (tar_bytes, diff) in enumerate(zip(layers, diff_ids, strict=True)):
        d = v1[i]
        doc = {"id": d, "created": "1970-01-01T00:00:00Z", "os": "linux"}
        if i:
            doc["parent"] = v1[i - 1]
        members[d + "/"] = ("dir", None)
        members[d + "/VERSION"] = ("file", b"1.0")
        members[d + "/json"] = ("file", json.dumps(doc).encode())
        if diff in first_path:
            members[d + "/layer.tar"] = ("link", "../" + first_path[diff])
        else:
            members[d + "/layer.tar"] = ("file", tar_bytes)
            first_path[diff] = d + "/layer.tar"
    members[cfg_name] = ("file", config)
    manifest = [{"Config": cfg_name, "RepoTags": [tag], "Layers": [d + "/layer.tar" for d in v1]}]
    members["manifest.json"] = ("file", json.dumps(manifest).encode())
    members["repositories"] = ("file", b'{"sdderiv":{"1":"%s"}}' % top.encode())
    return build(members), v1


def oci_archive(blobs_by_digest, config, layer_paths, tag="sdderiv:1"):
    """Docker 26's layout, in its order: blobs sorted by digest, then index.json, manifest.json."""
    cfg_digest = sha(config)
    manifest_blob = json.dumps({"schemaVersion": 2, "config": {"digest": cfg_digest}}).encode()
    members = {"blobs/": ("dir", None), "blobs/sha256/": ("dir", None)}
    blobs = dict(blobs_by_digest)
    blobs[cfg_digest] = config
    blobs[sha(manifest_blob)] = manifest_blob
    for digest, data in blobs.items():
        members["blobs/sha256/" + digest.split(":")[1]] = ("file", data)
    index = {"schemaVersion": 2, "manifests": [{"digest": sha(manifest_blob)}]}
    members["index.json"] = ("file", json.dumps(index).encode())
    manifest = [
        {"Config": "blobs/sha256/" + cfg_digest.split(":")[1], "RepoTags": [tag],
         "Layers": layer_paths}
    ]  # fmt: skip
    members["manifest.json"] = ("file", json.dumps(manifest).encode())
    members["oci-layout"] = ("file", b'{"imageLayoutVersion": "1.0.0"}')
    members["repositories"] = ("file", b"{}")
    return build(members)


def build(members):
    arc = Archive()
    for name in sorted(members):
        kind, data = members[name]
        if kind == "dir":
            arc.add(name, kind=tarfile.DIRTYPE)
        elif kind == "link":
            arc.add(name, kind=tarfile.SYMTYPE, link=data)
        else:
            arc.add(name, data)
    raw = arc.close()
    return arc, raw


class _Stream:
    """What ``main`` uses of ``sys.stdin`` / ``sys.stdout``: their byte ``buffer``."""

    def __init__(self, data: bytes = b""):
        self.buffer = io.BytesIO(data)


def run_in_process(raw: bytes, *args, stdout=None) -> subprocess.CompletedProcess:
    """``main()`` with ``args`` in ``sys.argv`` and ``raw`` on stdin, in this process (so that a
    mutation tester's mutants of the filter are the code that runs); exit status, stdout and
    stderr as a pipe run gives them (test_pipe_run_is_the_in_process_run checks that they agree)."""
    stdin, stdout, stderr = _Stream(raw), stdout or _Stream(), io.StringIO()
    saved = sys.stdin, sys.stdout, sys.stderr, sys.argv
    sys.stdin, sys.stdout, sys.stderr, sys.argv = stdin, stdout, stderr, ["save_filter.py", *args]
    try:
        try:
            code = sf.main()
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    finally:
        sys.stdin, sys.stdout, sys.stderr, sys.argv = saved
    return subprocess.CompletedProcess(list(args), code, stdout.buffer.getvalue(), stderr.getvalue().encode())


def run_piped(raw: bytes, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], input=raw, capture_output=True, timeout=120)


def run_filter(raw: bytes, *args, tmp_path=None, run=run_in_process):
    stats = None
    if tmp_path is not None:
        stats = tmp_path / "stats.json"
        args = (*args, "--stats", str(stats))
    cp = run(raw, *args)
    report = json.loads(cp.stderr.decode().strip().splitlines()[-1]) if cp.stderr else None
    if stats is not None and stats.exists():
        assert json.loads(stats.read_text()) == report
    return cp, report


def names_of(raw: bytes):
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r|") as t:
        return [m.name for m in t]


# -- legacy layout (Docker < 25) -------------------------------------------------------------


def test_legacy_v1_ids_match_docker_20_10():
    """v1 IDs observed in a real Docker 20.10 `docker save` (two lower layers of sdderiv:1)."""
    diff_ids = [
        "sha256:d018aca997651d202cb6a523238eaa053d4df3e7fb6bc395b387e0d1fba1fe54",
        "sha256:be0975d57402806b91ac64756340cb60b73aab408e307f15e757ecebcb0634db",
        "sha256:bb9513fe5650affed25d20abc59ccc7a2544346610016a7b5ca3c1771d24d583",
    ]
    assert sf.legacy_v1_ids(diff_ids) == [
        "238d79fc90d8f93decfb42c4df54c7846f6211a44c6244a56248e2cff0d0c114",
        "e8e3d2178e77ff9fdc05ce76c33b4dfe1ffc588bb501ac5b6e13101ff711e3f0",
    ]


def test_legacy_drops_the_base_layers(tmp_path):
    layers, diff_ids, config = image(3)
    (arc, raw), v1 = legacy_archive(layers, diff_ids, config)
    # manifest.json comes after every layer: the filter decides without it
    order = names_of(raw)
    assert order.index("manifest.json") > max(order.index(d + "/layer.tar") for d in v1)
    cp, report = run_filter(
        raw, "--layers", ",".join(diff_ids), "--have", diff_ids[0], "--have", diff_ids[1],
        tmp_path=tmp_path,
    )  # fmt: skip
    assert cp.returncode == 0, cp.stderr
    dropped = {v1[0] + "/layer.tar", v1[1] + "/layer.tar"}
    assert cp.stdout == arc.without(raw, dropped)
    assert report["layout"] == "legacy"
    assert sorted(report["dropped"], key=lambda d: d["path"]) == sorted(
        [
            {"path": v1[0] + "/layer.tar", "size": len(layers[0]), "diff_id": diff_ids[0]},
            {"path": v1[1] + "/layer.tar", "size": len(layers[1]), "diff_id": diff_ids[1]},
        ],
        key=lambda d: d["path"],
    )  # in archive order, which is lexical
    assert report["bytes_in"] == len(raw)
    assert report["bytes_out"] == len(cp.stdout)
    assert report["bytes_dropped"] == len(layers[0]) + len(layers[1])
    assert report["members_dropped"] == 2
    assert report["members_in"] - report["members_out"] == 2
    assert report["missed"] == []
    assert report["errors"] == []
    assert report["status"] == 0


def test_legacy_top_layer_recognised_by_its_parent(tmp_path):
    """The peer has every layer (e.g. the new image only changed labels): all tars dropped."""
    layers, diff_ids, config = image(3)
    (arc, raw), v1 = legacy_archive(layers, diff_ids, config)
    cp, report = run_filter(raw, "--layers", ",".join(diff_ids), *_haves(diff_ids))
    assert cp.returncode == 0
    assert cp.stdout == arc.without(raw, {d + "/layer.tar" for d in v1})
    assert report["missed"] == []


def test_legacy_single_layer_image(tmp_path):
    layers, diff_ids, config = image(1)
    (arc, raw), v1 = legacy_archive(layers, diff_ids, config)
    cp, report = run_filter(raw, "--layers", diff_ids[0], "--have", diff_ids[0])
    assert cp.stdout == arc.without(raw, {v1[0] + "/layer.tar"})
    assert report["missed"] == []


def test_legacy_without_layers_drops_nothing_and_says_so(tmp_path):
    layers, diff_ids, config = image(2)
    (arc, raw), v1 = legacy_archive(layers, diff_ids, config)
    cp, report = run_filter(raw, "--have", diff_ids[0])
    assert cp.returncode == 0
    assert cp.stdout == raw
    assert report["missed"] == [diff_ids[0]]


def test_only_the_chain_prefix_is_dropped(tmp_path):
    """The classic store keys layers by chain: a have-layer above a missing one is still sent."""
    layers, diff_ids, config = image(3)
    (arc, raw), v1 = legacy_archive(layers, diff_ids, config)
    cp, report = run_filter(raw, "--layers", ",".join(diff_ids), *_haves([diff_ids[0], diff_ids[2]]))
    assert cp.stdout == arc.without(raw, {v1[0] + "/layer.tar"})
    assert report["prefix_layers"] == 1
    assert report["missed"] == []


def test_legacy_duplicate_layer_symlink(tmp_path):
    """A diff ID recurring above the prefix keeps its file (a later symlink points at it)."""
    same = os.urandom(2000)
    layers, diff_ids, config = image(3, payloads=[same, os.urandom(100), same])
    assert diff_ids[0] == diff_ids[2]
    (arc, raw), v1 = legacy_archive(layers, diff_ids, config)
    cp, report = run_filter(raw, "--layers", ",".join(diff_ids), "--have", diff_ids[0])
    assert cp.returncode == 0
    assert cp.stdout == raw  # layer 0 is needed again at position 2: nothing droppable
    with tarfile.open(fileobj=io.BytesIO(cp.stdout)) as t:
        assert t.getmember(v1[2] + "/layer.tar").issym()


# -- OCI layout (Docker 25+) -----------------------------------------------------------------


def _haves(diff_ids):
    out = []
    for d in diff_ids:
        out += ["--have", d]
    return out


def test_oci_drops_blobs_by_digest(tmp_path):
    layers, diff_ids, config = image(3)
    arc, raw = oci_archive(
        dict(zip(diff_ids, layers, strict=True)), config,
        ["blobs/sha256/" + d.split(":")[1] for d in diff_ids],
    )  # fmt: skip
    have = tmp_path / "have.txt"
    have.write_text(f"# the peer's layers\n{diff_ids[0]}\n{diff_ids[1]}\n")
    lfile = tmp_path / "layers.json"
    lfile.write_text(json.dumps(diff_ids))
    cp, report = run_filter(raw, "--layers-file", str(lfile), "--have-file", str(have), tmp_path=tmp_path)
    assert cp.returncode == 0, cp.stderr
    dropped = {"blobs/sha256/" + d.split(":")[1] for d in diff_ids[:2]}
    assert cp.stdout == arc.without(raw, dropped)
    assert report["layout"] == "oci"
    assert {d["path"] for d in report["dropped"]} == dropped
    assert report["missed"] == []
    assert report["errors"] == []


def test_oci_without_layers_list_drops_named_blobs():
    layers, diff_ids, config = image(2)
    arc, raw = oci_archive(
        dict(zip(diff_ids, layers, strict=True)), config,
        ["blobs/sha256/" + d.split(":")[1] for d in diff_ids],
    )  # fmt: skip
    cp, report = run_filter(raw, "--have", diff_ids[0])
    assert cp.stdout == arc.without(raw, {"blobs/sha256/" + diff_ids[0].split(":")[1]})
    assert report["status"] == 0 and report["prefix_layers"] is None


def test_oci_compressed_blobs_need_drop_paths(tmp_path):
    """gzip layer blobs: digest != diff ID; in stream only --drop can leave them out."""
    layers, diff_ids, config = image(2)
    gz = [gzip.compress(t, mtime=0) for t in layers]
    paths = ["blobs/sha256/" + sha(g).split(":")[1] for g in gz]
    arc, raw = oci_archive({sha(g): g for g in gz}, config, paths)
    cp, report = run_filter(raw, "--layers", ",".join(diff_ids), "--have", diff_ids[0])
    assert cp.stdout == raw
    assert report["missed"] == [diff_ids[0]]  # the controller learns to pass --drop
    cp, report = run_filter(raw, "--layers", ",".join(diff_ids), "--have", diff_ids[0], "--drop", paths[0])
    assert cp.returncode == 0
    assert cp.stdout == arc.without(raw, {paths[0]})
    assert report["dropped"] == [{"path": paths[0], "size": len(gz[0]), "diff_id": diff_ids[0]}]
    assert report["missed"] == []


def test_dropping_a_layer_the_peer_lacks_is_flagged(tmp_path):
    layers, diff_ids, config = image(2)
    paths = ["blobs/sha256/" + d.split(":")[1] for d in diff_ids]
    arc, raw = oci_archive(dict(zip(diff_ids, layers, strict=True)), config, paths)
    cp, report = run_filter(raw, "--drop", paths[1])
    assert cp.returncode == 4
    assert report["unsafe"] is True
    assert report["errors"] == [f"dropped {paths[1]} (layer 1, {diff_ids[1]}) which the peer lacks"]


def test_pax_long_names_and_headers_are_kept_verbatim():
    """A member needing a pax header (long name): header blocks pass through unchanged."""
    arc = Archive(fmt=tarfile.PAX_FORMAT)
    long = "d/" + "x" * 150
    arc.add(long, b"payload")
    drop_me = os.urandom(700)
    arc.add("blobs/sha256/" + sha(drop_me).split(":")[1] + "/" + "y" * 120, b"kept: not a blob")
    arc.add("blobs/sha256/" + sha(drop_me).split(":")[1], drop_me)
    raw = arc.close()
    cp, report = run_filter(raw, "--have", sha(drop_me))
    assert cp.returncode == 0
    assert cp.stdout == arc.without(raw, {"blobs/sha256/" + sha(drop_me).split(":")[1]})
    assert names_of(cp.stdout)[0] == long


def test_streams_through_pipes_in_bounded_memory(tmp_path):
    """A 256 MiB layer goes through pipes (kept) while the filter stays far below its size."""
    size = 256 << 20
    chunk = os.urandom(1 << 20)
    header = tarfile.TarInfo("blobs/sha256/" + "ab" * 32)
    header.size = size
    header.mtime = 1
    head = header.tobuf(format=tarfile.USTAR_FORMAT)
    small = os.urandom(5000)
    small_info = tarfile.TarInfo("blobs/sha256/" + sha(small).split(":")[1])
    small_info.size = len(small)
    # The filter's address space is capped well below the layer's size: buffering the layer
    # would die with MemoryError. (ru_maxrss is no measure here: Linux carries the forked
    # parent's high-water mark across exec, and the parent is the whole pytest process.)
    limit = 160 << 20

    def cap():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--have", sha(small), "--quiet"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=cap,
    )  # fmt: skip
    out_len = [0]
    out_hash = hashlib.sha256()

    def reader():
        while data := proc.stdout.read(1 << 20):
            out_len[0] += len(data)
            out_hash.update(data)

    t = threading.Thread(target=reader)
    t.start()
    in_hash = hashlib.sha256()

    def feed(data):
        in_hash.update(data)
        proc.stdin.write(data)

    feed(small_info.tobuf(format=tarfile.USTAR_FORMAT) + small + b"\0" * (-len(small) % 512))
    in_hash = hashlib.sha256()  # the expected output starts after the dropped member
    feed(head)
    for _ in range(size // len(chunk)):
        feed(chunk)
    feed(b"\0" * 1024)
    proc.stdin.close()
    proc.wait()
    t.join()
    assert proc.returncode == 0
    assert out_len[0] == 512 + size + 1024
    assert out_hash.hexdigest() == in_hash.hexdigest()
    assert limit < size


def test_progress_lines(tmp_path):
    layers, diff_ids, config = image(2)
    arc, raw = oci_archive(
        dict(zip(diff_ids, layers, strict=True)), config,
        ["blobs/sha256/" + d.split(":")[1] for d in diff_ids],
    )  # fmt: skip
    cp = subprocess.run(
        [sys.executable, str(SCRIPT), "--progress", "1000", "--quiet"],
        input=raw, capture_output=True,
    )  # fmt: skip
    assert cp.returncode == 0
    # the final count is always printed, whatever the period
    assert cp.stderr.decode().splitlines() == [f"progress bytes={len(raw)} out={len(raw)}"]


@pytest.mark.parametrize("layout", ["oci", "legacy"])
def test_pipe_run_is_the_in_process_run(tmp_path, layout):
    """The in-process harness stands for the script run through pipes: same bytes, same
    report, same exit status."""
    layers, diff_ids, config = image(3)
    if layout == "legacy":
        (_, raw), _ = legacy_archive(layers, diff_ids, config)
    else:
        _, raw = oci_archive(dict(zip(diff_ids, layers, strict=True)), config,
                             ["blobs/sha256/" + d.split(":")[1] for d in diff_ids])
    args = ("--layers", ",".join(diff_ids), *_haves(diff_ids[:2]))
    piped, piped_report = run_filter(raw, *args, run=run_piped)
    inproc, inproc_report = run_filter(raw, *args)
    assert piped.returncode == inproc.returncode == 0
    assert piped.stdout == inproc.stdout and len(inproc.stdout) < len(raw)
    assert piped_report == inproc_report and inproc_report["members_dropped"] == 2


def test_truncated_archive_fails():
    layers, diff_ids, config = image(2)
    arc, raw = oci_archive(
        dict(zip(diff_ids, layers, strict=True)), config,
        ["blobs/sha256/" + d.split(":")[1] for d in diff_ids],
    )  # fmt: skip
    cp, report = run_filter(raw[: len(raw) // 2])
    assert cp.returncode == 3
    assert report["status"] == 3
    assert cp.stderr.decode().splitlines()[0] == "save_filter: archive truncated inside a member"
    assert report["errors"] == ["stream failed", "no readable manifest.json in the archive"]
    assert report["layout"] == "unknown"


@pytest.mark.parametrize("cut,error", [
    (lambda raw, first: raw[:first], "archive ended without an end-of-archive marker"),
    (lambda raw, first: raw[:first + 100], "archive truncated inside a header"),
], ids=["at-a-header", "inside-a-header"])
def test_where_an_archive_ends_early_is_said(cut, error):
    arc, raw, _, _ = _oci()
    first = min(e for _, e in arc.spans.values())  # the end of the first member
    cp, report = run_filter(cut(raw, first))
    assert cp.returncode == 3 and cp.stderr.decode().splitlines()[0] == "save_filter: " + error


class _Trickle(io.RawIOBase):
    """A pipe's reads: at most a few bytes each, whatever was asked."""

    def __init__(self, data: bytes, step: int = 7):
        self.data, self.pos, self.step = data, 0, step

    def readable(self):
        return True

    def read(self, n=-1):
        n = self.step if n is None or n < 0 else min(n, self.step)
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out


def test_short_reads_give_the_same_output():
    arc, raw, diff_ids, paths = _oci()
    plan = sf.Drops(diff_ids[:1], diff_ids, [])
    out = io.BytesIO()
    f = sf.Filter(plan, _Trickle(raw), out, err=io.StringIO())
    f.run()
    assert out.getvalue() == arc.without(raw, {paths[0]})
    assert f.check()["errors"] == [] and f.bytes_in == len(raw)


def test_a_dropped_or_large_kept_member_is_not_held_in_memory():
    import tracemalloc

    big = 24 << 20
    arc = Archive()
    arc.add("blobs/sha256/" + "a" * 64, b"\1" * big)  # dropped
    arc.add("blobs/sha256/" + "b" * 64, b"\2" * big)  # kept, above the metadata limit
    raw = arc.close()

    class Sink:
        n = 0

        def write(self, data):
            self.n += len(data)

        def flush(self):
            pass

    src, sink = io.BytesIO(raw), Sink()
    f = sf.Filter(sf.Drops(["sha256:" + "a" * 64], None, []), src, sink, err=io.StringIO())
    tracemalloc.start()
    try:
        f.run()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sink.n == len(raw) - (512 + big) and peak < 8 << 20


def test_a_global_pax_header_is_kept():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "g"}) as t:
        start = t.offset
        for name, data in (("blobs/sha256/" + "a" * 64, b"dropped"), ("keep.txt", b"kept")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
            if name != "keep.txt":
                end = t.offset
    raw = buf.getvalue()
    cp, report = run_filter(raw, "--have", "sha256:" + "a" * 64)
    assert raw[156:157] == tarfile.XGLTYPE  # the archive opens with the global header
    assert cp.returncode == 0 and cp.stdout == raw[:start] + raw[end:]


def test_a_pax_path_after_other_records_and_with_an_equals_sign():
    arc = Archive(fmt=tarfile.PAX_FORMAT)
    long = "blobs/sha256/" + "c" * 64 + "/x=1/" + "y" * 120
    info_headers = {"comment": "first record", "uname": "second record"}
    start = arc.tar.offset
    info = tarfile.TarInfo(long)
    info.size, info.pax_headers = 4, info_headers
    arc.tar.addfile(info, io.BytesIO(b"data"))
    arc.spans[long] = (start, arc.tar.offset)
    arc.add("z.txt", b"last")
    raw = arc.close()
    cp, report = run_filter(raw, "--drop", long)
    assert cp.stdout == arc.without(raw, {long})
    assert [d["path"] for d in report["dropped"]] == [long]


@pytest.mark.parametrize("config", [None, b"{not json"], ids=["missing", "unreadable"])
def test_a_config_the_archive_lacks_cannot_vouch_for_a_drop(config):
    layers, diff_ids, _ = image(2)
    paths = ["blobs/sha256/" + d.split(":")[1] for d in diff_ids]
    arc = Archive()
    for p, t in sorted(zip(paths, layers, strict=True)):
        arc.add(p, t)
    cfg = "blobs/sha256/" + "f" * 64
    if config is not None:
        arc.add(cfg, config)
    arc.add("manifest.json", json.dumps([{"Config": cfg, "Layers": paths}]).encode())
    raw = arc.close()
    cp, report = run_filter(raw, "--layers", ",".join(diff_ids), "--have", diff_ids[0])
    assert cp.returncode == 4
    assert report["errors"] == [f"config of {cfg}: cannot map layers",
                                f"dropped {paths[0]} which no manifest names as a layer"]


def test_not_a_tar_fails():
    cp, report = run_filter(b"this is not a tar archive".ljust(4096, b"!"))
    assert cp.returncode == 3
    assert cp.stderr.decode().splitlines()[0].startswith("save_filter: not a tar header (")


@pytest.mark.parametrize(
    "args,error",
    [
        (["--have", "sha256:short"], "argument --have: not a diff ID (sha256:<64 hex>): 'sha256:short'"),
        (["--have", "md5:" + "0" * 64], "argument --have: not a diff ID (sha256:<64 hex>): 'md5:" + "0" * 64 + "'"),
        (["--layers", "sha256:" + "0" * 64 + ",nope"], "not a diff ID (sha256:<64 hex>): 'nope'"),
        (["--progress", "0"], "--progress must be > 0"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--have-file", "/nonexistent/have.txt"], "[Errno 2] No such file or directory: '/nonexistent/have.txt'"),
        (["--layers", "sha256:" + "0" * 64, "--layers-file", "/dev/null"], "give --layers or --layers-file, not both"),
    ],
)
def test_bad_arguments_exit_2(args, error):
    cp = run_in_process(b"", *args)
    assert cp.returncode == 2
    assert cp.stderr.startswith(b"usage: save_filter.py")
    assert cp.stderr.decode().splitlines()[-1] == "save_filter.py: error: " + error
    assert cp.stdout == b""


def test_a_progress_period_below_one_second_is_fine():
    # (parse_args alone: in process, main's filter would print progress to the stderr the
    # script was loaded with, not to the harness's)
    args, _ = sf.parse_args(["--progress", "0.5"])
    assert args.progress == 0.5


def _oci(n=2):
    layers, diff_ids, config = image(n)
    paths = ["blobs/sha256/" + d.split(":")[1] for d in diff_ids]
    arc, raw = oci_archive(dict(zip(diff_ids, layers, strict=True)), config, paths)
    return arc, raw, diff_ids, paths


def _progress(raw: bytes, period: float) -> tuple[list[str], "sf.Filter"]:
    err = io.StringIO()
    f = sf.Filter(sf.Drops([], None, []), io.BytesIO(raw), io.BytesIO(), progress=period, err=err)
    f.run()
    return err.getvalue().splitlines(), f


def test_progress_every_period_and_always_the_final_count():
    _, raw, _, _ = _oci()
    lines, f = _progress(raw, 1000)
    assert lines == [f"progress bytes={len(raw)} out={len(raw)}"]
    lines, f = _progress(raw, 1e-9)  # a line at each write, counts only growing
    counts = [tuple(int(kv.split("=")[1]) for kv in ln.split()[1:]) for ln in lines]
    assert len(lines) > 5 and all(ln.startswith("progress bytes=") for ln in lines)
    assert counts == sorted(counts) and counts[-1] == (len(raw), len(raw))


def test_closed_output_exits_3_and_says_so():
    class Closed(_Stream):
        def __init__(self):
            super().__init__()
            self.buffer.write = self._write

        @staticmethod
        def _write(data):
            raise BrokenPipeError(32, "Broken pipe")

    _, raw, _, _ = _oci()
    cp = run_in_process(raw, stdout=Closed())
    assert cp.returncode == 3
    lines = cp.stderr.decode().splitlines()
    assert lines[0] == "save_filter: output closed"
    assert json.loads(lines[-1])["errors"][0] == "stream failed"


def test_lists_from_files_with_commas_and_comments(tmp_path):
    """A list file: JSON, or IDs split by commas or blanks, with '#' comments."""
    layers, diff_ids, config = image(3)
    (arc, raw), v1 = legacy_archive(layers, diff_ids, config)
    have = tmp_path / "have.txt"
    have.write_text(f"{diff_ids[0]}, {diff_ids[1]}  # the base # and its first layer\n\n")
    lfile = tmp_path / "layers.txt"
    lfile.write_text(" ".join(diff_ids) + "\n")
    cp, report = run_filter(raw, "--layers-file", str(lfile), "--have-file", str(have))
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == arc.without(raw, {v1[0] + "/layer.tar", v1[1] + "/layer.tar"})


def test_drop_paths_from_a_file(tmp_path):
    """gzip layer blobs (digest != diff ID) left out by the paths a file lists."""
    layers, diff_ids, config = image(2)
    gz = [gzip.compress(t, mtime=0) for t in layers]
    paths = ["blobs/sha256/" + sha(g).split(":")[1] for g in gz]
    arc, raw = oci_archive({sha(g): g for g in gz}, config, paths)
    drops = tmp_path / "drop.txt"
    drops.write_text(paths[0] + "\n")
    cp, report = run_filter(raw, "--layers", ",".join(diff_ids), "--have", diff_ids[0], "--drop-file", str(drops))
    assert cp.returncode == 0 and cp.stdout == arc.without(raw, {paths[0]})
    assert report["dropped"] == [{"path": paths[0], "size": len(gz[0]), "diff_id": diff_ids[0]}]


def test_dropping_a_member_that_is_no_layer_is_flagged():
    arc, raw, _, _ = _oci()
    cp, report = run_filter(raw, "--drop", "repositories")
    assert cp.returncode == 4 and report["unsafe"] is True
    assert report["dropped"] == [{"path": "repositories", "size": 2, "diff_id": None}]
    assert report["errors"] == ["dropped repositories which no manifest names as a layer"]


def test_member_names_with_a_dot_slash_prefix():
    """`tar -C dir .` writes ./name: the same members, the same decisions."""
    layers, diff_ids, config = image(2)
    cfg = sha(config).split(":")[1]
    arc = Archive()
    for d, t in sorted(zip(diff_ids, layers, strict=True)):
        arc.add("./blobs/sha256/" + d.split(":")[1], t)
    arc.add("./blobs/sha256/" + cfg, config)
    manifest = [{"Config": "blobs/sha256/" + cfg, "Layers": ["blobs/sha256/" + d.split(":")[1] for d in diff_ids]}]
    arc.add("./manifest.json", json.dumps(manifest).encode())
    arc.add("./index.json", b"{}")  # (the OCI layout told by index.json alone)
    raw = arc.close()
    cp, report = run_filter(raw, "--layers", ",".join(diff_ids), "--have", diff_ids[0])
    dropped = "blobs/sha256/" + diff_ids[0].split(":")[1]
    assert cp.returncode == 0 and cp.stdout == arc.without(raw, {"./" + dropped})
    assert report["dropped"][0]["path"] == dropped and report["errors"] == [] and report["layout"] == "oci"


def test_a_config_larger_than_a_read_chunk_still_maps_the_layers():
    layers, diff_ids, _ = image(2)
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": diff_ids},
                         "pad": [1234567] * (sf.CHUNK // 8)}).encode()  # read in two chunks
    paths = ["blobs/sha256/" + d.split(":")[1] for d in diff_ids]
    arc, raw = oci_archive(dict(zip(diff_ids, layers, strict=True)), config, paths)
    cp, report = run_filter(raw, "--layers", ",".join(diff_ids), "--have", diff_ids[0])
    assert cp.returncode == 0 and report["errors"] == [] and report["missed"] == []
    assert report["dropped"] == [{"path": paths[0], "size": len(layers[0]), "diff_id": diff_ids[0]}]


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT], ids=["pax", "gnu"])
def test_a_long_name_from_an_extended_header_can_be_dropped(fmt):
    """The name is in the pax or GNU long-name header: the member and that header go."""
    arc = Archive(fmt=fmt)
    long = "blobs/sha256/" + "c" * 64 + "/" + "y" * 120 + "X"
    arc.add("a.txt", b"first")
    arc.add(long, b"dropped by its long name")
    arc.add("z.txt", b"last")
    raw = arc.close()
    cp, report = run_filter(raw, "--drop", long)
    assert cp.stdout == arc.without(raw, {long})
    assert [d["path"] for d in report["dropped"]] == [long]


# -- the Python it needs ----------------------------------------------------------------------


def test_runs_on_python_3_8_syntax_and_library():
    """The node's python3 may be old: 3.8 syntax, and none of the newer calls it once used."""
    import ast

    tree = ast.parse(SCRIPT.read_text(), feature_version=(3, 8))
    newer = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if any(k.arg == "strict" for k in node.keywords):
                newer.append(f"line {node.lineno}: strict= (3.10)")
            fn = node.func
            if isinstance(fn, ast.Attribute) and fn.attr in ("removeprefix", "removesuffix"):
                newer.append(f"line {node.lineno}: {fn.attr} (3.9)")
        if isinstance(node, ast.Match if hasattr(ast, "Match") else ()):
            newer.append(f"line {node.lineno}: match (3.10)")
    assert newer == []
    assert sf.MIN_PYTHON == (3, 8)
    assert "needs Python 3.8 or newer" in SCRIPT.read_text()


def test_an_older_python_exits_5_before_reading(monkeypatch, capsys):
    monkeypatch.setattr(sys, "version_info", (3, 7, 9, "final", 0))
    assert sf.main(["--have", "sha256:" + "1" * 64]) == 5
    assert capsys.readouterr().err == "save_filter: needs Python 3.8+, this is 3.7\n"
