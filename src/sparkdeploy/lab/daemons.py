"""Lab daemons in the controller's (root) namespace and the lab's ``env`` file.

The model hub and the package index run here, on the controller's management address. Each is
recorded under ``controller_procs`` in the lab state, so ``lab.down`` stops it by PID; it is
restarted when its argv changed (another address, another checkout) or it died.
"""

from __future__ import annotations

from collections.abc import Callable

from sparkdeploy.core.files import write_if_changed
from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.core.wait import Stop, WaitTimeout, wait_for
from sparkdeploy.lab import keys, layout, proc
from sparkdeploy.lab import state as lab_state
from sparkdeploy.lab.proc import LabError


def ensure_daemon(st: dict, name: str, argv: list[str], ready: Callable[[], bool],
                  timeout: float = 30) -> Result:
    procs = st.setdefault("controller_procs", {})
    cur = procs.get(name)
    if proc.alive(cur) and cur.get("argv") == argv and ready():
        return Result(name, Status.OK, f"running (pid {cur['pid']})")
    was = proc.stop(cur)
    rec = proc.spawn(argv, layout.LAB_DIR / "log" / f"{name}.log")
    procs[name] = rec
    lab_state.save(st)

    def probe() -> bool:
        if ready():
            return True
        if not proc.alive(rec):
            raise Stop
        return False

    try:
        wait_for(probe, deadline=timeout, interval=0.2, what=f"{name} to answer")
    except (WaitTimeout, Stop):
        raise LabError(f"{name} did not get ready (see {rec['log']})") from None
    return Result(name, Status.CHANGED, f"{'restarted' if was else 'started'} (pid {rec['pid']})")


def set_env(st: dict, **values: str) -> bool:
    """Add variables to the lab's ``env`` file (HF_ENDPOINT, PIP_INDEX_URL)."""
    extra = {**st.get("env_extra", {}), **values}
    st["env_extra"] = extra
    lab_state.save(st)
    return write_if_changed(layout.ENV_FILE, keys.env_text(extra))
