"""``up``, ``down`` and ``status`` for the lab. Each returns Results and never prints; each runs
through ``run_one`` (the one way to run a step) and emits every Result on the ``EventSink`` it is
given as it happens, and a heartbeat during long phases."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from sparkdeploy.core import threads
from sparkdeploy.core.events import EventSink
from sparkdeploy.core.files import write_if_changed
from sparkdeploy.core.outcomes import Result, Status
from sparkdeploy.core.wait import Stop, WaitTimeout, wait_for
from sparkdeploy.lab import (
    dockerd,
    glm,
    image,
    internet,
    keys,
    layout,
    node,
    packages,
    proc,
    prometheus,
    standins_install,
)
from sparkdeploy.lab import state as lab_state
from sparkdeploy.lab.heartbeat import Heartbeat
from sparkdeploy.lab.layout import AddressPlan
from sparkdeploy.lab.proc import LabError
from sparkdeploy.steps.registry import StepContext, run_one


def preflight() -> str | None:
    """Why the lab cannot run here, or None."""
    if not os.uname().sysname == "Linux":
        return "the lab needs Linux (network and mount namespaces)"
    if os.geteuid() != 0:
        return "the lab needs root (namespaces, bridges, mounts)"
    return None


class _Run:
    """What one ``lab.up`` needs while it works: the results so far (each emitted as it lands),
    the state, the heartbeat naming the phase, and the slow cache builds started early."""

    def __init__(self, ctx: StepContext, beat: Heartbeat, st: dict, names: list[str],
                 flavor: str, jobs: dict[str, Future]):
        self.ctx, self.beat, self.st, self.names = ctx, beat, st, names
        self.flavor, self.jobs = flavor, jobs
        self.results: list[Result] = []
        self.plan: AddressPlan | None = None

    def add(self, r: Result) -> Result:
        self.results.append(r)
        return self.ctx.report(r)

    def save(self) -> None:
        lab_state.save(self.st)

    def join(self, name: str, step: str) -> None:
        """Wait for a background job (heartbeat lines while it runs) and add its result."""
        with self.beat.phase(step, note=f"waiting for {name}"):
            did, why = self.jobs[name].result()
        self.add(Result(step, Status.CHANGED if did else Status.OK, why))


def up(nodes: int = 2, flavor: str = layout.DEFAULT_DOCKERD, seed_worker: bool = False,
       mgmt_net: str | None = None, events: EventSink | None = None,
       real_engine: bool = False) -> list[Result]:
    """Bring the lab up (idempotent). ``mgmt_net``: None keeps the recorded management /24
    (or picks the first that does not clash), ``"fallback"`` forces the first fallback, a
    candidate CIDR picks that one; a lab on another /24 is moved in place. ``real_engine``:
    the real vLLM's image on the head too (``images.REAL_VLLM``). Each result is on
    ``events`` (a stream of its own when None) as it happens."""
    return run_one(None, "lab.up", events=events, body=_up_lab, nodes=nodes, flavor=flavor,
                   seed_worker=seed_worker, mgmt_net=mgmt_net, real_engine=real_engine)


def _up_lab(ctx: StepContext, nodes: int, flavor: str, seed_worker: bool,
            mgmt_net: str | None, real_engine: bool = False) -> None:
    events = ctx.events
    why = preflight()
    if why:
        ctx.failed(why)
        return
    if nodes < 1 or nodes > 9:
        ctx.failed(f"--nodes must be 1..9, not {nodes}")
        return
    try:
        flavors = layout.node_dockerds(flavor, nodes)
    except ValueError as e:
        ctx.failed(str(e))
        return
    events.log("lab.up", None, f"{nodes} node(s), dockerd {flavor}; state in {layout.LAB_DIR}")
    t0 = time.monotonic()
    pool = threads.pool(4)
    with Heartbeat(events) as beat:
        run = _Run(ctx, beat, {}, layout.node_names(nodes), flavor, {})
        try:
            with lab_state.locked():
                run.st = lab_state.load()
                layout.LAB_DIR.mkdir(parents=True, exist_ok=True)
                _packages(run)
                # start the slow cache builds now; each is joined before it is needed
                run.jobs["debootstrap"] = pool.submit(image.ensure_base_tarball)
                if set(flavors) != {"classic20"}:
                    run.jobs["docker26"] = pool.submit(dockerd.ensure_docker26)
                run.jobs["wheels"] = pool.submit(internet.prefetch, real_engine)
                run.jobs["prometheus"] = pool.submit(prometheus.ensure_cached)
                _up(run, mgmt_net, seed_worker, real_engine)
        except LabError as e:
            run.add(Result("lab.up", Status.FAILED, str(e)))
        else:
            run.add(Result("lab.up", Status.OK, f"done in {time.monotonic() - t0:.0f}s", None,
                           {"seconds": round(time.monotonic() - t0, 1)}))
        finally:
            with beat.phase("lab.up", note="waiting for background jobs to end"):
                pool.shutdown(wait=True, cancel_futures=True)


def _packages(run: _Run) -> None:
    with run.beat.phase("packages", note="apt-get"):
        got = packages.ensure()
    run.add(Result("packages", Status.CHANGED, "installed " + " ".join(got)) if got
            else Result("packages", Status.OK, "all present"))


def _up(run: _Run, mgmt_net: str | None, seed_worker: bool, real_engine: bool) -> None:
    _addresses(run, mgmt_net)
    _drop_extra_nodes(run)
    made = keys.ensure_keys(run.names)
    run.add(Result("keys", Status.CHANGED, "generated " + ", ".join(made)) if made
            else Result("keys", Status.OK, "present"))
    _networks(run)
    _ssh_and_daemons(run)
    _images(run)
    run.add(_ensure_glm(run.names[0]))
    _internet(run, seed_worker, real_engine)
    # the proof: controller -> every node over ssh with host key checking on
    for x in run.names:
        run.add(_check_ssh(x))


def _addresses(run: _Run, mgmt_net: str | None) -> None:
    st = run.st
    try:
        plan, why = layout.plan_addresses(layout.machine_routes(), st.get("mgmt_net"), mgmt_net)
    except ValueError as e:
        raise LabError(str(e)) from None
    node.check_no_clash_with_root(plan)
    moved = st.get("mgmt_net") not in (None, plan.mgmt_net)
    first = st.get("mgmt_net") is None
    st.update(mgmt_net=plan.mgmt_net, fast_net=plan.fast_net, controller=plan.controller)
    run.save()
    run.plan = plan
    run.add(Result("addresses", Status.CHANGED if first or moved else Status.OK, why, None,
                   {"mgmt": plan.mgmt_net, "fast": plan.fast_net}))
    wrote = write_if_changed(layout.PROFILE_OVERLAY, internet.profile_overlay(plan.controller))
    run.add(Result("profile.overlay", Status.CHANGED if wrote else Status.OK,
                   f"{layout.PROFILE_OVERLAY}: hub and index on {plan.controller}"))


def _drop_extra_nodes(run: _Run) -> None:
    """Nodes beyond --nodes from an earlier run go away first."""
    st = run.st
    for x in [x for x in st["nodes"] if x not in run.names]:
        _down_node(x, st)
        proc.remove_tree(layout.node_dir(x))
        st["nodes"].pop(x, None)
        run.save()
        run.add(Result("node", Status.CHANGED, "removed (beyond --nodes)", x))


def _networks(run: _Run) -> None:
    plan, st = run.plan, run.st
    assert plan is not None
    run.add(Result("network.mgmt", Status.CHANGED if node.ensure_mgmt_bridge(plan) else Status.OK,
                   f"{layout.MGMT_BRIDGE} {plan.controller}/{plan.prefix}"))
    for x in run.names:
        run.add(_ensure_node(x, st, plan))
    topo = node.fast_topology(len(run.names))
    made = node.ensure_fast(run.names, plan)
    st["fast_topology"] = topo
    run.save()
    desc = (f"{topo} {layout.FAST_BRIDGE} in netns {layout.FAST_NETNS}: " if topo != "none"
            else "none: ") + ", ".join(f"{x} {layout.FAST_IF} {plan.fast_addr(x)}"
                                        for x in run.names)
    run.add(Result("network.fast", Status.CHANGED if made else Status.OK, f"{desc} mtu {layout.FAST_MTU}"
                                      + (f"; made {', '.join(made)}" if made else "")))


def _ensure_node(x: str, st: dict, plan: AddressPlan) -> Result:
    """A node's namespaces, private mounts and management link."""
    rec = st["nodes"].setdefault(x, {"procs": {}})
    rec.update(netns=layout.netns_name(x), mntns=str(layout.mntns_path(x)),
               mgmt_if=layout.MGMT_IF, mgmt_addr=plan.mgmt_addr(x),
               fast_if=layout.FAST_IF, fast_addr=plan.fast_addr(x),
               docker_socket=layout.docker_socket(x), dir=str(layout.node_dir(x)))
    lab_state.save(st)
    what = []
    if not rec["procs"]:
        # no record of this node's daemons (state lost, or an older lab): whatever runs
        # in its namespaces was started by a lab, and would hold its ports
        n_old = _sweep_node(x)
        if n_old:
            what.append(f"ended {n_old} unrecorded process(es) in it")
    if node.ensure_netns(layout.netns_name(x)):
        what.append("made netns")
    if node.ensure_mntns(x, st["created_paths"]):
        what.append("made mount ns")
    mounts = node.ensure_private_mounts(x, st["created_paths"])
    if node.ensure_private_shm(x):
        mounts.append(node.SHM)
    if mounts:
        what.append("mounted " + " ".join(mounts))
    if node.ensure_mgmt_link(x, plan):
        what.append(f"linked {layout.MGMT_IF} {plan.mgmt_addr(x)}")
    st["created_paths"] = sorted(set(st["created_paths"]))
    lab_state.save(st)
    return (Result("node", Status.CHANGED, ", ".join(what), x) if what
            else Result("node", Status.OK, f"namespaces, mounts, {layout.MGMT_IF} {plan.mgmt_addr(x)}", x))


