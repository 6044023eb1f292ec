"""The lab's systemctl stand-in, run as a real process against unit files in a tmp dir."""

import os
import subprocess

import pytest

from sparkdeploy.lab.glm import STANDINS
from tests.unit.standin_node import (
    group_members,
    node_fixture,  # noqa: F401
    pid_alive,
    wait_for,
)

SLEEP = '/usr/bin/env python3 -c "import time; time.sleep(10**9)"'
LIST = ["list-units", "--all", "--plain", "--no-legend", "--no-pager", "--type=service"]


def service(description: str, exec_start: str = SLEEP, unit: str = "", extra: str = "",
            install: bool = True) -> str:
    text = f"[Unit]\nDescription={description}\n{unit}\n[Service]\nExecStart={exec_start}\n"
    text += extra
    if install:
        text += "\n[Install]\nWantedBy=multi-user.target\n"
    return text


@pytest.fixture
def glm_like(node):
    node.unit("cluster.service", service("Cluster"))
    node.unit("proxy.service", service(
        "Proxy", unit="Requires=cluster.service\nAfter=cluster.service"))
    node.unit("embed.service", service("Embeddings", unit="After=cluster.service"))
    return node


def test_start_is_active_stop_with_exit_codes(node):
    node.unit("a.service", service("Alpha"))
    r = node.systemctl("is-active", "a.service")
    assert (r.stdout, r.returncode) == ("inactive\n", 3)

    r = node.systemctl("start", "a.service")
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    r = node.systemctl("is-active", "a.service")
    assert (r.stdout, r.returncode) == ("active\n", 0)
    pid = node.main_pid("a.service")
    assert pid > 0 and pid_alive(pid)
    assert os.getsid(pid) != os.getsid(0)  # detached: a session of its own

    assert node.systemctl("start", "a").returncode == 0  # already running: no second process
    assert node.main_pid("a.service") == pid

    r = node.systemctl("stop", "a.service")
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    assert not pid_alive(pid)
    r = node.systemctl("is-active", "--quiet", "a.service")
    assert (r.stdout, r.returncode) == ("", 3)
    assert node.main_record("a.service") is None


def test_is_active_several_units_one_line_each(node):
    node.unit("a.service", service("Alpha"))
    node.systemctl("start", "a.service")
    r = node.systemctl("is-active", "a.service", "nope.service", "--no-pager")
    assert (r.stdout, r.returncode) == ("active\ninactive\n", 3)


def test_unknown_units_answer_like_systemd(node):
    r = node.systemctl("is-active", "ghost.service")
    assert (r.stdout, r.returncode) == ("inactive\n", 3)
    r = node.systemctl("is-enabled", "ghost.service")
    assert (r.stdout, r.returncode) == ("", 1)
    assert r.stderr == ("Failed to get unit file state for ghost.service: "
                        "No such file or directory\n")
    r = node.systemctl("cat", "ghost.service")
    assert (r.stdout, r.stderr, r.returncode) == ("", "No files found for ghost.service.\n", 1)
    r = node.systemctl("start", "ghost.service")
    assert (r.stderr, r.returncode) == (
        "Failed to start ghost.service: Unit ghost.service not found.\n", 5)
    r = node.systemctl("stop", "ghost")
    assert (r.stderr, r.returncode) == (
        "Failed to stop ghost.service: Unit ghost.service not loaded.\n", 5)
    r = node.systemctl(*LIST, "--", "ghost.service")
    assert (r.stdout, r.returncode) == ("", 0)
    r = node.systemctl("show", "-p", "ActiveState,LoadState", "--value", "ghost.service")
    assert r.stdout == "inactive\nnot-found\n"


def test_bad_verbs_and_options(node):
    r = node.systemctl("frobnicate", "a.service")
    assert (r.stderr, r.returncode) == ("Unknown command verb 'frobnicate'.\n", 1)
    r = node.systemctl("--bogus", "is-active", "a.service")
    assert (r.stderr, r.returncode) == ("systemctl: unrecognized option '--bogus'\n", 1)
    r = node.systemctl("start")
    assert (r.stderr, r.returncode) == ("Too few arguments.\n", 1)


