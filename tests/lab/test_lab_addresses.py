"""The lab talks only to itself: every address the lab profile names, every listener of the
lab, every node's route, and every socket a step run against the lab profile opens is on
loopback or the lab's own networks, also when the lab is on its fallback /24."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

from sparkdeploy.lab import hub, layout, lifecycle
from sparkdeploy.lab import state as lab_state
from sparkdeploy.lab.dockerd import docker
from sparkdeploy.profile.config import load_layered

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "configs" / "lab.yaml"
DERIVED = "sparkdeploy/sglang-qwen3.5:latest"
LOOPBACK = [ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128")]


def lab_networks() -> list:
    st = lab_state.load()
    return LOOPBACK + [ipaddress.ip_network(st["mgmt_net"]), ipaddress.ip_network(st["fast_net"])]


def is_labs(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host == "localhost"
    return any(ip in net for net in lab_networks())


def named_addresses() -> dict[str, str]:
    """Every address the lab profile makes a step talk to: what -> host."""
    profile, _ = load_layered(PROFILE)
    out = {"model.endpoint": urlsplit(profile.model.endpoint).hostname,
           "images.layer.index_url": urlsplit(profile.images.layer.index_url).hostname}
    if profile.endpoint:
        out["endpoint"] = urlsplit(profile.endpoint).hostname
    for n in profile.nodes:
        out[f"{n.name} link"] = n.link.address
        # where ssh really goes for the node's alias
        cfg = subprocess.run(["ssh", "-G", "-F", profile.ssh.config, n.ssh], capture_output=True,
                             text=True, check=True).stdout
        out[f"{n.name} ssh"] = re.search(r"^hostname (\S+)$", cfg, re.M).group(1)
    return out


def listeners() -> dict[str, list[str]]:
    """The lab daemons' TCP listening addresses, by daemon, from the kernel's socket table."""
    st = lab_state.load()
    procs = dict(st.get("controller_procs", {}))
    ss = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    out = {}
    for name, rec in procs.items():
        out[name] = [ln.split()[3].rsplit(":", 1)[0] for ln in ss.splitlines()
                     if f"pid={rec['pid']}," in ln]
    for x, rec in st["nodes"].items():
        nss = subprocess.run(["ip", "netns", "exec", layout.netns_name(x), "ss", "-Hltnp"],
                             capture_output=True, text=True, check=True).stdout
        out[f"{x} sshd"] = [ln.split()[3].rsplit(":", 1)[0] for ln in nss.splitlines()
                            if f"pid={rec['procs']['sshd']['pid']}," in ln]
    return out


def assert_only_lab_addresses() -> None:
    outside = {k: v for k, v in named_addresses().items() if not is_labs(v)}
    assert outside == {}, f"the lab profile names addresses outside the lab: {outside}"
    heard = listeners()
    assert heard["hub"] and heard["index"] and all(heard.values()), heard
    wild = {k: v for k, v in heard.items() if not all(is_labs(a) for a in v)}
    assert wild == {}, f"lab daemons listen outside the lab's addresses: {wild}"
    held = machine_addresses()
    for x in lab_state.load()["nodes"]:
        routes = json.loads(subprocess.run(["ip", "-j", "-n", layout.netns_name(x), "route"],
                                           capture_output=True, text=True, check=True).stdout)
        for r in routes:
            if r["dst"] == "default":
                # a default route may exist (a real node has one), but only to a next hop in the
                # lab that nobody holds: nothing can forward it off the machine
                gw = r.get("gateway", "")
                assert is_labs(gw) and gw not in held, f"{x}: default via {gw} ({r})"
            else:
                assert any(ipaddress.ip_network(r["dst"], strict=False).subnet_of(n)
                           for n in lab_networks() if n.version == 4), f"{x}: route {r}"


def machine_addresses() -> set[str]:
    """Every IPv4 address held on this machine: the root namespace and every lab node's."""
    out = set()
    for argv in [["ip", "-j", "addr"]] + [["ip", "-j", "-n", layout.netns_name(x), "addr"]
                                          for x in lab_state.load()["nodes"]]:
        for link in json.loads(subprocess.run(argv, capture_output=True, text=True,
                                              check=True).stdout):
            out |= {a["local"] for a in link.get("addr_info", []) if a.get("family") == "inet"}
    return out


def test_everything_the_lab_names_is_its_own(lab):
    assert_only_lab_addresses()


