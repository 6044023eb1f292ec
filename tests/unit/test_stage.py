"""Staging a helper on a node: a private directory, content checked before reuse and run."""

import os
import subprocess

import pytest
from invoke import Config, Context

from sparkdeploy.node import nodeops
from sparkdeploy.node.hosts import Host, HostError
from sparkdeploy.profile.config import Link, Node

LOCAL = Node(name="spark1", role="head", link=Link(interface="e0", address="10.0.0.1"))
HELPER = "#!/usr/bin/env python3\nprint('hello from the helper')\n"


@pytest.fixture
def host(tmp_path, monkeypatch):
    monkeypatch.setattr(nodeops, "STAGE_BASE", str(tmp_path))
    return Host(LOCAL, ctx=Context(Config(overrides={"run": {"dry": False}})))


def stage_dir(tmp_path):
    return tmp_path / f"sparkdeploy-stage-{os.getuid()}"


def test_stage_creates_a_private_directory_and_a_content_addressed_file(host, tmp_path):
    path = nodeops.stage(host, "helper.py", HELPER)
    d = stage_dir(tmp_path)
    assert oct(d.stat().st_mode & 0o777) == "0o700" and d.stat().st_uid == os.getuid()
    assert path.startswith(f"{d}/") and path.endswith("/helper.py")
    assert open(path).read() == HELPER
    assert os.listdir(os.path.dirname(path)) == ["helper.py"]  # no temporary left behind


def test_steps_staging_the_same_helper_at_once_all_get_it(host, tmp_path):
    # download and sync start together and stage the same helper on the head
    from concurrent.futures import ThreadPoolExecutor

    big = HELPER + "#" * 60_000 + "\n"  # long enough for the writes to overlap
    for _ in range(3):
        for d in stage_dir(tmp_path).glob("*"):
            for f in d.iterdir():
                f.unlink()
        with ThreadPoolExecutor(6) as pool:
            paths = list(pool.map(lambda _: nodeops.stage(host, "helper.py", big), range(6)))
        assert len(set(paths)) == 1 and open(paths[0]).read() == big
        assert os.listdir(os.path.dirname(paths[0])) == ["helper.py"]


def test_a_tampered_staged_file_is_replaced_not_reused(host, tmp_path):
    path = nodeops.stage(host, "helper.py", HELPER)
    with open(path, "w") as f:
        f.write("print('owned')\n")
    assert nodeops.stage(host, "helper.py", HELPER) == path
    assert open(path).read() == HELPER


@pytest.mark.parametrize("spoil", ["mode", "owner", "symlink"])
def test_a_stage_directory_that_is_not_private_is_refused(host, tmp_path, spoil):
    d = stage_dir(tmp_path)
    if spoil == "symlink":
        other = tmp_path / "elsewhere"
        other.mkdir(mode=0o700)
        d.symlink_to(other)
    else:
        d.mkdir(mode=0o700)
        if spoil == "mode":
            d.chmod(0o777)
        else:
            if os.getuid() != 0:
                pytest.skip("chown to another user needs root")
            os.chown(d, 4242, 4242)
    with pytest.raises(HostError) as e:
        nodeops.stage(host, "helper.py", HELPER)
    assert str(e.value).startswith(f"spark1: cannot stage helper.py: {d} is not a private directory")
    assert not any(d.rglob("helper.py"))


def run(argv):
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def test_verified_runs_a_matching_helper_and_refuses_a_changed_one(host):
    path = nodeops.stage(host, "helper.py", HELPER)
    argv = nodeops.verified([path], ["python3", path])
    r = run(argv)
    assert r.returncode == 0 and r.stdout == "hello from the helper\n"
    with open(path, "a") as f:
        f.write("print('injected')\n")
    r = run(argv)
    assert r.returncode == 97 and r.stdout == ""
    assert r.stderr.strip() == f"{path} differs from its sha256: not run"


def test_check_staged_needs_a_staged_path():
    with pytest.raises(ValueError):
        nodeops.check_staged("/tmp/helper.py")


# --- watched: a node's command ends with the controller's stdin -------------------------------

def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_watched_passes_the_exit_status_and_output_and_leaves_nothing_running(host, tmp_path):
    from sparkdeploy.node.hosts import Feed

    feed = Feed()
    pids = tmp_path / "pids"
    r = host.run(nodeops.watched(["bash", "-c", f"echo $$ > {pids}; echo out; echo err >&2; exit 3"]),
                 input=feed)
    feed.close()
    assert (r.exit_code, r.stdout, r.stderr.strip()) == (3, "out\n", "err")
    assert not _alive(int(pids.read_text()))


def test_watched_ends_the_command_and_its_children_when_stdin_closes(host, tmp_path):
    import threading
    import time

    from sparkdeploy.node.hosts import Feed

    feed = Feed()
    pids = tmp_path / "pids"
    script = f"sleep 60 & echo $! >> {pids}; echo $$ >> {pids}; sleep 60 | cat; echo never"
    threading.Timer(1.0, feed.close).start()  # the controller goes away
    t0 = time.monotonic()
    r = host.run(nodeops.watched(["bash", "-c", script]), input=feed, timeout=30)
    assert time.monotonic() - t0 < 10
    assert r.exit_code == 143 and "never" not in r.stdout
    time.sleep(0.2)
    assert [p for p in map(int, pids.read_text().split()) if _alive(p)] == []


def test_watched_is_its_argv_after_a_fixed_script():
    argv = nodeops.watched(["python3", "-I", "x.py", "--ref=-rf"])
    assert argv[:2] == ["bash", "-c"] and argv[3:] == ["watched", "python3", "-I", "x.py", "--ref=-rf"]
    assert '"$@" 2>&4 3<&- 4>&- & j=$!' in argv[2] and 'kill -TERM -- "-$j"' in argv[2]


def test_watched_adds_nothing_to_the_commands_stderr(host):
    """A command that ends at once, many times: job control's notices ("[1]+ Exit 3 ...") would
    land on stderr now and then (and a step reads a helper's last stderr line as its error)."""
    from sparkdeploy.node.hosts import Feed

    for _ in range(30):
        feed = Feed()
        r = host.run(nodeops.watched(["bash", "-c", "echo err >&2; exit 3"]), input=feed)
        feed.close()
        assert (r.exit_code, r.stderr) == (3, "err\n")