def test_enable_disable_is_enabled(node):
    path = node.unit("a.service", service("Alpha"))
    node.unit("static.service", service("Static", install=False))
    r = node.systemctl("is-enabled", "a.service")
    assert (r.stdout, r.returncode) == ("disabled\n", 1)

    r = node.systemctl("enable", "a.service")
    link = node.unit_dir / "multi-user.target.wants" / "a.service"
    assert r.returncode == 0
    assert r.stderr == f"Created symlink {link} \u2192 {path}.\n"
    assert os.readlink(link) == str(path)
    r = node.systemctl("is-enabled", "a.service")
    assert (r.stdout, r.returncode) == ("enabled\n", 0)
    assert node.systemctl("enable", "a.service").stderr == ""  # already: nothing to say
    assert node.systemctl("is-active", "a.service").returncode == 3  # enable does not start

    r = node.systemctl("is-enabled", "static.service")
    assert (r.stdout, r.returncode) == ("static\n", 0)

    r = node.systemctl("disable", "a.service")
    assert (r.returncode, r.stderr) == (0, f'Removed "{link}".\n')
    assert not os.path.lexists(link)
    assert node.systemctl("is-enabled", "-q", "a.service").returncode == 1
    assert node.systemctl("daemon-reload").returncode == 0


def test_enable_now_starts_and_disable_now_stops(node):
    node.unit("a.service", service("Alpha"))
    assert node.systemctl("enable", "--now", "a.service").returncode == 0
    assert node.systemctl("is-active", "a.service").stdout == "active\n"
    assert node.systemctl("disable", "--now", "a.service").returncode == 0
    assert node.systemctl("is-active", "a.service").stdout == "inactive\n"
    assert node.systemctl("is-enabled", "a.service").stdout == "disabled\n"


def test_cat_prints_path_then_file(node):
    text = service("Alpha")
    path = node.unit("a.service", text)
    r = node.systemctl("cat", "a.service")
    assert (r.stdout, r.returncode) == (f"# {path}\n{text}", 0)


def test_list_units_plain_format(glm_like):
    node = glm_like
    node.systemctl("start", "cluster.service")
    r = node.systemctl(*LIST, "--", "proxy.service", "cluster.service", "ghost.service")
    assert r.returncode == 0
    assert r.stdout == (
        "cluster.service loaded active   running Cluster\n"
        "proxy.service   loaded inactive dead    Proxy\n"
    )
    # the way a parser reads it
    rows = [line.split(None, 4) for line in r.stdout.splitlines()]
    assert [row[:4] for row in rows] == [
        ["cluster.service", "loaded", "active", "running"],
        ["proxy.service", "loaded", "inactive", "dead"],
    ]

    r = node.systemctl("list-units", "--plain", "--no-legend", "--type=service")  # no --all
    assert r.stdout == "cluster.service loaded active running Cluster\n"
    r = node.systemctl(*LIST, "--state=active")
    assert r.stdout == "cluster.service loaded active running Cluster\n"
    r = node.systemctl(*LIST, "--state=inactive", "*.service")
    assert r.stdout == ("embed.service loaded inactive dead Embeddings\n"
                        "proxy.service loaded inactive dead Proxy\n")


def test_list_units_with_legend(node):
    node.unit("a.service", service("Alpha"))
    node.systemctl("start", "a.service")
    r = node.systemctl("list-units", "--type=service")
    assert r.stdout.splitlines()[:2] == [
        "  UNIT      LOAD   ACTIVE SUB     DESCRIPTION",
        "  a.service loaded active running Alpha",
    ]
    assert "1 loaded units listed." in r.stdout


def test_start_starts_what_a_unit_requires_first(glm_like):
    node = glm_like
    assert node.systemctl("start", "proxy.service").returncode == 0
    r = node.systemctl("is-active", "cluster.service", "proxy.service", "embed.service")
    assert r.stdout == "active\nactive\ninactive\n"
    cluster = node.main_record("cluster.service")
    proxy = node.main_record("proxy.service")
    assert cluster["started"] <= proxy["started"]


