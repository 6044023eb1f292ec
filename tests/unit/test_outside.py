"""Outside data is data: hub file names, the token's destinations, deadlines on every wait,
validated JSON, from small misbehaving servers on loopback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkdeploy.core.outcomes import Status
from sparkdeploy.core.outside import OutsideError, request, validated
from sparkdeploy.core.packaged import helper
from sparkdeploy.core.records import HubMetadata
from sparkdeploy.lab import hub
from sparkdeploy.lab.hub_repo import RepoFile
from sparkdeploy.node import nodeops
from sparkdeploy.ops import model as model_ops
from sparkdeploy.steps import model, model_verify
from tests.unit.hostile import Hostile
from tests.unit.model_fakes import Node, deployment

HELPER = helper("model_node.py")
TOKEN = "hf_OutsideTestToken0123456789abcd"
COMMIT = "c" * 40
UNSAFE = ["../x", "/abs", "-x", "a/../../x", "a\\b", "a\nb", ""]


@pytest.fixture(scope="module")
def small_hub(tmp_path_factory):
    srv = hub.start_hub(port=0, data_dir=tmp_path_factory.mktemp("hub"), size_mb=1, shards=1)
    yield srv
    srv.stop()


@pytest.fixture
def hostile():
    servers: list[Hostile] = []

    def make(**kw) -> Hostile:
        servers.append(Hostile(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _dep(tmp_path, endpoint, **kw):
    return deployment(tmp_path, {"spark1": Node(), "spark2": Node()}, endpoint, **kw)


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


# --- hub file names ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", UNSAFE)
def test_a_hub_listing_an_unsafe_file_name_is_refused_before_the_node_is_touched(
        tmp_path, small_hub, name):
    repo = small_hub.state.repos[hub.REPO_ID]
    repo.files[name] = RepoFile(name, 3, "a" * 40, "b" * 64, False)
    try:
        dep, ctx = _dep(tmp_path, small_hub.url)
        before = _tree(tmp_path)
        results = model.download(dep)
        assert ctx.calls == []  # the download asks the hub first: no command reached a node
        results += model_verify.verify(dep)
    finally:
        del repo.files[name]
    assert [r.status for r in results] == [Status.FAILED, Status.FAILED]
    for r in results:
        assert "the hub's answer is refused" in r.why and "refused:" in r.why
        assert "\n" not in r.why
    # the verify asked the head for its recorded selection (it has none), nothing of the hub's
    # reached a node: no spec staged, no helper given a file name
    asked = [argv for _, argv, _ in ctx.calls]
    assert asked and all("spec.json" not in " ".join(a) for a in asked)
    assert [a[-3:] for a in asked if "selection" in a] == [["selection", "--dir",
                                                             dep.profile.model.path]]
    # no cache, no model dir, nothing written but the journal of that one read
    assert [p for p in _tree(tmp_path) if p not in before] == ["state", "state/journal.jsonl"]


def test_a_tampered_metadata_cache_is_never_used(tmp_path, hostile):
    silent = hostile(mode="silent")  # the hub does not answer: only the cache could serve
    dep, ctx = _dep(tmp_path, silent.url)
    monkey_deadline = model_ops.HUB_DEADLINE_S
    model_ops.HUB_DEADLINE_S = 0.3
    try:
        path = dep.records.path(HubMetadata, model_ops.cache_name(dep))
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"repo": "r/m", "revision": "main", "commit": COMMIT,
                                    "fetched_at": 1.0,
                                    "files": [{"path": "../x", "size": 1, "sha256": None,
                                               "oid": None}]}))
        started = time.monotonic()
        [res] = model.download(dep)
    finally:
        model_ops.HUB_DEADLINE_S = monkey_deadline
    assert time.monotonic() - started < 2
    assert res.status is Status.FAILED and ctx.calls == []
    assert "no whole answer within 0.3s" in res.why
    assert (f"the cache is not usable: {path}: bad hub metadata record (files.0.path: file name "
            "'../x' refused") in res.why


def _spec(tmp_path: Path, name: str) -> Path:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"repo": "r/m", "revision": "main", "commit": COMMIT,
                                "files": [{"path": "ok.txt", "size": 1, "sha256": None,
                                           "oid": None},
                                          {"path": name, "size": 1, "sha256": None,
                                           "oid": None}]}))
    return spec


@pytest.mark.parametrize("name", ["../victim", "/abs", "-x", "a/./b"])
@pytest.mark.parametrize("cmd", ["verify", "fetch"])
def test_the_node_helper_refuses_a_spec_with_an_unsafe_name_and_touches_nothing(
        tmp_path, name, cmd):
    victim = tmp_path / "victim"
    victim.write_text("keep me")  # what a name escaping the model dir would reach
    root = tmp_path / "m"
    spec = _spec(tmp_path, name)
    before = _tree(tmp_path)
    cp = subprocess.run([sys.executable, str(HELPER), cmd, "--dir", str(root), "--spec",
                         str(spec)], input="\n", capture_output=True, text=True, timeout=30)
    assert cp.returncode == 2, cp.stderr
    [line] = cp.stderr.strip().splitlines()
    assert line.startswith("error: file name ") and "refused" in line
    assert cp.stdout == "" and _tree(tmp_path) == before and victim.read_text() == "keep me"


def test_the_node_helper_reads_names_after_dashes_as_names(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    (root / "ok.txt").write_text("1")
    spec = _spec(tmp_path, "--quick")  # a file really named so would be read as an option
    cp = subprocess.run([sys.executable, str(HELPER), "verify", "--dir", str(root), "--spec",
                         str(spec), "--", "ok.txt"], capture_output=True, text=True, timeout=30)
    assert cp.returncode == 2 and "file name '--quick' refused" in cp.stderr
    spec = _spec(tmp_path, "b.txt")
    cp = subprocess.run([sys.executable, str(HELPER), "verify", "--dir", str(root), "--spec",
                         str(spec), "--", "b.txt"], capture_output=True, text=True, timeout=30)
    out = json.loads(cp.stdout.splitlines()[-1])  # its answer, last (after its progress)
    assert cp.returncode == 0 and out["missing"] == ["b.txt"] and out["ok"] == []


# --- the token's destinations -----------------------------------------------------------------

MODEL_INFO = json.dumps({"sha": COMMIT, "siblings": [
    {"rfilename": "config.json", "size": 2, "blobId": "d" * 40}]}).encode()


@pytest.mark.parametrize(("trust", "sent"), [(False, False), (True, True)])
def test_the_token_reaches_a_plain_http_hub_only_when_the_profile_trusts_it(
        tmp_path, hostile, monkeypatch, trust, sent):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    srv = hostile(body=MODEL_INFO)
    dep, _ = _dep(tmp_path, srv.url, trust_http=trust)
    meta, note = model_ops.metadata(dep)
    assert [f["path"] for f in meta["files"]] == ["config.json"] and note == ""
    [headers] = srv.seen
    assert ("authorization" in headers) is sent
    if sent:
        assert headers["authorization"] == f"Bearer {TOKEN}"
    token, why = model_ops.hub_token(dep)
    assert (token == TOKEN) is sent
    assert ("plain http; model.trust_http: true trusts it" in why) is (not sent)


def test_the_token_goes_to_an_https_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    dep, _ = _dep(tmp_path, "https://hub.example", trust_http=False)
    assert model_ops.hub_token(dep) == (TOKEN, "")


def test_a_token_keeps_auto_out_of_community_images(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    dep, _ = _dep(tmp_path, "https://hub.example")
    assert model_ops.image_gets_no_token(dep)
    dep, _ = _dep(tmp_path / "b", "https://hub.example", token_to_image=True)
    assert not model_ops.image_gets_no_token(dep)
    monkeypatch.setattr(model_ops, "controller_token", lambda: None)
    dep, _ = _dep(tmp_path / "c", "https://hub.example")
    assert not model_ops.image_gets_no_token(dep)  # no token: an image is as good as the venv


# --- deadlines --------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["silent", "trickle"])
def test_a_request_ends_at_its_deadline_whatever_the_server_does(hostile, mode):
    srv = hostile(mode=mode, gap=0.02)
    started = time.monotonic()
    with pytest.raises(OutsideError, match=r"no whole answer within 0.4s"):
        request("GET", srv.url + "/v1/models", deadline=0.4)
    assert 0.35 < time.monotonic() - started < 1.5


def test_a_request_refuses_an_answer_beyond_its_size(hostile):
    srv = hostile(body=b"x" * 5000)
    with pytest.raises(OutsideError, match="answer larger than 4096 bytes"):
        request("GET", srv.url, max_body=4096)


def test_an_unreachable_url_is_one_line():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    port = s.getsockname()[1]
    try:
        with pytest.raises(OutsideError, match=rf"^cannot reach http://127.0.0.1:{port}/x: "):
            request("GET", f"http://127.0.0.1:{port}/x", deadline=1)
    finally:
        s.close()


def test_no_env_proxy_is_used(hostile, monkeypatch):
    srv = hostile(body=b"{}")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    assert request("GET", srv.url + "/p").status == 200 and srv.paths == ["/p"]



# --- JSON from an endpoint ----------------------------------------------------------------------

BAD_MODELS = [b"not json", b"[]", b'{"data": []}', b'{"data": [{"id": 5}]}', b'{"data": "x"}',
              b'{"data": [{"id": ""}]}', b'{"data": [{"id": "m\\u001b[2J"}]}', b"[" * 100_000,
              b'{"data": [{"id": "' + b"x" * 600 + b'"}]}']


@pytest.mark.parametrize("body", BAD_MODELS)
def test_a_models_list_that_does_not_fit_is_one_line_naming_the_url(hostile, body):
    from sparkdeploy.bench.client import BenchError, Target, default_model
    from sparkdeploy.node import endpoint as ep

    srv = hostile(body=body)
    with pytest.raises(BenchError) as e:
        default_model(Target.parse(srv.url))
    line = str(e.value)
    assert line.startswith(f"{srv.url}/v1/models: ") and "\n" not in line and len(line) < 300
    assert ep.models(srv.url) == []


def test_the_models_list_is_read_when_it_fits(hostile):
    from sparkdeploy.bench.client import Target, default_model
    from sparkdeploy.node import endpoint as ep

    srv = hostile(body=b'{"object": "list", "data": [{"id": "m1", "x": 1}, {"id": "m2"}]}')
    assert default_model(Target.parse(srv.url)) == "m1" and ep.models(srv.url) == ["m1", "m2"]


@pytest.mark.parametrize("mode", ["silent", "trickle"])
def test_the_endpoint_probes_end_at_their_deadlines(hostile, mode):
    from sparkdeploy.node import endpoint as ep

    srv = hostile(mode=mode, gap=0.02)
    started = time.monotonic()
    assert ep.health(srv.url, deadline=0.3) is False
    assert ep.models(srv.url, deadline=0.3) == []
    assert ep.stream_chat(srv.url, "m", deadline=0.3) == ""
    assert time.monotonic() - started < 1.8


@pytest.mark.parametrize(("body", "text"), [
    (b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\ndata: [DONE]\n\n', "Hi"),
    (b'data: {"choices": [{"delta": {"content": 5}}]}\n\n', ""),
    (b'data: {"choices": "x"}\n\n', ""),
    (b"data: {not json\n\n", ""),
])
def test_a_streamed_chunk_that_does_not_fit_is_no_text(hostile, body, text):
    from sparkdeploy.node import endpoint as ep

    srv = hostile(body=body, ctype="text/event-stream")
    assert ep.stream_chat(srv.url, "m") == text


# --- a node helper's answers --------------------------------------------------------------------

@pytest.mark.parametrize(("printed", "why"), [
    ('{"ok": 5, "missing": [], "differ": {}, "unchecked": []}', "ok: "),
    ('{"ok": [], "missing": [], "differ": [], "unchecked": []}', "differ: "),
    ('{"ok": [], "missing": [], "differ": {}, "unchecked": [], "seconds": "NaN"}', "seconds: "),
    ('{"ok": []}', "missing: "),
])
def test_a_helper_answer_that_does_not_fit_is_one_line(printed, why):
    from sparkdeploy.node.hosts import Host
    from sparkdeploy.profile.config import Link, Node

    local = Host(Node(name="spark1", role="head", ssh=None, privilege="none",
                      link=Link(interface="e0", address="10.0.0.1")))
    with pytest.raises(nodeops.HelperFailed) as e:  # the real helper staged, its answer faked
        nodeops.run_helper(local, "model_node.py", [], result=model_ops.NodeState,
                           where="spark1: model_node.py verify",
                           wrap=lambda _: [sys.executable, "-c", f"print({printed!r})"])
    line = str(e.value)
    assert line.startswith("spark1: model_node.py verify: ") and why in line and "\n" not in line


@pytest.mark.parametrize(("said", "port"), [({"port": 8873, "private": "/tmp/x"}, 8873),
                                            ({"port": None, "private": None}, None),
                                            ({}, None)])
def test_a_receivers_ready_line_names_its_daemons_port_or_none(said, port):
    # None: no daemon listens, the ssh transport carries the files (what the helper says then)
    assert validated(model_ops.ReadyReport, said, "spark2: receive: ready").port == port


@pytest.mark.parametrize("said", [{"port": 0}, {"port": 70000}, {"port": "x"}])
def test_a_ready_line_with_a_port_that_is_no_port_is_one_line(said):
    with pytest.raises(OutsideError) as e:
        validated(model_ops.ReadyReport, said, "spark2: receive: ready")
    assert str(e.value).startswith("spark2: receive: ready: port: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("line", ["progress bytes=x total=10", "progress bytes=1e9",
                                  "progress bytes=1 out=-1", "progressing bytes=1"])
def test_a_progress_line_with_no_count_is_not_progress(line):
    assert nodeops.parse_progress(line) is None
    assert nodeops.parse_progress("progress bytes=5 total=10 file=a b") == {"bytes": "5",
                                                                            "total": "10",
                                                                            "file": "a"}


def test_a_failed_helper_says_its_last_error_line_not_its_progress():
    from sparkdeploy.node.hosts import Host
    from sparkdeploy.profile.config import Link, Node

    local = Host(Node(name="spark1", role="head", ssh=None, privilege="none",
                      link=Link(interface="e0", address="10.0.0.1")))
    seen: list[dict[str, str]] = []
    say = ("import sys; print('progress bytes=3 total=9'); sys.stderr.write('error: no room\\nlast words\\n'); "
           "print('progress bytes=4'); sys.exit(3)")
    with pytest.raises(nodeops.HelperFailed) as e:
        nodeops.run_helper(local, "model_node.py", [], result=model_ops.NodeState, where="spark1: x",
                           wrap=lambda _: [sys.executable, "-c", say], on_progress=seen.append)
    assert str(e.value) == "spark1: x: no room"
    assert seen == [{"bytes": "3", "total": "9"}, {"bytes": "4"}]


@pytest.mark.parametrize("printed", ["", "not json", '{"ip": "10.0.0.1"}', '[{"ip": 5}]',
                                     '[{"ip": "10.0.0.1", "gpus": "NaN"}]'])
def test_a_ray_probe_answer_that_does_not_fit_lists_no_node(printed):
    from sparkdeploy.ops import serve

    assert serve.ray_nodes(f"noise\n{printed}", "spark1") == []
    [n] = serve.ray_nodes('[{"ip": "10.0.0.1", "gpus": 1, "x": 2}]', "spark1")
    assert (n.ip, n.gpus) == ("10.0.0.1", 1.0)


@pytest.mark.parametrize(("printed", "why"), [
    ('{"gid": {}}', "iface: Field required"),
    ('{"iface": {"exists": "maybe"}, "gid": {}}', "iface.exists: "),
    ('{"iface": {"exists": true}, "gid": {}, "ports": {"x": {"free": true}}}', "ports.x.[key]: "),
    ('{"iface": {"exists": true}, "gid": {"index": "a"}}', "gid.index: "),
    ("[]", "not a JSON object (list)"),
])
def test_node_facts_that_do_not_fit_are_one_line(printed, why):
    from sparkdeploy.core.outside import last_line
    from sparkdeploy.ops.serve_preflight import FactsAnswer

    with pytest.raises(OutsideError) as e:
        last_line(FactsAnswer, printed, "spark1: serve_node.py facts")
    assert str(e.value).startswith("spark1: serve_node.py facts: ") and why in str(e.value)


def test_the_first_token_is_when_the_first_content_arrives_not_the_role_chunk():
    """``stream_chat(on_first=...)`` fires once, when bytes carrying content arrive: after the
    opening role chunk (``"content": ""``) and the server's pause, before the stream ends."""
    import http.server
    import threading

    from sparkdeploy.node import endpoint as ep

    pause, tail = 0.4, 0.4

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n')
            self.wfile.flush()
            time.sleep(pause)
            self.wfile.write(b'data: {"choices": [{"delta": {"content": "Hel"}}]}\n\n')
            self.wfile.flush()
            time.sleep(tail)
            self.wfile.write(b'data: {"choices": [{"delta": {"content": "lo"}}]}\n\ndata: [DONE]\n\n')

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        firsts: list[float] = []
        t0 = time.monotonic()
        text = ep.stream_chat(f"http://127.0.0.1:{srv.server_address[1]}", "m",
                              on_first=lambda: firsts.append(time.monotonic() - t0))
        ended = time.monotonic() - t0
    finally:
        srv.shutdown()
        srv.server_close()
    assert text == "Hello"
    [first] = firsts
    assert pause <= first < ended - tail / 2
