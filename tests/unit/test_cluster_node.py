"""The node helper ``cluster_node.py`` and the link choice, piece by piece: ``docker info`` as a
Spark's Docker answers it (``data/spark/docker-info.json``), the socket a session uses, root and
sudo, the probe that stands for a ping, the disk under the model path, and the twins of a port
whether the kernel shows them by PCI function (a Spark) or only by name (the lab's stand-in)."""

from __future__ import annotations

import json
import os

import pytest

from sparkdeploy.helpers import cluster_node as cn
from sparkdeploy.node.discover import LinkRefused, link_warnings, node_name, pick_link, port_hcas
from sparkdeploy.node.link import LinkFacts
from tests.unit.cluster_fakes import DOCKER_INFO

SPARK_INFO = json.loads(DOCKER_INFO.read_text())


def test_docker_info_of_a_spark():
    assert cn.judge_docker(SPARK_INFO) == {
        "version": "28.5.1", "driver": "overlay2", "store": "classic",
        "runtimes": ["io.containerd.runc.v2", "nvidia", "runc"], "default_runtime": "runc",
        "nvidia_runtime": True}


def test_the_containerd_image_store_is_told_by_its_driver_type():
    info = {**SPARK_INFO, "Driver": "overlayfs", "Runtimes": {"runc": {}},
            "DriverStatus": [["driver-type", "io.containerd.snapshotter.v1"]]}
    got = cn.judge_docker(info)
    assert (got["store"], got["driver"], got["nvidia_runtime"]) == ("containerd", "overlayfs", False)


@pytest.mark.parametrize("env, want", [
    ({}, ("/var/run/docker.sock", "the default socket")),
    ({"DOCKER_HOST": "unix:///run/user/1000/docker.sock"},
     ("/run/user/1000/docker.sock", "$DOCKER_HOST of the SSH session")),
    ({"DOCKER_HOST": "tcp://10.0.0.1:2375"}, ("/var/run/docker.sock", "the default socket")),
])
def test_the_socket_a_session_uses(env, want):
    assert cn.docker_socket(env) == want


def test_docker_that_does_not_answer_says_why(monkeypatch):
    monkeypatch.setattr(cn.shutil, "which", lambda t: "/usr/bin/docker")
    denied = ("permission denied while trying to connect to the Docker daemon socket at "
              "unix:///var/run/docker.sock: Get \"http://%2Fvar%2Frun%2Fdocker.sock/v1.51/info\": "
              "dial unix /var/run/docker.sock: connect: permission denied")
    monkeypatch.setattr(cn.protocol, "run", lambda argv, timeout=30: (1, "", denied + "\n"))
    got = cn.docker({})
    assert (got["version"], got["why"]) == (None, denied)
    monkeypatch.setattr(cn.shutil, "which", lambda t: None)
    assert cn.docker({})["why"] == "docker: not installed"


@pytest.mark.parametrize("uid, which, answer, want", [
    (0, None, None, {"root": True, "sudo": "not needed", "why": ""}),
    (1000, "/usr/bin/sudo", (0, "", ""), {"root": False, "sudo": "ok", "why": ""}),
    (1000, "/usr/bin/sudo", (1, "", "sudo: a password is required\n"),
     {"root": False, "sudo": "password", "why": "sudo: a password is required"}),
    (1000, "/usr/bin/sudo", (1, "", "owner is not in the sudoers file.\n"),
     {"root": False, "sudo": "denied", "why": "owner is not in the sudoers file."}),
    (1000, None, None, {"root": False, "sudo": "absent", "why": "sudo: not installed"}),
])
def test_privilege(monkeypatch, uid, which, answer, want):
    asked = []
    monkeypatch.setattr(cn.os, "geteuid", lambda: uid)
    monkeypatch.setattr(cn.shutil, "which", lambda t: which)
    monkeypatch.setattr(cn.protocol, "run", lambda argv, timeout=30: asked.append(argv) or answer)
    assert cn.privilege() == want
    assert asked == ([["sudo", "-n", "true"]] if answer else [])


def test_a_refusal_is_an_answer_a_timeout_is_not(monkeypatch):
    def connect(addr, timeout=None, source_address=None):
        assert (timeout, source_address) == (3, ("10.0.0.1", 0))
        if addr == ("10.0.0.2", 22):
            raise ConnectionRefusedError(111, "Connection refused")
        if addr == ("10.0.0.3", 22):
            raise TimeoutError("timed out")
        raise OSError(113, "No route to host")

    monkeypatch.setattr(cn.socket, "create_connection", connect)
    got = cn.answers("10.0.0.1", ["10.0.0.2", "10.0.0.3", "10.0.0.4"])
    assert got["answers"] == {
        "10.0.0.2": {"answered": True, "how": "port 22 refused (the address answered)"},
        "10.0.0.3": {"answered": False, "how": "no answer in 3s"},
        "10.0.0.4": {"answered": False, "how": "No route to host"}}


