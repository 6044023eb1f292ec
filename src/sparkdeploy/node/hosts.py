"""One ``Host``: run an argv on a node over OpenSSH (or locally), dry-run aware.

Every command goes through invoke's runner (so ``--hide``/``--echo`` behave as for any invoke
task), is journaled under the state dir with secrets redacted, and comes back as a
``CmdResult``. Commands are argv lists; the only shell involved is the remote login shell,
which gets ``shlex.join(argv)``.

Dry run (``inv --dry``): read-only probes (``change=False``) still run, since they change
nothing; every other command is echoed as ``[node] would run: ...`` and not run. Echo goes to
the deployment's event stream as ``Echo`` events, never to stdout.

A node that cannot be reached raises ``NodeUnreachable`` from ``run`` (the one error for it);
a command that merely fails comes back as a ``CmdResult`` with its exit code.
"""

from __future__ import annotations

import hashlib
import io
import os
import shlex
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from invoke import Context
from invoke.exceptions import CommandTimedOut

from sparkdeploy.core.errors import RunError
from sparkdeploy.core.events import Echo, EventSink
from sparkdeploy.core.redaction import redact
from sparkdeploy.core.state import StateDir
from sparkdeploy.profile.config import Node, SshSettings

SSH_UNREACHABLE = 255
PROBE_TIMEOUT_S = 120.0
"""A read-only probe (``change=False``) not done in this long has failed (a silent node)."""
CHANGE_TIMEOUT_S = 1800.0
"""A command that changes the node, unless its caller gives a longer deadline (a transfer,
a download, a helper that hashes the weights)."""
ALIVE_INTERVAL_S = 15
ALIVE_COUNT = 4
"""ssh asks the server every 15 s and gives up after 4 unanswered asks: a node that died
under a running command is a failed command within a minute, not a hang."""


class HostError(RunError):
    """A command could not be run as asked (sudo wants a password, the node is unreachable)."""


class NodeUnreachable(HostError):
    """The node cannot be reached (ssh cannot connect, authenticate or verify its host key).

    The one error for it: ``Host.run`` raises it, a step's context turns it into one failed
    result for the node (``StepContext.unreachable``), and a task that sees it escape exits 1
    with its one line."""

    def __init__(self, node: str, why: str):
        super().__init__(f"{node}: unreachable: {why}")
        self.node = node
        self.why = why


