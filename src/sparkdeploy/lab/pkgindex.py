"""A PEP 503 (and PEP 691 JSON) package index for the rehearsal lab, served from the controller.

The lab's networks have no route out, so ``pip install "transformers>=5"`` inside a lab
``docker build`` uses this index (``PIP_INDEX_URL=http://<controller>:8901/simple/``). It serves
a directory of wheels filled on the controller by ``pip download`` (``ensure_wheels``), for
CPython 3.11 on Linux (Debian bookworm, glibc 2.36) and the machine's architecture.

Default port: 8901 (the model hub, ``sparkdeploy.lab.hub``, uses 8900).
Default wheel directory: /var/cache/sparkdeploy/wheels.

Endpoints: ``/simple/`` and ``/simple/<project>/`` (HTML per PEP 503 with ``#sha256=`` and
``data-requires-python``; JSON per PEP 691 when the client's Accept header prefers
``application/vnd.pypi.simple.v1+json``), ``/files/<filename>``, ``/_lab/health``. The
directory is rescanned on each request, so wheels added while the index runs are served.

Function API::

    from sparkdeploy.lab import pkgindex
    pkgindex.ensure_wheels()                      # defaults: DEFAULT_REQUIREMENTS into the cache
    pkgindex.ensure_wheels([["six"], ["transformers==4.57.1"]], "/tmp/wheels")
    server = pkgindex.start_index(bind="127.0.0.1", port=0, wheel_dir="/tmp/wheels")
    server.url            # "http://127.0.0.1:<port>";  server.index_url -> ".../simple/"
    server.pip_env        # {"PIP_INDEX_URL": ".../simple/", "PIP_TRUSTED_HOST": "127.0.0.1"}
    server.stop()

pip ignores a plain-HTTP index on any host but localhost unless told the host is trusted: the
lab's env file needs both ``PIP_INDEX_URL`` and ``PIP_TRUSTED_HOST`` (``pip_env(url)``), and a
``docker build`` passes both (``--build-arg`` or ``--trusted-host``).

``ensure_wheels(requirements, cache_dir)`` resolves each requirement set with its own
``pip download`` (sets may conflict with each other, e.g. transformers 4 and 5) and records
what each set needed in ``<cache_dir>/.sets/``; a set already recorded whose files are present
is not downloaded again (no network at all).

CLI (``lab.up`` as a daemon: ``ensure_wheels()`` in lab.up itself so failures surface there,
then ``Popen(pkgindex.cli_argv(controller_addr))``, record the PID, ``pkgindex.wait_ready(url)``;
it prints ``READY <index url>`` once it serves; the lab's env file gets
``pip_env("http://<controller>:8901/simple/")``: PIP_INDEX_URL and PIP_TRUSTED_HOST)::

    python -m sparkdeploy.lab.pkgindex --bind 10.x.y.1 --port 8901 \
        --wheels /var/cache/sparkdeploy/wheels [--ensure]   # --ensure: ensure_wheels() first
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import html
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from sparkdeploy.core.files import move_in
from sparkdeploy.lab.server import LabServer, serve_until_stopped
from sparkdeploy.lab.server import wait_ready as wait_health

DEFAULT_PORT = 8901
DEFAULT_WHEEL_DIR = Path("/var/cache/sparkdeploy/wheels")
# One pip resolution per inner list: the two transformers lines conflict with each other.
DEFAULT_REQUIREMENTS: tuple[tuple[str, ...], ...] = (
    ("transformers>=5",),
    ("transformers==5.3.0",),  # what SGLang 0.5.10rc0 declares: the layer image.build resolves
    ("transformers==4.57.1",),
    ("huggingface_hub",),  # model.download's own virtualenv on a node whose pip is refused
)
TARGET_PYTHON = "3.11"  # Debian bookworm's python3
TARGET_GLIBC_MINOR = 36  # Debian bookworm's glibc 2.36
JSON_TYPE = "application/vnd.pypi.simple.v1+json"
HTML_TYPE = "application/vnd.pypi.simple.v1+html"
ARCHIVE_SUFFIXES = (".whl", ".tar.gz", ".zip")

Runner = Callable[..., subprocess.CompletedProcess]

# --------------------------------------------------------------------------------------------
# Filling the wheel directory
# --------------------------------------------------------------------------------------------


def normalize(name: str) -> str:
    """PEP 503 normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def target_platforms(machine: str | None = None) -> list[str]:
    """Platform tags a bookworm CPython accepts on this machine's architecture."""
    arch = {"arm64": "aarch64", "amd64": "x86_64"}.get(
        (machine or platform.machine()).lower(), (machine or platform.machine()).lower())
    tags = [f"manylinux_2_{m}_{arch}" for m in range(TARGET_GLIBC_MINOR, 16, -1)]
    tags.append(f"manylinux2014_{arch}")
    if arch == "x86_64":
        tags += ["manylinux2010_x86_64", "manylinux1_x86_64"]
    return tags


