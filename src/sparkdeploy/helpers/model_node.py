"""sparkdeploy's node-side helper for model weights (standard library only at import).

Subcommands (each prints one JSON object last on stdout, progress lines before it; see protocol.py):

  verify  --dir D --spec S [--quick] [--jobs N] [-- P ...]
      Check every file of the spec (size; sha256 for LFS files, the git blob id for the
      others). A record of what was verified (size, mtime, hashes) lives in
      ``D/.sparkdeploy/verified.jsonl``: a file whose size and mtime match its record is not
      read again. ``--quick`` hashes nothing (files without a matching record are "unchecked").
      Also says whether a download holds the download lock (``download_running``).
  fetch   --dir D --spec S [--workers N] [--endpoint URL] [-- P ...]
      Download what is missing or wrong with huggingface_hub (which must be importable: run it
      with a container's or a virtualenv's python, never the system's), hash each file as it
      completes and record it, so ``model.sync`` can send it at once. The token, if any, is the
      first line of stdin; it is handed to huggingface_hub in memory only. It runs for as long
      as stdin stays open (in a container too: ``docker run -i``): at its end it stops.
  mkroot  --dir D [--spec S]
      Make the model dir when it is missing; with --spec, record the spec (the selection of
      files the engine loads, decided on the controller) as ``D/.sparkdeploy/selection.json``,
      where every controller reads it (``selection``).
  selection --dir D
      Print the selection recorded in D (``{"selection": null}`` when there is none).
  venv    --venv DIR --index-url URL
      Create (once) a virtualenv of sparkdeploy's own holding huggingface_hub; print its python.
  receive --dir D --spec S [--address A --port P --allow ADDR,...] [--jobs N]
      The receiving side of one ``model.sync``, for as long as its stdin stays open. With
      --address: an rsync daemon bound to A only (first free port from P), module ``model`` at
      D, one user whose secret (stdin's first line) goes to a 0600 file in a private 0700
      directory; the daemon stops and the directory goes when stdin ends. Each expected file
      (stdin's next line, a JSON list) is hashed as soon as it lands and reported on stdout as
      ``file {"path", "state", "why"}``; ``ready {"port", "private"}`` comes first. The daemon
      runs under a ``guard`` whose stdin is a pipe from this helper: when the helper ends, by
      any signal, the guard stops the daemon and removes the directory.
  guard   --private DIR -- ARGV...
      Run ARGV (the daemon) for as long as stdin stays open, then stop it (its process group)
      and remove DIR; the daemon gets SIGTERM should the guard itself be killed.

The files named after ``--`` (all of the spec's when none is) are checked against the spec.
Every file name of the spec is checked before anything acts on it (the spec comes from a hub
and a metadata cache: data, never trusted): a relative path with no ``..``, no leading ``-``,
no backslash or control character; a spec that holds any other is refused (exit 2).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import fcntl
import hashlib
import json
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable

try:  # in the package (the controller, the tests)
    from . import protocol
except ImportError:  # a script: protocol.py beside it (a checkout) or a directory up (staged on a node)
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [_here, os.path.dirname(_here)]
    import protocol  # type: ignore[import-not-found, no-redef]

META = ".sparkdeploy"


def one_line(e: BaseException) -> str:
    """An error as one line: its type and its first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
RECORD = "verified.jsonl"
SELECTION = "selection.json"
LOCK = "download.lock"
CREATED = "created"
CHUNK = 1024 * 1024
HF_META = os.path.join(".cache", "huggingface", "download")


def pool(workers: int) -> cf.ThreadPoolExecutor:
    """The one way this helper runs work side by side."""
    return cf.ThreadPoolExecutor(max_workers=max(1, workers))


# --- records -------------------------------------------------------------------------------

def make_root(root: str) -> None:
    """The model dir, made when missing; only a dir made here gets the ``CREATED`` marker, the
    one thing ``deploy.rollback --purge`` removes a model dir by (never a dir it was given)."""
    if os.path.isdir(root):
        return
    os.makedirs(root)
    with open(os.path.join(meta_dir(root), CREATED), "w", encoding="utf-8") as f:
        f.write("made by sparkdeploy; deploy.rollback --purge may remove this directory\n")


