"""The persisted units' supervisors (helpers/serve_unit.py): their group state is answered only
to a peer holding the group key, and believed only from one; on the fast-link address only."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import urllib.error
import urllib.request

import pytest

from sparkdeploy.core.packaged import helper
from sparkdeploy.helpers import serve_unit

SCRIPT = helper("serve_unit.py")
KEY = b"k" * 64


@pytest.fixture(scope="module")
def su():
    spec = importlib.util.spec_from_file_location("serve_unit", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def group(su, key=KEY, clock=None):
    spec = {"node": "spark2", "role": "worker", "listen": ["127.0.0.1", 0]}
    return su.Group(spec, key, clock or Clock())


@pytest.fixture
def served(su):
    g = group(su)
    srv = g.serve()
    yield g, [*srv.server_address[:2]]
    srv.shutdown()
    srv.server_close()


def test_a_peer_with_the_key_reads_the_state(su, served):
    g, addr = served
    assert su.peer(group(su, clock=g.clock), addr) == g.state


@pytest.mark.parametrize("why,asker", [
    ("another key", lambda su, g: group(su, b"x" * 64, g.clock)),
    ("a request from too long ago", lambda su, g: group(su, clock=Clock(g.clock.now - 31))),
    ("a request from the future", lambda su, g: group(su, clock=Clock(g.clock.now + 31))),
])
def test_a_peer_without_a_valid_request_reads_nothing(su, served, why, asker):
    g, addr = served
    assert su.peer(asker(su, g), addr) is None, why


def test_the_edge_of_the_window_is_still_accepted(su, served):
    g, addr = served
    assert su.peer(group(su, clock=Clock(g.clock.now - su.WINDOW_S)), addr) == g.state


@pytest.mark.parametrize("headers", [{}, {"X-Sparkdeploy-Auth": "0" * 64}])
def test_the_server_refuses_a_request_without_its_hmac(su, served, headers):
    g, addr = served
    path, _, _ = su.request_path(KEY, g.clock())
    req = urllib.request.Request(f"http://{addr[0]}:{addr[1]}{path}", headers=headers)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 403 and e.value.read() == b""


def test_a_replayed_request_is_refused_once_stale_and_its_answer_is_bound_to_its_nonce(su, served):
    g, addr = served
    path, headers, nonce = su.request_path(KEY, g.clock())
    req = urllib.request.Request(f"http://{addr[0]}:{addr[1]}{path}", headers=headers)
    with urllib.request.urlopen(req, timeout=5) as r:
        body, auth = r.read().decode(), r.headers["X-Sparkdeploy-Auth"]
    assert json.loads(body) == g.state
    assert auth == su.sign(KEY, "state", nonce, body)
    assert auth != su.sign(KEY, "state", "another nonce", body)  # no use to another request
    g.clock.now += su.WINDOW_S + 1
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 403


def test_an_answer_not_signed_with_the_key_is_not_believed(su, served):
    """A server on the peer's address without the key (or a forged answer): as a silent peer."""
    g, addr = served
    g.key = b"y" * 64  # it answers, signing with another key
    assert su.peer(group(su, clock=g.clock), addr) is None


def test_the_state_is_served_on_the_listen_address_only(su):
    import socket

    g = su.Group({"node": "spark2", "role": "worker", "listen": ["127.0.0.2", 0]}, KEY, Clock())
    srv = g.serve()
    try:
        host, port = srv.server_address[:2]
        assert host == "127.0.0.2"
        assert su.peer(group(su, clock=g.clock), [host, port]) == g.state
        with pytest.raises(ConnectionRefusedError):  # not on every address of the node
            socket.create_connection(("127.0.0.1", port), timeout=2)
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("content", [None, b"short\n"])
def test_a_unit_without_its_group_key_does_not_start(su, tmp_path, capsys, content):
    key = tmp_path / "sglang.key"
    if content is not None:
        key.write_bytes(content)
    assert su.cmd_run({"key": str(key), "node": "spark2", "role": "worker"}) == 2
    assert "error: no group key" in capsys.readouterr().out


# --- adoption: serve.persist's hand-over keeps what serves ------------------------------------

HEAD_ID, AUX_ID = "1" * 64, "2" * 64