@pytest.fixture(scope="module")
def on_fallback(lab):
    """The lab moved onto its fallback /24 for these tests, and back afterwards."""
    before = lab_state.load()["mgmt_net"]
    results = lifecycle.up(nodes=len(lab.nodes), flavor=lab.state["dockerd"], mgmt_net="fallback")
    bad = [f"{r.step} {r.node or ''}: {r.why}" for r in results if r.failed]
    assert not bad, bad
    try:
        yield lab_state.load()
    finally:
        back = lifecycle.up(nodes=len(lab.nodes), flavor=lab.state["dockerd"], mgmt_net=before)
        assert not [r for r in back if r.failed], [r.why for r in back if r.failed]


def test_forced_fallback_moves_the_whole_lab(lab, on_fallback):
    assert on_fallback["mgmt_net"] != layout.MGMT_CANDIDATES[0]
    assert on_fallback["mgmt_net"] in layout.MGMT_CANDIDATES[1:]
    controller = on_fallback["controller"]
    assert f"http://{controller}:8900" in layout.PROFILE_OVERLAY.read_text()
    assert hub.wait_ready(f"http://{controller}:8900", timeout=5)
    for x in lab.nodes:
        # ssh through the lab's ssh_config, host keys checked, reaches the node at its new address
        got = lab.ssh(x, "ip -4 -o addr show dev eth0").stdout
        assert f" {on_fallback['nodes'][x]['mgmt_addr']}/24 " in got
    assert_only_lab_addresses()


def audited_inv(state: Path, log: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "INVOKE_SPARKDEPLOY_PROFILE": str(PROFILE),
           "INVOKE_SPARKDEPLOY_STATE_DIR": str(state), "SPARKDEPLOY_AUDIT_LOG": str(log),
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_ENDPOINT", None)
    return subprocess.run([sys.executable, str(Path(__file__).with_name("audited_inv.py")), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)


def test_probe_and_build_on_the_fallback_reach_only_the_labs_hub_and_index(lab, on_fallback,
                                                                           tmp_path):
    controller = on_fallback["controller"]
    hub_url, index_url = f"http://{controller}:8900", f"http://{controller}:8901"
    head_addr = on_fallback["nodes"][lab.nodes[0]]["mgmt_addr"]
    # the head loses the derived image and image.build runs without the layer cache, so it
    # really builds (pip on the head); a downloaded model's config.json is set aside, so the
    # probe asks the hub for it
    subprocess.run(docker(lab.nodes[0], "image", "rm", "-f", DERIVED), capture_output=True)
    profile, _ = load_layered(PROFILE)
    config = f"{profile.model.path.rstrip('/')}/config.json"
    lab.ssh(lab.nodes[0], f"if [ -e {config} ]; then mv {config} {config}.aside; fi")
    try:
        _probe_and_build_reach_only_the_lab(lab, on_fallback, tmp_path, hub_url=hub_url,
                                            index_url=index_url, head_addr=head_addr)
    finally:
        lab.ssh(lab.nodes[0], f"if [ -e {config}.aside ]; then mv {config}.aside {config}; fi")


def _probe_and_build_reach_only_the_lab(lab, on_fallback, tmp_path, *, hub_url, index_url,
                                        head_addr):
    controller = on_fallback["controller"]
    hub.set_knobs(hub_url, reset_stats=True)
    index_before = len(requests.get(index_url + "/_lab/stats", timeout=10).json()["requests"])
    log = tmp_path / "audit.jsonl"

    probe = audited_inv(tmp_path / "state", log, "image.probe")
    assert probe.returncode == 0, probe.stdout + probe.stderr
    build = audited_inv(tmp_path / "state", log, "image.build", "--no-cache")
    assert build.returncode == 0, build.stdout + build.stderr
    assert "changed  image.build" in build.stdout

    # the controller's side: every socket it opened is the lab's (or a local unix socket)
    events = [json.loads(ln) for ln in log.read_text().splitlines()]
    tcp = {tuple(e["address"]) for e in events if e["event"] == "connect"
           and isinstance(e["address"], list)}
    assert (controller, 8900) in tcp and (controller, 8901) in tcp
    assert [a for a in tcp if not is_labs(str(a[0]))] == []
    names = {e["host"] for e in events if e["event"] == "getaddrinfo"}
    assert [h for h in names if not is_labs(str(h))] == []

    # the servers' side: the hub answered the probe, the index the resolver and the head's pip
    got = hub.get_stats(hub_url)["requests"]
    assert any(r["path"].endswith("/config.json") and r["client"] == controller for r in got)
    seen = requests.get(index_url + "/_lab/stats", timeout=10).json()["requests"][index_before:]
    clients = {r["client"] for r in seen}
    assert controller in clients and head_addr in clients, clients
    assert any(r["path"].startswith("/files/transformers-") for r in seen)
