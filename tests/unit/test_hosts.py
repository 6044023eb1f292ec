import shlex
import sys

import pytest
from invoke import Context

from sparkdeploy.node.hosts import (
    CHANGE_TIMEOUT_S,
    PROBE_TIMEOUT_S,
    Feed,
    Host,
    HostError,
    NodeUnreachable,
    elide,
    ssh_base_argv,
)
from sparkdeploy.profile.config import Link, Node, SshSettings
from tests.unit.fakes import FakeContext

NODE = Node(name="spark1", role="head", ssh="spark1", link=Link(interface="e0", address="10.0.0.1"),
            privilege="sudo")


def test_wrap_uses_the_profile_ssh_files_and_quotes_the_remote_command():
    h = Host(NODE, SshSettings(config="/lab/ssh_config", known_hosts="/lab/known_hosts"))
    argv = h.wrap(["sh", "-c", "echo $HOME; rm x", "a b"], sudo=True)
    assert argv[:3] == ["ssh", "-F", "/lab/ssh_config"]
    assert "UserKnownHostsFile=/lab/known_hosts" in argv and "StrictHostKeyChecking=yes" in argv
    assert argv[-3:] == ["--", "spark1", "sudo -n -- sh -c 'echo $HOME; rm x' 'a b'"]


def test_local_node_runs_argv_as_is():
    local = NODE.model_copy(update={"ssh": None, "privilege": "none"})
    assert Host(local).wrap(["ls", "-l"], sudo=True) == ["ls", "-l"]


class Ctx(FakeContext):
    def __init__(self, answers):
        super().__init__()
        self._set("answers", answers)
        self._set("timeouts", [])

    @property
    def seen(self):
        return [shlex.join(argv) for _, argv in self.calls]

    def answer(self, alias, argv, stdin, command, kw):
        self.timeouts.append(kw.get("timeout"))
        code = self.answers.get(shlex.join(argv), 0)
        return self.result(command, code, stderr="boom" if code else "")


def test_a_command_exiting_255_on_a_live_node_is_not_unreachable():
    ctx = Ctx({"exit255": 255})
    h = Host(NODE, SshSettings(), ctx)
    r = h.run(["exit255"])
    assert r.exit_code == 255 and r.stderr == "boom"
    assert h.run(["echo"]).ok
    assert ctx.seen == ["exit255", "true", "echo"]


def test_an_unreachable_node_is_asked_once():
    ctx = Ctx({"a": 255, "true": 255, "b": 0})
    h = Host(NODE, SshSettings(), ctx)
    with pytest.raises(NodeUnreachable) as first:
        h.run(["a"])
    with pytest.raises(NodeUnreachable) as second:
        h.run(["b"])
    assert ctx.seen == ["a", "true"]
    # one line, the same both times, naming the node and ssh's own words
    assert str(first.value) == str(second.value) == "spark1: unreachable: boom"
    assert (first.value.node, first.value.why) == (NODE.name, "boom")


def test_elide_long_arguments():
    assert elide(["sh", "x" * 300]) == ["sh", "<300 bytes>"]


def test_control_dir_is_created_private(tmp_path):
    import os

    from sparkdeploy.node.hosts import private_dir

    d = str(tmp_path / "cm")
    assert private_dir(d) == d
    st = os.stat(d)
    assert st.st_mode & 0o777 == 0o700 and st.st_uid == os.getuid()
    assert private_dir(d) == d  # ours already: reused


@pytest.mark.parametrize("spoil", ["mode", "owner", "symlink", "file"])
def test_control_dir_not_private_is_refused(tmp_path, spoil):
    import os

    from sparkdeploy.node.hosts import HostError, private_dir

    d = tmp_path / "cm"
    if spoil == "symlink":
        (tmp_path / "other").mkdir(mode=0o700)
        d.symlink_to(tmp_path / "other")
    elif spoil == "file":
        d.write_text("")
    else:
        d.mkdir(mode=0o700)
        if spoil == "mode":
            d.chmod(0o755)
        elif os.getuid() == 0:
            os.chown(d, 4242, 4242)
        else:
            pytest.skip("chown to another user needs root")
    with pytest.raises(HostError) as e:
        private_dir(str(d))
    assert str(e.value).startswith(f"{d} is not private (")
    assert str(e.value).endswith(f"needs uid {os.getuid()}, mode 700): remove it")


