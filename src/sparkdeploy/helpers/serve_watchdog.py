"""The watchdog that knows alive from serving (standard library only).

One module, three users: the persisted supervisors (``serve_unit.py`` imports it from beside
itself on the node), ``inv serve.watch`` on the controller (imports it as
``sparkdeploy.helpers.serve_watchdog``), and the node side of ``serve.watch`` (run as a helper:
the subcommands below).

A **wedge** is what ``Restart=on-failure`` never sees: a canary (a short streamed completion
against the endpoint) that brings no token within its deadline, or a rank whose engine is
gone, stopped (state ``T``: SIGSTOP, a debugger; ``docker pause``) or a zombie while its
container still "runs". ``wedge()`` decides from what was seen; ``rank_problem()`` reads one
rank; ``next_restart()`` applies the budget (at most ``max_restarts`` restarts within
``window_s``) and the backoff (the n-th restart in the window waits ``backoff_s * 2**(n-1)``,
at most ``backoff_max_s``, after the one before).

**The restart record** lives on the head node (any controller reads it there):
``<NODE_DIR>/<engine>.restarts.json`` = ``{"restarts": [entry, ...]}``, the last ``KEEP``
entries, oldest first. An entry::

    {"id": "20261204T051000Z-1a2b",  # the restart's id (its logs' directory name)
     "at": "2026-12-04T05:10:00Z",   # when the wedge was found (UTC)
     "t": 1764825000.0,              # the same, in seconds since the epoch
     "by": "sparkdeploy-sglang.service" or "serve.watch",
     "engine": "sglang",
     "kind": "canary" | "rank",      # what saw it
     "why": "spark2: sparkdeploy-sglang-worker stopped (state T: pid 4242)",
     "evidence": ["...", ...],       # the lines that show it (at most MAX_EVIDENCE)
     "class": "unknown" | a diagnose class | null (not classified yet),
     "logs": {"spark1": "/var/lib/sparkdeploy-node/serve/logs/<id>", ...},
     "restart": 1,                   # the n-th restart within the window
     "backoff_s": 0.0,               # how long it waited before restarting
     "outcome": "restarted" | "gave-up",
     "served_again_after_s": 41.2 or null}  # from the wedge found to the canary's next token

Every node saves its own engine containers' logs under ``<NODE_DIR>/logs/<id>/`` (the last
``LOG_LINES`` lines of each, at most ``LOG_BYTES``; the last ``KEEP_LOGS`` restarts kept).

Subcommands (each prints one JSON object):

  ranks --docker ARG ... --name C ...
      {"ranks": {C: null (serving) | "what is wrong"}} for the named containers.
  save-logs --docker ARG ... --name C ... --id ID [--dir D]
      {"dir": D/logs/ID, "files": [...]}: the containers' logs saved there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

try:  # in the package (the controller, the tests)
    from . import protocol
except ImportError:  # a script: protocol.py beside it (installed with the unit, a checkout) or a directory up
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [_here, os.path.dirname(_here)]
    import protocol  # type: ignore[import-not-found, no-redef]

NODE_DIR = "/var/lib/sparkdeploy-node/serve"
KEEP = 20
KEEP_LOGS = 5
LOG_LINES = 2000
LOG_BYTES = 1 << 20
MAX_EVIDENCE = 8


# --- the policy ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    watch_s: float = 30.0
    """How often the canary runs and the ranks are read."""
    canary_s: float = 30.0
    """How long the canary may take to bring its first token."""
    max_restarts: int = 3
    window_s: float = 3600.0
    backoff_s: float = 30.0
    backoff_max_s: float = 600.0

    @classmethod
    def of(cls, d: dict) -> Policy:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


# --- one rank -------------------------------------------------------------------------------------


def proc_stat(pid: int, proc: str = "/proc") -> tuple[str, int] | None:
    """(state letter, parent pid) of a process, None when it is gone."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    if len(fields) < 2 or not fields[1].lstrip("-").isdigit():
        return None
    return fields[0], int(fields[1])


def process_tree(pid: int, proc: str = "/proc") -> dict[int, str]:
    """{pid: state} of ``pid`` and its descendants ({} when ``pid`` is gone)."""
    top = proc_stat(pid, proc)
    if top is None:
        return {}
    children: dict[int, list[int]] = {}
    states = {pid: top[0]}
    for name in os.listdir(proc):
        if name.isdigit() and int(name) != pid:
            st = proc_stat(int(name), proc)
            if st is not None:
                children.setdefault(st[1], []).append(int(name))
                states[int(name)] = st[0]
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        if p in out:
            continue
        out[p] = states[p]
        todo += children.get(p, [])
    return out


