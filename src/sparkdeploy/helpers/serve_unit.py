"""sparkdeploy's supervisor for a persisted deployment (standard library only).

``serve.persist`` puts this file and one spec per engine on every node and a systemd unit
running ``serve_unit.py run --spec FILE`` (``Restart=on-failure``; ``ExecStop`` runs
``serve_unit.py stop --spec FILE``). The supervisors of one deployment form a group over the
fast link, each publishing a small JSON state on ``<own fast-link address>:<group port>``:

    {"node": ..., "epoch": random id of this supervisor run, "stage": highest stage started
     (-1: ready, nothing started), "following": the head epoch a worker started under}

- Workers before the head: the head starts nothing until every worker answers ``ready``.
- The head starts its own containers stage by stage and publishes the stage; a worker starts
  its containers of every stage the head has published; the head waits for them, then for the
  stage's condition (``dist-port``: the head's init port answers; ``ray-nodes``: Ray lists
  every node with its GPUs; ``ranks-joined``: each of the stage's containers printed its
  ``joined`` line, read by the supervisor of its node from its log and published in
  ``joined``), then goes on.
- Restarted together: every supervisor reads its own ranks each poll (``serve_watchdog``:
  the container gone or exited, its engine process gone, stopped (state T) or a zombie) and
  publishes what is wrong (``ranks``); the head also runs a canary (a short streamed
  completion on its own endpoint) every ``watch_s`` once the group serves. A rank that is wrong
  anywhere, or a canary without a token within ``canary_s``, is a wedge: the head decides
  (the budget and the backoff of ``serve_watchdog.next_restart``), writes the restart record
  on its node, publishes ``restarting`` (each worker then saves its own logs under the
  restart's id and exits 1), saves its own, removes its containers, waits the backoff and
  exits 1; systemd restarts every supervisor and the group comes up again as a whole. When the
  head next serves, the record gets ``served_again_after_s``. A spent budget: the head
  records ``gave-up``, removes its containers and stays (publishing ``gave_up``; the workers
  remove theirs). A worker whose head changed epoch or vanished, or a head whose worker
  vanished or is not following it, exits 1 as before. Users of other launchers report a
  half-cluster left serving nothing after one rank died, and ranks wedged while ``/health``
  answered 200.
- SIGTERM (``systemctl stop``) and ``stop`` remove this node's containers.
- Adopted, not restarted: ``serve.persist`` hands a deployment that serves as the profile says
  over to the units without a second bring-up. Before it starts a node's unit it leaves
  ``<node_dir>/<engine>.adopt`` (a line ``NAME ID`` per container of that node); the supervisor
  reads and deletes it as it starts, and when every one of its node's containers runs under
  the ID written there it keeps them: its stages start nothing and the group forms around what
  serves. Anything else (a container missing, stopped, replaced, a line it cannot read) and
  it removes them and starts afresh, as without the file. Only the first run after a
  hand-over finds the file: a restart always starts afresh.
- Peers authenticate each other with the group's key (``key``: a file of mode 0600 that
  ``serve.persist`` writes on every node over stdin): a request carries its time, a fresh nonce
  and an HMAC-SHA256 of both (``X-Sparkdeploy-Auth``); a request older or newer than
  ``WINDOW_S`` or with another HMAC is refused (403). The answer carries an HMAC of the nonce and
  its body, so a state is believed only from a holder of the key, and never replayed. The state
  is published on the node's fast-link address only.

The spec (JSON): ``docker`` (the docker CLI argv prefix for this node's engine), ``node``,
``role`` (``head``/``worker``), ``listen`` ([address, port]), ``head`` ([address, port]),
``workers`` ({node: [address, port]}), ``stages`` ([{"wait": null|"dist-port"|"ray-nodes"|
"ranks-joined", "joined": regex or null, "containers": [{"node", "name", "run": [docker run
args]}]}]), ``wait_addr``
([address, port] of the init port), ``ray_nodes`` ({address: gpus}), ``ray_probe`` (Python
source run in the Ray head container), ``ready_timeout_s``, ``key`` (the group key's file),
``watch`` (``serve_watchdog.Policy`` as a dict), ``canary`` ({"port", "model"}: the head's
endpoint on 127.0.0.1), ``engine``, ``unit``, ``node_dir`` (where records and logs go),
``nodes`` (every node of the group), ``started_labels`` (``at``, ``by``: the label names saying
when and by what a container was started, ``by_value``: this unit's name; added to each
``docker run`` as it starts).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

try:  # beside this file on a node; in the package on the controller (tests)
    import serve_watchdog as wd  # type: ignore[import-not-found]
except ImportError:  # the package's own import path
    from sparkdeploy.helpers import serve_watchdog as wd

POLL = 1.0
WINDOW_S = 30.0
"""How far a request's time may be from the server's (clocks of the nodes, the network)."""
AUTH = "X-Sparkdeploy-Auth"
GRACE = 5
"""Polls a peer may miss before the group restarts (a short network blip is not a death)."""


def say(msg: str) -> None:
    print(f"serve_unit: {msg}", flush=True)


def sign(key: bytes, *parts: str) -> str:
    return hmac.new(key, "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def request_path(key: bytes, now: float) -> tuple[str, dict[str, str], str]:
    """(path, headers, nonce) of one authenticated request for the state."""
    nonce = secrets.token_hex(16)
    path = "/state?" + urllib.parse.urlencode({"t": f"{now:.3f}", "nonce": nonce})
    return path, {AUTH: sign(key, "GET", path)}, nonce


def accepted(key: bytes, path: str, auth: str | None, now: float) -> str | None:
    """The request's nonce when ``path`` and its HMAC ``auth`` are valid now, else None."""
    q = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
    try:
        t, nonce = float(q["t"][0]), q["nonce"][0]
    except (KeyError, IndexError, ValueError):
        return None
    if not auth or abs(now - t) > WINDOW_S:
        return None
    return nonce if hmac.compare_digest(sign(key, "GET", path), auth) else None


