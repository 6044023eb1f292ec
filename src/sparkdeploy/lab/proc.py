"""Running commands, and processes the lab started: recorded by PID plus start time."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from sparkdeploy.core.wait import WaitTimeout, wait_for


class LabError(Exception):
    """Something the lab could not do; ``str()`` is one line for the user."""


def run(argv: Sequence[str], *, check: bool = True, input: str | bytes | None = None,
        timeout: float | None = 600, env: dict[str, str] | None = None,
        cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run argv (no shell), capture output; on failure raise LabError naming the command."""
    text = not isinstance(input, bytes)
    try:
        cp = subprocess.run(list(argv), capture_output=True, input=input, timeout=timeout,
                            env=env, cwd=cwd, text=text, preexec_fn=_die_with_parent)
    except FileNotFoundError:
        raise LabError(f"{argv[0]}: command not found") from None
    except subprocess.TimeoutExpired:
        raise LabError(f"timed out after {timeout}s: {' '.join(argv)}") from None
    if check and cp.returncode != 0:
        err = cp.stderr if text else cp.stderr.decode(errors="replace")
        lines = [ln for ln in (err or "").strip().splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit code {cp.returncode}"
        raise LabError(f"{' '.join(argv[:6])}{' ...' if len(argv) > 6 else ''}: {why}")
    return cp


def _die_with_parent() -> None:
    """A command we wait for gets SIGTERM when the thread that started it dies (a killed
    ``lab.up`` leaves no debootstrap or apt-get running)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def remove_tree(path: Path) -> None:
    """rm -rf a directory of ours, first unmounting anything left mounted under it
    (debootstrap mounts /proc and /sys in its target; a killed run may leave them)."""
    path = Path(path)
    if not path.exists():
        return
    prefix = os.path.realpath(path) + "/"
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].replace("\\040", " ")
        if mp.startswith(prefix):
            mounts.append(mp)
    for mp in sorted(mounts, key=len, reverse=True):
        run(["umount", "-l", mp], check=False)
    run(["rm", "-rf", "--one-file-system", str(path)])


def pid_of_tmp(path: Path) -> int | None:
    """The PID in a ``name.<pid>.tmp`` path, if any."""
    parts = Path(path).name.split(".")
    if len(parts) >= 3 and parts[-1] == "tmp" and parts[-2].isdigit():
        return int(parts[-2])
    return None


def clean_stale_tmp(parent: Path, stem: str) -> None:
    """Remove ``stem.<pid>.tmp`` leftovers whose process is gone."""
    for p in Path(parent).glob(f"{stem}.*.tmp"):
        pid = pid_of_tmp(p)
        if pid is not None and pid != os.getpid() and start_time(pid) is None:
            if p.is_dir():
                remove_tree(p)
            else:
                p.unlink(missing_ok=True)


def in_node(mntns: Path | str, netns: Path | str, argv: Sequence[str]) -> list[str]:
    """argv entering a node's mount and network namespaces (never ``ip netns exec``)."""
    return ["nsenter", f"--mount={mntns}", f"--net={netns}", *argv]


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2:].split()[19])


def alive(rec: dict | None) -> bool:
    """True when a recorded process still runs (same PID *and* same start time, not a zombie)."""
    if not rec or not rec.get("pid"):
        return False
    pid = int(rec["pid"])
    st = start_time(pid)
    if st is None or st != rec.get("start"):
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def record(pid: int, **extra) -> dict:
    return {"pid": pid, "start": start_time(pid), **extra}


def spawn(argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> dict:
    """Start a daemon detached from us (own session), output to ``log``; return its record.

    ``nsenter`` execs its command, so the PID is the daemon's own.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        p = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=fh, stderr=fh,
                             start_new_session=True, env=env, close_fds=True)
    # nsenter may not have exec'd yet; wait until the command name changes from nsenter
    _quietly(lambda: _comm(p.pid) != "nsenter", 5, 0.02)
    rec = record(p.pid, argv=list(argv), log=str(log))
    _children_reaper(p)
    return rec


_POPENS: list[subprocess.Popen] = []


def _children_reaper(p: subprocess.Popen) -> None:
    # keep a reference so Python does not warn; the daemon outlives us in its own session
    _POPENS.append(p)


def reap_exited() -> None:
    for p in list(_POPENS):
        if p.poll() is not None:
            _POPENS.remove(p)


def stop(rec: dict | None, timeout: float = 15) -> bool:
    """SIGTERM a recorded process, wait, then SIGKILL. True if it was running.

    A daemon of ours (started by ``spawn`` in this process) is waited for, so it leaves no
    zombie in ``/proc``, also when it dies late; one that already died is reaped here too."""
    if rec is None or not alive(rec):
        reap_exited()
        return False
    pid = int(rec["pid"])
    _signal(pid, signal.SIGTERM)
    if _ended(rec, timeout):
        return True
    _signal(pid, signal.SIGKILL)
    # a process in uninterruptible sleep (a daemon's unmounts on a busy disk) dies when it
    # wakes: wait for that, not only for the signal
    _ended(rec, KILLED_WAIT_S)
    return True


KILLED_WAIT_S = 120
"""How long a SIGKILLed process may take to leave (uninterruptible sleep ends first)."""


def _ended(rec: dict, deadline: float) -> bool:
    """Wait up to ``deadline`` s for a recorded process to end. Our own child is waited for
    (``waitpid``), which reaps it; any other is polled. True once it has gone."""
    own = next((p for p in _POPENS if p.pid == rec["pid"]), None)
    if own is None:
        return _quietly(lambda: not alive(rec), deadline, 0.1)
    try:
        own.wait(timeout=deadline)
    except subprocess.TimeoutExpired:
        return False
    _POPENS.remove(own)
    return True


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _quietly(probe, deadline: float, interval: float) -> bool:
    """``wait_for`` that answers False on timeout instead of raising."""
    try:
        return bool(wait_for(probe, deadline=deadline, interval=interval))
    except WaitTimeout:
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def ns_inode(path: Path | str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def pids_in_ns(kind: str, inode: int) -> list[int]:
    """PIDs whose ``/proc/PID/ns/<kind>`` (``net`` or ``mnt``) is the namespace ``inode``."""
    want = f"{kind}:[{inode}]"
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{d}/ns/{kind}") == want:
                out.append(int(d))
        except OSError:
            continue
    return out


def kill_pids(pids: Sequence[int], timeout: float = 10) -> list[int]:
    """TERM then KILL exactly these PIDs (found by namespace, recorded); return those signalled.
    Those that were our own children are waited for, so none stays a zombie."""
    recs = [r for r in (record(p) for p in pids) if r["start"] is not None]
    for r in recs:
        _signal(r["pid"], signal.SIGTERM)
    _quietly(lambda: not any(alive(r) for r in recs), timeout, 0.1)
    for r in recs:
        if alive(r):
            _signal(r["pid"], signal.SIGKILL)
    end = time.monotonic() + KILLED_WAIT_S
    for r in recs:
        _ended(r, max(0.0, end - time.monotonic()))
    reap_exited()
    return [r["pid"] for r in recs]