def _ssh_and_daemons(run: _Run) -> None:
    plan, st, names = run.plan, run.st, run.names
    assert plan is not None
    files = keys.write_ssh_files(names, plan, fast=st["fast_topology"] != "none",
                                 env_extra=st.get("env_extra"))
    run.add(Result("ssh.files", Status.CHANGED, f"wrote {len(files)}: " + ", ".join(files[:4])
                    + (" ..." if len(files) > 4 else ""), None, {"files": files}) if files
            else Result("ssh.files", Status.OK, f"{layout.SSH_CONFIG}, known_hosts, node keys unchanged"))
    run.join("prometheus", "prometheus")
    for x in names:
        did = standins_install.install(x)
        if prometheus.install(standins_install.backing(x)):
            did = ", ".join(filter(None, [did, "bin/prometheus (Debian's)"]))
        run.add(Result("standins", Status.CHANGED, did, x) if did else Result("standins", Status.OK, "up to date", x))
    for x in names:
        with run.beat.phase("sshd", x):
            run.add(_ensure_sshd(x, st, plan))
    if "docker26" in run.jobs:
        run.join("docker26", "docker26")
    for x, flavor in zip(names, layout.node_dockerds(run.flavor, len(names)), strict=True):
        with run.beat.phase("dockerd", x):
            run.add(_ensure_dockerd(x, st, flavor))
    st["dockerd"] = run.flavor
    st.pop("engine", None)
    run.save()