def rank_problem(status: str, exit_code: int, main_pid: int, procs: dict[int, str]) -> str | None:
    """None when the rank's engine runs; else what is wrong with it, in words.

    ``status``/``exit_code``/``main_pid``: the container's (``docker inspect``); ``procs``: its
    process tree ({pid: state}, ``process_tree``)."""
    if status == "paused":
        return "paused (every process frozen)"
    if status != "running":
        return f"{status or 'gone'} (exit code {exit_code})"
    if main_pid <= 0 or main_pid not in procs:
        return "its engine process is gone"
    if procs[main_pid] in ("Z", "X"):
        return f"its engine process is a zombie (pid {main_pid})"
    stopped = sorted(p for p, s in procs.items() if s in ("T", "t"))
    if stopped:
        more = f" +{len(stopped) - 3}" if len(stopped) > 3 else ""
        return f"stopped (state T: pid {', '.join(map(str, stopped[:3]))}{more})"
    return None


def inspect_ranks(docker: list[str], names: list[str], proc: str = "/proc",
                  run=subprocess.run) -> dict[str, str | None]:
    """{container: None | what is wrong} for the named containers on this node."""
    r = run([*docker, "inspect", "--format",
             "{{.Name}}|{{.State.Status}}|{{.State.ExitCode}}|{{.State.Pid}}", *names],
            capture_output=True, text=True, timeout=60)
    seen: dict[str, tuple[str, int, int]] = {}
    for line in r.stdout.splitlines():
        parts = line.strip().lstrip("/").split("|")
        if len(parts) == 4 and parts[2].lstrip("-").isdigit() and parts[3].isdigit():
            seen[parts[0]] = (parts[1], int(parts[2]), int(parts[3]))
    out: dict[str, str | None] = {}
    for n in names:
        status, code, pid = seen.get(n, ("gone", -1, 0))
        out[n] = rank_problem(status, code, pid, process_tree(pid, proc) if pid > 0 else {})
    return out


# --- the decisions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Wedge:
    kind: str  # "canary" | "rank"
    why: str
    evidence: list[str]


def wedge(canary_error: str | None, ranks: dict[str, str | None]) -> Wedge | None:
    """A wedge from one look (None: serving). ``canary_error``: None when the canary brought a
    token in time, else why not; ``ranks``: {"node: container": None | what is wrong}. A rank
    that is wrong is named first: it is the cause of a canary that brings nothing."""
    bad = [f"{n} {p}" for n, p in sorted(ranks.items()) if p]
    if bad:
        ev = bad + ([f"canary: {canary_error}"] if canary_error else [])
        return Wedge("rank", "; ".join(bad), ev[:MAX_EVIDENCE])
    if canary_error is not None:
        return Wedge("canary", f"canary: {canary_error}", [f"canary: {canary_error}"])
    return None


def recent(records: list[dict], now: float, window_s: float) -> list[dict]:
    """The restarts within the window (the budget counts them)."""
    return [r for r in records if r.get("outcome") == "restarted"
            and now - float(r.get("t", 0)) < window_s]


def next_restart(records: list[dict], now: float, policy: Policy) -> tuple[bool, float, int]:
    """(restart?, how long to wait first, which restart in the window it is).

    False when ``max_restarts`` restarts happened within ``window_s`` already (the budget is
    spent: the watchdog gives up and says so). The first restart in a window waits nothing, the
    n-th ``backoff_s * 2**(n-2)`` (at most ``backoff_max_s``) counted from the one before."""
    past = recent(records, now, policy.window_s)
    n = len(past) + 1
    if n > policy.max_restarts:
        return False, 0.0, n
    if n == 1:
        return True, 0.0, n
    wait = min(policy.backoff_s * 2 ** (n - 2), policy.backoff_max_s)
    since = now - float(past[-1].get("t", now))
    return True, max(0.0, wait - since), n


def stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def restart_id(t: float, salt: str) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t)) + "-" + salt


def entry(w: Wedge, *, rid: str, t: float, by: str, engine: str, n: int, backoff_s: float,
          gave_up: bool, logs: dict[str, str], cls: str | None = None) -> dict:
    """One restart record (the shape the module's docstring gives)."""
    return {"id": rid, "at": stamp(t), "t": round(t, 3), "by": by, "engine": engine,
            "kind": w.kind, "why": w.why, "evidence": w.evidence[:MAX_EVIDENCE], "class": cls,
            "logs": logs, "restart": n, "backoff_s": round(backoff_s, 1),
            "outcome": "gave-up" if gave_up else "restarted", "served_again_after_s": None}


# --- the record on the node -----------------------------------------------------------------------


def record_path(engine: str, node_dir: str = NODE_DIR) -> str:
    return f"{node_dir}/{engine}.restarts.json"


def parse_records(text: str) -> list[dict]:
    """The entries of a record file's text ([] when it is not one)."""
    try:
        data = json.loads(text)
    except ValueError:
        return []
    got = data.get("restarts") if isinstance(data, dict) else None
    return [r for r in got if isinstance(r, dict)] if isinstance(got, list) else []


