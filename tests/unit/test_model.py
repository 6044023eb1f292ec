"""model.download / model.verify against a lab hub on loopback and a scripted node whose
helper runs for real; model.sync's scheduling and commands."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import pytest

from sparkdeploy.core.outcomes import Status
from sparkdeploy.core.packaged import helper
from sparkdeploy.core.records import HubMetadata
from sparkdeploy.lab import hub
from sparkdeploy.ops import model as model_ops
from sparkdeploy.ops import model_select
from sparkdeploy.ops import model_sync as sync_ops
from sparkdeploy.steps import model, model_verify
from tests.unit.fakes import WALL
from tests.unit.model_fakes import Node, deployment

TOKEN = "hf_UnitTestToken0123456789abcdef"
IMAGE = "scitrera/dgx-spark-sglang:0.5.10rc0"
SHARD2 = "model-00002-of-00003.safetensors"


@pytest.fixture(scope="module")
def lab_hub(tmp_path_factory):
    srv = hub.start_hub(port=0, data_dir=tmp_path_factory.mktemp("hub"), size_mb=48, shards=3)
    yield srv
    srv.stop()


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return TOKEN


def _dep(tmp_path, lab_hub, images=None, free=None, dry=False, **kw):
    nodes = {"spark1": Node(images=images if images is not None else {IMAGE: True}, free=free),
             "spark2": Node()}
    lab_hub.set_knobs(fault=None, reset_stats=True, bandwidth_bps=None)
    kw.setdefault("token_to_image", True)  # the image path; the default is tested on its own
    return deployment(tmp_path, nodes, lab_hub.url, dry=dry, **kw)


def _unwrap(argv):
    """The command a staged-file check (``sh -c 'sha256sum -c ...; exec "$@"'``) runs."""
    assert argv[:2] == ["sh", "-c"] and "sha256sum -c" in argv[2], argv
    return argv[4:]


def _fetches(ctx):
    return [(n, _unwrap(a), t) for n, a, t in ctx.calls if "fetch" in a]


def test_download_runs_in_a_container_with_the_token_on_stdin_only(tmp_path, lab_hub, token):
    dep, ctx = _dep(tmp_path, lab_hub)
    dep.wall = lambda: WALL
    with dep.events.collect() as events:
        [res] = model.download(dep)
    assert res.status is Status.CHANGED, res.why
    [(node, argv, stdin)] = _fetches(ctx)
    assert node == "spark1" and stdin == TOKEN + "\n"
    path = dep.profile.model.path
    sock = dep.profile.head.docker_socket
    assert argv[:argv.index("--user")] == [
        "docker", "-H", f"unix://{sock}", "run", "--rm", "-i", "--name", model_ops.CONTAINER,
        f"--label=org.sparkdeploy.deployment={dep.profile.name}",
        "--label=org.sparkdeploy.role=download", "--label=org.sparkdeploy.started=2026-11-30T00:53:20Z",
        "--label=org.sparkdeploy.started.by=model.download", "--network", "host"]
    assert argv[argv.index("--entrypoint"):argv.index("--entrypoint") + 4] == [
        "--entrypoint", "python3", "--", IMAGE]
    assert ["-v", f"{path}:{path}"] == argv[argv.index("-v"):argv.index("-v") + 2]
    # the staged helper, the protocol it imports (a directory up) and the spec are mounted
    # read only, nothing else of the node
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    script = argv[argv.index("--entrypoint") + 4]
    helper_dir, protocol_dir = os.path.dirname(script), os.path.dirname(os.path.dirname(script))
    assert mounts[1:3] == [f"{helper_dir}:{helper_dir}:ro", f"{protocol_dir}:{protocol_dir}:ro"]
    assert len(mounts) == 4 and mounts[3].endswith(":ro") and os.path.isfile(f"{protocol_dir}/protocol.py")
    env = [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
    assert env == ["HF_HOME=/tmp/hf-home", "HF_HUB_DISABLE_TELEMETRY=1"]
    # the token is in no argv, no journal line, no event, no file of the node
    assert not any(TOKEN in " ".join(a) for _, a, _ in ctx.calls)
    assert TOKEN not in dep.state.journal_path.read_text()
    assert not any(TOKEN in repr(e) for e in events)
    for dirpath, _, names in os.walk(path):
        for n in names:
            assert TOKEN.encode() not in open(os.path.join(dirpath, n), "rb").read()
    progress = [e for e in events if type(e).__name__ == "Progress"]
    assert progress and progress[-1].done == progress[-1].total == model_ops.total_bytes(
        model_select.selected(dep)[0])
    # every selected file is there, as the hub has it
    meta, _ = model_select.selected(dep)
    for f in meta["files"]:
        assert os.path.getsize(os.path.join(path, f["path"])) == f["size"]


def test_rerun_fetches_nothing_and_starts_no_container(tmp_path, lab_hub, token):
    dep, ctx = _dep(tmp_path, lab_hub)
    model.download(dep)
    lab_hub.set_knobs(reset_stats=True)
    ctx.calls.clear()
    [res] = model.download(dep)
    assert res.status is Status.OK and "all 10 files present and verified" in res.why
    assert not _fetches(ctx) and not any(a[0] == "docker" for _, a, _ in ctx.calls)
    assert not [r for r in lab_hub.stats()["requests"] if "/_lab/lfs/" in r["path"]]


def test_resume_after_a_dropped_connection_fetches_only_the_rest(tmp_path, lab_hub, token):
    dep, ctx = _dep(tmp_path, lab_hub)
    lab_hub.set_knobs(fault={"file": SHARD2, "after_bytes": 12_000_000})
    [res] = model.download(dep)
    assert res.status is Status.CHANGED, res.why
    st = lab_hub.stats()
    assert st["faults_fired"] and st["faults_fired"][0]["file"] == SHARD2
    shard2 = [r for r in st["requests"] if r["path"].endswith(SHARD2) and "/_lab/lfs/" in r["path"]
              and r["method"] == "GET"]
    # the second request for the shard resumes from what was kept (huggingface_hub writes
    # whole 10 MiB chunks), not from zero
    assert [r["range"] for r in shard2] == [None, "bytes=10485760-"], shard2
    assert model_verify.verify(dep, "spark1")[0].status is Status.OK


def test_disk_precheck_fails_early_with_both_numbers(tmp_path, lab_hub, token):
    dep, ctx = _dep(tmp_path, lab_hub, free=5_000_000)
    [res] = model.download(dep)
    assert res.status is Status.FAILED
    need = model_ops.total_bytes(model_select.selected(dep)[0]) + 1_000_000
    assert f"0.01 GB free on /srv, needs {need / 1e9:.2f} GB" in res.why
    assert not _fetches(ctx)


def test_no_image_with_huggingface_hub_means_a_venv_never_system_pip(tmp_path, lab_hub, token):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python3"  # a venv that has huggingface_hub
    py.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    py.chmod(0o755)
    dep, ctx = _dep(tmp_path, lab_hub, images={IMAGE: False}, runtime="auto", venv=str(venv),
                    index_url="http://127.0.0.1:9/simple")
    [res] = model.download(dep)
    assert res.status is Status.CHANGED, res.why
    venv_calls = [_unwrap(a) for _, a, _ in ctx.calls if "venv" in a and "--venv" in a]
    assert venv_calls[0][-4:] == ["--venv", str(venv), "--index-url", "http://127.0.0.1:9/simple"]
    [(_, argv, stdin)] = _fetches(ctx)
    assert argv[0] == str(venv / "bin" / "python3") and stdin == TOKEN + "\n"
    assert not any("--break-system-packages" in a for _, a, _ in ctx.calls)
    assert not any(a[:3] == ["python3", "-m", "pip"] for _, a, _ in ctx.calls)


def test_dry_run_says_what_it_would_download(tmp_path, lab_hub, token):
    dep, ctx = _dep(tmp_path, lab_hub, dry=True)
    [res] = model.download(dep)
    assert res.status is Status.SKIPPED and res.why.startswith("spark1: would download 10 files")
    assert not _fetches(ctx) and not os.path.exists(dep.profile.model.path)


def test_verify_names_a_corrupted_file_and_repair_refetches_only_it(tmp_path, lab_hub, token):
    dep, ctx = _dep(tmp_path, lab_hub)
    model.download(dep)
    first = model_verify.verify(dep, "spark1")[0]
    assert first.status is Status.OK and first.details["hashed"] == 0  # the download recorded all
    target = os.path.join(dep.profile.model.path, SHARD2)
    with open(target, "r+b") as f:
        f.seek(4096)
        f.write(b"\xff" * 16)
    [bad] = model_verify.verify(dep, "spark1")
    assert bad.status is Status.FAILED
    assert f"1 files differ: {SHARD2} (sha256 differs from the hub's)" in bad.why
    lab_hub.set_knobs(reset_stats=True)
    ctx.calls.clear()
    [fixed] = model_verify.verify(dep, "spark1", repair=True)
    assert fixed.status is Status.CHANGED, fixed.why
    [(_, argv, _)] = _fetches(ctx)
    assert argv[-2:] == ["--", SHARD2]  # a file name after "--": never an option
    got = [r["path"] for r in lab_hub.stats()["requests"] if "/_lab/lfs/" in r["path"]
           and r["method"] == "GET"]
    assert len(got) == 1 and got[0].endswith(SHARD2)
    assert model_verify.verify(dep, "spark1")[0].status is Status.OK


def test_verify_works_offline_from_the_heads_record(tmp_path, lab_hub, token):
    """The selection the download recorded on the head drives a verify: no hub, and no cache
    on this controller (a fresh clone's state dir) needed."""
    import shutil

    dep, ctx = _dep(tmp_path, lab_hub)
    model.download(dep)
    shutil.rmtree(dep.state.path / "model")
    offline = dep.profile.model.model_copy(update={"endpoint": "http://127.0.0.1:9"})
    dep.profile = dep.profile.model_copy(update={"model": offline})
    [res] = model_verify.verify(dep, "spark1")
    assert res.status is Status.OK and res.why.startswith("spark1: 10 files verified"), res.why
    assert not (dep.state.path / "model").exists()  # the hub was not asked, nothing cached


def test_verify_falls_back_to_the_cached_metadata_without_a_record(tmp_path, lab_hub, token):
    dep, ctx = _dep(tmp_path, lab_hub)
    model.download(dep)
    os.unlink(os.path.join(dep.profile.model.path, ".sparkdeploy", "selection.json"))
    offline = dep.profile.model.model_copy(update={"endpoint": "http://127.0.0.1:9"})
    dep.profile = dep.profile.model_copy(update={"model": offline})
    [res] = model_verify.verify(dep, "spark1")  # decided again from the controller's cache
    assert res.status is Status.OK and res.why.startswith("spark1: 10 files verified"), res.why


def test_second_verify_of_unchanged_files_reads_nothing(tmp_path, lab_hub, token):
    dep, ctx = _dep(tmp_path, lab_hub)
    model.download(dep)
    os.unlink(os.path.join(dep.profile.model.path, ".sparkdeploy", "verified.jsonl"))
    one = model_verify.verify(dep, "spark1")[0]
    two = model_verify.verify(dep, "spark1")[0]
    total = model_ops.total_bytes(model_select.selected(dep)[0])
    assert one.details["hashed"] == total and one.details["reused"] == 0
    assert two.details["hashed"] == 0 and two.details["reused"] == 10


# --- model.sync -----------------------------------------------------------------------------

def finish(plan, batch, good):
    """The batch's rsync ended and the receiver checked each of its files."""
    plan.sent(batch)
    for f in batch[0]:
        plan.resolved(f, batch[2], f in good)


def test_plan_sends_ready_files_and_lets_workers_serve_the_next():
    plan = sync_ops.Schedule(need={"w1": ["a", "b"], "w2": ["a", "b"]}, holders={"a": ["head"]})
    first = plan.next_transfers(streams=1, head="head")
    assert first == [(("a",), "head", "w1")]  # b is not ready; the head sends one stream
    finish(plan, first[0], ["a"])
    plan.holders["b"] = ["head"]
    second = plan.next_transfers(streams=1, head="head")
    # w1 serves w2; b goes round to w2 (the head feeds every worker), once w2's stream is free
    assert second == [(("a",), "w1", "w2")]
    finish(plan, second[0], ["a"])
    assert plan.next_transfers(streams=1, head="head") == [(("b",), "head", "w2")]
    finish(plan, (("b",), "head", "w2"), ["b"])
    third = plan.next_transfers(streams=1, head="head")
    assert third == [(("b",), "w2", "w1")]  # and w2 serves w1
    finish(plan, third[0], ["b"])
    assert plan.done()


def test_plan_spreads_the_ready_files_over_the_free_streams_even_in_bytes():
    sizes = {"a": 5, "b": 4, "c": 3, "d": 2, "e": 1}
    plan = sync_ops.Schedule(need={"w1": list("abcde")}, holders={f: ["head"] for f in "abcde"},
                           sizes=sizes)
    # largest first onto the lighter stream: 5+2+1 and 4+3; each stream's files in send order
    first = plan.next_transfers(streams=2, head="head")
    assert first == [(("a", "d", "e"), "head", "w1"), (("b", "c"), "head", "w1")]
    assert plan.next_transfers(streams=2, head="head") == []  # both streams busy
    plan.sent(first[1])  # that rsync ended; its files await their check, its stream is free
    assert plan.next_transfers(streams=2, head="head") == []  # nothing else to send
    plan.resolved("b", "w1", False)  # b failed its check: it goes again on the free stream
    plan.resolved("c", "w1", True)
    assert plan.next_transfers(streams=2, head="head") == [(("b",), "head", "w1")]
    assert plan.need["w1"] == ["a", "b", "d", "e"] and plan.holders["c"] == ["head", "w1"]


def test_plan_never_opens_a_stream_without_a_file():
    plan = sync_ops.Schedule(need={"w1": ["cfg", "tok"]}, holders={"cfg": ["head"], "tok": ["head"]})
    # sizes unknown (all 0): still one file per stream, no empty batch
    assert plan.next_transfers(streams=4, head="head") == [
        (("cfg",), "head", "w1"), (("tok",), "head", "w1")]
    sizes = {"cfg": 1, "tok": 2, "s1": 10, "s2": 40, "vocab": 3}
    order = ["cfg", "tok", "s1", "s2", "vocab"]
    plan = sync_ops.Schedule(need={"w1": list(order)}, holders={f: ["head"] for f in order},
                           sizes=sizes)
    # one large file fills a stream; the small ones join the other
    assert plan.next_transfers(streams=2, head="head") == [
        (("s2",), "head", "w1"), (("cfg", "tok", "s1", "vocab"), "head", "w1")]


def test_a_file_that_failed_to_verify_is_sent_again():
    plan = sync_ops.Schedule(need={"w1": ["a", "b"]}, holders={"a": ["head"], "b": ["head"]})
    [batch] = plan.next_transfers(streams=1, head="head")
    assert batch == (("a", "b"), "head", "w1")  # one stream: one rsync carries both
    finish(plan, batch, ["a"])
    assert plan.need["w1"] == ["b"] and plan.next_transfers(1, "head") == [(("b",), "head", "w1")]


def test_a_receiver_is_told_the_end_once_all_it_needs_is_in_flight():
    plan = sync_ops.Schedule(need={"w1": ["a", "b"], "w2": ["a"]}, holders={"a": ["head"]})
    assert not plan.waiting_only("w1") and not plan.waiting_only("w2")
    plan.next_transfers(streams=1, head="head")  # a to w1; b is not on the head yet
    assert not plan.waiting_only("w1")
    plan.failed["w2"] = "disk full"
    assert plan.waiting_only("w2")
    plan.holders["b"] = ["head"]
    plan.next_transfers(streams=2, head="head")
    assert plan.waiting_only("w1")
    plan.resolved("a", "w1", True)
    plan.resolved("b", "w1", True)
    assert plan.waiting_only("w1") and plan.need["w1"] == []


def test_plan_stops_sending_to_a_failed_worker_only():
    plan = sync_ops.Schedule(need={"w1": ["a"], "w2": ["a"]}, holders={"a": ["head"]})
    plan.failed["w1"] = "disk full"
    assert plan.next_transfers(streams=4, head="head") == [(("a",), "head", "w2")]


def test_send_argv_rsyncd_and_ssh(tmp_path):
    dep, _ = deployment(tmp_path, {"spark1": Node(), "spark2": Node()}, "http://127.0.0.1:9")
    head, w = dep.host("spark1"), dep.host("spark2")
    path = dep.profile.model.path
    assert sync_ops.send_argv(dep, head, w, ["sub/x.safetensors", "y"], 8731) == [
        "rsync", "-rlt", "--ignore-times", "--relative", "--whole-file",
        "--checksum-choice=none", "--partial-dir=.sparkdeploy/partial",
        "--timeout=60", "--password-file=-", "--", f"{path}/./sub/x.safetensors", f"{path}/./y",
        "rsync://sparkdeploy@10.77.1.2:8731/model/"]
    assert sync_ops.send_argv(dep, head, w, ["x"], None)[-4:] == [
        "ssh -o BatchMode=yes -o StrictHostKeyChecking=yes", "--", f"{path}/./x", f"10.77.1.2:{path}/"]
    # a per-stream cap in MB/s becomes rsync's KiB/s, before the files
    m = dep.profile.model
    dep.profile = dep.profile.model_copy(update={"model": m.model_copy(update={
        "sync": m.sync.model_copy(update={"bwlimit_mb_s": 20.0})})})
    argv = sync_ops.send_argv(dep, head, w, ["x"], 8731)
    assert argv[:9] == ["rsync", "-rlt", "--ignore-times", "--relative", "--whole-file",
                        "--checksum-choice=none", "--partial-dir=.sparkdeploy/partial",
                        "--timeout=60", "--bwlimit=19531"]
    assert argv.index("--bwlimit=19531") < argv.index("--")


def test_the_receiver_binds_the_link_address_only_with_rsyncd(tmp_path):
    dep, _ = deployment(tmp_path, {"spark1": Node(), "spark2": Node()}, "http://127.0.0.1:9")
    st = model_ops.Staged(f"/s/{'a' * 64}/model_node.py", f"/s/{'b' * 64}/spec.json")
    w, path = dep.host("spark2"), dep.profile.model.path
    assert sync_ops.receive_argv(dep, w, st, ["10.77.1.1", "10.77.1.2"]) == [
        "python3", st.script, "receive", "--dir", path, "--spec", st.spec, "--address",
        "10.77.1.2", "--port", "8730", "--allow", "10.77.1.1,10.77.1.2", "--max-connections", "10"]
    # over ssh: no daemon, the same check of each file as it lands
    assert sync_ops.receive_argv(dep, w, st, None) == [
        "python3", st.script, "receive", "--dir", path, "--spec", st.spec]


def test_the_receiver_checks_each_file_as_it_lands_and_its_daemon_goes_with_its_stdin(tmp_path):
    """The real helper with a real rsync daemon on loopback, fed by a real rsync client: each
    file is checked as soon as it lands (before the sender says its batch ended), a wrong one is
    named, a settled file that never came is reported missing; when stdin ends the listener and
    its private directory are gone. The config never looks up the peer's name: with no DNS
    answering for a link address, each connection waited out the resolver."""
    import queue
    import socket
    import subprocess
    import threading

    script = str(helper("model_node.py"))
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    good, bad = os.urandom(300_000), os.urandom(1000)
    (src / "good.bin").write_bytes(good)
    (src / "bad.bin").write_bytes(bad)
    old = os.urandom(2000)  # on the receiver already, with no record yet
    dst.mkdir()
    (dst / "old.bin").write_bytes(old)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"files": [
        {"path": "good.bin", "size": len(good), "sha256": hashlib.sha256(good).hexdigest()},
        {"path": "bad.bin", "size": len(bad), "sha256": "0" * 64},
        {"path": "never.bin", "size": 5, "sha256": "1" * 64},
        {"path": "old.bin", "size": len(old), "sha256": hashlib.sha256(old).hexdigest()}]}))
    p = subprocess.Popen([sys.executable, script, "receive", "--dir", str(dst), "--spec", str(spec),
                          "--address", "127.0.0.1", "--port", "18730", "--allow", "127.0.0.1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x.rstrip("\n")) for x in p.stdout], daemon=True).start()

    def next_line() -> str:  # the next line that is not the progress of hashing
        while (line := lines.get(timeout=30)).startswith("progress "):
            pass
        return line

    try:
        p.stdin.write('s3cret\n["good.bin", "bad.bin", "never.bin", "old.bin"]\n')
        p.stdin.flush()
        kind, _, rest = next_line().partition(" ")
        assert kind == "state", rest
        state = json.loads(rest)  # what is there, hashed if it has no record; the free space
        assert state["ok"] == ["old.bin"] and state["hashed_bytes"] == len(old)
        assert state["missing"] == ["good.bin", "bad.bin", "never.bin"]
        assert state["free"] > 0 and os.path.ismount(state["mount"])
        assert str(tmp_path).startswith(state["mount"])
        with pytest.raises(queue.Empty):  # no daemon before it hears what comes
            lines.get(timeout=0.5)
        p.stdin.write('expect ["good.bin", "bad.bin", "never.bin"]\n')
        p.stdin.flush()
        kind, _, rest = next_line().partition(" ")
        assert kind == "ready", rest
        ready = json.loads(rest)
        conf = open(os.path.join(ready["private"], "rsyncd.conf")).read().splitlines()
        assert "reverse lookup = no" in conf
        assert "hosts allow = 127.0.0.1" in conf and "hosts deny = *" in conf
        assert oct(os.stat(ready["private"]).st_mode & 0o777) == "0o700"
        assert oct(os.stat(os.path.join(ready["private"], "secrets")).st_mode & 0o777) == "0o600"

        def push(name: str) -> None:
            cp = subprocess.run(["rsync", "-t", "--password-file=-", "--", str(src / name),
                                 f"rsync://sparkdeploy@127.0.0.1:{ready['port']}/model/"],
                                input="s3cret\n", capture_output=True, text=True, timeout=60)
            assert cp.returncode == 0, cp.stderr

        push("good.bin")
        assert json.loads(next_line().partition(" ")[2]) == {
            "path": "good.bin", "state": "ok", "why": "hashed"}
        push("bad.bin")
        assert json.loads(next_line().partition(" ")[2]) == {
            "path": "bad.bin", "state": "differ", "why": "sha256 differs from the hub's"}
        p.stdin.write('settle ["never.bin"]\n')
        p.stdin.flush()
        assert json.loads(next_line().partition(" ")[2]) == {
            "path": "never.bin", "state": "missing", "why": "not received"}
        assert p.poll() is None  # it runs until its stdin ends
        p.stdin.close()
        assert p.wait(30) == 0
        assert json.loads(next_line()) == {"ok": 1, "differ": 1, "missing": 1,  # its report, last
                                           "hashed_bytes": len(good) + len(bad)}
        with pytest.raises(queue.Empty):
            lines.get(timeout=0.5)
    finally:
        if p.poll() is None:
            p.kill()
    assert not os.path.exists(ready["private"])
    with pytest.raises(ConnectionRefusedError):  # nothing listens any more
        socket.create_connection(("127.0.0.1", ready["port"]), timeout=5)
    records = [json.loads(x) for x in (dst / ".sparkdeploy" / "verified.jsonl").read_text().splitlines()]
    assert {r["path"] for r in records} == {"good.bin", "bad.bin", "old.bin"}


def _exited(pid: int, within: float) -> bool:
    """True once process ``pid`` (not a child of ours) has exited, waiting at most ``within``."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], within)[0])
    finally:
        os.close(fd)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_receiver_killed_by_any_signal_takes_its_daemon_and_secret_along(tmp_path, sig):
    """The helper killed outright (its stdin still open, nothing of it runs any more): its
    guard reads EOF on the pipe only the helper held, stops the daemon and removes the
    directory holding the secret."""
    import signal
    import socket
    import subprocess

    script = str(helper("model_node.py"))
    (tmp_path / "dst").mkdir()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"files": [{"path": "a.bin", "size": 5, "sha256": "1" * 64}]}))
    p = subprocess.Popen([sys.executable, script, "receive", "--dir", str(tmp_path / "dst"),
                          "--spec", str(spec), "--address", "127.0.0.1", "--port", "18760",
                          "--allow", "127.0.0.1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        p.stdin.write('s3cret\n["a.bin"]\nexpect ["a.bin"]\n')
        p.stdin.flush()
        ready = next(json.loads(ln[6:]) for ln in p.stdout if ln.startswith("ready "))
        assert os.path.exists(os.path.join(ready["private"], "secrets"))
        socket.create_connection(("127.0.0.1", ready["port"]), timeout=5).close()
        guards = [int(d) for d in os.listdir("/proc") if d.isdigit() and _ppid(int(d)) == p.pid]
        assert len(guards) == 1
        os.kill(p.pid, getattr(signal, sig))
        assert p.wait(30) != 0
        assert _exited(guards[0], 30)
    finally:
        if p.poll() is None:
            p.kill()
    assert not os.path.exists(ready["private"])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", ready["port"]), timeout=5)


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def test_the_downloader_stops_when_its_stdin_ends(tmp_path, lab_hub):
    """stdin is the controller's connection (kept open by model.download, attached with
    ``docker run -i`` in a container): when it ends mid-download the helper stops at once,
    leaving its partial files for a re-run, and the download lock is free again."""
    import subprocess

    dep, _ = _dep(tmp_path, lab_hub)
    meta, _ = model_select.selected(dep)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({k: meta[k] for k in ("repo", "revision", "commit", "files")}))
    lab_hub.set_knobs(bandwidth_bps=2_000_000)  # 48 MB: ~25 s, far longer than the test
    root = tmp_path / "m"
    p = subprocess.Popen([sys.executable, str(helper("model_node.py")), "fetch", "--dir", str(root),
                          "--spec", str(spec), "--endpoint", lab_hub.url, "--workers", "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        p.stdin.write("\n")  # no token
        p.stdin.flush()
        for line in p.stdout:  # once bytes of a shard are in flight (its progress)
            if line.startswith("progress ") and int(line.split("bytes=")[1].split()[0]) > 0:
                break
        p.stdin.close()
        assert p.wait(10) == 9
        assert "error: the controller's connection ended" in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
    assert json.loads(subprocess.run(
        [sys.executable, str(helper("model_node.py")), "verify", "--dir", str(root), "--spec",
         str(spec), "--quick"], capture_output=True, text=True).stdout)["download_running"] is False


def test_steps_are_registered_for_the_graph():
    from sparkdeploy.steps import registry

    specs = registry.load_all()
    assert specs["model.download"].long and specs["model.sync"].long
    # pipelined: it starts beside the download, once the fit passed
    assert specs["model.sync"].needs == ("model.fit",)
    assert "model.fit" in specs["model.download"].needs
    assert set(specs["model.verify"].needs) == {"model.download", "model.sync"}


def test_metadata_is_cached_under_the_state_dir(tmp_path, lab_hub, token):
    dep, _ = _dep(tmp_path, lab_hub)
    meta, note = model_ops.metadata(dep)
    path = dep.records.path(HubMetadata, model_ops.cache_name(dep))
    cached = json.loads(path.read_text())
    assert note == "" and cached["data"]["files"] == meta["files"]
    assert path.parent == dep.state.path / "model"
    assert any(f["sha256"] for f in meta["files"]) and all(f["oid"] for f in meta["files"])


def test_plan_caps_what_each_node_sends_and_receives():
    files = ["a", "b", "c"]
    plan = sync_ops.Schedule(need={"w1": list(files), "w2": list(files)},
                           holders={f: ["head"] for f in files}, sizes={"a": 3, "b": 2, "c": 1})
    # the head sends two streams in all, not two per receiver: one each, the files going round
    # the receivers (each then serves the other what it got)
    assert plan.next_transfers(streams=2, head="head") == [
        (("a", "c"), "head", "w1"), (("b",), "head", "w2")]
    # w2 holds nothing yet and the head is busy: nothing more
    assert plan.next_transfers(streams=2, head="head") == []


def test_plan_takes_a_file_only_from_a_node_that_holds_it_and_one_stream_per_receiver():
    plan = sync_ops.Schedule(need={"w2": ["a", "c"]}, holders={"a": ["head", "w1"], "c": ["head"]})
    # one stream into w2: the worker serves a; c waits for the free stream
    assert plan.next_transfers(streams=1, head="head") == [(("a",), "w1", "w2")]
    plan = sync_ops.Schedule(need={"w2": ["a", "c"]}, holders={"a": ["head", "w1"], "c": ["head"]})
    # two streams into w2: w1 sends only what it holds, the head sends the rest
    assert plan.next_transfers(streams=2, head="head") == [
        (("a",), "w1", "w2"), (("c",), "head", "w2")]
    assert plan.in_load == {"w2": 2} and plan.out_load == {"w1": 1, "head": 1}


def test_plan_passes_over_a_busy_worker_to_the_next_source():
    plan = sync_ops.Schedule(need={"w2": ["a"], "w3": ["a"]}, holders={"a": ["head", "w1"]},
                           out_load={"w1": 1})
    # w1 already sends its one stream; the head sent a once (w1 has it): w1 serves when free
    assert plan.next_transfers(streams=1, head="head") == []
    plan.out_load["w1"] = 0
    assert plan.next_transfers(streams=1, head="head") == [(("a",), "w1", "w2")]
    # a worker only the head's copy would serve (w1 lost): the head sends it again
    plan = sync_ops.Schedule(need={"w2": ["a"]}, holders={"a": ["head", "w1"]},
                           lost={"w1": "unreachable"})
    assert plan.next_transfers(streams=1, head="head") == [(("a",), "head", "w2")]
    plan = sync_ops.Schedule(need={"w2": ["a"]}, holders={"a": ["head", "w1", "w3"]},
                           out_load={"w1": 1})
    # of two workers, the less loaded one serves
    assert plan.next_transfers(streams=2, head="head") == [(("a",), "w3", "w2")]
    assert plan.out_load == {"w1": 1, "w3": 1} and plan.in_load == {"w2": 1}
    plan.sent((("a",), "w3", "w2"))
    assert plan.out_load == {"w1": 1, "w3": 0} and plan.in_load == {"w2": 0}


def test_a_plan_whose_receivers_all_failed_is_done():
    plan = sync_ops.Schedule(need={"w1": ["a"], "w2": []})
    assert not plan.done()
    plan.failed["w1"] = "disk full"
    assert plan.done()


def test_plan_a_lost_sender_serves_no_more_and_what_it_did_not_deliver_goes_again():
    plan = sync_ops.Schedule(need={"w1": [], "w2": ["a", "b"], "w3": ["a"]},
                           holders={"a": ["head", "w1"], "b": ["head"]})
    first = plan.next_transfers(streams=2, head="head")
    # w1 holds a: it serves a (the head sent it once); b only the head has
    assert first == [(("a",), "w1", "w2"), (("b",), "head", "w2"), (("a",), "w1", "w3")]
    plan.lose("w1", "w1: unreachable")
    for batch in (first[0], first[2]):
        plan.sent(batch)
    assert plan.retry("a", "w2") is True and plan.retry("a", "w3") is True
    assert not plan.waiting_only("w3")  # not ended: a comes again
    finish(plan, first[1], ["b"])
    assert plan.retry("b", "w2") is False  # its sender is fine
    # only the head's copy is left: it sends a again, once, to the receiver it has sent the
    # fewest files (w2 had b); w2 waits for w3
    assert plan.next_transfers(streams=2, head="head") == [(("a",), "head", "w3")]
    finish(plan, (("a",), "head", "w3"), ["a"])
    assert plan.next_transfers(streams=2, head="head") == [(("a",), "w3", "w2")]
    assert plan.sources("a", "w2", "head") == ["w3"]


def test_plan_a_failed_receiver_is_no_sender():
    plan = sync_ops.Schedule(need={"w1": ["b"], "w2": ["a"]}, holders={"a": ["head", "w1"]})
    plan.failed["w1"] = "disk full on w1"
    assert plan.next_transfers(streams=1, head="head") == [(("a",), "head", "w2")]


def test_plan_four_nodes_each_worker_serves_the_next_and_the_head_sends_once():
    files = list("abcd")
    plan = sync_ops.Schedule(need={w: list(files) for w in ("w1", "w2", "w3")},
                           holders={f: ["head"] for f in files})
    sent_by: dict[str, int] = {}
    while not plan.done():
        batches = plan.next_transfers(streams=1, head="head")
        assert batches
        for b in batches:
            sent_by[b[1]] = sent_by.get(b[1], 0) + len(b[0])
            finish(plan, b, list(b[0]))
    # 12 file copies in all; the head sends each file once, the workers the rest
    assert sum(sent_by.values()) == 12
    assert sent_by["head"] == len(files)


def test_the_receiver_expects_a_missing_file_again(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("model_node_t", helper("model_node.py"))
    mn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mn)
    data = b"x" * 10
    arr = mn.Arrivals(str(tmp_path), {"f": {"path": "f", "size": 10,
                                            "sha256": hashlib.sha256(data).hexdigest()}}, 1)
    try:
        arr.settled.add("f")
        arr.step()
        assert arr.counts["missing"] == 1 and "f" not in arr.pending
        arr.again(["f", "not-ours"])
        assert arr.pending == {"f"} and "f" not in arr.settled
        (tmp_path / "f").write_bytes(data)
        while arr.pending or arr.hashing:
            arr.step()
        assert arr.counts["ok"] == 1
    finally:
        arr.close()


def test_plan_the_head_feeds_every_worker_at_once_with_files_of_its_own():
    files = [f"s{i}" for i in range(6)]
    plan = sync_ops.Schedule(need={w: list(files) for w in ("w1", "w2", "w3")},
                           holders={f: ["head"] for f in files}, sizes=dict.fromkeys(files, 1))
    first = plan.next_transfers(streams=4, head="head")
    # one stream from the head to each worker (4 // 3), the files going round them, none twice
    assert first == [(("s0", "s3"), "head", "w1"), (("s1", "s4"), "head", "w2"),
                     (("s2", "s5"), "head", "w3")]
    finish(plan, first[0], ["s0"])  # s3 failed its check on w1: it goes again to w1 only
    again = plan.next_transfers(streams=4, head="head")
    assert (("s3",), "head", "w1") in again and all(
        b[1] == "w1" and b[0] == ("s0",) for b in again if b[1] != "head")
