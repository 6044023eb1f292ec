"""Scripted nodes for the serve tests: a docker engine with containers that print scripted log
lines on a fake clock, the node helper's facts, nvidia-smi; the controller's HTTP probes answer
from the same fake cluster."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass, field

from sparkdeploy.helpers import serve_watchdog as wd
from tests.unit.fakes import FakeClock, FakeContext, has_label, ps_line

BASE = dt.datetime(2026, 12, 2, 17, 0, 0, tzinfo=dt.UTC).timestamp()


def stamp(t: float) -> str:
    return dt.datetime.fromtimestamp(BASE + t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f000Z")


@dataclass
class Script:
    """What a container does: log lines at offsets from its start, then serve, hang or exit."""

    lines: list[tuple[float, str]] = field(default_factory=list)
    exit_at: float | None = None
    exit_code: int = 1
    opens: dict[int, float] = field(default_factory=dict)
    """port -> seconds after start when it listens"""


@dataclass
class Container:
    name: str
    started: float
    script: Script
    labels: dict[str, str]
    run_argv: list[str]

    @property
    def id(self) -> str:
        return hashlib.sha256(self.name.encode()).hexdigest()

    def status(self, now: float) -> tuple[str, int]:
        if self.script.exit_at is not None and now - self.started >= self.script.exit_at:
            return "exited", self.script.exit_code
        return "running", 0

    def log(self, now: float) -> list[tuple[str, str]]:
        return [(stamp(self.started + t), text) for t, text in self.script.lines
                if now - self.started >= t]


@dataclass
class FakeNode:
    name: str
    clock: FakeClock
    facts: dict = field(default_factory=dict)
    images: dict[str, str] = field(default_factory=dict)
    gpu: list[tuple[int, str]] = field(default_factory=list)
    unreachable: bool = False
    scripts: dict[str, Script] = field(default_factory=dict)
    containers: dict[str, Container] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    cluster: FakeCluster | None = None
    stdin: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    """Files the node holds (what ``cat`` reads), e.g. the watchdog's restart record."""
    frozen: set[str] = field(default_factory=set)
    """Containers whose processes are stopped (SIGSTOP): running, state T."""
    saved: list[tuple[str, list[str]]] = field(default_factory=list)
    selection: dict | None = None
    """The selection of files the node's model dir records (``model_node.py selection``)."""
    verify: dict = field(default_factory=lambda: {
        "ok": ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"],
        "missing": [], "differ": {}, "unchecked": [], "hashed_bytes": 0, "reused": 3,
        "present": True, "seconds": 0.01, "download_running": False})

    def answer(self, argv: list[str], stdin: str | None) -> tuple[int, str, str]:
        now = self.clock()
        if self.unreachable:
            return 255, "", f"ssh: connect to host {self.name} port 22: No route to host"
        if argv[:3] == ["sudo", "-n", "--"]:
            argv = argv[3:]
        if argv == ["true"]:
            return 0, "", ""
        if argv[:2] == ["sh", "-c"] and argv[2].startswith("set -eu") and "base64 -d" in argv[2]:
            return 0, f"/tmp/sparkdeploy-stage-0/{argv[4]}/{argv[5]}\n", ""  # staging a helper
        if argv[:2] == ["sh", "-c"] and argv[2].endswith('exec "$@"'):
            argv = argv[4:]  # a staged helper, run after its sha256 check
        if argv[:2] == ["sh", "-c"] and "for f" in argv[2]:
            return 0, "", ""  # no unit installed
        if argv[:3] == ["systemctl", "is-active", "--"]:  # none installed: systemd's answer
            return 3, "inactive\n" * len(argv[3:]), ""
        if argv[0] == "python3" and argv[2] == "verify":
            assert "--quick" in argv
            return 0, json.dumps(self.verify) + "\n", ""
        if argv[0] == "python3" and argv[2] == "selection":  # what the node's model dir records
            return 0, json.dumps({"selection": self.selection}) + "\n", ""
        if argv[0] == "python3" and argv[2] == "facts":
            return 0, json.dumps(self.facts) + "\n", ""
        if argv[0] == "python3" and argv[2] == "connect":
            port = int(argv[argv.index("--port") + 1])
            return 0, json.dumps({"open": self.cluster.listening(port)}) + "\n", ""
        if argv[:2] == ["cat", "--"]:
            if argv[2] in self.files:
                return 0, self.files[argv[2]], ""
            return 1, "", f"cat: {argv[2]}: No such file or directory"
        if argv[:2] == ["sha256sum", "--"]:
            got = self.files.get(argv[2])
            return (0, f"{hashlib.sha256(got.encode()).hexdigest()}  {argv[2]}\n", "") \
                if got is not None else (1, "", f"sha256sum: {argv[2]}: No such file or directory")
        if argv[:2] == ["sh", "-c"] and 'cat > "$1.part"' in argv[2]:  # put_file, through stdin
            self.files[argv[4]] = stdin or ""
            return 0, "", ""
        if argv[:3] == ["rm", "-f", "--"]:
            for f in argv[3:]:
                self.files.pop(f, None)
            return 0, "", ""
        if argv[0] == "python3" and argv[2] in ("ranks", "save-logs"):
            return self.watchdog(argv[2], argv[3:], now)
        if argv[0] == "nvidia-smi":
            return 0, "".join(f"{p}, {n}, [N/A]\n" for p, n in self.gpu), ""
        assert argv[:3] == ["docker", "-H", f"unix:///run/{self.name}.sock"], argv
        return self.docker(argv[3:], now, stdin)

    def watchdog(self, cmd: str, args: list[str], now: float) -> tuple[int, str, str]:
        """The node side of serve.watch (helpers/serve_watchdog.py): what it reads of each rank
        (the container's state; a frozen one's processes in state T), where it saves logs."""
        assert [a for a in args if a.startswith("--docker=")] == [
            "--docker=docker", "--docker=-H", f"--docker=unix:///run/{self.name}.sock"], args
        names = [a.removeprefix("--name=") for a in args if a.startswith("--name=")]
        if cmd == "save-logs":
            rid = args[args.index("--id") + 1]
            self.saved.append((rid, names))
            d = f"{wd.NODE_DIR}/logs/{rid}"
            return 0, json.dumps({"dir": d, "files": [f"{d}/{n}.log" for n in names]}) + "\n", ""
        out = {}
        for n in names:
            c = self.containers.get(n)
            st, code = c.status(now) if c else ("gone", -1)
            procs = {100: "T" if n in self.frozen else "S"}
            out[n] = wd.rank_problem(st, code, 100 if c else 0, procs)
        return 0, json.dumps({"ranks": out}) + "\n", ""

    def docker(self, a: list[str], now: float, stdin: str | None) -> tuple[int, str, str]:
        if a[:2] == ["image", "inspect"]:
            ref = a[-1]
            if ref not in self.images:
                return 1, "", f"Error: No such image: {ref}"
            return 0, json.dumps({"Id": self.images[ref]}) + "\n", ""
        if a[:2] == ["ps", "--all"]:
            filters = [a[i + 1].removeprefix("label=") for i, x in enumerate(a) if x == "--filter"]
            fmt = a[a.index("--format") + 1]
            out = []
            for c in self.containers.values():
                state, code = c.status(now)
                if all(has_label(c.labels, f) for f in filters):
                    out.append(ps_line(fmt, c.id, c.name, state, code, c.labels))
            return 0, "".join(f"{line}\n" for line in out), ""
        if a[0] == "run":
            name = next(x.split("=", 1)[1] for x in a if x.startswith("--name="))
            labels = dict(x.removeprefix("--label=").split("=", 1) for x in a
                          if x.startswith("--label="))
            if name in self.containers:
                return 125, "", ("docker: Error response from daemon: Conflict. The container "
                                 f'name "/{name}" is already in use.')
            if stdin is not None:
                self.stdin[name] = stdin
            self.containers[name] = Container(name, now, self.scripts.get(name, Script()), labels, a)
            return 0, "0123abcd\n", ""
        if a[0] == "inspect":
            fmt, names = a[2], a[3:]
            out = []
            for n in names:
                if n in self.containers:
                    st, code = self.containers[n].status(now)
                    out.append(fmt.replace("{{.Name}}", f"/{n}").replace("{{.State.Status}}", st)
                               .replace("{{.State.ExitCode}}", str(code))
                               .replace("{{.Id}}", self.containers[n].id)
                               .replace("{{.State.Running}}", str(st == "running").lower()))
            return (0 if len(out) == len(names) else 1), "\n".join(out) + "\n", ""
        if a[0] == "logs":
            name = a[-1]
            if name not in self.containers:
                return 1, "", f"Error: No such container: {name}"
            since = a[a.index("--since") + 1] if "--since" in a else None
            lines = [(ts, t) for ts, t in self.containers[name].log(now) if since is None or ts >= since]
            return 0, "".join(f"{ts} {t}\n" for ts, t in lines), ""
        if a[:2] == ["rm", "--force"]:
            for n in a[3:]:
                if self.containers.pop(n, None):
                    self.removed.append(n)
            return 0, "", ""
        if a[0] == "exec":
            return 0, json.dumps(self.cluster.ray_nodes()) + "\n", ""
        raise AssertionError(f"unexpected docker {a}")