def _images(run: _Run) -> None:
    run.join("debootstrap", "base.tarball")
    with run.beat.phase("base.image", note="docker import / save | load"):
        per = image.ensure_base_image(run.names)
    for x in run.names:
        msg = per[x]
        run.add(Result("base.image", Status.OK if msg == "ok" else Status.CHANGED,
                       layout.BASE_IMAGE + ("" if msg == "ok" else f" {msg}"), x))


def _internet(run: _Run, seed_worker: bool, real_engine: bool) -> None:
    """The closed internet (hub, package index) and the community images on the head."""
    plan, head = run.plan, run.names[0]
    assert plan is not None
    run.join("wheels", "wheels")
    with run.beat.phase("servers", note="model hub and package index"):
        for r in internet.ensure_servers(run.st, plan.controller):
            run.add(r)
    with run.beat.phase("community.images", head, note="docker build"):
        for r in internet.ensure_community_images(head, real_engine):
            run.add(r)
    if seed_worker:
        for x in run.names[1:]:
            with run.beat.phase("seed-worker", x, note="docker save | docker load"):
                run.add(internet.seed_worker(head, x))


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _ensure_sshd(x: str, st: dict, plan: AddressPlan) -> Result:
    procs = st["nodes"][x]["procs"]
    cfg = keys.sshd_config_path(x)
    h = _hash(cfg.read_text())
    cur = procs.get("sshd")
    if proc.alive(cur) and cur.get("config") == h and _port_open(plan.mgmt_addr(x), 22):
        return Result("sshd", Status.OK, f"running (pid {cur['pid']})", x)
    restarted = proc.stop(cur)
    if not Path("/run/sshd").exists():  # sshd's privilege separation dir
        Path("/run/sshd").mkdir(mode=0o755)
        st["created_paths"] = sorted(set(st["created_paths"]) | {"/run/sshd"})
    mnt, net = layout.mntns_path(x), layout.netns_path(x)
    rec = proc.spawn(proc.in_node(mnt, net, ["/usr/sbin/sshd", "-D", "-e", "-f", str(cfg)]),
                     layout.node_dir(x) / "log" / "sshd.log")
    rec["config"] = h
    procs["sshd"] = rec
    lab_state.save(st)

    def listening() -> bool:
        if _port_open(plan.mgmt_addr(x), 22):
            return True
        if not proc.alive(rec):
            raise Stop
        return False

    try:
        wait_for(listening, deadline=30, interval=0.1, what=f"{x}: sshd on port 22")
    except (WaitTimeout, Stop):
        raise LabError(f"{x}: sshd did not listen on {plan.mgmt_addr(x)}:22 "
                       f"(see {rec['log']})") from None
    return Result("sshd", Status.CHANGED, f"{'restarted' if restarted else 'started'} (pid {rec['pid']})", x)


