"""The weights on the lab: download on spark1 (pipelined sync to spark2), faults, token hygiene.

Everything goes to a path of its own on the nodes (``PATH``), not the profile's model path; the
lab hub's knobs are reset after each test."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sparkdeploy.core.outcomes import Status
from sparkdeploy.lab import hub, hub_layouts, layout
from sparkdeploy.node.deployment import load
from sparkdeploy.ops import model as model_ops
from sparkdeploy.ops import model_select
from sparkdeploy.steps import model, model_sync, model_verify

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
PATH = "/srv/models/test-weights"
TOKEN = "hf_LabTokenNeverWritten0123456789"


@pytest.fixture
def dep(lab, tmp_path):
    d = load(ROOT / "configs" / "lab.yaml", tmp_path / "state")
    d.profile = d.profile.model_copy(update={"model": d.profile.model.model_copy(
        update={"path": PATH, "venv": "/var/lib/sparkdeploy-node/hf-venv"})})
    for n in ("spark1", "spark2"):
        lab.ssh(n, ["rm", "-rf", "--", PATH])
    yield d
    hub.set_knobs(d.profile.model.endpoint, fault=None, bandwidth_bps=None)
    for n in ("spark1", "spark2"):
        subprocess.run(["nsenter", f"--mount={layout.mntns_path(n)}", "umount", PATH],
                       capture_output=True)
        lab.ssh(n, ["rm", "-rf", "--", PATH])


def _with(dep, **model_kw):
    dep.profile = dep.profile.model_copy(update={"model": dep.profile.model.model_copy(update=model_kw)})
    return dep


def _tmpfs(node: str, size: str) -> None:
    subprocess.run(["nsenter", f"--mount={layout.mntns_path(node)}", "mkdir", "-p", PATH], check=True)
    subprocess.run(["nsenter", f"--mount={layout.mntns_path(node)}", "mount", "-t", "tmpfs", "-o",
                    f"size={size}", "tmpfs", PATH], check=True)


def _listeners(node: str) -> str:
    return subprocess.run(["ip", "netns", "exec", f"lab-{node}", "ss", "-ltnpH"],
                          capture_output=True, text=True).stdout


def _on_worker(lab, rel: str) -> bool:
    return lab.ssh("spark2", ["test", "-f", f"{PATH}/{rel}"], check=False).returncode == 0


def test_download_and_sync_together_leave_identical_verified_weights(lab, dep):
    hub.set_knobs(dep.profile.model.endpoint, bandwidth_bps=40_000_000)  # well below the link
    seen: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.3):
            seen.extend(ln for ln in _listeners("spark2").splitlines() if "rsync" in ln)

    out: dict[str, list] = {}
    ends: dict[str, float] = {}

    def go(name, fn):
        out[name] = fn()
        ends[name] = time.monotonic()

    w = threading.Thread(target=watch)
    w.start()
    ts = [threading.Thread(target=go, args=("download", lambda: model.download(dep))),
          threading.Thread(target=go, args=("sync", lambda: model_sync.sync(dep, "spark2")))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    stop.set()
    w.join()
    assert out["download"][0].status is Status.CHANGED, out["download"][0].why
    assert out["sync"][0].status is Status.CHANGED, out["sync"][0].why
    # pipelined: the worker was done within seconds of the head, not a whole copy later
    assert ends["sync"] - ends["download"] < 15, ends
    for r in model_verify.verify(dep):
        assert r.status is Status.OK, r.why
    sums = [lab.ssh(n, ["sh", "-c", f"cd {PATH} && sha256sum *.json *.safetensors"]).stdout
            for n in ("spark1", "spark2")]
    assert sums[0] == sums[1] and "safetensors" in sums[0]
    # the daemon listened on the worker's link address only, and is gone
    assert seen and all(" 10.77.1.2:" in ln for ln in seen), seen
    assert "rsync" not in _listeners("spark2")
    assert not list(Path("/tmp").glob("sparkdeploy-rsyncd-*"))


def test_only_the_files_the_engine_loads_land_on_the_nodes(lab, dep):
    """The lab hub's gpt-oss-shaped repository holds its weights three times (root, original/,
    metal/): the head downloads the root shards its index names and the files beside them,
    records that selection, and the sync sends the worker the same; no byte of original/ or
    metal/ leaves the hub. (The lab hub must serve the recipe-shaped repositories: a hub
    started before lab/hub_layouts.py existed is restarted by lab.down/lab.up.)"""
    gpt = next(la for la in hub_layouts.LAYOUTS if la.repo_id == "openai/gpt-oss-120b")
    want = sorted([*gpt.root_weights(), *gpt.tokenizer, "config.json", "generation_config.json",
                   "model.safetensors.index.json"])
    _with(dep, repo=gpt.repo_id)
    hub.set_knobs(dep.profile.model.endpoint, reset_stats=True)
    [down] = model.download(dep)
    [sent] = model_sync.sync(dep, "spark2")
    assert down.status is Status.CHANGED, down.why
    assert sent.status is Status.CHANGED, sent.why
    find = (f"cd {PATH} && find . \\( -path ./.sparkdeploy -o -path ./.cache \\) -prune -o "
            "-type f -print | sed 's|^./||' | sort")
    for n in ("spark1", "spark2"):
        assert lab.ssh(n, ["sh", "-c", find]).stdout.split() == want, n
    rec = json.loads(lab.ssh("spark1", ["cat", f"{PATH}/.sparkdeploy/selection.json"]).stdout)
    assert sorted(f["path"] for f in rec["files"]) == want
    served = {q["file"] for q in hub.get_stats(dep.profile.model.endpoint)["requests"]
              if q["method"] == "GET" and q.get("file") and q["status"] in (200, 206)}
    assert served and not [f for f in served if f.startswith(("original/", "metal/"))], served
    for r in model_verify.verify(dep):
        assert r.status is Status.OK, r.why


def test_pep668_node_still_downloads_in_a_venv_of_its_own(lab, dep):
    refused = lab.ssh("spark1", ["python3", "-m", "pip", "install", "huggingface_hub"], check=False)
    assert refused.returncode != 0
    assert ("externally-managed-environment" in refused.stderr + refused.stdout
            or "No module named pip" in refused.stderr)
    _with(dep, runtime="venv")
    [res] = model.download(dep)
    assert res.status is Status.CHANGED and res.details["runtime"] == "venv", res.why
    assert lab.ssh("spark1", ["python3", "-c", "import huggingface_hub"], check=False).returncode != 0
    assert model_verify.verify(dep, "spark1")[0].status is Status.OK


def test_a_dropped_connection_resumes_and_a_rerun_fetches_nothing(lab, dep):
    url = dep.profile.model.endpoint
    meta, _ = model_select.selected(dep)
    shard = max(meta["files"], key=lambda f: f["size"])["path"]
    hub.set_knobs(url, fault={"file": shard, "after_bytes": 12_000_000}, reset_stats=True)
    [res] = model.download(dep)
    assert res.status is Status.CHANGED, res.why
    st = hub.get_stats(url)
    assert st["faults_fired"] and st["faults_fired"][0]["file"] == shard
    gets = [q["range"] for q in st["requests"] if q["method"] == "GET" and q["path"].endswith(shard)
            and "/_lab/lfs/" in q["path"]]
    assert gets[0] is None and gets[1].startswith("bytes=") and gets[1] != "bytes=0-", gets
    hub.set_knobs(url, reset_stats=True)
    [again] = model.download(dep)
    assert again.status is Status.OK
    # the re-run asks for the revision's file list, never for a file
    bodies = [q["path"] for q in hub.get_stats(url)["requests"] if q["method"] == "GET"
              and ("/resolve/" in q["path"] or "/_lab/lfs/" in q["path"])]
    assert bodies == []


def test_disk_precheck_names_both_numbers(lab, dep):
    _tmpfs("spark1", "50m")
    [res] = model.download(dep)
    assert res.status is Status.FAILED
    assert "GB free on " + PATH in res.why and "needs" in res.why and "missing" in res.why
    assert lab.ssh("spark1", ["ls", "-A", PATH]).stdout.strip() == ""


def test_disk_full_on_the_worker_then_a_rerun_completes(lab, dep):
    assert model.download(dep)[0].status is Status.CHANGED
    meta, _ = model_select.selected(dep)
    total = model_ops.total_bytes(meta)
    _tmpfs("spark2", f"{(total + 80_000_000) // 1_000_000}m")  # passes the pre-check
    # one capped stream: ~20 s for the test repo, time to interfere
    _with(dep, sync=dep.profile.model.sync.model_copy(update={"streams": 1, "bwlimit_mb_s": 15.0}))
    first = sorted(f["path"] for f in meta["files"] if f["path"].endswith(".safetensors"))[0]
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", model_sync.sync(dep, "spark2")))
    t.start()
    deadline = time.monotonic() + 120
    while not _on_worker(lab, first) and time.monotonic() < deadline:
        time.sleep(0.1)
    # something else fills the worker's disk while the sync runs
    lab.ssh("spark2", ["sh", "-c", f"dd if=/dev/zero of={PATH}/filler bs=1M count=400 2>/dev/null; true"])
    t.join()
    [res] = box["r"]
    assert res.status is Status.FAILED and "disk full on spark2" in res.why, res.why
    lab.ssh("spark2", ["rm", "-f", f"{PATH}/filler"])
    [again] = model_sync.sync(dep, "spark2")
    assert again.status is Status.CHANGED, again.why
    assert again.details["bytes"] < total  # what was verified before stayed
    assert model_verify.verify(dep, "spark2")[0].status is Status.OK


def test_a_cut_sync_resumes(lab, dep):
    assert model.download(dep)[0].status is Status.CHANGED
    meta, _ = model_select.selected(dep)
    total = model_ops.total_bytes(meta)
    # one capped stream: ~20 s for the test repo, time to interfere
    _with(dep, sync=dep.profile.model.sync.model_copy(update={"streams": 1, "bwlimit_mb_s": 15.0}))
    first = sorted(f["path"] for f in meta["files"] if f["path"].endswith(".safetensors"))[0]
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", model_sync.sync(dep, "spark2")))
    t.start()
    deadline = time.monotonic() + 120
    while not _on_worker(lab, first) and time.monotonic() < deadline:
        time.sleep(0.1)
    # cut the transfer: end the sending rsync (the one this sync started, by its PID)
    ps = lab.ssh("spark1", ["ps", "-eo", "pid=,args="]).stdout
    pids = [ln.split()[0] for ln in ps.splitlines() if "rsync://sparkdeploy@" in ln and PATH in ln]
    assert pids, ps
    lab.ssh("spark1", ["kill", "-KILL", *pids], check=False)
    t.join()
    [res] = box["r"]
    assert res.status is Status.FAILED and "failed" in res.why, res.why
    [again] = model_sync.sync(dep, "spark2")
    assert again.status is Status.CHANGED, again.why
    assert again.details["bytes"] < total
    assert model_verify.verify(dep, "spark2")[0].status is Status.OK
    assert "rsync" not in _listeners("spark2")


def test_the_ssh_transport_sends_and_checks_with_no_daemon(lab, dep):
    assert model.download(dep)[0].status is Status.CHANGED
    _with(dep, sync=dep.profile.model.sync.model_copy(update={"transport": "ssh"}))
    seen: list[str] = []
    stop = threading.Event()

    def watch() -> None:  # anything listening on spark2 while the sync runs
        while not stop.is_set():
            seen.append(_listeners("spark2"))
            time.sleep(0.05)

    t = threading.Thread(target=watch)
    t.start()
    try:
        [res] = model_sync.sync(dep, "spark2")
    finally:
        stop.set()
        t.join()
    assert res.status is Status.CHANGED and "over ssh" in res.why, res.why
    assert not any("rsync" in x for x in seen)
    assert model_verify.verify(dep, "spark2")[0].status is Status.OK


CHILD = """
import sys
from pathlib import Path
from sparkdeploy.node.deployment import load
from sparkdeploy.steps import model_sync
d = load(Path(sys.argv[1]), Path(sys.argv[2]))
m = d.profile.model
sync = m.sync.model_copy(update={"streams": 1, "bwlimit_mb_s": 15.0})
d.profile = d.profile.model_copy(update={"model": m.model_copy(update={"path": sys.argv[3],
                                                                       "sync": sync})})