def read_key(path: str) -> bytes:
    with open(path, "rb") as f:
        key = f.read().strip()
    if len(key) < 32:
        raise ValueError(f"{path}: the group key is missing or too short")
    return key


class Group:
    def __init__(self, spec: dict, key: bytes = b"", clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep, run=subprocess.run,
                 mono: Callable[[], float] = time.monotonic):
        self.spec = spec
        self.key, self.clock, self.sleep, self.run, self.mono = key, clock, sleep, run, mono
        self.state = {"node": spec["node"], "epoch": secrets.token_hex(6), "stage": -1,
                      "following": None, "accepting": spec["role"] == "head", "joined": []}
        self.lock = threading.Lock()
        self.stopping = False
        self.adopted: frozenset[str] = frozenset()
        """This node's containers kept from a hand-over (their stages start nothing)."""
        self.policy = wd.Policy.of(spec.get("watch") or {})

    # -- the published state ---------------------------------------------------------------
    def serve(self) -> ThreadingHTTPServer:
        group = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                nonce = accepted(group.key, self.path, self.headers.get(AUTH), group.clock())
                if nonce is None:
                    self.send_response(403)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                with group.lock:
                    body = json.dumps(group.state).encode()
                self.send_response(200)
                self.send_header(AUTH, sign(group.key, "state", nonce, body.decode()))
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a) -> None:
                pass

        addr, port = self.spec["listen"]
        ThreadingHTTPServer.allow_reuse_address = True
        srv = ThreadingHTTPServer((addr, int(port)), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        return srv

    def set(self, **kw) -> None:
        with self.lock:
            self.state.update(kw)

    # -- docker ------------------------------------------------------------------------------
    def docker(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.run([*self.spec["docker"], *args], capture_output=True, text=True,
                        timeout=timeout)

    def mine(self) -> list[dict]:
        return [c for st in self.spec["stages"] for c in st["containers"]
                if c["node"] == self.spec["node"]]

    def remove_mine(self) -> None:
        names = [c["name"] for c in self.mine()]
        if names:
            self.docker("rm", "--force", "--volumes", *names)

    def run_args(self, c: dict) -> list[str]:
        """A container's ``docker run`` arguments with the labels saying when and by what it
        started (the spec's ``started_labels`` names them)."""
        lab = self.spec.get("started_labels")
        if not lab:
            return list(c["run"])
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.clock()))
        return [c["run"][0], f"--label={lab['at']}={now}", f"--label={lab['by']}={lab['by_value']}",
                *c["run"][1:]]

    def adopt(self, text: str | None) -> frozenset[str]:
        """The names of this node's containers to keep, from the text of the hand-over's
        one-shot file (None: there was none): all of them when each runs under the ID the
        file gives, else none."""
        if text is None:
            return frozenset()
        want = adoption(text)
        names = sorted(c["name"] for c in self.mine())
        if want is None or sorted(want) != names:
            say(f"{adopt_path(self.spec)} does not name this node's containers; starting afresh")
            return frozenset()
        r = self.docker("inspect", "--format", "{{.Name}} {{.Id}} {{.State.Running}}", *names,
                        timeout=60)
        seen = {}
        for line in r.stdout.splitlines() if r.returncode == 0 else []:
            parts = line.split()
            if len(parts) == 3:
                seen[parts[0].lstrip("/")] = (parts[1], parts[2] == "true")
        kept = [n for n in names if n in seen and seen[n][1] and seen[n][0].startswith(want[n])]
        if kept != names:
            say(f"not every container the hand-over named runs under its ID "
                f"({', '.join(sorted(set(names) - set(kept)))}); starting afresh")
            return frozenset()
        say(f"adopting {', '.join(names)}: already serving, kept running")
        return frozenset(names)

    def start_stage(self, k: int) -> None:
        for c in self.spec["stages"][k]["containers"]:
            if c["node"] == self.spec["node"] and c["name"] in self.adopted:
                say(f"kept {c['name']} (stage {k}): adopted")
            elif c["node"] == self.spec["node"]:
                r = self.docker(*self.run_args(c), timeout=300)
                if r.returncode != 0:
                    raise Restart(f"docker run {c['name']}: {(r.stderr or r.stdout).strip()[-300:]}")
                say(f"started {c['name']} (stage {k})")

    def note_joined(self, upto: int) -> None:
        """Publish this node's containers (of stages up to ``upto`` that wait for their ranks)
        whose log now shows their stage's ``joined`` line."""
        done = set(self.state["joined"])
        for st in self.spec["stages"][:upto + 1]:
            if st.get("wait") != "ranks-joined":
                continue
            for c in st["containers"]:
                if c["node"] == self.spec["node"] and c["name"] not in done:
                    r = self.docker("logs", c["name"], timeout=60)
                    if re.search(st.get("joined") or r"$^", r.stdout + r.stderr, re.MULTILINE):
                        done.add(c["name"])
                        say(f"{c['name']} joined")
        self.set(joined=sorted(done))

    def check_mine(self, upto: int) -> dict[str, str]:
        """What is wrong with this node's ranks of the stages up to ``upto`` (published as
        ``ranks``: {"node: container": why}; {} when every one serves)."""
        names = [c["name"] for k, st in enumerate(self.spec["stages"]) if k <= upto
                 for c in st["containers"] if c["node"] == self.spec["node"]]
        got = wd.inspect_ranks(self.spec["docker"], names, run=self.run) if names else {}
        bad = {f"{self.spec['node']}: {n}": p for n, p in got.items() if p}
        self.set(ranks=bad)
        return bad

    def save_logs(self, rid: str) -> str:
        d, _ = wd.save_logs(self.spec["docker"], [c["name"] for c in self.mine()], rid,
                            self.node_dir, run=self.run)
        return d

    @property
    def node_dir(self) -> str:
        return self.spec.get("node_dir") or wd.NODE_DIR