def test_ssh_destination_comes_after_the_end_of_options():
    h = Host(NODE, SshSettings())
    argv = h.wrap(["true"])
    assert argv[-3:] == ["--", "spark1", "true"]
    assert argv.index("--") == len(argv) - 3


def test_input_reaches_the_command_in_one_write(monkeypatch):
    """Invoke feeds a non-terminal stdin one byte per 10 ms poll unless handed it whole: every
    rsync of model.sync waited 0.44 s for its 44-byte secret."""
    from invoke.runners import Local

    writes = []
    real = Local.write_proc_stdin
    monkeypatch.setattr(Local, "write_proc_stdin",
                        lambda self, data: (writes.append(data), real(self, data))[1])
    local = NODE.model_copy(update={"ssh": None, "privilege": "none"})
    secret = "s" * 43 + "\n"
    r = Host(local).run(["cat"], input=secret)
    assert r.stdout == secret and writes == [secret]


def test_a_feed_reaches_a_running_command_and_its_close_ends_stdin():
    """A command answers each line sent while it runs (its answers come back as they are
    written), and ends when the feed closes."""
    import threading


    local = NODE.model_copy(update={"ssh": None, "privilege": "none"})
    feed = Feed()
    heard: list[str] = []
    answered = threading.Event()

    def on_line(line: str) -> None:
        heard.append(line)
        answered.set()

    echo = ("import sys\nfor line in sys.stdin:\n"
            "    print('got ' + line.strip(), file=sys.stderr, flush=True)\nprint('eof')")
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault(
        "r", Host(local).run([sys.executable, "-c", echo], input=feed, on_stderr=on_line)))
    t.start()
    feed.send("one\n")
    assert answered.wait(10) and heard == ["got one"]  # answered while stdin stays open
    answered.clear()
    feed.send("two\n")
    assert answered.wait(10) and heard == ["got one", "got two"]
    assert t.is_alive()
    feed.close()
    t.join(10)
    assert not t.is_alive() and box["r"].ok and box["r"].stdout == "eof\n"
    with pytest.raises(ValueError):
        feed.send("three\n")


def test_every_node_command_has_a_deadline_by_its_kind():
    ctx = Ctx({})
    h = Host(NODE, SshSettings(), ctx)
    h.run(["docker", "info"], change=False)
    h.run(["systemctl", "start", "--", "x"])
    h.run(["rsync", "big"], timeout=6 * 3600)
    assert ctx.timeouts == [PROBE_TIMEOUT_S, CHANGE_TIMEOUT_S, 6 * 3600]
    assert PROBE_TIMEOUT_S == 120 and CHANGE_TIMEOUT_S == 1800


def test_a_command_past_its_deadline_is_one_failed_result_in_bounded_time():
    import time

    local = NODE.model_copy(update={"ssh": None, "privilege": "none"})
    started = time.monotonic()
    r = Host(local, ctx=Context()).run([sys.executable, "-c", "import time; time.sleep(30)"],
                                       change=False, timeout=0.5)
    assert time.monotonic() - started < 2.5
    assert r.exit_code == 124 and r.one_line_error() == "timed out after 0.5s"


def test_ssh_keeps_the_connection_alive_and_gives_up_on_a_dead_node():
    argv = ssh_base_argv(SshSettings())
    opts = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    assert "ServerAliveInterval=15" in opts and "ServerAliveCountMax=4" in opts


def test_ssh_view_asks_ssh_dash_g_once_on_this_machine(tmp_path):
    from sparkdeploy.core.state import StateDir

    class G(FakeContext):
        def answer(self, alias, argv, stdin, command, kw):
            return self.result(command, stdout="hostname 10.1.2.3\nport 2222\nuser me\n")

    ctx, state = G(dry=True), StateDir(tmp_path / "state")
    ssh = SshSettings(config="/lab/ssh_config")
    h = Host(NODE, ssh, ctx, state)
    assert h.ssh_view()["hostname"] == "10.1.2.3" and h.ssh_view()["port"] == "2222"
    # once, here (not through ssh to the node), even under --dry: it changes nothing
    assert ctx.calls == [(None, [*ssh_base_argv(ssh), "-G", "--", "spark1"])]
    from sparkdeploy.node import endpoint
    from sparkdeploy.steps.hosts import resolve
    assert endpoint.controller_address(h) == "10.1.2.3"
    assert (resolve(h).host, resolve(h).port) == ("10.1.2.3", 2222)
    local = Host(NODE.model_copy(update={"ssh": None}), ssh, ctx, state)
    assert local.ssh_view() == {} and endpoint.controller_address(local) == "127.0.0.1"
    assert len(ctx.calls) == 1