def _port_open(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=1):
            return True
    except OSError:
        return False


def _ensure_dockerd(x: str, st: dict, flavor: str) -> Result:
    procs = st["nodes"][x]["procs"]
    mnt, net = layout.mntns_path(x), layout.netns_path(x)
    cur, ccur = procs.get("dockerd"), procs.get("containerd")
    want_c = flavor == "containerd"
    if (proc.alive(cur) and cur.get("argv") == dockerd.dockerd_argv(x, mnt, net, flavor)
            and (not want_c or (proc.alive(ccur) and ccur.get("argv")
                                == dockerd.containerd_argv(x, mnt, net, flavor)))
            and (want_c or ccur is None)
            and dockerd.info(x) is not None):
        return Result("dockerd", Status.OK, f"{flavor} running (pid {cur['pid']})", x)
    was = proc.stop(cur)
    proc.stop(ccur)
    procs.pop("containerd", None)
    lab_state.save(st)
    if want_c:
        procs["containerd"] = dockerd.start_containerd(x, mnt, net, flavor)
        lab_state.save(st)
    rec = dockerd.start_dockerd(x, mnt, net, flavor)
    procs["dockerd"] = rec
    lab_state.save(st)
    info = dockerd.info(x) or {}
    store = dict(info.get("DriverStatus") or []).get("driver-type", "classic store")
    return Result("dockerd", Status.CHANGED, f"{'restarted' if was else 'started'} {flavor}: Docker "
                   f"{info.get('ServerVersion', '?')}, {info.get('Driver', '?')}, {store} "
                   f"(pid {rec['pid']})", x)


def _ensure_glm(head: str) -> Result:
    """The GLM deployment the seed had to stop: four units enabled and running on the head,
    driven through the node's own systemctl stand-in inside its namespaces."""

    unit_dir = layout.node_dir(head) / layout.PRIVATE_MOUNTS[layout.UNIT_DIR]
    ctl = proc.in_node(layout.mntns_path(head), layout.netns_path(head),
                       [f"{layout.STANDIN_DIR}/bin/systemctl"])
    return glm.deploy_glm(unit_dir, ctl, {"PATH": layout.NODE_PATH},
                          gpu_user=f"{layout.STANDIN_DIR}/lib/gpu_user.py", node=head)