def adopting(containers: dict[str, tuple[str, bool]]):
    """A head supervisor whose node runs ``containers`` ({name: (id, running)}); the docker
    commands it runs are kept in ``g.ran``. (The package's module, not the file ``su`` loads:
    the mutation tester mutates the package's.)"""
    su = serve_unit
    spec = {"node": "spark1", "role": "head", "listen": ["127.0.0.1", 0], "engine": "vllm",
            "docker": ["docker", "-H", "unix:///run/spark1.sock"], "node_dir": "/srv/x",
            "stages": [{"containers": [{"node": "spark1", "name": "head", "run": ["run"]},
                                       {"node": "spark2", "name": "worker", "run": ["run"]}]},
                       {"containers": [{"node": "spark1", "name": "aux", "run": ["run"]}]}]}
    ran = []

    def run(argv, **kw):
        ran.append(argv)
        assert argv[:4] == ["docker", "-H", "unix:///run/spark1.sock", "inspect"]
        assert argv[4:6] == ["--format", "{{.Name}} {{.Id}} {{.State.Running}}"]
        lines = [f"/{n} {containers[n][0]} {str(containers[n][1]).lower()}"
                 for n in argv[6:] if n in containers]
        return subprocess.CompletedProcess(argv, 0 if len(lines) == len(argv[6:]) else 1,
                                           "".join(f"{x}\n" for x in lines), "")

    g = su.Group(spec, KEY, Clock(), run=run)
    g.ran = ran
    return g


def test_every_container_running_under_its_id_is_adopted():
    g = adopting({"head": (HEAD_ID, True), "aux": (AUX_ID, True)})
    assert g.adopt(f"head {HEAD_ID[:12]}\naux {AUX_ID}\n") == {"head", "aux"}
    assert [a[6:] for a in g.ran] == [["aux", "head"]]  # this node's only


@pytest.mark.parametrize("text,containers", [
    (None, {"head": (HEAD_ID, True), "aux": (AUX_ID, True)}),  # no file: a restart, or at boot
    (f"head {HEAD_ID}\naux {AUX_ID}\n", {"head": (HEAD_ID, True), "aux": (AUX_ID, False)}),
    (f"head {HEAD_ID}\naux {AUX_ID}\n", {"head": ("3" * 64, True), "aux": (AUX_ID, True)}),
    (f"head {HEAD_ID}\naux {AUX_ID}\n", {"head": (HEAD_ID, True)}),  # one gone
    (f"head {HEAD_ID}\n", {"head": (HEAD_ID, True), "aux": (AUX_ID, True)}),  # one not named
    (f"head {HEAD_ID}\naux {AUX_ID}\nworker {AUX_ID}\n",  # another node's named too
     {"head": (HEAD_ID, True), "aux": (AUX_ID, True)}),
    (f"head {HEAD_ID} x\naux {AUX_ID}\n", {"head": (HEAD_ID, True), "aux": (AUX_ID, True)}),
    (f"head {HEAD_ID}\naux --format\n", {"head": (HEAD_ID, True), "aux": (AUX_ID, True)}),
    (f"head {HEAD_ID}\nhead {HEAD_ID}\n", {"head": (HEAD_ID, True), "aux": (AUX_ID, True)}),
    # a name twice is not believed, whichever ID runs
    (f"head {'3' * 64}\naux {AUX_ID}\nhead {HEAD_ID}\n", {"head": (HEAD_ID, True), "aux": (AUX_ID, True)}),
    ("", {"head": (HEAD_ID, True), "aux": (AUX_ID, True)}),
])
def test_anything_short_of_all_running_under_their_ids_adopts_nothing(text, containers, capsys):
    assert adopting(containers).adopt(text) == frozenset()
    if text is not None:
        said = capsys.readouterr().out
        assert said.endswith("starting afresh\n") and said.count("\n") == 1, said


def test_the_adoption_file_is_read_once(tmp_path):
    f = tmp_path / "vllm.adopt"
    f.write_text("head 0123456789ab\n")
    assert serve_unit.read_once(str(f)) == "head 0123456789ab\n"
    assert not f.exists() and serve_unit.read_once(str(f)) is None
    assert serve_unit.adopt_path({"engine": "vllm", "node_dir": str(tmp_path)}) == str(f)
    assert serve_unit.adopt_path({"engine": "sglang"}) == "/var/lib/sparkdeploy-node/serve/sglang.adopt"


def test_an_adopted_container_is_not_started_again_and_the_rest_is():
    g = adopting({})
    g.adopted = frozenset({"head"})
    g.ran.clear()
    g.run = lambda argv, **kw: (g.ran.append(argv), subprocess.CompletedProcess(argv, 0, "", ""))[1]
    g.start_stage(0)
    assert g.ran == []
    g.start_stage(1)
    assert [a[3] for a in g.ran] == ["run"] and len(g.ran) == 1