def read_records(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return parse_records(f.read())
    except OSError:
        return []


def records_text(records: list[dict]) -> str:
    return json.dumps({"restarts": records[-KEEP:]}, indent=1, sort_keys=True) + "\n"


def write_records(path: str, records: list[dict]) -> None:
    """Atomically (``protocol.write_atomic``: a part file renamed over the record)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    protocol.write_atomic(path, records_text(records), 0o644)


def served_again(records: list[dict], t: float) -> bool:
    """The latest restart's ``served_again_after_s`` set (from its wedge to ``t``), if unset;
    True when it changed."""
    if not records or records[-1].get("outcome") != "restarted" \
            or records[-1].get("served_again_after_s") is not None:
        return False
    records[-1]["served_again_after_s"] = round(t - float(records[-1].get("t", t)), 1)
    return True


# --- the logs on the node -------------------------------------------------------------------------


def save_logs(docker: list[str], names: list[str], rid: str, node_dir: str = NODE_DIR,
              run=subprocess.run) -> tuple[str, list[str]]:
    """Each container's last LOG_LINES lines (at most LOG_BYTES) in ``<node_dir>/logs/<rid>/``;
    only the last KEEP_LOGS restarts' directories are kept. (directory, files)."""
    base = os.path.join(node_dir, "logs")
    d = os.path.join(base, rid)
    os.makedirs(d, mode=0o700, exist_ok=True)
    files = []
    for n in names:
        try:
            r = run([*docker, "logs", "--timestamps", "--tail", str(LOG_LINES), n],
                    capture_output=True, timeout=120)
            data = (r.stdout or b"") + (r.stderr or b"")
        except (OSError, subprocess.TimeoutExpired) as e:
            data = f"(docker logs failed: {e})\n".encode()
        path = os.path.join(d, f"{n}.log")
        with open(path, "wb") as f:
            f.write(data[-LOG_BYTES:])
        files.append(path)
    dirs = sorted(x for x in os.listdir(base) if os.path.isdir(os.path.join(base, x)))
    for old in dirs[:-KEEP_LOGS]:
        for x in os.listdir(os.path.join(base, old)):
            os.unlink(os.path.join(base, old, x))
        os.rmdir(os.path.join(base, old))
    return d, files


# --- the canary (the supervisors' side; the controller uses sparkdeploy.node.endpoint) --------------


def canary(host: str, port: int, model: str, deadline_s: float, key: str | None = None,
           clock=time.monotonic) -> str | None:
    """One short streamed chat completion: None when a token came within ``deadline_s``, else
    why not. The key (when given) only in the Authorization header."""
    import http.client  # noqa: PLC0415

    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 2, "stream": True})
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    end = clock() + deadline_s
    conn = http.client.HTTPConnection(host, port, timeout=deadline_s)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            return f"HTTP {resp.status}"
        while True:
            left = end - clock()
            if left <= 0:
                return f"no token within {deadline_s:g}s"
            if conn.sock is not None:
                conn.sock.settimeout(left)
            line = resp.fp.readline(65536)
            if not line:
                return "the stream ended without a token"
            if _has_token(line):
                return None
    except TimeoutError:
        return f"no token within {deadline_s:g}s"
    except (OSError, http.client.HTTPException) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def _has_token(line: bytes) -> bool:
    """A chunk that shows the engine generated: text (or reasoning), or a ``finish_reason`` (the
    answer ended, at its length or at the model's own end). Two tokens may both be bytes of one
    character the engine holds back (vLLM sends them as empty ``content``): the finish still says
    they were generated."""
    if not line.startswith(b"data: {"):
        return False
    try:
        chunk = json.loads(line[6:])
    except ValueError:
        return False
    for c in chunk.get("choices") or []:
        d = c.get("delta") or {}
        if d.get("content") or d.get("reasoning_content") or c.get("finish_reason"):
            return True
    return False


# --- the helper's command line --------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="serve_watchdog.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("ranks", "save-logs"):
        s = sub.add_parser(name)
        s.add_argument("--docker", action="append", required=True)
        s.add_argument("--name", action="append", required=True)
        if name == "save-logs":
            s.add_argument("--id", required=True)
            s.add_argument("--dir", default=NODE_DIR)
    a = p.parse_args(argv)
    if a.cmd == "ranks":
        print(json.dumps({"ranks": inspect_ranks(a.docker, a.name)}))
        return 0
    if "/" in a.id or a.id.startswith("."):
        print("error: --id: a plain name", file=sys.stderr)
        return 2
    d, files = save_logs(a.docker, a.name, a.id, a.dir)
    print(json.dumps({"dir": d, "files": files}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