def cmd_mkroot(a: argparse.Namespace) -> int:
    text = None
    if a.spec:  # checked before anything is made: a spec that is not one is never recorded
        try:
            with open(a.spec, encoding="utf-8") as f:
                text = f.read()
            checked_files(json.loads(text))
        except (OSError, ValueError) as e:
            raise SpecError(f"cannot read the spec {a.spec}: {e}") from None
    try:
        make_root(a.dir)
    except OSError as e:
        return protocol.fail(f"cannot create {a.dir}: {e.strerror or e}", 3)
    if text is not None:
        path = os.path.join(meta_dir(a.dir), SELECTION)
        try:
            protocol.write_atomic(path, text)
        except OSError as e:
            return protocol.fail(f"cannot record the selection in {path}: {e.strerror or e}", 3)
    protocol.answer({"dir": a.dir})
    return 0


def cmd_selection(a: argparse.Namespace) -> int:
    """The selection recorded in the model dir (None: no record, or one that cannot be read)."""
    path = os.path.join(a.dir, META, SELECTION)
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        checked_files(spec)
    except FileNotFoundError:
        spec = None
    except (OSError, ValueError, SpecError) as e:
        protocol.say(f"warning: {path} is not a selection: {e}")
        spec = None
    protocol.answer({"selection": spec})
    return 0


def meta_dir(root: str) -> str:
    d = os.path.join(root, META)
    os.makedirs(d, exist_ok=True)
    return d


def load_records(root: str) -> dict[str, dict]:
    path = os.path.join(root, META, RECORD)
    out: dict[str, dict] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a torn last line of a killed writer
                if isinstance(rec, dict) and "path" in rec:
                    out[rec["path"]] = rec
    except FileNotFoundError:
        pass
    return out


_append_lock = threading.Lock()


