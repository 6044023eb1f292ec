#!/usr/bin/env python3
"""Stream a `docker save` archive from stdin to stdout, leaving out layers the peer already has.

Standard library only; needs Python 3.8 or newer (checked at start: exit 5 on an older one;
the ship checks the source's python3 before it stages this filter).

    docker save IMG | python3 save_filter.py --layers-file L --have-file H --stats S.json \
        | ssh peer docker load

Both `docker save` layouts are handled:

* OCI (Docker 25+): ``blobs/sha256/<digest>``, ``index.json``, ``oci-layout`` and a
  ``manifest.json`` whose ``Layers`` point into ``blobs/``.  On the classic image store the
  layer blobs are uncompressed tars, so a blob's digest is the layer's diff ID and a blob can be
  dropped by its name alone.
* legacy (Docker < 25): ``<v1id>/{VERSION,json,layer.tar}``, a ``<config-hex>.json`` and a
  ``manifest.json`` whose ``Layers`` are ``<v1id>/layer.tar``.  A v1 ID is not a diff ID: it is
  the sha256 of a small JSON document naming the layer's chain ID and its parent's v1 ID.

Member order (observed, see tests and the ship notes): Docker 20.10 and 26.1 both write the archive
in lexical name order (they tar up a temp directory), so ``manifest.json`` and, in the OCI layout,
``index.json`` always come AFTER the layers, and the config lands wherever its hex name sorts.
The filter therefore cannot learn the digest -> diff ID mapping from the archive before it has to
decide about a layer.  It decides from what the caller passes:

* ``--have DIFFID`` / ``--have-file``: diff IDs whose layers the peer already has;
* ``--layers DIFFID,...`` / ``--layers-file``: the image's own diff IDs in order (the source's
  ``docker image inspect --format '{{json .RootFS.Layers}}'``).  Recommended always, required for
  the legacy layout.  Docker's classic store keys layers by *chain*: `docker load` skips a layer's
  tar only when the whole chain up to it exists.  With ``--layers`` the filter only drops the
  longest prefix of layers that are all in the have-set, never a diff ID that recurs later in the
  image outside that prefix, and computes the legacy v1 IDs of that prefix itself (the v1 ID of
  every layer but the top one has a fixed form; the top one is recognised by its ``json`` member,
  which precedes its ``layer.tar``, naming the previous layer as parent).  Without ``--layers`` the
  OCI blobs named in the have-set are dropped as given (the caller is responsible for the chain
  rule) and no legacy layer is dropped.
* ``--drop PATH`` / ``--drop-file``: member paths to leave out, computed by the caller, for what
  the filter cannot map by itself (compressed OCI layer blobs, whose digest is not the diff ID).

Whatever is kept is copied byte for byte (tar headers included): the archive is parsed block by
block and data are copied in chunks, never a whole member in memory, never a temp file.  Small
metadata members (manifest, config) are remembered while passing through, so at the end the filter
checks what it dropped against ``manifest.json`` and the config and reports, as JSON on stderr and
in ``--stats FILE``, bytes in/out, the members dropped (with their diff IDs) and any droppable layer
it could not recognise in stream (``missed``: sent although the peer has it).  Exit status: 0 ok,
2 bad arguments, 3 the archive is not a tar or is truncated, 4 a dropped member is not a layer of
the have-prefix according to the archive's own manifest (caller error: the output is unusable),
5 this Python is older than 3.8.
"""

import argparse
import hashlib
import json
import os
import re
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
META_LIMIT = 16 << 20  # remember non-dropped members up to this size (manifests, configs, v1 json)

# json.Marshal of Docker's zero container.Config, as written by Docker < 25 into every v1 `json`
# of a non-top layer (field order of the Go struct, compact).
_ZERO_CONTAINER_CONFIG = (
    '{"Hostname":"","Domainname":"","User":"","AttachStdin":false,"AttachStdout":false,'
    '"AttachStderr":false,"Tty":false,"OpenStdin":false,"StdinOnce":false,"Env":null,"Cmd":null,'
    '"Image":"","Volumes":null,"WorkingDir":"","Entrypoint":null,"OnBuild":null,"Labels":null}'
)