def test_disk_under_a_path_not_made_yet(tmp_path):
    got = cn.disk(str(tmp_path / "models" / "Qwen"))
    st = os.statvfs(tmp_path)
    assert got["probed"] == str(tmp_path) and got["why"] == ""
    assert abs(got["free"] - st.f_bavail * st.f_frsize) < 64 * 1024 * 1024
    assert os.path.ismount(got["mount"]) and str(tmp_path).startswith(got["mount"])


def _lab_like(addr: str, twin_state: str = "4: ACTIVE") -> LinkFacts:
    """The lab's stand-in: both twins behind one net device, no PCI function behind them."""
    port = {"port": 1, "state": "ACTIVE", "roce_v2": {addr: 3}}
    return LinkFacts.model_validate({
        "version": 1,
        "netdevs": [{"name": "eth0", "up": True, "mtu": 1500, "ipv4": [{"address": "10.77.0.11", "prefix": 24}]},
                    {"name": "enp1s0f0np0", "up": True, "mtu": 9000,
                     "ipv4": [{"address": addr, "prefix": 24}], "hcas": ["roceP2p1s0f0", "rocep1s0f0"]}],
        "hcas": [{"name": "roceP2p1s0f0", "netdevs": ["enp1s0f0np0"], "twin": "rocep1s0f0",
                  "ports": [{**port, "state": twin_state.split(": ")[1]}]},
                 {"name": "rocep1s0f0", "netdevs": ["enp1s0f0np0"], "twin": "rocep1s0f0", "ports": [port]}],
        "twins": [{"key": "rocep1s0f0", "hcas": ["roceP2p1s0f0", "rocep1s0f0"], "netdevs": ["enp1s0f0np0"]}]})


def test_the_twins_come_domain_zero_first_without_pci_too():
    facts = _lab_like("10.77.1.1")
    assert port_hcas(facts, facts.netdev("enp1s0f0np0")) == ("rocep1s0f0", "roceP2p1s0f0")
    [link] = pick_link({"spark1": facts, "spark2": _lab_like("10.77.1.2")})
    assert link.subnet == "10.77.1.0/24"
    assert [(e.node, e.interface, e.address) for e in link.ends] == [
        ("spark1", "enp1s0f0np0", "10.77.1.1"), ("spark2", "enp1s0f0np0", "10.77.1.2")]
    assert link_warnings(facts, link.ends[0]) == []


def test_a_second_interface_in_the_links_subnet_and_a_missing_gid_are_warned():
    facts = _lab_like("10.77.1.1", twin_state="1: DOWN")
    [link] = pick_link({"spark1": facts, "spark2": _lab_like("10.77.1.2")})
    other = _lab_like("10.77.1.5")  # its GID table holds .5, not the address the link uses
    moved = LinkFacts.model_validate({**facts.model_dump(), "hcas": other.model_dump()["hcas"],
                                      "netdevs": [*facts.model_dump()["netdevs"], {
                                          "name": "enP7s7", "up": True,
                                          "ipv4": [{"address": "10.77.1.9", "prefix": 24}]}]})
    assert link_warnings(moved, link.ends[0]) == [
        "no RoCE v2 GID holds 10.77.1.1 on rocep1s0f0, roceP2p1s0f0",
        "enP7s7 is in the link's subnet 10.77.1.0/24 too"]
    assert link_warnings(facts, link.ends[0]) == [
        "roceP2p1s0f0 is DOWN while its twin rocep1s0f0 is ACTIVE (one twin carries about "
        "half the bandwidth)"]


def test_an_interface_asked_for_that_no_node_has_is_refused():
    with pytest.raises(LinkRefused, match=r"^no subnet that every node reaches on an RDMA-backed "
                       r"interface named enp1s0f1np1 that is up"):
        pick_link({"spark1": _lab_like("10.77.1.1")}, "enp1s0f1np1")


@pytest.mark.parametrize("alias, name", [
    ("spark1", "spark1"), ("owner@spark2", "spark2"), ("Spark-A.local", "spark-a-local"),
    ("me@192.168.1.40", "192-168-1-40")])
def test_node_names_from_aliases(alias, name):
    assert node_name(alias) == name


def test_an_alias_that_makes_no_name_is_refused():
    with pytest.raises(ValueError, match="no safe node name"):
        node_name("a" * 40 + "." + "b" * 40)