class Restart(Exception):
    def __init__(self, why: str, wait_s: float = 0.0):
        super().__init__(why)
        self.wait_s = wait_s


class GaveUp(Exception):
    """The restart budget is spent: the group stays down, the supervisor stays (said why)."""


def adopt_path(spec: dict) -> str:
    return f"{spec.get('node_dir') or wd.NODE_DIR}/{spec['engine']}.adopt"


def read_once(path: str) -> str | None:
    """A one-shot file's text, the file deleted as it is read (None when there is none)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def adoption(text: str) -> dict[str, str] | None:
    """``NAME ID`` lines -> {name: id}; None when a line is not two words or an ID is not hex
    (the file is then not believed at all)."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2 or not re.fullmatch(r"[0-9a-f]{12,64}", parts[1]) or parts[0] in out:
            return None
        out[parts[0]] = parts[1]
    return out or None


def peer(g: Group, addr: list) -> dict | None:
    """A peer's state, when it answers with the group's key; else None (as a silent peer)."""
    path, headers, nonce = request_path(g.key, g.clock())
    req = urllib.request.Request(f"http://{addr[0]}:{addr[1]}{path}", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            body = r.read(65536).decode()
            auth = r.headers.get(AUTH) or ""
    except (OSError, ValueError):
        return None
    if not hmac.compare_digest(sign(g.key, "state", nonce, body), auth):
        return None
    try:
        state = json.loads(body)
    except ValueError:
        return None
    return state if isinstance(state, dict) else None


def port_open(addr: list) -> bool:
    try:
        with socket.create_connection((addr[0], int(addr[1])), timeout=2):
            return True
    except OSError:
        return False


def stage_ready(g: Group, stage: dict, states: dict[str, dict | None]) -> bool:
    """The stage's condition (``wait``) holds."""
    wait = stage.get("wait")
    if wait == "dist-port":
        return port_open(g.spec["wait_addr"])
    if wait == "ray-nodes":
        return ray_ready(g)
    if wait == "ranks-joined":
        g.note_joined(len(g.spec["stages"]) - 1)
        joined = set(g.state["joined"]).union(*((s or {}).get("joined") or [] for s in states.values()))
        return {c["name"] for c in stage["containers"]} <= joined
    return True


def ray_ready(g: Group) -> bool:
    rh = g.spec["stages"][0]["containers"][0]["name"]
    r = g.docker("exec", rh, "python3", "-c", g.spec["ray_probe"], timeout=60)
    try:
        seen = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False
    have = {s["ip"]: s["gpus"] for s in seen}
    return all(have.get(a, 0) >= n for a, n in g.spec["ray_nodes"].items())


class Watcher:
    """Counts consecutive misses per peer."""

    def __init__(self) -> None:
        self.misses: dict[str, int] = {}

    def seen(self, name: str, ok: bool, why: str) -> None:
        self.misses[name] = 0 if ok else self.misses.get(name, 0) + 1
        if self.misses[name] > GRACE:
            raise Restart(why)


def wedged(g: Group, w: wd.Wedge) -> None:
    """The head's decision on a wedge: record it, tell the workers (they save their logs and
    exit), save this node's logs; then Restart (after the backoff) or GaveUp."""
    now = g.clock()
    path = wd.record_path(g.spec["engine"], g.node_dir)
    recs = wd.read_records(path)
    go, wait, n = wd.next_restart(recs, now, g.policy)
    rid = wd.restart_id(now, g.state["epoch"][:4])
    logs = {node: f"{g.node_dir}/logs/{rid}" for node in g.spec["nodes"]}
    recs.append(wd.entry(w, rid=rid, t=now, by=g.spec["unit"], engine=g.spec["engine"], n=n,
                         backoff_s=wait, gave_up=not go, logs=logs))
    wd.write_records(path, recs)
    g.set(restarting={"id": rid, "why": w.why, "gave_up": not go})
    say(f"wedge: {w.why}; " + (f"restart {n} of {g.policy.max_restarts} (id {rid})" if go else
                               f"the restart budget is spent ({g.policy.max_restarts} within "
                               f"{g.policy.window_s:g}s): giving up (id {rid})"))
    g.save_logs(rid)
    g.sleep(3 * POLL)  # the workers read ``restarting`` and save their logs
    if not go:
        raise GaveUp(w.why)
    raise Restart(w.why, wait)


class Recorded(Restart):
    """A Restart the head decided and recorded already."""


def run_head(g: Group) -> None:
    workers = g.spec["workers"]
    say(f"epoch {g.state['epoch']}: waiting for {len(workers)} worker(s) to be ready")
    while True:
        states = {n: peer(g, a) for n, a in workers.items()}
        if all(s is not None and s["stage"] == -1 for s in states.values()):
            break
        time.sleep(POLL)
    try:
        _head_group(g)
    except Restart as e:
        if isinstance(e, Recorded):
            raise
        wedged(g, wd.Wedge("group", str(e), [str(e)]))


def _head_group(g: Group) -> None:
    workers = g.spec["workers"]
    epoch = g.state["epoch"]
    w = Watcher()
    joined: set[str] = set()

    def watch_workers(upto: int, canary_error: str | None = None) -> dict[str, dict | None]:
        states = {n: peer(g, a) for n, a in workers.items()}
        for n, s in states.items():
            w.seen(n, s is not None, f"worker {n} does not answer")
            if s is None:
                continue
            if s["following"] == epoch:
                joined.add(n)
            elif n in joined:
                raise Restart(f"worker {n} restarted")
            elif s["following"] is not None:
                raise Restart(f"worker {n} follows another head epoch")
        if joined == set(workers) and g.state["accepting"]:
            g.set(accepting=False)
        bad = dict(g.check_mine(upto))
        for s in states.values():
            if s is not None and s.get("following") == epoch and isinstance(s.get("ranks"), dict):
                bad.update({str(k): str(v) for k, v in s["ranks"].items()})
        found = wd.wedge(canary_error, bad)
        if found is not None:
            try:
                wedged(g, found)
            except Restart as e:
                raise Recorded(str(e), e.wait_s) from None
        return states

    deadline = g.mono() + float(g.spec["ready_timeout_s"])
    for k, stage in enumerate(g.spec["stages"]):
        g.start_stage(k)
        g.set(stage=k)
        needs = {c["node"] for c in stage["containers"]} - {g.spec["node"]}
        while True:
            states = watch_workers(k)
            if all((states[n] or {"stage": -1})["stage"] >= k for n in needs):  # None: not heard
                break
            if g.mono() > deadline:
                raise Restart(f"workers did not start stage {k} in time")
            g.sleep(POLL)
        while not stage_ready(g, stage, states):
            states = watch_workers(k)
            if g.mono() > deadline:
                raise Restart(f"stage {k}: {stage.get('wait')} not reached in time")
            g.sleep(POLL)
        say(f"stage {k} up")
    last = len(g.spec["stages"]) - 1
    say("all stages up; waiting for the endpoint to serve")
    canary = g.spec.get("canary")
    served = canary is None
    next_canary = 0.0
    while True:
        err = None
        if canary is not None and g.mono() >= next_canary:
            err = wd.canary("127.0.0.1", int(canary["port"]), canary["model"], g.policy.canary_s)
            next_canary = g.mono() + (g.policy.watch_s if served or err is None else POLL)
            if err is None and not served:
                served = True
                say("serving; the watchdog runs a canary every " f"{g.policy.watch_s:g}s")
                path = wd.record_path(g.spec["engine"], g.node_dir)
                recs = wd.read_records(path)
                if wd.served_again(recs, g.clock()):
                    wd.write_records(path, recs)
            elif err is not None and not served:
                if g.mono() > deadline:
                    raise Restart(f"the endpoint did not serve within {g.spec['ready_timeout_s']}s "
                                  f"({err})")
                err = None  # still coming up: not a wedge yet
        watch_workers(last, err)
        g.sleep(POLL)


def run_worker(g: Group) -> None:
    w = Watcher()
    following = None
    started = -1
    bad_since: float | None = None
    patience = g.policy.canary_s + 10 * POLL  # the head decides; this node only if it never does
    say(f"epoch {g.state['epoch']}: ready, waiting for the head")
    while True:
        h = peer(g, g.spec["head"])
        if following is None:
            if h is not None and h["stage"] >= 0 and h.get("accepting"):
                following = h["epoch"]
                g.set(following=following)
                say(f"following head epoch {following}")
        if following is not None:
            w.seen("head", h is not None, "the head does not answer")
            if h is not None:
                if h["epoch"] != following:
                    raise Restart("the head restarted")
                r = h.get("restarting")
                if isinstance(r, dict) and isinstance(r.get("id"), str):
                    g.save_logs(r["id"])
                    if r.get("gave_up"):
                        raise GaveUp(f"the head gave up: {r.get('why')}")
                    raise Restart(f"the head restarts the group: {r.get('why')}")
                while started < h["stage"]:
                    started += 1
                    g.start_stage(started)
                    g.set(stage=started)
            bad = g.check_mine(started)
            g.note_joined(started)
            if not bad:
                bad_since = None
            elif bad_since is None:
                bad_since = g.mono()
            elif g.mono() - bad_since > patience:
                raise Restart(f"{'; '.join(bad.values())}, and the head did not restart the group")
        g.sleep(POLL)


def cmd_run(spec: dict) -> int:
    try:
        key = read_key(spec["key"])
    except (OSError, KeyError, ValueError) as e:
        say(f"error: no group key: {e}")
        return 2
    g = Group(spec, key)

    def on_term(signum, frame) -> None:
        g.stopping = True
        say("stopping: removing this node's containers")
        g.remove_mine()
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    g.adopted = g.adopt(read_once(adopt_path(spec)))
    if not g.adopted:
        g.remove_mine()
    srv = g.serve()
    try:
        (run_head if spec["role"] == "head" else run_worker)(g)
    except Restart as e:
        say(f"restarting the group: {e}")
        srv.shutdown()
        g.remove_mine()
        if e.wait_s > 0:
            say(f"backoff: {e.wait_s:.0f}s before the group starts again")
            time.sleep(e.wait_s)
        return 1
    except GaveUp as e:
        g.remove_mine()
        say(f"given up, the group stays down: {e} (serve.status shows the record)")
        while True:  # active, so systemd does not restart it; `systemctl stop` ends it
            time.sleep(3600)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="serve_unit.py")
    p.add_argument("cmd", choices=["run", "stop"])
    p.add_argument("--spec", required=True)
    a = p.parse_args(argv)
    with open(a.spec) as f:
        spec = json.load(f)
    if a.cmd == "stop":
        Group(spec).remove_mine()
        return 0
    return cmd_run(spec)


if __name__ == "__main__":
    sys.exit(main())