def legacy_v1_ids(layers):
    """v1 IDs (hex) that Docker < 25 `docker save` gives to every layer but the top one.

    Docker computes sha256 over the compact, key-sorted JSON of the v1 image with `layer_id` (the
    chain ID) and `parent` (the previous v1 ID) added; below the top layer that v1 image is empty
    but for `created` = the epoch.
    """
    ids = []
    parent = None
    for chain in protocol.chain_ids(layers)[:-1]:
        doc = '{{"container_config":{},"created":"1970-01-01T00:00:00Z","layer_id":"{}"{}}}'.format(
            _ZERO_CONTAINER_CONFIG,
            chain,
            f',"parent":"sha256:{parent}"' if parent else "",
        )
        parent = hashlib.sha256(doc.encode()).hexdigest()
        ids.append(parent)
    return ids


def normalize(name):
    while name.startswith("./"):
        name = name[2:]
    return name.rstrip("/")


def _read_list(path):
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    stripped = text.strip()
    if stripped.startswith("["):
        return [str(x) for x in json.loads(stripped)]
    items = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            items.extend(x for x in re.split(r"[,\s]+", line) if x)
    return items


def _diff_id(value):
    if not protocol.is_digest(value):
        raise argparse.ArgumentTypeError(f"not a diff ID (sha256:<64 hex>): {value!r}")
    return value


class Drops:
    """What to drop, decided before the archive is read."""

    def __init__(self, have, layers, drop_paths):
        self.have = set(have)
        self.layers = list(layers) if layers is not None else None
        self.drop_paths = set(normalize(p) for p in drop_paths)
        if self.layers is not None:
            k = 0
            while k < len(self.layers) and self.layers[k] in self.have:
                k += 1
            self.prefix = k
            later = set(self.layers[k:])
            self.droppable = set(self.layers[:k]) - later
            v1 = legacy_v1_ids(self.layers)
            self.legacy_drop = {}  # v1 hex -> diff id
            for i in range(min(k, len(self.layers) - 1)):
                if self.layers[i] in self.droppable:
                    self.legacy_drop[v1[i]] = self.layers[i]
            n = len(self.layers)
            # The top layer's v1 ID embeds the whole image config: recognise it by its parent.
            self.top_parent = v1[n - 2] if n >= 2 else ""
            self.top_droppable = n > 0 and k == n and self.layers[n - 1] in self.droppable
        else:
            self.prefix = None
            self.droppable = set(self.have)
            self.legacy_drop = {}
            self.top_parent = None
            self.top_droppable = False

    def oci_diff(self, name):
        if name.startswith("blobs/sha256/"):
            digest = "sha256:" + name[len("blobs/sha256/") :]
            if digest in self.droppable:
                return digest
        return None