def test_stop_propagates_to_units_that_require_it(glm_like):
    node = glm_like
    node.systemctl("start", "proxy.service", "embed.service")
    pids = {u: node.main_pid(u) for u in ("cluster.service", "proxy.service", "embed.service")}
    assert node.systemctl("stop", "cluster.service").returncode == 0
    r = node.systemctl("is-active", "cluster.service", "proxy.service", "embed.service")
    assert (r.stdout, r.returncode) == ("inactive\ninactive\nactive\n", 3)
    assert not pid_alive(pids["cluster.service"]) and not pid_alive(pids["proxy.service"])
    assert pid_alive(pids["embed.service"])
    # stopping a unit that is already inactive is fine, as with systemd
    assert node.systemctl("stop", "proxy.service").returncode == 0


def test_restart_restarts_units_that_require_it(glm_like):
    node = glm_like
    node.systemctl("start", "proxy.service")
    before = node.main_pid("cluster.service"), node.main_pid("proxy.service")
    assert node.systemctl("restart", "cluster.service").returncode == 0
    after = node.main_pid("cluster.service"), node.main_pid("proxy.service")
    assert node.systemctl("is-active", "cluster.service", "proxy.service").returncode == 0
    assert not set(before) & set(after)


def test_missing_requirement_fails_start(node):
    node.unit("a.service", service("Alpha", unit="Requires=gone.service"))
    r = node.systemctl("start", "a.service")
    assert (r.stderr, r.returncode) == (
        "Failed to start a.service: Unit gone.service not found.\n", 5)
    assert node.systemctl("is-active", "a.service").stdout == "inactive\n"


def test_process_exiting_non_zero_is_failed(node):
    node.unit("bad.service", service("Bad", "/bin/sh -c 'exit 3'"))
    node.unit("done.service", service("Done", "/bin/true"))
    node.systemctl("start", "bad.service", "done.service")
    wait_for(lambda: node.systemctl("is-active", "bad.service").stdout == "failed\n",
             "bad.service failed")
    wait_for(lambda: node.systemctl("is-active", "done.service").stdout == "inactive\n",
             "done.service finished")
    assert node.systemctl("is-active", "bad.service").returncode == 3
    r = node.systemctl(*LIST, "bad.service")
    assert r.stdout == "bad.service loaded failed failed Bad\n"
    assert node.systemctl("show", "-p", "ExecMainStatus", "--value", "bad").stdout == "3\n"
    assert node.systemctl("is-failed", "-q", "bad.service").returncode == 0
    assert node.systemctl("start", "bad.service").returncode == 0  # a failed unit starts again


def test_unrunnable_exec_start_fails_with_203(node):
    node.unit("x.service", service("X", "/nonexistent/binary --flag"))
    node.systemctl("start", "x.service")
    wait_for(lambda: node.systemctl("is-active", "x.service").stdout == "failed\n", "x failed")
    assert node.systemctl("show", "-p", "ExecMainStatus", "--value", "x").stdout == "203\n"


def test_restart_on_failure_runs_the_process_again(node):
    node.unit("flaky.service", service(
        "Flaky", "/bin/sh -c 'echo run; exit 1'", extra="Restart=on-failure\nRestartSec=0.1\n"))
    node.systemctl("start", "flaky.service")
    wait_for(lambda: node.log("flaky.service").count("run\n") >= 3, "three runs")
    assert node.systemctl("is-active", "flaky.service").stdout in ("active\n", "activating\n")
    assert node.systemctl("stop", "flaky.service").returncode == 0
    assert node.systemctl("is-active", "flaky.service").stdout == "inactive\n"