def standin_unit_pids(x: str) -> list[dict]:
    """Processes the systemctl stand-in recorded on a node (supervisors and their children)."""
    root = (layout.node_dir(x) / layout.PRIVATE_MOUNTS[layout.NODE_STATE_DIR] / "standins"
            / "systemctl" / "units")
    out = []
    for f in sorted(root.glob("*/*.json")) if root.exists() else []:
        if f.name not in ("main.json", "child.json"):
            continue
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("pid"):
            out.append({"pid": int(data["pid"]), "start": data.get("starttime")})
    return out


def _check_ssh(x: str) -> Result:
    cp = proc.run(ssh_argv(x, "true"), check=False, timeout=30)
    if cp.returncode != 0:
        lines = cp.stderr.strip().splitlines()
        return Result("ssh", Status.FAILED, f"ssh -F {layout.SSH_CONFIG} {x} true: "
                      f"{lines[-1] if lines else cp.returncode}", x)
    return Result("ssh", Status.OK, f"ssh -F {layout.SSH_CONFIG} {x} works (host key checked)", x)


def ssh_argv(x: str, *cmd: str) -> list[str]:
    return ["ssh", "-F", str(layout.SSH_CONFIG), "-o", "BatchMode=yes", "-o",
            "ConnectTimeout=10", x, "--", *cmd]


# --- down --------------------------------------------------------------------------------


def _known_nodes(st: dict) -> list[str]:
    found = set(st.get("nodes", {}))
    if layout.NS_DIR.exists():
        found |= {p.stem for p in layout.NS_DIR.glob("*.mnt")}
    netns_dir = Path("/var/run/netns")
    if netns_dir.exists():
        found |= {p.name.removeprefix("lab-") for p in netns_dir.glob("lab-spark*")}
    return sorted(found, key=lambda s: (len(s), s))


def _down_node(x: str, st: dict) -> list[str]:
    """Stop a node's processes (recorded ones, then any left in its namespaces), unmount,
    remove its namespaces and links. Returns what was done."""
    done = []
    procs = (st.get("nodes", {}).get(x) or {}).get("procs", {})
    for name in ("dockerd", "containerd", "sshd"):
        if proc.stop(procs.get(name)):
            done.append(f"stopped {name} ({procs[name]['pid']})")
    units = [r for r in standin_unit_pids(x)
             if r["start"] in (None, 0) or proc.start_time(r["pid"]) == r["start"]]
    units = [r for r in units if proc.start_time(r["pid"]) is not None]
    if units:
        proc.kill_pids([r["pid"] for r in units])
        done.append(f"stopped {len(units)} unit process(es) of the systemctl stand-in")
    n_left = _sweep_node(x)
    if n_left:
        done.append(f"ended {n_left} process(es) left in its namespaces")
    if node.unmount_ns(layout.mntns_path(x)):
        done.append("mount ns removed")
    if node.remove_node_net(x):
        done.append("netns removed")
    return done


def _sweep_node(x: str) -> int:
    """End every process inside a node's network or mount namespace (found by the namespace's
    inode, signalled by PID): all of them were started by the lab. Returns how many."""
    pids: set[int] = set()
    for kind, path in (("net", layout.netns_path(x)), ("mnt", layout.mntns_path(x))):
        ino = proc.ns_inode(path)
        if ino is not None and node.is_ns_mounted(Path(path)):
            pids |= set(proc.pids_in_ns(kind, ino))
    pids.discard(os.getpid())
    return len(proc.kill_pids(sorted(pids))) if pids else 0


def down(events: EventSink | None = None) -> list[Result]:
    """Stop what the lab started, remove what it made; each result on ``events`` as it
    happens."""
    return run_one(None, "lab.down", events=events, body=_down_lab)