class Filter:
    def __init__(self, plan, src, dst, progress=None, err=sys.stderr):
        self.plan = plan
        self.src = src
        self.dst = dst
        self.progress = progress
        self.err = err
        self.bytes_in = 0
        self.bytes_out = 0
        self.members_in = 0
        self.members_out = 0
        self.dropped = []  # {"path", "size", "diff_id"}
        self.meta = {}  # name -> bytes of small kept members
        self.legacy_top_dirs = {}  # v1 hex recognised as the top layer -> diff id
        self._last_progress = time.monotonic()

    # -- io -------------------------------------------------------------------------------------
    def _read(self, n):
        data = self.src.read(n)
        if data is None:
            data = b""
        while len(data) < n:
            more = self.src.read(n - len(data))
            if not more:
                break
            data += more
        self.bytes_in += len(data)
        return data

    def _write(self, data):
        self.dst.write(data)
        self.bytes_out += len(data)
        self._tick()

    def _tick(self, force=False):
        if self.progress is None:
            return
        now = time.monotonic()
        if force or now - self._last_progress >= self.progress:
            self._last_progress = now
            protocol.progress(self.err, bytes=self.bytes_in, out=self.bytes_out)

    def _data(self, size, keep, capture):
        """Copy (keep) or skip the padded data of one member; return captured bytes or None."""
        remaining = size + (-size % BLOCK)
        left = size
        parts = [] if capture else None
        while remaining:
            chunk = self._read(min(CHUNK, remaining))
            if not chunk:
                raise EOFError("archive truncated inside a member")
            remaining -= len(chunk)
            if capture:
                parts.append(chunk[: max(0, min(len(chunk), left))])
            left -= len(chunk)
            if keep:
                self._write(chunk)
            else:
                self._tick()
        return b"".join(parts) if capture else None

    # -- decisions ------------------------------------------------------------------------------
    def _decide(self, name):
        """Return the diff ID (or "" when unknown) if the member must be dropped, else None."""
        plan = self.plan
        if name in plan.drop_paths:
            return plan.oci_diff(name) or ""
        diff = plan.oci_diff(name)
        if diff is not None:
            return diff
        parts = name.split("/")
        if len(parts) == 2 and parts[1] == "layer.tar":
            if parts[0] in plan.legacy_drop:
                return plan.legacy_drop[parts[0]]
            if parts[0] in self.legacy_top_dirs:
                return self.legacy_top_dirs[parts[0]]
        return None

    def _note_legacy_json(self, name, data):
        """A legacy `<v1id>/json` precedes its `layer.tar`: spot the top layer by its parent."""
        plan = self.plan
        if not plan.top_droppable or data is None:
            return
        parts = name.split("/")
        if len(parts) != 2 or parts[1] != "json":
            return
        try:
            doc = json.loads(data.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return
        if not isinstance(doc, dict) or doc.get("id") != parts[0]:
            return
        if doc.get("parent", "") == plan.top_parent:
            self.legacy_top_dirs[parts[0]] = plan.layers[-1]

    # -- main loop ------------------------------------------------------------------------------
    def run(self):
        pending = []  # raw blocks of extended headers (pax 'x', GNU 'L'/'K') for the next member
        pending_name = None
        pending_size = None
        while True:
            header = self._read(BLOCK)
            if not header:
                raise EOFError("archive ended without an end-of-archive marker")
            if len(header) < BLOCK:
                raise EOFError("archive truncated inside a header")
            if header == b"\0" * BLOCK:
                # End of archive: pass the marker and any trailing padding through unchanged.
                self._write(header)
                while True:
                    chunk = self._read(CHUNK)
                    if not chunk:
                        break
                    self._write(chunk)
                break
            try:
                info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
            except tarfile.HeaderError as exc:
                raise ValueError(f"not a tar header ({exc})") from None
            size = info.size
            if info.type in (tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK):
                data = self._data(size, keep=False, capture=True)
                raw = header + data + b"\0" * (-size % BLOCK)
                pending.append(raw)
                if info.type == tarfile.XHDTYPE:
                    for key, value in _pax_records(data):
                        if key == "path":
                            pending_name = value
                        elif key == "size":
                            pending_size = int(value)
                elif info.type == tarfile.GNUTYPE_LONGNAME:
                    pending_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
                continue
            if info.type == tarfile.XGLTYPE:  # global pax header: always kept
                self._write(header)
                self._data(size, keep=True, capture=False)
                continue
            name = normalize(pending_name if pending_name is not None else info.name)
            if pending_size is not None:
                size = pending_size
            if not info.isreg() and info.type in tarfile.SUPPORTED_TYPES:
                size = 0  # links, directories, devices: no data follows (as tarfile reads it)
            self.members_in += 1
            diff = self._decide(name)
            if diff is not None:
                self._data(size, keep=False, capture=False)
                self.dropped.append({"path": name, "size": size, "diff_id": diff or None})
            else:
                for raw in pending:
                    self._write(raw)
                self._write(header)
                capture = info.isreg() and size <= META_LIMIT
                data = self._data(size, keep=True, capture=capture)
                if data is not None:
                    self.meta[name] = data
                    self._note_legacy_json(name, data)
                self.members_out += 1
            pending = []
            pending_name = None
            pending_size = None
        self.dst.flush()
        self._tick(force=True)

    # -- after the stream -----------------------------------------------------------------------
    def check(self):
        """Compare what was dropped with the archive's own manifest and config."""
        report = {
            "layout": "unknown",
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "members_in": self.members_in,
            "members_out": self.members_out,
            "members_dropped": len(self.dropped),
            "bytes_dropped": sum(d["size"] for d in self.dropped),
            "dropped": self.dropped,
            "prefix_layers": self.plan.prefix,
            "missed": [],
            "errors": [],
            "unsafe": False,
        }
        if "oci-layout" in self.meta or "index.json" in self.meta:
            report["layout"] = "oci"
        elif "manifest.json" in self.meta:
            report["layout"] = "legacy"
        try:
            manifest = json.loads(self.meta["manifest.json"].decode("utf-8"))
        except (KeyError, ValueError, UnicodeDecodeError):
            report["errors"].append("no readable manifest.json in the archive")
            return report
        dropped_paths = {d["path"]: d for d in self.dropped}
        fine = set()
        bad = []
        for entry in manifest if isinstance(manifest, list) else []:
            paths = [normalize(p) for p in entry.get("Layers", [])]
            diff_ids = []
            config = self.meta.get(normalize(entry.get("Config", "")))
            if config is not None:
                try:
                    diff_ids = json.loads(config.decode("utf-8"))["rootfs"]["diff_ids"]
                except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                    diff_ids = []
            if len(diff_ids) != len(paths):
                report["errors"].append(
                    "config of {}: cannot map layers".format(entry.get("Config"))
                )
                continue
            k = 0
            while k < len(diff_ids) and diff_ids[k] in self.plan.have:
                k += 1
            later = set(diff_ids[k:])
            for i, path in enumerate(paths):  # no zip(strict=): that needs 3.10
                diff = diff_ids[i]  # same length (checked above)
                if path in dropped_paths:
                    if i < k and diff not in later:
                        fine.add(path)
                        dropped_paths[path]["diff_id"] = diff
                    else:
                        bad.append(f"dropped {path} (layer {i}, {diff}) which the peer lacks")
                        fine.add(path)
                elif i < k and diff not in later and diff not in report["missed"]:
                    report["missed"].append(diff)
        for path in dropped_paths:
            if path not in fine:
                bad.append(f"dropped {path} which no manifest names as a layer")
        report["errors"].extend(bad)
        report["unsafe"] = bool(bad)
        return report


def _pax_records(data):
    pos = 0
    out = []
    while pos < len(data):
        match = re.match(rb"(\d+) ", data[pos:])
        if not match:
            break
        length = int(match.group(1))
        record = data[pos + match.end() : pos + length - 1]
        pos += length
        key, _, value = record.partition(b"=")
        out.append((key.decode("utf-8", "replace"), value.decode("utf-8", "surrogateescape")))
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="save_filter.py",
        description="Filter a `docker save` archive (stdin -> stdout), leaving out layers "
        "the peer has.",
    )
    p.add_argument("--have", action="append", default=[], type=_diff_id, metavar="DIFFID")
    p.add_argument("--have-file", metavar="FILE", help="diff IDs, one a line or a JSON list")
    p.add_argument("--layers", metavar="DIFFID,...", help="the image's diff IDs, in order")
    p.add_argument("--layers-file", metavar="FILE", help="the image's diff IDs, in order")
    p.add_argument("--drop", action="append", default=[], metavar="PATH")
    p.add_argument("--drop-file", metavar="FILE", help="member paths to leave out, one a line")
    p.add_argument("--stats", metavar="FILE", help="write the JSON report here too")
    p.add_argument(
        "--progress",
        type=float,
        metavar="SECONDS",
        help="print 'progress bytes=N out=M' (read, written) to stderr this often",
    )
    p.add_argument("--quiet", action="store_true", help="no report on stderr")
    args = p.parse_args(argv)
    have = list(args.have)
    layers = None
    try:
        if args.have_file:
            have.extend(_diff_id(x) for x in _read_list(args.have_file))
        if args.layers and args.layers_file:
            p.error("give --layers or --layers-file, not both")
        if args.layers is not None:
            layers = [_diff_id(x) for x in args.layers.split(",") if x]
        if args.layers_file:
            layers = [_diff_id(x) for x in _read_list(args.layers_file)]
        drops = list(args.drop)
        if args.drop_file:
            drops.extend(_read_list(args.drop_file))
    except (OSError, ValueError, argparse.ArgumentTypeError) as exc:
        p.error(str(exc))
    if args.progress is not None and args.progress <= 0:
        p.error("--progress must be > 0")
    return args, Drops(have, layers, drops)


MIN_PYTHON = (3, 8)


def main(argv=None):
    if sys.version_info < MIN_PYTHON:
        sys.stderr.write("save_filter: needs Python {}.{}+, this is {}.{}\n".format(
            *MIN_PYTHON, *sys.version_info[:2]))
        return 5
    args, plan = parse_args(sys.argv[1:] if argv is None else argv)
    filt = Filter(plan, sys.stdin.buffer, sys.stdout.buffer, progress=args.progress)
    status = 0
    try:
        filt.run()
    except (EOFError, ValueError) as exc:
        sys.stderr.write(f"save_filter: {exc}\n")
        status = 3
    except BrokenPipeError:
        sys.stderr.write("save_filter: output closed\n")
        status = 3
    report = filt.check()
    if status:
        report["errors"].insert(0, "stream failed")
    elif report.get("unsafe"):
        status = 4
    report["status"] = status
    text = json.dumps(report, sort_keys=True)
    if args.stats:
        with open(args.stats, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    if not args.quiet:  # stdout is the archive: the report goes last on stderr (protocol.py)
        protocol.answer(report, sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