def append_record(root: str, rec: dict) -> None:
    """Append one line; a full disk only costs the record (the file is re-hashed next time)."""
    line = json.dumps(rec, sort_keys=True) + "\n"
    try:
        path = os.path.join(meta_dir(root), RECORD)
        with _append_lock, open(path, "a", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(line)
            f.flush()
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError as e:
        protocol.say(f"warning: cannot record {rec.get('path')}: {e}")


def compact_records(root: str) -> None:
    """Rewrite the record with the last entry per file (under the same lock as appends)."""
    path = os.path.join(meta_dir(root), RECORD)
    try:
        f = open(path, "r+", encoding="utf-8")
    except FileNotFoundError:
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        last: dict[str, str] = {}
        for line in f:
            try:
                rec = json.loads(line)
                last[rec["path"]] = json.dumps(rec, sort_keys=True)
            except (ValueError, KeyError, TypeError):
                continue
        with contextlib.suppress(OSError):  # a full disk: keep the appended record as it is
            protocol.write_atomic(path, "".join(v + "\n" for v in last.values()))


# --- hashing and checking ------------------------------------------------------------------

def hash_file(path: str, size: int, git: bool) -> dict:
    sha = hashlib.sha256()
    blob = None
    if git:
        blob = hashlib.sha1()
        blob.update(b"blob %d\0" % size)
    buf = bytearray(CHUNK)  # one buffer reused: a fresh 8 MB bytes per read is an mmap, its
    view = memoryview(buf)  # page faults and an munmap each time
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            sha.update(view[:n])
            if blob is not None:
                blob.update(view[:n])
    out = {"sha256": sha.hexdigest()}
    if blob is not None:
        out["oid"] = blob.hexdigest()
    return out


def matches(want: dict, got: dict) -> str | None:
    """None when the digests agree with the hub's metadata, else what differs."""
    if want.get("sha256"):
        if got.get("sha256") != want["sha256"]:
            return "sha256 differs from the hub's"
        return None
    if want.get("oid") and got.get("oid") is not None and got.get("oid") != want["oid"]:
        return "content differs from the hub's (git blob id)"
    if want.get("oid") and got.get("oid") is None:
        return "not hashed"
    return None


def check_one(root: str, want: dict, records: dict, quick: bool) -> tuple[str, str, dict | None]:
    """(state, why, new record): state is ok | missing | differ | unchecked."""
    rel = want["path"]
    path = os.path.join(root, rel)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "missing", "missing", None
    if st.st_size != want["size"]:
        return "differ", f"size {st.st_size}, the hub says {want['size']}", None
    rec = records.get(rel)
    if rec and rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns:
        why = matches(want, rec)
        if why is None:
            return "ok", "recorded", None
        if why != "not hashed":
            return "differ", why, None
    if quick:
        return "unchecked", "not verified yet", None
    got = hash_file(path, st.st_size, git=not want.get("sha256"))
    st2 = os.stat(path)
    new = {"path": rel, "size": st2.st_size, "mtime_ns": st2.st_mtime_ns, **got,
           "verified_at": time.time()}
    if st2.st_size != st.st_size or st2.st_mtime_ns != st.st_mtime_ns:
        return "unchecked", "changed while hashed", None
    why = matches(want, got)
    return ("ok", "hashed", new) if why is None else ("differ", why, new)


def download_running(root: str) -> bool:
    path = os.path.join(root, META, LOCK)
    try:
        f = open(path)
    except FileNotFoundError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


class SpecError(Exception):
    """The spec does not hold what a spec holds (one line)."""


def name_problem(name: object) -> str | None:
    """Why ``name`` is not a safe file name inside the model dir, or None."""
    if not isinstance(name, str) or not name or len(name) > 1024:
        return "not a non-empty name of at most 1024 characters"
    if name.startswith(("/", "-")):
        return "starts with / or -"
    if any(ord(ch) < 32 or ord(ch) == 127 or ch == "\\" for ch in name):
        return "holds a control character or a backslash"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "has an empty, . or .. component"
    return None


def checked_files(spec: object) -> list[dict]:
    """The spec's file list, every entry checked (SpecError naming the first bad one)."""
    files = spec.get("files") if isinstance(spec, dict) else None
    if not isinstance(files, list):
        raise SpecError("the spec has no list of files")
    for x in files:
        if not isinstance(x, dict):
            raise SpecError(f"a file entry is not an object: {x!r:.80}")
        why = name_problem(x.get("path"))
        if why:
            raise SpecError(f"file name {x.get('path')!r:.120} refused: {why}")
        size = x.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise SpecError(f"{x['path']}: size {size!r:.40} is not a count of bytes")
    return files


def load_spec(path: str, only: list[str] | None) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except (OSError, ValueError) as e:
        raise SpecError(f"cannot read the spec {path}: {e}") from None
    files = checked_files(spec)
    if only:
        keep = set(only)
        files = [x for x in files if x["path"] in keep]
    return files


def check_files(root: str, files: list[dict], quick: bool, jobs: int) -> dict:
    """What ``root`` holds of ``files``: ok / missing / differ / unchecked (``quick``: records
    only, nothing read), recording each file hashed."""
    out: dict = {"ok": [], "missing": [], "differ": {}, "unchecked": [], "hashed_bytes": 0,
                 "reused": 0, "present": os.path.isdir(root)}
    if not os.path.isdir(root):
        out["missing"] = [x["path"] for x in files]
        out["download_running"] = False
        return out
    records = load_records(root)
    started = time.monotonic()
    total = sum(x["size"] for x in files)
    done = [0]
    lock = threading.Lock()

    def one(want: dict) -> tuple[dict, tuple]:
        res = check_one(root, want, records, quick)
        with lock:
            done[0] += want["size"]
            if not quick:
                protocol.progress(bytes=done[0], total=total, file=want["path"])
        return want, res

    writable = os.access(root, os.W_OK)
    with pool(jobs) as hashers:
        for want, (state, why, new) in hashers.map(one, files):
            if new is not None:
                out["hashed_bytes"] += want["size"]
                if writable:
                    append_record(root, new)
            elif state == "ok":
                out["reused"] += 1
            if state == "ok":
                out["ok"].append(want["path"])
            elif state == "differ":
                out["differ"][want["path"]] = why
            else:
                out[state].append(want["path"])
    if writable and out["hashed_bytes"] and not download_running(root):
        compact_records(root)
    out["seconds"] = round(time.monotonic() - started, 3)
    out["download_running"] = download_running(root)
    return out


def cmd_verify(a: argparse.Namespace) -> int:
    protocol.answer(check_files(a.dir, load_spec(a.spec, a.names), a.quick, a.jobs))
    return 0


# --- fetch ---------------------------------------------------------------------------------

def forget(root: str, rel: str) -> None:
    """Remove a wrong file and huggingface_hub's metadata for it (keep its .incomplete)."""
    if name_problem(rel):  # load_spec refused such a name already: never act on one
        raise SpecError(f"file name {rel!r:.120} refused")
    for p in (os.path.join(root, rel), os.path.join(root, HF_META, rel + ".metadata")):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def in_flight(root: str) -> int:
    """Bytes in huggingface_hub's partial files (its resume points)."""
    n = 0
    base = os.path.join(root, HF_META)
    for dirpath, _, names in os.walk(base):
        for name in names:
            if name.endswith(".incomplete"):
                try:
                    n += os.stat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    pass
    return n


class _Fetch:
    """One download into ``root``, the state its threads share: the counts so far (a ticker
    reports them each second), the files that failed, the hashing of what has arrived."""

    def __init__(self, a: argparse.Namespace, spec: dict, files: list[dict], token: str | None):
        self.a, self.spec, self.files, self.token = a, spec, files, token
        self.root = a.dir
        self.records = load_records(self.root)
        self.total = sum(x["size"] for x in files)
        self.state = {"complete": 0, "files": 0, "fetched": 0, "present": 0}
        self.failures: dict[str, str] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.hasher = pool(2)
        self.hashing: list[cf.Future] = []

    def run(self, download) -> dict:
        started = time.monotonic()
        ticker = threading.Thread(target=self.report, daemon=True)
        ticker.start()
        try:
            with pool(self.a.workers) as workers:
                list(workers.map(lambda want: self.one(want, download), self.files))
            for fut in self.hashing:
                fut.result()
        finally:
            self.hasher.shutdown(wait=True)
            self.stop.set()
        compact_records(self.root)
        st = self.state
        protocol.progress(bytes=st["complete"], total=self.total, files=st["files"], of=len(self.files))
        return {"fetched_bytes": st["fetched"], "files": st["files"], "present": st["present"],
                "failed": self.failures, "seconds": round(time.monotonic() - started, 3),
                "total": self.total}

    def report(self) -> None:
        while not self.stop.wait(1.0):
            with self.lock:
                done = self.state["complete"]
                nfiles = self.state["files"]
            protocol.progress(bytes=done + in_flight(self.root), total=self.total, files=nfiles,
                     of=len(self.files))

    def _count(self, want: dict, *keys: str) -> None:
        with self.lock:
            self.state["complete"] += want["size"]
            self.state["files"] += 1
            for k in keys:
                self.state[k] += want["size"] if k == "fetched" else 1

    def one(self, want: dict, download) -> None:
        rel = want["path"]
        st, _, new = check_one(self.root, want, self.records, quick=False)
        if new is not None:
            append_record(self.root, new)
        if st == "ok":
            self._count(want, "present")
            return
        forget(self.root, rel)

        def fetch() -> None:
            download(repo_id=self.spec["repo"], filename=rel, revision=self.spec["commit"],
                     local_dir=self.root, token=self.token, endpoint=self.a.endpoint or None)

        def failed(n: int, e: Exception) -> None:
            protocol.say(f"retry {rel} (attempt {n} of {self.a.attempts}): {one_line(e)}")

        try:
            protocol.retry(fetch, tries=self.a.attempts, pause=lambda n: min(2 * n, 10),
                           on_error=failed)
        except Exception as e:  # noqa: BLE001 - any failure of one file is reported by name
            with self.lock:
                self.failures[rel] = one_line(e)
            return
        # hashed beside the next download, so the hub's bandwidth stays in use
        self.hashing.append(self.hasher.submit(self.finish, want))

    def finish(self, want: dict) -> None:
        rel = want["path"]
        st, why, new = check_one(self.root, want, {}, quick=False)
        if st == "ok":
            assert new is not None  # an ok file always has its record
            append_record(self.root, new)
            self._count(want, "fetched")
            protocol.say(f"complete {rel}")
            return
        forget(self.root, rel)
        with self.lock:
            self.failures[rel] = f"downloaded but {why} (a re-run fetches it again)"


def _end_with_stdin() -> None:
    """stdin is the controller's connection: at its end (the controller or its SSH session
    gone) the download stops at once. huggingface_hub's partial files stay, the next run
    resumes them; the download lock goes with the process."""
    for _ in sys.stdin:
        pass
    protocol.say("error: the controller's connection ended; the download stops (a re-run resumes it)")
    os._exit(9)


def cmd_fetch(a: argparse.Namespace) -> int:
    token = sys.stdin.readline().strip() or None
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as e:
        protocol.say(f"error: huggingface_hub is not importable here ({e})")
        return 4
    files = load_spec(a.spec, a.names)  # checked before anything is made or removed
    with open(a.spec, encoding="utf-8") as f:
        spec = json.load(f)
    root = a.dir
    make_root(root)
    lockf = open(os.path.join(meta_dir(root), LOCK), "w")
    try:
        fcntl.flock(lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        protocol.say(f"error: another download into {root} is running")
        return 5
    # small files first (config and tokenizer are there at once), then shards in order
    files.sort(key=lambda x: (x["size"] > 50_000_000, x["path"]))
    threading.Thread(target=_end_with_stdin, daemon=True).start()
    out = _Fetch(a, spec, files, token).run(hf_hub_download)
    protocol.answer(out)
    fcntl.flock(lockf, fcntl.LOCK_UN)
    lockf.close()
    return 3 if out["failed"] else 0


# --- venv ----------------------------------------------------------------------------------

def cmd_venv(a: argparse.Namespace) -> int:
    venv = os.path.expanduser(a.venv)
    py = os.path.join(venv, "bin", "python3")
    probe = [py, "-c", "import huggingface_hub"]
    if os.path.exists(py) and subprocess.run(probe, capture_output=True).returncode == 0:
        protocol.answer({"python": py, "created": False})
        return 0
    os.makedirs(os.path.dirname(venv) or ".", mode=0o700, exist_ok=True)
    cp = subprocess.run([sys.executable, "-m", "venv", venv], capture_output=True, text=True)
    if cp.returncode != 0:
        tail = (cp.stderr or cp.stdout).strip().splitlines()
        protocol.say(f"error: python3 -m venv {venv} failed: {tail[-1] if tail else cp.returncode} "
            "(install python3-venv)")
        return 6
    pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--index-url", a.index_url]
    parts = urllib.parse.urlsplit(a.index_url)
    if parts.scheme == "http" and parts.hostname:  # the profile chose a plain-HTTP index
        pip += ["--trusted-host", parts.hostname]
    cp = subprocess.run([*pip, "huggingface_hub"], capture_output=True, text=True)
    if cp.returncode != 0:
        tail = (cp.stderr or cp.stdout).strip().splitlines()
        protocol.say(f"error: pip install huggingface_hub into {venv} failed: "
            f"{tail[-1] if tail else cp.returncode}")
        return 6
    protocol.answer({"python": py, "created": True})
    return 0


# --- rsync daemon --------------------------------------------------------------------------

def _free_port(address: str, first: int, tries: int = 50) -> int:
    for port in range(first, first + tries):
        s = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
        # as the daemon binds: a port whose last connections wait in TIME_WAIT is free to it
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
            return port
        except OSError:
            continue
        finally:
            s.close()
    raise OSError(f"no free port on {address} in {first}..{first + tries - 1}")


class DaemonError(Exception):
    pass


def start_rsyncd(a: argparse.Namespace, secret: str) -> tuple[subprocess.Popen, int, str]:
    """An rsync daemon bound to ``a.address`` only, under a guard (``guard``) that lives as long
    as this helper: (the guard, port, private directory)."""
    make_root(a.dir)
    priv = tempfile.mkdtemp(prefix="sparkdeploy-rsyncd-")  # 0700, ours
    secrets = os.path.join(priv, "secrets")
    fd = os.open(secrets, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"sparkdeploy:{secret}\n")
    st = os.stat(a.dir)
    allow = " ".join(x for x in a.allow.split(",") if x)
    conf = os.path.join(priv, "rsyncd.conf")
    lines = [
        "use chroot = false",
        # access is by address only; a PTR lookup of the peer's link address can wait out the
        # resolver's timeout on every connection where no DNS answers for it
        "reverse lookup = no",
        f"max connections = {a.max_connections}",
        f"lock file = {os.path.join(priv, 'rsyncd.lock')}",
        "[model]",
        f"path = {a.dir}",
        "read only = false",
        "list = false",
        "auth users = sparkdeploy",
        f"secrets file = {secrets}",
        "strict modes = true",
        f"hosts allow = {allow}" if allow else "",
        "hosts deny = *" if allow else "",
    ]
    if os.geteuid() == 0:
        lines += [f"uid = {st.st_uid}", f"gid = {st.st_gid}"]
    with open(conf, "w") as f:
        f.write("\n".join(x for x in lines if x) + "\n")
    port = _free_port(a.address, a.port)
    argv = ["timeout", "-s", "TERM", str(a.max_seconds), "rsync", "--daemon", "--no-detach",
            f"--address={a.address}", f"--port={port}", f"--config={conf}",
            f"--log-file={os.path.join(priv, 'rsyncd.log')}"]
    # the guard's stdin is a pipe only this process writes to: it reads EOF when this process
    # ends, however it ends (a kill -9 included); a session of its own, so that a signal to
    # this helper's process group does not reach it before it has cleaned up
    guard = subprocess.Popen([sys.executable, os.path.abspath(__file__), "guard", "--private",
                              priv, "--", *argv], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    def listening() -> tuple[subprocess.Popen, int, str]:
        if guard.poll() is not None:
            assert guard.stderr is not None
            why = guard.stderr.read().strip().splitlines()
            shutil.rmtree(priv, ignore_errors=True)
            raise DaemonError(f"rsync daemon exited at start: {why[-1] if why else guard.returncode}")
        with socket.create_connection((a.address, port), timeout=1):
            return guard, port, priv

    try:
        return protocol.retry(listening, errors=(OSError,), deadline=protocol.Deadline(10),
                              pause=lambda n: 0.02)
    except OSError:
        stop_rsyncd(guard, priv)
        raise DaemonError(f"rsync daemon did not listen on {a.address}:{port}") from None


def stop_rsyncd(guard: subprocess.Popen, priv: str) -> None:
    """Stop the daemon (its guard's stdin ends) and remove its private directory."""
    if guard.stdin is not None:
        with contextlib.suppress(OSError):
            guard.stdin.close()
    try:
        guard.wait(15)
    except subprocess.TimeoutExpired:  # the daemon gets SIGTERM when its guard dies
        guard.kill()
        guard.wait()
    shutil.rmtree(priv, ignore_errors=True)


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append(int(d))
    return out


def _term_with_parent() -> Callable[[], None]:
    """A preexec function: the child gets SIGTERM when this process dies (Linux's
    ``PR_SET_PDEATHSIG``, kept across exec)."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGTERM, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before the line above
            os._exit(1)

    return preexec


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member changed its uid (the daemon as the model dir's owner)
        return True
    return True


def _end_daemon(proc: subprocess.Popen) -> None:
    """Stop the daemon's whole process group: every rsync it forked holds the listening socket
    too, so the port is free only once none is left."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            # timeout, the listener and any connection's rsync share a session of their own;
            # TERM lets a connection's rsync keep its partial file
            os.killpg(proc.pid, signal.SIGTERM)
        for child in _children(proc.pid):  # the listener: on TERM rsync sleeps 400 ms before
            with contextlib.suppress(ProcessLookupError):  # it exits, its socket still open;
                os.kill(child, signal.SIGKILL)  # it holds no file, so it need not wait
    deadline = protocol.Deadline(5)
    while _group_alive(proc.pid) and not deadline.passed():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = protocol.Deadline(5)  # killed: gone once reaped (a zombie still counts)
    while _group_alive(proc.pid) and not deadline.passed():
        time.sleep(0.01)


def cmd_guard(a: argparse.Namespace) -> int:
    """Run the daemon (``a.argv``) for as long as stdin stays open, then stop it and remove its
    private directory (``a.private``, the secret's). It also ends on SIGTERM, SIGHUP or SIGINT,
    or when the daemon exits (the last line of its log on stderr); the daemon gets SIGTERM
    should this guard itself be killed."""
    ended: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda n, _f: ended.append(n))
    proc = subprocess.Popen(a.argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_term_with_parent())
    try:
        while not ended and proc.poll() is None:
            try:
                ready, _, _ = select.select([sys.stdin], [], [], 0.2)
            except InterruptedError:
                continue
            if ready and not os.read(sys.stdin.fileno(), 4096):
                break  # EOF: the helper that started us is done, or gone
        code = proc.poll()
        _end_daemon(proc)
        if code is not None:
            with contextlib.suppress(OSError, IndexError), \
                    open(os.path.join(a.private, "rsyncd.log")) as f:
                protocol.say(f.read().strip().splitlines()[-1])
    finally:
        shutil.rmtree(a.private, ignore_errors=True)
    return 0 if code is None else 1


def _ident(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _commands(out: queue.SimpleQueue[str | None]) -> None:
    for line in sys.stdin:
        out.put(line.strip())
    out.put(None)  # EOF: the sender is done (or gone)


def free_space(path: str) -> dict:
    """What df says of the filesystem that holds (or will hold) ``path``: bytes available to
    this user and its mount point."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    st = os.statvfs(p)
    mount = p
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    return {"free": st.f_bavail * st.f_frsize, "mount": mount}


def no_counts() -> dict:
    """What ``receive`` says at its end, before anything was received."""
    return {"ok": 0, "differ": 0, "missing": 0, "hashed_bytes": 0}


class Arrivals:
    """The expected files of one sync on this receiver, each checked as soon as it lands: it
    has its size and another inode or mtime than when it was expected (rsync writes a
    temporary file and renames it into place)."""

    def __init__(self, root: str, files: dict[str, dict], jobs: int):
        self.root, self.files = root, files
        self.base = {rel: _ident(os.path.join(root, rel)) for rel in files}
        self.pending = set(files)
        self.settled: set[str] = set()  # their transfer ended, landed or not
        self.ending = False  # nothing more comes
        self.hashing: dict[cf.Future, str] = {}
        self.pool = pool(jobs)
        self.counts = no_counts()

    def done(self) -> bool:
        return self.ending and not self.pending and not self.hashing

    def again(self, rels: list[str]) -> None:
        """Files reported missing that will be sent again: expected anew."""
        for rel in rels:
            if rel in self.files and rel not in self.hashing.values():
                self.settled.discard(rel)
                self.base[rel] = _ident(os.path.join(self.root, rel))
                self.pending.add(rel)

    def _report(self, rel: str, state: str, why: str) -> None:
        self.counts[state] += 1
        protocol.event("file", {"path": rel, "state": state, "why": why})

    def step(self) -> bool:
        """Hash what landed, report what was checked or will not come; True if anything did."""
        busy = False
        for rel in sorted(self.pending):
            want = self.files[rel]
            now = _ident(os.path.join(self.root, rel))
            if now is not None and now[2] == want["size"] and now != self.base[rel]:
                self.pending.discard(rel)
                self.hashing[self.pool.submit(check_one, self.root, want, {}, False)] = rel
                busy = True
            elif rel in self.settled or self.ending:
                self.pending.discard(rel)
                busy = True
                if now is None or now == self.base[rel]:
                    self._report(rel, "missing", "not received")
                else:
                    self._report(rel, "differ", f"size {now[2]}, the hub says {want['size']}")
        for fut in [f for f in self.hashing if f.done()]:
            rel = self.hashing.pop(fut)
            state, why, new = fut.result()
            busy = True
            if new is not None:
                self.counts["hashed_bytes"] += new["size"]
                append_record(self.root, new)
            if state == "unchecked":  # changed while hashed: hashed again once it is still
                self.base[rel] = None
                self.pending.add(rel)
            else:
                self._report(rel, state, why)
        return busy

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def cmd_receive(a: argparse.Namespace) -> int:
    """The receiving side of one sync, until stdin ends.

    stdin: the daemon's secret (with --address), then a JSON list of the files the sync covers.
    First it says what this node holds of them (``state {...}``: as verify, hashing the files
    present without a record, plus ``free`` and ``mount``), then waits for ``expect <JSON
    list>``: the files that will be sent. With --address it starts the daemon then, and says
    ``ready {"port", "private"}``. Then ``settle <JSON list>`` for each batch whose transfer
    ended, and ``expect <JSON list>`` again for files reported missing that another sender
    will send. A file counts as landed once it has its size and another inode or mtime than at
    ``expect`` (rsync renames a finished file into place); it is hashed at once, beside the
    transfers still running, and reported (``file {"path", "state", "why"}``). A settled file
    that has not landed is reported missing. When stdin ends the daemon stops, what landed is
    still checked, and the rest is reported missing."""
    secret = sys.stdin.readline().strip() if a.address else ""
    if a.address and not secret:
        protocol.say("error: no secret on stdin")
        return 2
    try:
        scope = json.loads(sys.stdin.readline() or "[]")
    except ValueError:
        protocol.say("error: the second line of stdin is not a JSON list of files")
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = a.dir
    files = {x["path"]: x for x in load_spec(a.spec, scope)} if scope else {}
    protocol.event("state", {**check_files(root, list(files.values()), False, a.jobs),
                             **free_space(root)})
    cmds: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    threading.Thread(target=_commands, args=(cmds,), daemon=True).start()
    first = cmds.get()
    if first is None or not first.startswith("expect "):
        protocol.answer(no_counts())
        return 0
    files = {rel: files[rel] for rel in json.loads(first[7:]) if rel in files}
    make_root(root)
    if shutil.which("rsync") is None:
        protocol.say("error: rsync is not installed on this node (apt-get install rsync)")
        return 7
    daemon, port, priv = None, None, None
    if a.address:
        try:
            proc, port, priv = start_rsyncd(a, secret)
        except (DaemonError, OSError) as e:
            protocol.say(f"error: {e}")
            return 7
        daemon = (proc, priv)
    arrivals = Arrivals(root, files, a.jobs)
    deadline = protocol.Deadline(a.max_seconds)
    try:
        protocol.event("ready", {"port": port, "private": priv})
        while not arrivals.done():
            busy = False
            while True:
                try:
                    cmd = cmds.get_nowait()
                except queue.Empty:
                    break
                busy = True
                if cmd is None:
                    arrivals.ending = True
                    if daemon is not None:  # nothing more comes: the listener goes now
                        stop_rsyncd(*daemon)
                        daemon = None
                elif cmd.startswith("settle "):
                    arrivals.settled.update(json.loads(cmd[7:]))
                elif cmd.startswith("expect "):  # reported missing: sent again, from another
                    arrivals.again(json.loads(cmd[7:]))
            busy = arrivals.step() or busy
            if deadline.passed():
                protocol.say(f"error: still receiving after {a.max_seconds}s")
                return 8
            if not busy:
                time.sleep(0.02)
    finally:
        arrivals.close()
        if daemon is not None:
            stop_rsyncd(*daemon)
    if arrivals.counts["hashed_bytes"] and not download_running(root):
        compact_records(root)
    protocol.answer(arrivals.counts)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="model_node.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify")
    v.add_argument("--dir", required=True)
    v.add_argument("--spec", required=True)
    v.add_argument("--quick", action="store_true")
    v.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    v.add_argument("names", nargs="*", help="after --: the files to check (default: all)")
    f = sub.add_parser("fetch")
    f.add_argument("--dir", required=True)
    f.add_argument("--spec", required=True)
    f.add_argument("--workers", type=int, default=4)
    f.add_argument("--attempts", type=int, default=3)
    f.add_argument("--endpoint", default="")
    f.add_argument("names", nargs="*", help="after --: the files to fetch (default: all)")
    e = sub.add_parser("venv")
    e.add_argument("--venv", required=True)
    e.add_argument("--index-url", required=True)
    k = sub.add_parser("mkroot")
    k.add_argument("--dir", required=True)
    k.add_argument("--spec", default="")
    s = sub.add_parser("selection")
    s.add_argument("--dir", required=True)
    r = sub.add_parser("receive")
    r.add_argument("--dir", required=True)
    r.add_argument("--spec", required=True)
    r.add_argument("--address", default="")
    r.add_argument("--port", type=int, default=8730)
    r.add_argument("--allow", default="")
    r.add_argument("--max-connections", type=int, default=16)
    r.add_argument("--max-seconds", type=int, default=24 * 3600)
    r.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    g = sub.add_parser("guard")
    g.add_argument("--private", required=True)
    g.add_argument("argv", nargs="+")
    a = p.parse_args(argv)
    try:
        return {"verify": cmd_verify, "fetch": cmd_fetch, "venv": cmd_venv,
                "receive": cmd_receive, "guard": cmd_guard, "mkroot": cmd_mkroot,
                "selection": cmd_selection}[a.cmd](a)
    except SpecError as e:
        protocol.say(f"error: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