class FakeCluster:
    """The nodes plus what the controller sees over HTTP."""

    def __init__(self, clock: FakeClock, nodes: dict[str, FakeNode], head: str, controller_addr: str):
        self.clock = clock
        self.nodes = nodes
        self.head = head
        self.addr = controller_addr
        self.ray_gpus: dict[str, float] = {}
        self.stalled = False
        """The endpoint answers and streams no token (a wedge the ranks do not show)."""
        for n in nodes.values():
            n.cluster = self

    def listening(self, port: int) -> bool:
        now = self.clock()
        for c in self.nodes[self.head].containers.values():
            at = c.script.opens.get(port)
            if at is not None and now - c.started >= at and c.status(now)[0] == "running":
                return True
        return False

    def ray_nodes(self) -> list[dict]:
        return [{"ip": ip, "gpus": g} for ip, g in self.ray_gpus.items()]

    def probes(self, model: str) -> dict:
        def port_open(host, port, timeout=2.0):
            return host == self.addr and self.listening(port)

        def serving(url):
            return self.listening(int(url.rsplit(":", 1)[1]))

        return {
            "port_open": port_open,
            "health": lambda url: serving(url),
            "models": lambda url: [model] if serving(url) else [],
            "stream_chat": lambda url, m, **kw: "Hello" if serving(url) and not self.stalled else "",
            "controller_address": lambda host: self.addr,
        }


class ServeContext(FakeContext):
    def __init__(self, nodes: dict[str, FakeNode], dry: bool = False):
        super().__init__(dry)
        self._set("nodes", nodes)

    def answer(self, alias, argv, stdin, command, kw):
        assert alias is not None, command
        code, out, err = self.nodes[alias].answer(argv, stdin)
        return self.result(command, code, out, err)