def test_trust_asks_ssh_and_adds_the_confirmed_key_every_command_through_the_host(tmp_path,
                                                                                  seed_profile):
    from sparkdeploy.steps.hosts import trust
    from tests.unit.fakes import deployment

    kh = tmp_path / "known_hosts"
    kh.write_text("")
    prof = seed_profile.model_copy(update={"ssh": seed_profile.ssh.model_copy(
        update={"known_hosts": str(kh)})})
    key = "10.1.2.3 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFake"

    class Keys(FakeContext):
        def answer(self, alias, argv, stdin, command, kw):
            assert alias is None, command  # all of it runs here, none on the node
            if "-G" in argv:
                return self.result(command, stdout="hostname 10.1.2.3\nport 22\n")
            if argv[:2] == ["ssh-keygen", "-F"]:
                return self.result(command, 1)
            if argv[0] == "ssh-keyscan":
                return self.result(command, stdout=key + "\n")
            assert argv == ["ssh-keygen", "-l", "-f", "-"] and stdin == key + "\n", argv
            return self.result(command, stdout="256 SHA256:abc 10.1.2.3 (ED25519)\n")

    ctx = Keys()
    dep = deployment(tmp_path / "p.yaml", tmp_path / "state", ctx, profile=prof)
    [r] = trust(dep, "spark1", confirm=lambda node, fp: True)
    assert (r.status.value, r.why) == ("changed", f"added 256 SHA256:abc 10.1.2.3 (ED25519) to {kh}")
    assert kh.read_text() == key + "\n"
    assert [argv[0] for _, argv in ctx.calls] == ["ssh", "ssh-keygen", "ssh-keyscan", "ssh-keygen"]
    assert ctx.calls[2][1] == ["ssh-keyscan", "-T", "5", "-p", "22", "-t", "ed25519", "--",
                               "10.1.2.3"]


class Writes(Ctx):
    """A node whose writes fail with ``fail`` (exit 1), each command's stdin kept."""

    def __init__(self, fail: str = ""):
        super().__init__({})
        self._set("fail", fail)
        self._set("stdins", [])

    def answer(self, alias, argv, stdin, command, kw):
        self.stdins.append(stdin)
        return self.result(command, 1 if self.fail else 0, stderr=self.fail)


def test_put_file_is_one_atomic_write_through_stdin_private_unless_said():
    ctx = Writes()
    h = Host(NODE, SshSettings(), ctx)
    h.put_file("/etc/sd/unit.json", "a secret", mode="0600", keep_previous=True)
    h.put_file("/var/lib/sd/record.json", "{}\n", private=False)
    (_, kept), (_, record) = ctx.calls
    assert kept == ["sudo", "-n", "--", "sh", "-c",
                    'umask 077 && mkdir -p -- "$(dirname -- "$1")" && rm -f -- "$1.previous" '
                    '&& { [ ! -e "$1" ] || cp -p -- "$1" "$1.previous"; } && cat > "$1.part" '
                    '&& chmod "$2" "$1.part" && mv -f -- "$1.part" "$1"', "sh", "/etc/sd/unit.json", "0600"]
    assert record[3:] == ["sh", "-c", 'umask 022 && mkdir -p -- "$(dirname -- "$1")" && cat > "$1.part" '
                          '&& mv -f -- "$1.part" "$1"', "sh", "/var/lib/sd/record.json"]
    assert ctx.stdins == ["a secret", "{}\n"]  # the content never in argv


def test_a_write_that_fails_is_a_host_error_naming_the_file_not_an_unreachable_node():
    h = Host(NODE, SshSettings(), Writes("cat: write error: No space left on device"))
    with pytest.raises(HostError) as e:
        h.put_file("/etc/sd/unit.json", "x")
    assert not isinstance(e.value, NodeUnreachable)
    assert str(e.value) == "spark1: cannot write /etc/sd/unit.json: cat: write error: No space left on device"