model_sync.sync(d, "spark2")
"""


def test_a_controller_killed_mid_sync_leaves_no_listener(lab, dep, tmp_path):
    """The receiver's daemon lives as long as its helper's stdin: when the controller dies
    mid-sync, its SSH connection ends, and with it the daemon, the directory holding its secret
    and the helper; a re-run then completes."""
    assert model.download(dep)[0].status is Status.CHANGED
    meta, _ = model_select.selected(dep)
    first = sorted(f["path"] for f in meta["files"] if f["path"].endswith(".safetensors"))[0]
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(ROOT / "configs" / "lab.yaml"),
                              str(tmp_path / "killed"), PATH],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not _on_worker(lab, first) and time.monotonic() < deadline:
            time.sleep(0.1)
        ps = lab.ssh("spark2", ["ps", "-eo", "pid=,args="]).stdout
        daemons = [ln.split() for ln in ps.splitlines()
                   if "rsync --daemon" in ln and "sparkdeploy-rsyncd-" in ln]
        assert daemons and "rsync" in _listeners("spark2"), ps
        conf = next(a for a in daemons[0] if a.startswith("--config="))[len("--config="):]
        private = os.path.dirname(conf)
        assert lab.ssh("spark2", ["test", "-d", private], check=False).returncode == 0
    finally:
        child.kill()  # the controller, as a power cut or kill -9 would end it
        child.wait()

    def gone() -> bool:
        ps = lab.ssh("spark2", ["ps", "-eo", "args="]).stdout
        return ("rsync" not in _listeners("spark2")
                and not any("receive" in ln and PATH in ln for ln in ps.splitlines())
                and lab.ssh("spark2", ["test", "-e", private], check=False).returncode != 0)

    deadline = time.monotonic() + 30
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gone(), _listeners("spark2")
    [again] = model_sync.sync(dep, "spark2")
    assert again.status is Status.CHANGED, again.why
    assert model_verify.verify(dep, "spark2")[0].status is Status.OK


def test_a_receive_helper_killed_mid_sync_leaves_no_daemon_and_no_secret(lab, dep):
    """kill -9 of the receiving helper itself on the worker (its SSH session still open): the
    guard of its daemon reads EOF on the pipe only the helper held, stops the daemon and
    removes the directory holding its secret; the sync fails, and a re-run completes."""
    assert model.download(dep)[0].status is Status.CHANGED
    meta, _ = model_select.selected(dep)
    first = sorted(f["path"] for f in meta["files"] if f["path"].endswith(".safetensors"))[0]
    _with(dep, sync=dep.profile.model.sync.model_copy(update={"streams": 1, "bwlimit_mb_s": 15.0}))
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", model_sync.sync(dep, "spark2")))
    t.start()
    try:
        deadline = time.monotonic() + 120
        while not _on_worker(lab, first) and time.monotonic() < deadline:
            time.sleep(0.1)
        ps = lab.ssh("spark2", ["ps", "-eo", "pid=,args="]).stdout
        helpers = [ln.split()[0] for ln in ps.splitlines()  # the helper, not a shell around it
                   if "model_node.py receive" in ln and PATH in ln
                   and ln.split()[1].endswith("python3")]
        conf = next(a for ln in ps.splitlines() if "rsync --daemon" in ln
                    for a in ln.split() if a.startswith("--config="))[len("--config="):]
        private = os.path.dirname(conf)
        assert len(helpers) == 1 and "rsync" in _listeners("spark2"), ps
        assert lab.ssh("spark2", ["test", "-f", f"{private}/secrets"], check=False).returncode == 0
        lab.ssh("spark2", ["kill", "-KILL", helpers[0]])

        def gone() -> bool:
            return ("rsync" not in _listeners("spark2")
                    and lab.ssh("spark2", ["test", "-e", private], check=False).returncode != 0)

        deadline = time.monotonic() + 10
        while not gone() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert gone(), _listeners("spark2")
    finally:
        t.join(300)
    [res] = box["r"]
    assert res.status is Status.FAILED, res.why
    [again] = model_sync.sync(dep, "spark2")
    assert again.status is Status.CHANGED, again.why
    assert model_verify.verify(dep, "spark2")[0].status is Status.OK
    assert "rsync" not in _listeners("spark2")


def test_a_corrupted_file_on_the_worker_is_named_and_repaired(lab, dep):
    assert model.download(dep)[0].status is Status.CHANGED
    assert model_sync.sync(dep, "spark2")[0].status is Status.CHANGED
    meta, _ = model_select.selected(dep)
    shard = sorted(f["path"] for f in meta["files"] if f["path"].endswith(".safetensors"))[-1]
    lab.ssh("spark2", ["sh", "-c", f"printf XXXX | dd of={PATH}/{shard} bs=1 seek=5000 conv=notrunc"])
    [bad] = model_verify.verify(dep, "spark2")
    assert bad.status is Status.FAILED and shard in bad.why and "sha256" in bad.why, bad.why
    [fixed] = model_verify.verify(dep, "spark2", repair=True)
    assert fixed.status is Status.CHANGED, fixed.why
    assert model_verify.verify(dep, "spark2")[0].status is Status.OK


def test_the_token_reaches_the_hub_and_nothing_else(lab, dep, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    url = dep.profile.model.endpoint
    hub.set_knobs(url, bandwidth_bps=30_000_000, reset_stats=True)
    images_before = lab.ssh("spark1", ["docker", "-H", f"unix://{dep.profile.head.docker_socket}",
                                       "image", "ls", "-q", "--no-trunc"]).stdout
    seen_args: list[str] = []
    seen_inspect: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.2):
            seen_args.append(lab.ssh("spark1", ["ps", "-eo", "args="], check=False).stdout)
            seen_inspect.append(lab.ssh("spark1", [
                "docker", "-H", f"unix://{dep.profile.head.docker_socket}", "inspect",
                model_ops.CONTAINER], check=False).stdout)

    w = threading.Thread(target=watch)
    w.start()
    with dep.events.collect() as events:
        [res] = model.download(dep)
    stop.set()
    w.join()
    assert res.status is Status.CHANGED, res.why
    # we looked while it ran: the helper fetched in sparkdeploy's own virtualenv, since the
    # token is not handed to a community image's python3 (model.token_to_image is false)
    assert any("model_node.py fetch" in s for s in seen_args)
    assert not any(model_ops.CONTAINER in s for s in seen_inspect)
    assert res.details["runtime"] == "venv"
    want = hashlib.sha256(f"Bearer {TOKEN}".encode()).hexdigest()[:16]
    assert any(q.get("auth") == want for q in hub.get_stats(url)["requests"])  # it arrived
    assert not any(TOKEN in s for s in seen_args + seen_inspect)
    assert not any(TOKEN in repr(e) for e in events)
    assert TOKEN not in dep.state.journal_path.read_text()
    for node in ("spark1", "spark2"):
        found = lab.ssh(node, ["grep", "-rl", "--", TOKEN, PATH, "/var/lib/sparkdeploy-node",
                               f"/tmp/sparkdeploy-stage-{0}"], check=False)
        assert found.stdout.strip() == "", found.stdout
    # the engine's container records (where `docker run -e` would have put it), logs, state
    nd = layout.node_dir("spark1")
    where = [str(p) for p in nd.glob("docker/*/containers")] + [str(nd / "log"), str(nd / "node-state")]
    grep = subprocess.run(["grep", "-rl", "--", TOKEN, *where], capture_output=True, text=True)
    assert grep.stdout.strip() == ""
    images_after = lab.ssh("spark1", ["docker", "-H", f"unix://{dep.profile.head.docker_socket}",
                                      "image", "ls", "-q", "--no-trunc"]).stdout
    assert sorted(images_before.split()) == sorted(images_after.split())
    assert json.dumps(res.details).find(TOKEN) < 0