@dataclass
class CmdResult:
    host: str
    argv: list[str]
    exit_code: int
    stdout: str = ""
    stderr: str = ""
    duration: float = 0.0
    dry: bool = False
    """True when the command was not run because of ``--dry``."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def one_line_error(self) -> str:
        text = (self.stderr or self.stdout).strip().splitlines()
        return text[-1] if text else f"exit code {self.exit_code}"


def elide(argv: Sequence[str], limit: int = 200) -> list[str]:
    """argv for echo and the journal: a long argument (a staged file) shown by its size."""
    return [a if len(a) <= limit else f"<{len(a)} bytes>" for a in argv]


def ssh_base_argv(ssh: SshSettings, control_dir: str | None = None) -> list[str]:
    """The ssh client options every connection uses (host key checking stays on)."""
    argv = ["ssh"]
    if ssh.config:
        argv += ["-F", ssh.config]
    argv += [
        "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"ConnectTimeout={ssh.connect_timeout}",
        "-o", "ControlMaster=auto",
        # one master per (ssh settings, connection): a master opened with another known_hosts
        # or ssh_config is never reused
        "-o", f"ControlPath={control_dir or default_control_dir()}/{settings_tag(ssh)}-%C",
        "-o", f"ControlPersist={ssh.control_persist}",
        "-o", f"ServerAliveInterval={ALIVE_INTERVAL_S}",
        "-o", f"ServerAliveCountMax={ALIVE_COUNT}",
    ]  # fmt: skip
    if ssh.known_hosts:
        argv += ["-o", f"UserKnownHostsFile={ssh.known_hosts}"]
    return argv


def peer_ssh_argv() -> list[str]:
    """The ssh a node runs to reach a peer over the fast link: host keys checked, never a
    prompt (the nodes trust each other's host keys)."""
    return ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes"]


def settings_tag(ssh: SshSettings) -> str:
    key = f"{ssh.config}\0{ssh.known_hosts}".encode()
    return hashlib.sha256(key).hexdigest()[:8]


def default_control_dir() -> str:
    # Unix socket paths are limited to ~104 bytes (the name adds 50): keep the directory short.
    base = tempfile.gettempdir()
    if len(base) > 40:
        base = "/tmp"
    return private_dir(os.path.join(base, f"sparkdeploy-cm-{os.getuid()}"))


def private_dir(d: str) -> str:
    """Create ``d`` (mode 0700) or accept it only when it is a real directory owned by this user
    with mode 0700: a directory someone else made first in a shared /tmp is refused."""
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise HostError(f"cannot create {d}: {e.strerror}") from None
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o777 != 0o700:
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a directory"
        raise HostError(f"{d} is not private ({kind}, owner uid {st.st_uid}, mode "
                        f"{st.st_mode & 0o777:o}; needs uid {os.getuid()}, mode 700): remove it")
    return d


class _WholeInput(io.StringIO):
    """stdin for invoke that hands over everything at once. Invoke reads a stream that is not a
    terminal one byte per poll (10 ms apart): a 44-byte secret took 0.44 s per command."""

    def read(self, size: int | None = -1) -> str:
        return super().read(-1)


class Feed:
    """stdin for a command that reads while it runs: ``send`` hands it text, ``close`` ends it
    (EOF). Invoke polls it (``read`` gives what was sent since, ``None`` while nothing was,
    ``""`` once closed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buf = ""
        self._closed = False

    def send(self, text: str) -> None:
        with self._lock:
            if self._closed:
                raise ValueError("send on a closed Feed")
            self._buf += text

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def read(self, size: int | None = -1) -> str | None:
        with self._lock:
            out, self._buf = self._buf, ""
        if out:
            return out
        return "" if self._closed else None


class _LineStream:
    """A write-only stream handing complete lines to a callback (invoke's out/err_stream)."""

    def __init__(self, cb: Callable[[str], None]):
        self.cb = cb
        self.buf = ""

    def write(self, data: str) -> int:
        self.buf += data
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            self.cb(line)
        return len(data)

    def flush(self) -> None:
        pass


@dataclass
class Host:
    node: Node
    ssh: SshSettings = field(default_factory=SshSettings)
    ctx: Context | None = None
    state: StateDir | None = None
    events: EventSink = field(default_factory=EventSink)
    """The deployment's event stream: echo goes there as ``Echo`` events."""
    clock: Callable[[], float] = time.monotonic
    """The deployment's clock (durations in the journal)."""
    _unreachable: str | None = None
    _ssh_view: dict[str, str] | None = None

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def dry(self) -> bool:
        return bool(self.ctx is not None and self.ctx.config.run.dry)

    @property
    def echo(self) -> bool:
        return bool(self.ctx is not None and (self.ctx.config.run.echo or self.ctx.config.run.dry))

    def wrap(self, argv: Sequence[str], *, sudo: bool = False) -> list[str]:
        """The local argv that runs ``argv`` on this node (ssh + remote command, or as is)."""
        argv = list(argv)
        if sudo and self.node.privilege == "sudo":
            argv = ["sudo", "-n", "--", *argv]
        if self.node.local:
            return argv
        # "--" before the destination: nothing after it is read as an ssh option
        return [*ssh_base_argv(self.ssh), "--", self.node.ssh or "", shlex.join(argv)]

    def _say(self, text: str, would: bool = False) -> None:
        self.events.emit(Echo(self.name, text, would))

    def run(
        self,
        argv: Sequence[str],
        *,
        change: bool = True,
        sudo: bool = False,
        timeout: float | None = None,
        on_stderr: Callable[[str], None] | None = None,
        on_stdout: Callable[[str], None] | None = None,
        input: str | Feed | None = None,
        here: bool = False,
    ) -> CmdResult:
        """Run ``argv`` on the node. ``change=False`` marks a read-only probe; ``here`` runs it
        on this machine on the node's behalf (``ssh -G`` for its alias), echoed and journaled
        as any other.

        ``timeout``: seconds before the command is ended (exit 124); by default
        ``PROBE_TIMEOUT_S`` for a probe, ``CHANGE_TIMEOUT_S`` for any other command.
        ``on_stderr`` receives each stderr line as it arrives (progress of long commands),
        ``on_stdout`` each stdout line (a node helper's progress and events; stdout is kept whole
        in the result all the same).
        ``input`` is written to the command's stdin, then stdin is closed: the way a secret
        reaches a process on a node (never echoed, journaled or put in argv). A ``Feed`` keeps
        stdin open while the command runs, for commands sent to it as it works.

        Raises ``NodeUnreachable`` when ssh cannot reach the node (asked once per run: later
        commands raise at once)."""
        argv = [str(a) for a in argv]
        if timeout is None:
            timeout = PROBE_TIMEOUT_S if not change else CHANGE_TIMEOUT_S
        shown = shlex.join(redact(elide(argv if not (sudo and self.node.privilege == "sudo")
                                        else ["sudo", "-n", *argv])))
        if self.dry and change:
            self._say(shown, would=True)
            # nothing ran and nothing is written, not even the journal
            return CmdResult(self.name, argv, 0, dry=True)
        if self.echo:
            self._say(shown)
        if self._unreachable is not None:
            raise NodeUnreachable(self.name, self._unreachable)
        full = argv if here else self.wrap(argv, sudo=sudo)
        ctx = self.ctx or Context()
        start = self.clock()
        try:
            r = ctx.run(
                shlex.join(full),
                dry=False,
                echo=False,
                warn=True,
                hide=("err" if on_stdout and not on_stderr else "out" if on_stderr and not on_stdout
                      else None if on_stdout else True),
                out_stream=_LineStream(on_stdout) if on_stdout else None,
                err_stream=_LineStream(on_stderr) if on_stderr else None,
                pty=False,
                timeout=timeout,
                in_stream=(_WholeInput(input) if isinstance(input, str) else
                           input if input is not None else False),
                echo_stdin=False,
            )
            res = CmdResult(self.name, argv, r.exited, r.stdout, r.stderr,
                            self.clock() - start)
        except CommandTimedOut as e:
            res = CmdResult(self.name, argv, 124, e.result.stdout,
                            (e.result.stderr + f"\ntimed out after {timeout}s").strip(),
                            self.clock() - start)
        self._journal(res, change)
        if (not self.node.local and not here and res.exit_code == SSH_UNREACHABLE
                and self._lost(ctx)):
            # ssh itself failed (a command of ours may exit 255 too: then the node still answers)
            self._unreachable = res.one_line_error()
            raise NodeUnreachable(self.name, self._unreachable)
        if sudo and self.node.privilege == "sudo" and res.exit_code != 0 and (
            "a password is required" in res.stderr or "a terminal is required" in res.stderr
        ):
            raise HostError(
                f"{self.name}: sudo needs a password for {argv[0]}; allow it without a password "
                f"(NOPASSWD) for the deploying user, or set privilege: none"
            )
        return res

    def put_file(self, path: str, data: str, *, mode: str | None = None, private: bool = True,
                 keep_previous: bool = False, sudo: bool = True) -> None:
        """Write ``data`` at ``path`` on the node, whole or not at all: through stdin (never in
        argv), into ``<path>.part`` renamed over ``path`` (a reader sees the old file or the new
        one), its directory made when missing. ``private``: under umask 077 (a directory it
        makes is 0700, the file 0600 until ``mode``), else 022 (what anyone on the node may
        read: the node's records); ``mode``: the file's mode (octal, ``"0644"``);
        ``keep_previous``: the file it replaces kept as ``<path>.previous``. The one way a file
        is written on a node (the staging of helpers aside: ``nodeops.stage``).

        Raises ``HostError`` (``<node>: cannot write <path>: why``) when the write fails,
        ``NodeUnreachable`` when the node cannot be reached; under ``--dry`` it is echoed as
        ``would run`` and nothing is written."""
        steps = [f"umask {'077' if private else '022'}", 'mkdir -p -- "$(dirname -- "$1")"']
        if keep_previous:
            steps += ['rm -f -- "$1.previous"', '{ [ ! -e "$1" ] || cp -p -- "$1" "$1.previous"; }']
        steps.append('cat > "$1.part"')
        if mode is not None:
            steps.append('chmod "$2" "$1.part"')
        steps.append('mv -f -- "$1.part" "$1"')
        argv = ["sh", "-c", " && ".join(steps), "sh", path, *([mode] if mode is not None else [])]
        r = self.run(argv, sudo=sudo, input=data)
        if not r.ok:
            raise HostError(f"{self.name}: cannot write {path}: {r.one_line_error()}")

    def ssh_view(self) -> dict[str, str]:
        """How ssh sees this node's alias (``ssh -G``: the profile's ssh_config applied), e.g.
        ``hostname``, ``port``; empty for this machine. Asked once."""
        if self.node.local:
            return {}
        if self._ssh_view is None:
            r = self.run([*ssh_base_argv(self.ssh), "-G", "--", self.node.ssh or ""],
                         change=False, here=True, timeout=10)
            view: dict[str, str] = {}
            for line in r.stdout.splitlines() if r.ok else []:
                key, _, value = line.partition(" ")
                view.setdefault(key, value.strip())
            self._ssh_view = view
        return self._ssh_view

    def _lost(self, ctx: Context) -> bool:
        r = ctx.run(shlex.join(self.wrap(["true"])), dry=False, echo=False, warn=True, hide=True,
                    pty=False, in_stream=False, timeout=self.ssh.connect_timeout + 10)
        return r.exited != 0

    def _journal(self, res: CmdResult, change: bool) -> None:
        if self.state is None or self.dry:
            return
        self.state.journal(
            {
                "host": self.name,
                "argv": elide(res.argv),
                "exit": res.exit_code,
                "duration_s": round(res.duration, 4),
                "dry": res.dry,
                "change": change,
                "stderr": res.stderr,
            }
        )