def _down_lab(ctx: StepContext) -> None:
    events = ctx.events
    why = preflight()
    if why:
        ctx.failed(why)
        return
    def add(r: Result) -> None:
        ctx.report(r)

    try:
        with lab_state.locked(), Heartbeat(events) as beat, beat.phase("lab.down"):
            st = lab_state.load()
            names = _known_nodes(st)
            for name, rec in sorted(st.get("controller_procs", {}).items()):
                if proc.stop(rec):
                    add(Result(name, Status.CHANGED, f"stopped (pid {rec['pid']})"))
            for x in names:
                done = _down_node(x, st)
                add(Result("node", Status.CHANGED, "; ".join(done), x) if done
                    else Result("node", Status.OK, "nothing left", x))
            what = []
            if node.netns_exists(layout.FAST_NETNS) or Path(
                    f"/var/run/netns/{layout.FAST_NETNS}").exists():
                proc.run(["ip", "netns", "del", layout.FAST_NETNS], check=False)
                what.append(layout.FAST_NETNS)
            if node.remove_mgmt_bridge():
                what.append(layout.MGMT_BRIDGE)
            add(Result("network", Status.CHANGED, "removed " + ", ".join(what)) if what
                else Result("network", Status.OK, "nothing left"))
            removed = []
            for p in sorted(st.get("created_paths", []), key=len, reverse=True):
                try:
                    os.rmdir(p)
                    removed.append(p)
                except OSError:
                    pass
            leftover = [m for m in node.root_mounts() if m.startswith(str(layout.LAB_DIR) + "/")]
            for m in sorted(leftover, key=len, reverse=True):
                proc.run(["umount", "-l", m], check=False)
            if layout.LAB_DIR.exists():
                shutil.rmtree(layout.LAB_DIR)
                removed.append(str(layout.LAB_DIR))
            add(Result("data", Status.CHANGED, "removed " + ", ".join(removed)) if removed
                else Result("data", Status.OK, "nothing left"))
    except LabError as e:
        add(Result("lab.down", Status.FAILED, str(e)))


# --- status ------------------------------------------------------------------------------


def status(events: EventSink | None = None) -> list[Result]:
    """The lab's nodes, addresses, daemons and images; each result on ``events``."""
    def body(ctx: StepContext) -> None:
        for r in _status():
            ctx.report(r)

    return run_one(None, "lab.status", events=events, body=body)


def _status() -> list[Result]:
    why = preflight()
    if why:
        return [Result("lab.status", Status.FAILED, why)]
    try:
        st = lab_state.load()
    except LabError as e:
        return [Result("lab.status", Status.FAILED, str(e))]
    if not st["nodes"]:
        return [Result("lab", Status.SKIPPED, "not up (no state in " + str(layout.STATE_FILE) + ")")]
    out = [Result("lab", Status.OK, f"dockerd {_flavor(st)}, management {st.get('mgmt_net')} "
              f"(controller {st.get('controller')}), fast link {st.get('fast_topology')} "
              f"{st.get('fast_net')}; ssh -F {layout.SSH_CONFIG}")]
    for name, p in sorted(st.get("controller_procs", {}).items()):
        live = proc.alive(p)
        out.append(Result(name, Status.OK if live else Status.FAILED, f"{'alive' if live else 'dead'} "
                                            f"(pid {p.get('pid')}) on the controller"))
    for x, rec in sorted(st["nodes"].items()):
        addrs = node.node_addresses(x) if node.netns_exists(layout.netns_name(x)) else {}
        a = ", ".join(f"{k} {' '.join(v)}" for k, v in sorted(addrs.items())) or "no netns"
        out.append(Result("node", Status.OK if addrs else Status.FAILED, a, x, {"addresses": addrs}))
        for name, p in sorted(rec.get("procs", {}).items()):
            live = proc.alive(p)
            out.append(Result(name, Status.OK if live else Status.FAILED,
                              f"{'alive' if live else 'dead'} (pid {p.get('pid')})", x))
        imgs = image.images(x)
        out.append(Result("images", Status.OK, "; ".join(imgs) if imgs else "none (or dockerd down)", x,
                          {"images": imgs}))
    return out


def _flavor(st: dict) -> str | None:
    return st.get("dockerd") or st.get("engine")  # "engine": what labs before the rename recorded


def lab_facts() -> dict[str, Any]:
    """What tests and other tools need: node names, addresses, ssh_config path."""
    st = lab_state.load()
    return {
        "nodes": sorted(st["nodes"], key=lambda s: (len(s), s)),
        "ssh_config": str(layout.SSH_CONFIG),
        "known_hosts": str(layout.KNOWN_HOSTS),
        "controller": st.get("controller"),
        "mgmt_net": st.get("mgmt_net"),
        "dockerd": _flavor(st),
        "node": st["nodes"],
    }
