"""``up``, ``down`` and ``status`` for the lab. Each returns Results and never prints."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sparkdeploy.lab import engine, image, internet, keys, layout, node, packages, proc, standins_install
from sparkdeploy.lab import state as lab_state
from sparkdeploy.lab.layout import AddressPlan
from sparkdeploy.lab.proc import LabError
from sparkdeploy.results import Result, changed, failed, ok, skipped


class _Run:
    """Collects results; a component that raises LabError fails and stops the run."""

    def __init__(self) -> None:
        self.results: list[Result] = []

    def add(self, r: Result) -> Result:
        self.results.append(r)
        return r


def preflight() -> str | None:
    """Why the lab cannot run here, or None."""
    if not os.uname().sysname == "Linux":
        return "the lab needs Linux (network and mount namespaces)"
    if os.geteuid() != 0:
        return "the lab needs root (namespaces, bridges, mounts)"
    return None


def up(nodes: int = 2, engine_name: str = layout.DEFAULT_ENGINE,
       progress: Callable[[Result], None] | None = None, seed_worker: bool = False) -> list[Result]:
    """Bring the lab up (idempotent). ``progress`` is called with each result as it lands."""
    why = preflight()
    if why:
        return [failed("lab.up", why)]
    if engine_name not in layout.ENGINES:
        return [failed("lab.up", f"unknown engine {engine_name!r} (one of {', '.join(layout.ENGINES)})")]
    if nodes < 1 or nodes > 9:
        return [failed("lab.up", f"--nodes must be 1..9, not {nodes}")]
    run = _Run()
    emit = progress or (lambda r: None)

    def add(r: Result) -> Result:
        emit(r)
        return run.add(r)

    t0 = time.monotonic()
    try:
        with lab_state.locked():
            _up(add, nodes, engine_name, seed_worker)
    except LabError as e:
        add(failed("lab.up", str(e)))
    else:
        add(ok("lab.up", f"done in {time.monotonic() - t0:.0f}s",
               seconds=round(time.monotonic() - t0, 1)))
    return run.results


def _up(add: Callable[[Result], Result], n: int, engine_name: str, seed_worker: bool = False) -> None:
    names = layout.node_names(n)
    st = lab_state.load()
    layout.LAB_DIR.mkdir(parents=True, exist_ok=True)

    # 1. packages
    got = packages.ensure()
    add(changed("packages", "installed " + " ".join(got)) if got
        else ok("packages", "all present"))

    # start the slow cache builds now; join before they are needed
    pool = ThreadPoolExecutor(max_workers=4)
    base_job = pool.submit(image.ensure_base_tarball)
    d26_job = pool.submit(engine.ensure_docker26) if engine_name != "classic20" else None
    wheels_job = pool.submit(internet.prefetch)

    try:
        # 2. addresses
        try:
            plan, why = layout.plan_addresses(layout.machine_routes(), st.get("mgmt_net"))
        except ValueError as e:
            raise LabError(str(e)) from None
        node.check_no_clash_with_root(plan)
        first = st.get("mgmt_net") is None
        st.update(mgmt_net=plan.mgmt_net, fast_net=plan.fast_net, controller=plan.controller)
        lab_state.save(st)
        add((changed if first else ok)("addresses", why, mgmt=plan.mgmt_net, fast=plan.fast_net))
        wrote = keys.write_if_changed(layout.PROFILE_OVERLAY, internet.profile_overlay(plan.controller))
        add((changed if wrote else ok)("profile.overlay", f"{layout.PROFILE_OVERLAY}: hub and "
                                       f"index on {plan.controller}"))

        # nodes beyond --nodes from an earlier run go away first
        extra = [x for x in st["nodes"] if x not in names]
        for x in extra:
            _down_node(x, st)
            proc.remove_tree(layout.node_dir(x))
            st["nodes"].pop(x, None)
            lab_state.save(st)
            add(changed("node", "removed (beyond --nodes)", x))

        # 3. keys
        made = keys.ensure_keys(names)
        add(changed("keys", "generated " + ", ".join(made)) if made else ok("keys", "present"))

        # 4. management bridge
        add((changed if node.ensure_mgmt_bridge(plan) else ok)(
            "network.mgmt", f"{layout.MGMT_BRIDGE} {plan.controller}/{plan.prefix}"))

        # 5. per node namespaces, mounts, mgmt link
        for x in names:
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
            if mounts:
                what.append("mounted " + " ".join(mounts))
            if node.ensure_mgmt_link(x, plan):
                what.append(f"linked {layout.MGMT_IF} {plan.mgmt_addr(x)}")
            st["created_paths"] = sorted(set(st["created_paths"]))
            lab_state.save(st)
            add(changed("node", ", ".join(what), x) if what
                else ok("node", f"namespaces, mounts, {layout.MGMT_IF} {plan.mgmt_addr(x)}", x))

        # 6. fast link
        topo = node.fast_topology(len(names))
        fast_changed = node.ensure_fast(names, plan)
        st["fast_topology"] = topo
        lab_state.save(st)
        desc = f"{topo}: " + ", ".join(f"{x} {layout.FAST_IF} {plan.fast_addr(x)}" for x in names)
        add((changed if fast_changed else ok)("network.fast", f"{desc} mtu {layout.FAST_MTU}"))

        # 7. ssh files (controller and nodes)
        files = keys.write_ssh_files(names, plan, fast=topo != "none",
                                     env_extra=st.get("env_extra"))
        add(changed("ssh.files", f"wrote {len(files)}: " + ", ".join(files[:4])
                    + (" ..." if len(files) > 4 else ""), files=files) if files
            else ok("ssh.files", f"{layout.SSH_CONFIG}, known_hosts, node keys unchanged"))

        # 8. stand-ins on each node's PATH
        for x in names:
            did = standins_install.install(x)
            add(changed("standins", did, x) if did else ok("standins", "up to date", x))

        # 9. sshd per node
        for x in names:
            add(_ensure_sshd(x, st, plan))

        # 10. engines
        if d26_job is not None:
            did, why = d26_job.result()
            add((changed if did else ok)("docker26", why))
        for x in names:
            add(_ensure_engine(x, st, engine_name))
        st["engine"] = engine_name
        lab_state.save(st)

        # 11. base image
        did, why = base_job.result()
        add((changed if did else ok)("base.tarball", why))
        per = image.ensure_base_image(names)
        for x in names:
            msg = per[x]
            add((ok if msg == "ok" else changed)("base.image", f"{layout.BASE_IMAGE}"
                                                 + ("" if msg == "ok" else f" {msg}"), x))

        # 12. GLM units on the head
        add(_ensure_glm(names[0]))

        # 13. part 2: the closed internet (hub, package index) and the community images
        did, why = wheels_job.result()
        add((changed if did else ok)("wheels", why))
        for r in internet.ensure_servers(st, plan.controller):
            add(r)
        for r in internet.ensure_community_images(names[0]):
            add(r)
        if seed_worker:
            for x in names[1:]:
                add(internet.seed_worker(names[0], x))

        # 14. the proof: controller -> every node over ssh with host key checking on
        for x in names:
            add(_check_ssh(x))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def ensure_controller_daemon(st: dict, name: str, argv: list[str],
                             ready: Callable[[], bool], timeout: float = 30) -> Result:
    """A lab daemon in the root namespace (part 2: the model hub and the package index on the
    controller's management address). Recorded under ``controller_procs`` so ``lab.down``
    stops it by PID; restarted when its argv changed or it died."""
    procs = st.setdefault("controller_procs", {})
    cur = procs.get(name)
    if proc.alive(cur) and cur.get("argv") == argv and ready():
        return ok(name, f"running (pid {cur['pid']})")
    was = proc.stop(cur)
    rec = proc.spawn(argv, layout.LAB_DIR / "log" / f"{name}.log")
    procs[name] = rec
    lab_state.save(st)
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline or not proc.alive(rec):
            raise LabError(f"{name} did not get ready (see {rec['log']})")
        time.sleep(0.2)
    return changed(name, f"{'restarted' if was else 'started'} (pid {rec['pid']})")


def set_env(st: dict, **values: str) -> bool:
    """Add variables to the lab's ``env`` file (part 2: HF_ENDPOINT, PIP_INDEX_URL)."""
    extra = {**st.get("env_extra", {}), **values}
    st["env_extra"] = extra
    lab_state.save(st)
    return keys.write_if_changed(layout.ENV_FILE, keys.env_text(extra))


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _ensure_sshd(x: str, st: dict, plan: AddressPlan) -> Result:
    procs = st["nodes"][x]["procs"]
    cfg = keys.sshd_config_path(x)
    h = _hash(cfg.read_text())
    cur = procs.get("sshd")
    if proc.alive(cur) and cur.get("config") == h and _port_open(plan.mgmt_addr(x), 22):
        return ok("sshd", f"running (pid {cur['pid']})", x)
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
    deadline = time.monotonic() + 30
    while not _port_open(plan.mgmt_addr(x), 22):
        if time.monotonic() > deadline or not proc.alive(rec):
            raise LabError(f"{x}: sshd did not listen on {plan.mgmt_addr(x)}:22 "
                           f"(see {rec['log']})")
        time.sleep(0.1)
    return changed("sshd", f"{'restarted' if restarted else 'started'} (pid {rec['pid']})", x)


def _port_open(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=1):
            return True
    except OSError:
        return False


def _ensure_engine(x: str, st: dict, engine_name: str) -> Result:
    procs = st["nodes"][x]["procs"]
    mnt, net = layout.mntns_path(x), layout.netns_path(x)
    cur, ccur = procs.get("dockerd"), procs.get("containerd")
    want_c = engine_name == "containerd"
    if (proc.alive(cur) and cur.get("argv") == engine.dockerd_argv(x, mnt, net, engine_name)
            and (not want_c or (proc.alive(ccur) and ccur.get("argv")
                                == engine.containerd_argv(x, mnt, net, engine_name)))
            and (want_c or ccur is None)
            and engine.engine_info(x) is not None):
        return ok("engine", f"{engine_name} dockerd running (pid {cur['pid']})", x)
    was = proc.stop(cur)
    proc.stop(ccur)
    procs.pop("containerd", None)
    lab_state.save(st)
    if want_c:
        procs["containerd"] = engine.start_containerd(x, mnt, net, engine_name)
        lab_state.save(st)
    rec = engine.start_dockerd(x, mnt, net, engine_name)
    procs["dockerd"] = rec
    lab_state.save(st)
    info = engine.engine_info(x) or {}
    store = dict(info.get("DriverStatus") or []).get("driver-type", "classic store")
    return changed("engine", f"{'restarted' if was else 'started'} {engine_name}: Docker "
                   f"{info.get('ServerVersion', '?')}, {info.get('Driver', '?')}, {store} "
                   f"(pid {rec['pid']})", x)


def _ensure_glm(head: str) -> Result:
    """The GLM deployment the seed had to stop: four units enabled and running on the head,
    driven through the node's own systemctl stand-in inside its namespaces."""
    from sparkdeploy.lab import glm

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
        return failed("ssh", f"ssh -F {layout.SSH_CONFIG} {x} true: "
                      f"{lines[-1] if lines else cp.returncode}", x)
    return ok("ssh", f"ssh -F {layout.SSH_CONFIG} {x} works (host key checked)", x)


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


def down() -> list[Result]:
    why = preflight()
    if why:
        return [failed("lab.down", why)]
    results: list[Result] = []
    try:
        with lab_state.locked():
            st = lab_state.load()
            names = _known_nodes(st)
            for name, rec in sorted(st.get("controller_procs", {}).items()):
                if proc.stop(rec):
                    results.append(changed(name, f"stopped (pid {rec['pid']})"))
            for x in names:
                done = _down_node(x, st)
                results.append(changed("node", "; ".join(done), x) if done
                               else ok("node", "nothing left", x))
            what = []
            if node.netns_exists(layout.FAST_NETNS) or Path(
                    f"/var/run/netns/{layout.FAST_NETNS}").exists():
                proc.run(["ip", "netns", "del", layout.FAST_NETNS], check=False)
                what.append(layout.FAST_NETNS)
            if node.remove_mgmt_bridge():
                what.append(layout.MGMT_BRIDGE)
            results.append(changed("network", "removed " + ", ".join(what)) if what
                           else ok("network", "nothing left"))
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
            results.append(changed("data", "removed " + ", ".join(removed)) if removed
                           else ok("data", "nothing left"))
    except LabError as e:
        results.append(failed("lab.down", str(e)))
    return results


# --- status ------------------------------------------------------------------------------


def status() -> list[Result]:
    why = preflight()
    if why:
        return [failed("lab.status", why)]
    try:
        st = lab_state.load()
    except LabError as e:
        return [failed("lab.status", str(e))]
    if not st["nodes"]:
        return [skipped("lab", "not up (no state in " + str(layout.STATE_FILE) + ")")]
    out = [ok("lab", f"engine {st.get('engine')}, management {st.get('mgmt_net')} "
              f"(controller {st.get('controller')}), fast link {st.get('fast_topology')} "
              f"{st.get('fast_net')}; ssh -F {layout.SSH_CONFIG}")]
    for name, p in sorted(st.get("controller_procs", {}).items()):
        live = proc.alive(p)
        out.append((ok if live else failed)(name, f"{'alive' if live else 'dead'} "
                                            f"(pid {p.get('pid')}) on the controller"))
    for x, rec in sorted(st["nodes"].items()):
        addrs = node.node_addresses(x) if node.netns_exists(layout.netns_name(x)) else {}
        a = ", ".join(f"{k} {' '.join(v)}" for k, v in sorted(addrs.items())) or "no netns"
        out.append((ok if addrs else failed)("node", a, x, addresses=addrs))
        for name, p in sorted(rec.get("procs", {}).items()):
            live = proc.alive(p)
            out.append((ok if live else failed)(
                name, f"{'alive' if live else 'dead'} (pid {p.get('pid')})", x))
        imgs = image.images(x)
        out.append(ok("images", "; ".join(imgs) if imgs else "none (or engine down)", x,
                      images=imgs))
    return out


def lab_facts() -> dict[str, Any]:
    """What tests and other tools need: node names, addresses, ssh_config path."""
    st = lab_state.load()
    return {
        "nodes": sorted(st["nodes"], key=lambda s: (len(s), s)),
        "ssh_config": str(layout.SSH_CONFIG),
        "known_hosts": str(layout.KNOWN_HOSTS),
        "controller": st.get("controller"),
        "engine": st.get("engine"),
        "node": st["nodes"],
    }
