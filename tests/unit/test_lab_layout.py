"""The lab's address plan: the default /24 unless the machine's routes clash (no root needed)."""

import pytest

from sparkdeploy.lab import layout
from sparkdeploy.lab.layout import AddressPlan, plan_addresses

MACHINE = [
    {"dst": "default", "gateway": "192.0.2.1", "dev": "eth0"},
    {"dst": "192.0.2.0/24", "dev": "eth0", "prefsrc": "192.0.2.2"},
    {"dst": "127.0.0.0/8", "dev": "lo", "type": "local", "table": "local"},
    {"dst": "fd00::/64", "dev": "eth0"},
]


def test_default_plan_on_a_machine_without_clashes():
    plan, why = plan_addresses(MACHINE)
    assert plan == AddressPlan("10.77.0.0/24", "10.77.1.0/24")
    assert "(default)" in why
    assert plan.controller == "10.77.0.1"
    assert [plan.mgmt_addr(n) for n in ("spark1", "spark2")] == ["10.77.0.11", "10.77.0.12"]
    assert [plan.fast_addr(n) for n in ("spark1", "spark2")] == ["10.77.1.1", "10.77.1.2"]


def test_the_labs_own_bridge_route_is_not_a_clash():
    routes = MACHINE + [{"dst": "10.77.0.0/24", "dev": layout.MGMT_BRIDGE}]
    assert plan_addresses(routes)[0].mgmt_net == "10.77.0.0/24"


@pytest.mark.parametrize("dst", ["10.77.0.0/25", "10.77.0.128/26", "10.77.0.5"])
def test_a_clashing_default_falls_back_and_says_so(dst):
    plan, why = plan_addresses(MACHINE + [{"dst": dst, "dev": "wg0"}])
    assert plan.mgmt_net == layout.MGMT_CANDIDATES[1]
    assert "clashes" in why


def test_a_clash_on_the_fast_link_range_is_an_error_naming_the_profile():
    with pytest.raises(ValueError, match="configs/lab.yaml"):
        plan_addresses(MACHINE + [{"dst": "10.77.1.0/24", "dev": "tun0"}])


def test_every_candidate_clashing_is_an_error():
    routes = MACHINE + [{"dst": c, "dev": "x"} for c in layout.MGMT_CANDIDATES[1:]] + [
        {"dst": "10.77.0.0/24", "dev": "y"}]
    with pytest.raises(ValueError, match="every candidate"):
        plan_addresses(routes)


def test_a_recorded_network_is_kept():
    plan, why = plan_addresses(MACHINE, recorded="172.31.77.0/24")
    assert plan.mgmt_net == "172.31.77.0/24" and "recorded" in why


def test_interface_names_fit_the_kernel_limit():
    for n in layout.node_names(9):
        assert len(layout.root_veth(n)) <= 15 and len(layout.fast_peer_veth(n)) <= 15
    assert len(layout.FAST_IF) <= 15


def test_each_node_keeps_one_fast_mac_of_its_own_locally_administered():
    macs = [layout.fast_mac(n) for n in layout.node_names(8)]
    assert macs[0] == "02:5d:1a:f0:00:01" and macs[3] == "02:5d:1a:f0:00:04"
    assert len(set(macs)) == 8 and macs == [layout.fast_mac(n) for n in layout.node_names(8)]
    assert all(int(m.split(":")[0], 16) & 0b11 == 0b10 for m in macs)  # local, unicast


def test_fallback_is_forced_even_when_the_default_is_free_and_recorded():
    plan, why = plan_addresses(MACHINE, recorded="10.77.0.0/24", want="fallback")
    assert plan.mgmt_net == layout.MGMT_CANDIDATES[1]
    assert "asked for the fallback" in why and "moved from 10.77.0.0/24" in why


def test_fallback_skips_a_clashing_fallback():
    plan, _ = plan_addresses(MACHINE + [{"dst": layout.MGMT_CANDIDATES[1], "dev": "wg0"}],
                             want="fallback")
    assert plan.mgmt_net == layout.MGMT_CANDIDATES[2]


def test_asking_for_the_default_moves_a_lab_back():
    plan, why = plan_addresses(MACHINE, recorded=layout.MGMT_CANDIDATES[1],
                               want=layout.MGMT_CANDIDATES[0])
    assert plan.mgmt_net == layout.MGMT_CANDIDATES[0]
    assert why == f"management network 10.77.0.0/24 (default) (moved from {layout.MGMT_CANDIDATES[1]})"


@pytest.mark.parametrize("want,match", [("10.0.0.0/24", "must be 'fallback' or one of"),
                                        ("10.77.0.0/24", "clashes with this machine's route")])
def test_a_bad_or_clashing_choice_is_one_line(want, match):
    with pytest.raises(ValueError, match=match):
        plan_addresses(MACHINE + [{"dst": "10.77.0.0/24", "dev": "wg0"}], want=want)
