"""Lab pieces that need no root: exact daemon argv, sshd config, PID records, mirror lookup."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from sparkdeploy.core.wait import wait_for
from sparkdeploy.lab import dockerd, keys, layout, proc
from sparkdeploy.lab.layout import AddressPlan

N = "/var/lib/sparkdeploy/lab/nodes/spark2"
ENTER = ["nsenter", "--mount=/var/lib/sparkdeploy/lab/ns/spark2.mnt",
         "--net=/var/run/netns/lab-spark2"]


def _argv(flavor: str) -> list[str]:
    return dockerd.dockerd_argv("spark2", layout.mntns_path("spark2"), layout.netns_path("spark2"),
                               flavor)


def test_dockerd_argv_per_flavor(monkeypatch):
    monkeypatch.setattr(dockerd, "storage_driver",
                        lambda e: "overlayfs" if e == "containerd" else "overlay2")
    common = ["--iptables=false", "--ip-masq=false", "--bridge=none",
              "--add-runtime", "nvidia=/opt/sparkdeploy-lab/bin/nvidia-container-runtime",
              "--add-runtime", "lab-runc=/opt/sparkdeploy-lab/runtime/runc"]
    assert _argv("docker26") == ENTER + [
        "/var/cache/sparkdeploy/docker26/usr/sbin/dockerd",
        "--config-file", f"{N}/docker/docker26/daemon.json",
        "--data-root", f"{N}/docker/docker26/data", "--exec-root", f"{N}/docker/docker26/exec",
        "--pidfile", f"{N}/run/docker.pid", "-H", f"unix://{N}/run/docker.sock",
        "--storage-driver", "overlay2", *common]
    assert _argv("classic20")[len(ENTER)] == "/usr/sbin/dockerd"
    c = _argv("containerd")
    assert c[c.index("--storage-driver") + 1] == "overlayfs"
    # where Docker's own docker.service points dockerd: the node's private /run/containerd
    assert c[-2:] == ["--containerd", "/run/containerd/containerd.sock"]
    assert layout.PRIVATE_MOUNTS["/run/containerd"] == "containerd-run"


def test_sshd_config_gives_sessions_the_stand_ins_and_the_nodes_engine():
    text = keys.sshd_config("spark2", AddressPlan("10.77.0.0/24", "10.77.1.0/24"), fast=True)
    lines = text.splitlines()
    assert "ListenAddress 10.77.0.12" in lines and "ListenAddress 10.77.1.2" in lines
    assert "PermitRootLogin prohibit-password" in lines
    assert "PasswordAuthentication no" in lines
    assert (f"SetEnv PATH=/opt/sparkdeploy-lab/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:"
            f"/usr/bin:/sbin:/bin DOCKER_HOST=unix://{N}/run/docker.sock") in lines
    single = keys.sshd_config("spark1", AddressPlan("10.77.0.0/24", "10.77.1.0/24"), fast=False)
    assert [ln for ln in single.splitlines() if ln.startswith("ListenAddress")] == [
        "ListenAddress 10.77.0.11"]


def test_a_recorded_process_is_alive_only_with_its_own_start_time():
    me = proc.record(os.getpid())
    assert proc.alive(me)
    assert not proc.alive({**me, "start": me["start"] - 1})  # a recycled PID
    p = subprocess.Popen(["true"])
    rec = proc.record(p.pid)
    p.wait()
    assert not proc.alive(rec)
    assert not proc.alive(None) and not proc.alive({})


def test_stale_tmp_names_carry_the_pid():
    assert proc.pid_of_tmp(Path("/x/rootfs-bookworm.1234.tmp")) == 1234
    assert proc.pid_of_tmp(Path("/x/base-bookworm.tar.99.tmp")) == 99
    assert proc.pid_of_tmp(Path("/x/base-bookworm.tar")) is None


def test_debian_mirror_is_read_from_the_machines_sources(tmp_path):
    f = tmp_path / "debian.sources"
    f.write_text("Types: deb\nURIs: http://mirror.example/debian-security\n"
                 "Suites: bookworm-security\nComponents: main\n\n"
                 "Types: deb\nURIs: http://mirror.example/debian/\nSuites: bookworm\n"
                 "Components: main\n")
    assert dockerd.debian_mirror(f) == "http://mirror.example/debian"


def test_heartbeat_speaks_only_after_a_quiet_spell_inside_a_phase():
    from sparkdeploy.core.events import EventSink, Progress
    from sparkdeploy.lab.heartbeat import Heartbeat

    now = [0.0]
    sink = EventSink()
    beat = Heartbeat(sink, every=10, clock=lambda: now[0])
    with sink.collect() as got:
        sink.listeners.append(beat._heard)
        assert beat.beat() is False  # no phase: nothing to say
        with beat.phase("wheels", note="pip download"):
            now[0] = 9
            assert beat.beat() is False
            now[0] = 12
            assert beat.beat() is True
            assert beat.beat() is False  # its own line counts as heard
            with beat.phase("wheels", "spark1", note="inner"):
                now[0] = 23
                assert beat.beat() is True
            sink.log("x", None, "something said")
            now[0] = 30
            assert beat.beat() is False
    assert got[0] == Progress("wheels", None, 12, None, "s", "elapsed, pip download")
    assert got[1] == Progress("wheels", "spark1", 11, None, "s", "elapsed, inner")


def test_a_daemon_of_ours_that_died_leaves_no_zombie_once_stopped(tmp_path):
    rec = proc.spawn(["sleep", "60"], tmp_path / "sleep.log")
    os.kill(rec["pid"], signal.SIGKILL)
    wait_for(lambda: not proc.alive(rec), deadline=5, interval=0.02)
    assert Path(f"/proc/{rec['pid']}").exists()  # a zombie: dead, not reaped
    assert proc.stop(rec) is False  # it was not running
    assert not Path(f"/proc/{rec['pid']}").exists()


def test_a_running_daemon_of_ours_stopped_leaves_no_zombie(tmp_path):
    # sleep dies at once on SIGTERM: between two polls it is a zombie, reaped before stop ends
    for i in range(5):
        rec = proc.spawn(["sleep", "60"], tmp_path / f"s{i}.log")
        assert proc.stop(rec) is True
        assert not Path(f"/proc/{rec['pid']}").exists()


def test_our_children_killed_by_pid_leave_no_zombie(tmp_path):
    recs = [proc.spawn(["sleep", "60"], tmp_path / f"s{i}.log") for i in range(2)]
    assert sorted(proc.kill_pids([r["pid"] for r in recs])) == sorted(r["pid"] for r in recs)
    assert not [r for r in recs if Path(f"/proc/{r['pid']}").exists()]


def test_dockerd_flavours_one_for_all_or_one_per_node():
    assert layout.node_dockerds("containerd", 3) == ["containerd"] * 3
    assert layout.node_dockerds("containerd,docker26", 2) == ["containerd", "docker26"]
    assert layout.node_dockerds("classic20,docker26,containerd", 3) == [
        "classic20", "docker26", "containerd"]
    for bad, n in [("containerd,docker26", 3), ("docker27", 2), ("docker26,", 2), ("", 1),
                   ("containerd,docker26,classic20", 2), ("-x", 1)]:
        with pytest.raises(ValueError) as e:
            layout.node_dockerds(bad, n)
        assert str(e.value) == ("--dockerd: must be one of docker26, classic20, containerd, or one "
                                f"per node ({n}) separated by commas, not {bad!r}")