def test_exec_stop_and_environment(node):
    node.unit("e.service", service(
        "Env", '/bin/sh -c \'echo "greeting=$GREETING path=$PATH"; exec sleep 1000\'',
        extra='Environment="GREETING=hello world"\nExecStop=/bin/echo stopping $MAINPID\n'))
    node.systemctl("start", "e.service")
    wait_for(lambda: "greeting=" in node.log("e.service"), "service output")
    pid = node.main_pid("e.service")
    node.systemctl("stop", "e.service")
    log = node.log("e.service")
    # systemd's PATH, the stand-in's own directory first: `systemctl` in a unit is the node's
    assert (f"greeting=hello world path={STANDINS.resolve()}:/usr/local/sbin:/usr/local/bin:/usr/sbin:"
            in log)
    assert f"stopping {pid}\n" in log


def test_stop_kills_a_process_that_ignores_sigterm(node):
    node.unit("stubborn.service", service(
        "Stubborn", "/bin/sh -c 'trap \"\" TERM; while :; do sleep 0.1; done'",
        extra="TimeoutStopSec=0.5\n"))
    node.systemctl("start", "stubborn.service")
    wait_for(lambda: node.main_pid("stubborn.service"), "main pid")
    pgid = node.main_record("stubborn.service")["pgid"]
    assert node.systemctl("stop", "stubborn.service").returncode == 0
    assert node.systemctl("is-active", "stubborn.service").stdout == "inactive\n"
    assert group_members(pgid) == []


def test_concurrent_starts_make_one_process(node):
    node.unit("a.service", service("Alpha"))
    cmd = [str(STANDINS / "systemctl"), "start", "a.service"]
    procs = [subprocess.Popen(cmd, env=node.env) for _ in range(4)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]
    pgid = node.main_record("a.service")["pgid"]
    groups = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
            except OSError:
                continue
            if str(node.root).encode() in cmdline and b"--standin-supervise" in cmdline:
                groups.add(os.getpgid(int(entry)))
    assert groups == {pgid}


def test_exec_start_pre_post_and_stop_post_run_around_each_start(node, tmp_path):
    trail = tmp_path / "trail"
    rec = f'/bin/sh -c "echo $0 >> {trail}"'
    node.unit("s.service", service(
        "Sup", unit="Requires=docker.service\nAfter=docker.service network-online.target",
        extra=(f"ExecStartPre=-/bin/false\nExecStartPre={rec.replace('$0', 'pre')}\n"
               f"ExecStartPost={rec.replace('$0', 'post')}\nExecStopPost={rec.replace('$0', 'stoppost')}\n")))
    r = node.systemctl("start", "s.service")
    assert r.returncode == 0, r.stderr  # docker.service is the lab's own dockerd: active
    assert node.systemctl("is-active", "docker.service").stdout == "active\n"
    wait_for(lambda: trail.exists() and trail.read_text().split() == ["pre", "post"], "pre, post")
    assert node.systemctl("stop", "s.service").returncode == 0
    wait_for(lambda: trail.read_text().split() == ["pre", "post", "stoppost"], "stop post")


def test_a_failing_exec_start_pre_fails_the_unit_and_restarts_it(node, tmp_path):
    count = tmp_path / "count"
    node.unit("f.service", service(
        "Fails", extra=f'ExecStartPre=/bin/sh -c "echo x >> {count}; exit 3"\nRestart=on-failure\nRestartSec=0.2\n'))
    node.systemctl("start", "f.service")
    wait_for(lambda: count.exists() and len(count.read_text().split()) >= 2, "a restart")
    node.systemctl("stop", "f.service")


def test_boot_starts_enabled_units_in_order(node):
    node.unit("w.service", service("Worker"))
    node.unit("h.service", service("Head", unit="After=w.service\nRequires=w.service"))
    node.unit("off.service", service("Not enabled"))
    assert node.systemctl("enable", "w.service", "h.service").returncode == 0
    r = node.systemctl("--standin-boot")
    assert r.returncode == 0, r.stderr
    assert node.systemctl("is-active", "h.service", "w.service").stdout == "active\nactive\n"
    assert node.systemctl("is-active", "off.service").stdout == "inactive\n"
    assert node.main_record("w.service")["started"] <= node.main_record("h.service")["started"]
    node.systemctl("stop", "h.service", "w.service")
