"""The lab's package index: ensure_wheels (exact pip argv, idempotence) and the PEP 503 server."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import requests

from sparkdeploy.lab import pkgindex

X86_TAGS = [f"manylinux_2_{m}_x86_64" for m in range(36, 16, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def test_target_platforms_cover_bookworm_glibc_per_architecture():
    assert pkgindex.target_platforms("x86_64") == X86_TAGS
    arm = pkgindex.target_platforms("aarch64")
    assert arm[0] == "manylinux_2_36_aarch64" and arm[-1] == "manylinux2014_aarch64"
    assert pkgindex.target_platforms("arm64") == arm


def test_pip_env_trusts_the_plain_http_host():
    assert pkgindex.pip_env("http://10.77.0.1:8901/simple/") == {
        "PIP_INDEX_URL": "http://10.77.0.1:8901/simple/", "PIP_TRUSTED_HOST": "10.77.0.1"}


def test_pip_download_argv_is_exact():
    argv = pkgindex.pip_download_argv(["transformers>=5"], "/d", "/c", machine="x86_64",
                                      python="/py")
    platforms = [a for tag in X86_TAGS for a in ("--platform", tag)]
    assert argv == ["/py", "-m", "pip", "download", "--disable-pip-version-check", "--no-input",
                    "--dest", "/d", "--find-links", "/c", "--only-binary=:all:",
                    "--python-version", "3.11", "--implementation", "cp", *platforms,
                    "transformers>=5"]


class FakePip:
    """Stands in for `pip download`: records argv, writes the named files into --dest."""

    def __init__(self, files_per_call, returncode=0, stderr=""):
        self.calls: list[list[str]] = []
        self.files_per_call = list(files_per_call)
        self.returncode, self.stderr = returncode, stderr

    def __call__(self, argv, capture_output, text):
        self.calls.append(argv)
        dest = Path(argv[argv.index("--dest") + 1])
        for name in self.files_per_call.pop(0) if self.files_per_call else []:
            (dest / name).write_bytes(b"wheel " + name.encode())
        return subprocess.CompletedProcess(argv, self.returncode, "", self.stderr)


def test_ensure_wheels_resolves_each_set_once(tmp_path):
    pip = FakePip([["a-1-py3-none-any.whl", "b-2-py3-none-any.whl"],
                   ["a-1-py3-none-any.whl", "c-3-py3-none-any.whl"]])
    report = pkgindex.ensure_wheels([["a"], "c"], tmp_path, machine="x86_64", python="/py",
                                    runner=pip)

    assert [c[-1] for c in pip.calls] == ["a", "c"]
    assert pip.calls[0] == pkgindex.pip_download_argv(
        ["a"], pip.calls[0][pip.calls[0].index("--dest") + 1], tmp_path, "x86_64", "/py")
    assert report.changed and report.downloaded == [["a"], ["c"]]
    assert report.files == {"a": ["a-1-py3-none-any.whl", "b-2-py3-none-any.whl"],
                            "c": ["a-1-py3-none-any.whl", "c-3-py3-none-any.whl"]}
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "a-1-py3-none-any.whl", "b-2-py3-none-any.whl", "c-3-py3-none-any.whl"]

    again = pkgindex.ensure_wheels([["a"], "c"], tmp_path, machine="x86_64", python="/py",
                                   runner=pip)
    assert len(pip.calls) == 2  # nothing ran: both sets are recorded and present
    assert not again.changed and again.present == [["a"], ["c"]]

    (tmp_path / "b-2-py3-none-any.whl").unlink()
    pip.files_per_call = [["a-1-py3-none-any.whl", "b-2-py3-none-any.whl"]]
    third = pkgindex.ensure_wheels([["a"], "c"], tmp_path, machine="x86_64", python="/py",
                                   runner=pip)
    assert [c[-1] for c in pip.calls] == ["a", "c", "a"]
    assert third.downloaded == [["a"]] and third.present == [["c"]]
    assert (tmp_path / "b-2-py3-none-any.whl").is_file()


def test_ensure_wheels_reports_pip_failure(tmp_path):
    pip = FakePip([], returncode=1, stderr="ERROR: No matching distribution found for nope\n")
    with pytest.raises(pkgindex.WheelDownloadError, match="No matching distribution"):
        pkgindex.ensure_wheels(["nope"], tmp_path, runner=pip)
    assert not list((tmp_path / ".sets").iterdir())


@pytest.mark.parametrize(("filename", "project"), [
    ("Typing_Extensions-4.16.0-py3-none-any.whl", "typing-extensions"),
    ("huggingface_hub-2.4.0-py3-none-any.whl", "huggingface-hub"),
    ("zope.interface-7.0-cp311-cp311-manylinux_2_17_x86_64.whl", "zope-interface"),
    ("ruamel.yaml.clib-0.2.8.tar.gz", "ruamel-yaml-clib"),
    ("notes.txt", None),
])
def test_project_names_are_pep503_normalized(filename, project):
    assert pkgindex.project_of(filename) == project


def make_wheel(directory: Path, name: str, version: str, requires_python: str | None) -> Path:
    path = directory / f"{name}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    if requires_python:
        meta += f"Requires-Python: {requires_python}\n"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


@pytest.fixture()
def index(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    server = pkgindex.start_index(port=0, wheel_dir=wheels)
    yield server, wheels
    server.stop()


def test_simple_pages_html_and_json(index):
    server, wheels = index
    w = make_wheel(wheels, "Demo_Pkg", "1.0", ">=3.9, <4")
    digest = hashlib.sha256(w.read_bytes()).hexdigest()

    root = requests.get(server.index_url)
    assert root.headers["Content-Type"].startswith("text/html")
    assert '<a href="/simple/demo-pkg/">demo-pkg</a>' in root.text
    page = requests.get(server.index_url + "demo-pkg/")
    assert (f'<a href="/files/{w.name}#sha256={digest}" data-requires-python="&gt;=3.9, &lt;4">'
            f"{w.name}</a>") in page.text
    moved = requests.get(server.index_url + "Demo_Pkg", allow_redirects=False)
    assert (moved.status_code, moved.headers["Location"]) == (301, "/simple/demo-pkg/")

    accept = {"Accept": "application/vnd.pypi.simple.v1+json, text/html; q=0.01"}
    as_json = requests.get(server.index_url + "demo-pkg/", headers=accept)
    assert as_json.headers["Content-Type"] == pkgindex.JSON_TYPE
    assert as_json.json()["files"] == [{"filename": w.name, "url": f"/files/{w.name}",
                                        "hashes": {"sha256": digest},
                                        "requires-python": ">=3.9, <4"}]
    assert requests.get(server.index_url, headers=accept).json()["projects"] == [
        {"name": "demo-pkg"}]
    assert requests.get(server.url + f"/files/{w.name}").content == w.read_bytes()
    assert requests.get(server.index_url + "absent/").status_code == 404
    assert requests.get(server.url + "/files/..%2Fetc%2Fpasswd").status_code == 404


def test_wheels_added_while_running_are_served(index):
    server, wheels = index
    assert requests.get(server.index_url + "late/").status_code == 404
    make_wheel(wheels, "late", "0.1", None)
    page = requests.get(server.index_url + "late/").text
    assert "late-0.1-py3-none-any.whl" in page and "data-requires-python" not in page


def test_pip_installs_a_cached_wheel_from_the_index(tmp_path):
    """Real pip: download six into a wheel dir, serve it, install it into a throwaway venv."""
    wheels = tmp_path / "wheels"
    report = pkgindex.ensure_wheels(["six"], wheels)
    assert any(f.startswith("six-") for f in report.files["six"])
    server = pkgindex.start_index(port=0, wheel_dir=wheels)
    try:
        venv.create(tmp_path / "venv", with_pip=True)
        py = tmp_path / "venv" / "bin" / "python"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
        done = subprocess.run(
            [str(py), "-m", "pip", "install", "--no-cache-dir", "--index-url", server.index_url,
             "six"], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        out = subprocess.run([str(py), "-c", "import six, json; print(json.dumps(six.__file__))"],
                             capture_output=True, text=True, check=True).stdout
        assert json.loads(out).startswith(str(tmp_path / "venv"))
        assert ("GET", "/simple/six/", 200, "127.0.0.1") in server.requests
        assert any(p.startswith("/files/six-") for _, p, _, _ in server.requests)
    finally:
        server.stop()


def test_cli_serves_and_reports_ready(tmp_path):
    make_wheel(tmp_path, "cli_demo", "1.0", None)
    argv = pkgindex.cli_argv("127.0.0.1", 0, tmp_path)
    assert argv == [sys.executable, "-m", "sparkdeploy.lab.pkgindex", "--bind", "127.0.0.1",
                    "--port", "0", "--wheels", str(tmp_path)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("READY http://127.0.0.1:") and line.endswith("/simple/")
        assert pkgindex.wait_ready(line.split()[1], timeout=10)
        assert "cli-demo" in requests.get(line.split()[1]).text
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_stats_name_each_request_and_its_client(tmp_path):
    from sparkdeploy.lab import pkgindex

    server = pkgindex.start_index(port=0, wheel_dir=tmp_path)
    try:
        assert requests.get(server.index_url).status_code == 200
        assert requests.get(server.url + "/_lab/health").status_code == 200
        got = requests.get(server.url + "/_lab/stats").json()["requests"]
    finally:
        server.stop()
    assert got == [{"method": "GET", "path": "/simple/", "status": 200, "client": "127.0.0.1"}]