def pip_download_argv(requirements: Sequence[str], dest: Path | str, find_links: Path | str,
                      machine: str | None = None, python: str = sys.executable) -> list[str]:
    """The exact ``pip download`` command for one requirement set."""
    argv = [python, "-m", "pip", "download", "--disable-pip-version-check", "--no-input",
            "--dest", str(dest), "--find-links", str(find_links), "--only-binary=:all:",
            "--python-version", TARGET_PYTHON, "--implementation", "cp"]
    for tag in target_platforms(machine):
        argv += ["--platform", tag]
    return [*argv, *requirements]


def _set_key(requirements: Sequence[str], machine: str | None) -> str:
    ident = json.dumps([list(requirements), TARGET_PYTHON, target_platforms(machine)])
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


@dataclass
class WheelsReport:
    """What ensure_wheels did: sets resolved now, sets already present, files per set."""

    cache_dir: Path
    downloaded: list[list[str]] = field(default_factory=list)
    present: list[list[str]] = field(default_factory=list)
    files: dict[str, list[str]] = field(default_factory=dict)  # "req; req" -> file names

    @property
    def changed(self) -> bool:
        return bool(self.downloaded)


class WheelDownloadError(RuntimeError):
    pass


def ensure_wheels(
    requirements: Sequence[Sequence[str] | str] = DEFAULT_REQUIREMENTS,
    cache_dir: Path | str = DEFAULT_WHEEL_DIR,
    *,
    machine: str | None = None,
    python: str = sys.executable,
    runner: Runner = subprocess.run,
) -> WheelsReport:
    """Make sure cache_dir holds wheels for every requirement set (idempotent).

    Each item of ``requirements`` is one set resolved on its own (a string is a set of one).
    A set whose record in ``<cache_dir>/.sets/`` lists files that are all present is skipped
    without running pip. Raises WheelDownloadError (with pip's last lines) when pip fails.
    """
    cache = Path(cache_dir)
    (cache / ".sets").mkdir(parents=True, exist_ok=True)
    report = WheelsReport(cache_dir=cache)
    for item in requirements:
        reqs = [item] if isinstance(item, str) else list(item)
        label = "; ".join(reqs)
        record = cache / ".sets" / f"{_set_key(reqs, machine)}.json"
        if record.exists():
            files = json.loads(record.read_text()).get("files", [])
            if files and all((cache / f).is_file() for f in files):
                report.present.append(reqs)
                report.files[label] = files
                continue
        with tempfile.TemporaryDirectory(dir=cache, prefix=".dl-") as tmp:
            argv = pip_download_argv(reqs, tmp, cache, machine=machine, python=python)
            proc = runner(argv, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = "\n".join(((proc.stderr or "") + (proc.stdout or "")).splitlines()[-15:])
                raise WheelDownloadError(f"pip download {label!r} failed:\n{tail}")
            files = sorted(n for n in os.listdir(tmp) if n.endswith(ARCHIVE_SUFFIXES))
            for name in files:
                if not (cache / name).is_file():
                    move_in(os.path.join(tmp, name), cache / name)
        record.write_text(json.dumps({"requirements": reqs, "files": files,
                                      "python": TARGET_PYTHON,
                                      "platforms": target_platforms(machine)}, indent=1))
        report.downloaded.append(reqs)
        report.files[label] = files
    return report


# --------------------------------------------------------------------------------------------
# The index
# --------------------------------------------------------------------------------------------


def project_of(filename: str) -> str | None:
    """Normalized project name of a wheel or sdist file name (None if not an archive)."""
    if filename.endswith(".whl"):
        return normalize(filename.split("-", 1)[0])
    for suffix in (".tar.gz", ".zip"):
        if filename.endswith(suffix):
            name, sep, _version = filename[: -len(suffix)].rpartition("-")
            return normalize(name) if sep else None
    return None


def _requires_python(path: Path) -> str | None:
    if not path.name.endswith(".whl"):
        return None
    try:
        with zipfile.ZipFile(path) as z:
            meta = next((n for n in z.namelist()
                         if n.endswith(".dist-info/METADATA") and n.count("/") == 1), None)
            if meta is None:
                return None
            msg = email.parser.BytesHeaderParser().parsebytes(z.read(meta))
            return msg.get("Requires-Python")
    except (zipfile.BadZipFile, OSError):
        return None


@dataclass(frozen=True)
class DistFile:
    filename: str
    project: str
    sha256: str
    requires_python: str | None
    size: int


class WheelDir:
    """A directory of distributions, rescanned per request; hashes cached by (size, mtime)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self._lock = threading.Lock()
        self._meta: dict[str, tuple[tuple[int, int], DistFile]] = {}

    def files(self) -> list[DistFile]:
        out = []
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        for name in names:
            project = project_of(name)
            path = self.root / name
            if project is None or not path.is_file():
                continue
            st = path.stat()
            stamp = (st.st_size, st.st_mtime_ns)
            with self._lock:
                cached = self._meta.get(name)
            if cached and cached[0] == stamp:
                out.append(cached[1])
                continue
            sha = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    sha.update(block)
            dist = DistFile(name, project, sha.hexdigest(), _requires_python(path), st.st_size)
            with self._lock:
                self._meta[name] = (stamp, dist)
            out.append(dist)
        return out

    def projects(self) -> dict[str, list[DistFile]]:
        by: dict[str, list[DistFile]] = {}
        for d in self.files():
            by.setdefault(d.project, []).append(d)
        return by


def _prefers_json(accept: str | None) -> bool:
    """True when the Accept header ranks PEP 691 JSON first (ties: the earlier entry)."""
    ranked = []
    for i, part in enumerate((accept or "").split(",")):
        fields = [x.strip() for x in part.split(";")]
        q = 1.0
        for param in fields[1:]:
            if param.startswith("q="):
                try:
                    q = float(param[2:])
                except ValueError:
                    q = 0.0
        ranked.append((q, -i, fields[0]))
    return bool(ranked) and max(ranked)[2] == JSON_TYPE


class IndexHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "sparkdeploy-lab-index/1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    @property
    def wheels(self) -> WheelDir:
        return self.server.wheels  # type: ignore[attr-defined]

    def _send(self, status: int, body: bytes, ctype: str,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        if not self.path.startswith("/_lab/"):
            self.server.record(self.command, self.path, status,  # type: ignore[attr-defined]
                               self.client_address[0])

    def _not_found(self, what: str) -> None:
        self._send(404, f"not found: {what}\n".encode(), "text/plain; charset=utf-8")

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        try:
            self._route()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    do_HEAD = do_GET

    def _route(self) -> None:
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        if path == "/_lab/health":
            return self._send(200, b'{"ok": true}', "application/json")
        if path == "/_lab/stats":
            return self._send(200, json.dumps(self.server.stats()).encode(),  # type: ignore[attr-defined]
                              "application/json")
        if path in ("/", "/simple"):
            return self._send(301, b"", "text/plain", {"Location": "/simple/"})
        if path == "/simple/":
            return self._root()
        if path.startswith("/simple/"):
            name = path[len("/simple/"):].strip("/")
            if "/" in name or not name:
                return self._not_found(path)
            if normalize(name) != name or not path.endswith("/"):
                return self._send(301, b"", "text/plain",
                                  {"Location": f"/simple/{normalize(name)}/"})
            return self._project(name)
        if path.startswith("/files/"):
            return self._file(path[len("/files/"):])
        return self._not_found(path)

    def _root(self) -> None:
        projects = sorted(self.wheels.projects())
        if _prefers_json(self.headers.get("Accept")):
            body = {"meta": {"api-version": "1.0"}, "projects": [{"name": p} for p in projects]}
            return self._send(200, json.dumps(body).encode(), JSON_TYPE)
        links = "\n".join(f'    <a href="/simple/{p}/">{p}</a><br/>' for p in projects)
        page = ("<!DOCTYPE html>\n<html>\n  <head><meta name=\"pypi:repository-version\" "
                f"content=\"1.0\"><title>Simple index</title></head>\n  <body>\n{links}\n"
                "  </body>\n</html>\n")
        self._send(200, page.encode(), "text/html; charset=utf-8")

    def _project(self, name: str) -> None:
        dists = self.wheels.projects().get(name)
        if not dists:
            return self._not_found(name)
        if _prefers_json(self.headers.get("Accept")):
            files = []
            for d in dists:
                entry: dict[str, Any] = {"filename": d.filename, "url": f"/files/{d.filename}",
                                         "hashes": {"sha256": d.sha256}}
                if d.requires_python:
                    entry["requires-python"] = d.requires_python
                files.append(entry)
            body = {"meta": {"api-version": "1.0"}, "name": name, "files": files}
            return self._send(200, json.dumps(body).encode(), JSON_TYPE)
        rows = []
        for d in dists:
            attrs = f' data-requires-python="{html.escape(d.requires_python, quote=True)}"' if (
                d.requires_python) else ""
            href = f"/files/{urllib.parse.quote(d.filename)}#sha256={d.sha256}"
            rows.append(f'    <a href="{href}"{attrs}>{html.escape(d.filename)}</a><br/>')
        page = ("<!DOCTYPE html>\n<html>\n  <head><meta name=\"pypi:repository-version\" "
                f"content=\"1.0\"><title>Links for {name}</title></head>\n  <body>\n"
                f"    <h1>Links for {name}</h1>\n" + "\n".join(rows) + "\n  </body>\n</html>\n")
        self._send(200, page.encode(), "text/html; charset=utf-8")

    def _file(self, filename: str) -> None:
        if "/" in filename or filename.startswith(".") or project_of(filename) is None:
            return self._not_found(filename)
        path = self.wheels.root / filename
        if not path.is_file():
            return self._not_found(filename)
        size = path.stat().st_size
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size))
        self.end_headers()
        if self.command != "HEAD":
            with open(path, "rb") as f:
                shutil.copyfileobj(f, self.wfile, 1 << 16)
        self.server.record(self.command, self.path, 200,  # type: ignore[attr-defined]
                           self.client_address[0])


class IndexServer(LabServer):
    thread_name = "lab-index"

    def __init__(self, addr: tuple[str, int], wheel_dir: Path | str):
        super().__init__(addr, IndexHandler)
        self.wheels = WheelDir(wheel_dir)
        self.requests: list[tuple[str, str, int, str]] = []
        self._lock = threading.Lock()

    def record(self, method: str, path: str, status: int, client: str = "") -> None:
        with self._lock:
            self.requests.append((method, path, status, client))
            del self.requests[:-2000]

    def stats(self) -> dict[str, Any]:
        """What ``GET /_lab/stats`` answers: the last requests (method, path, status, client)."""
        with self._lock:
            return {"requests": [{"method": m, "path": p, "status": s, "client": c}
                                 for m, p, s, c in self.requests]}

    @property
    def index_url(self) -> str:
        return self.url + "/simple/"

    @property
    def pip_env(self) -> dict[str, str]:
        return pip_env(self.index_url)


def pip_env(index_url: str) -> dict[str, str]:
    """Environment for pip (and the lab's env file) to use the index over plain HTTP.

    pip ignores a plain-HTTP index on any host but localhost unless it is a trusted host.
    """
    host = urllib.parse.urlsplit(index_url).hostname or ""
    return {"PIP_INDEX_URL": index_url, "PIP_TRUSTED_HOST": host}


def start_index(bind: str = "127.0.0.1", port: int = 0,
                wheel_dir: Path | str = DEFAULT_WHEEL_DIR) -> IndexServer:
    """Serve wheel_dir as a simple index from a background thread."""
    Path(wheel_dir).mkdir(parents=True, exist_ok=True)
    return IndexServer((bind, port), wheel_dir).start()


def cli_argv(bind: str, port: int = DEFAULT_PORT, wheel_dir: Path | str = DEFAULT_WHEEL_DIR,
             python: str = sys.executable) -> list[str]:
    """argv to run the index as a daemon (lab.up: ensure_wheels() first, then Popen this)."""
    return [python, "-m", "sparkdeploy.lab.pkgindex", "--bind", bind, "--port", str(port),
            "--wheels", str(wheel_dir)]


def wait_ready(url: str, timeout: float = 60.0) -> bool:
    """Poll GET <server root>/_lab/health until it answers 200 (True) or timeout (False)."""
    return wait_health(url.split("/simple", 1)[0], timeout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparkdeploy.lab.pkgindex",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--bind", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--wheels", default=str(DEFAULT_WHEEL_DIR), help="wheel directory")
    p.add_argument("--ensure", action="store_true",
                   help="run ensure_wheels() with the default requirements first")
    args = p.parse_args(argv)
    if args.ensure:
        try:
            ensure_wheels(DEFAULT_REQUIREMENTS, args.wheels)
        except WheelDownloadError as e:
            print(f"pkgindex: {e}", file=sys.stderr)
            return 1
    try:
        server = start_index(args.bind, args.port, args.wheels)
    except OSError as e:
        print(f"pkgindex: cannot start: {e}", file=sys.stderr)
        return 1
    return serve_until_stopped(server, server.index_url)


__all__ = [
    "DEFAULT_PORT", "DEFAULT_WHEEL_DIR", "DEFAULT_REQUIREMENTS", "IndexServer", "WheelsReport",
    "WheelDownloadError", "ensure_wheels", "normalize", "pip_download_argv", "project_of",
    "pip_env", "start_index", "target_platforms", "cli_argv", "wait_ready", "main",
]

if __name__ == "__main__":
    sys.exit(main())
