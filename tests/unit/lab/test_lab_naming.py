"""Names, addresses and subnets of a lab are derived from its name alone."""

import ipaddress

import pytest

from deploybench.errors import LabError
from deploybench.lab.naming import (
    IFNAMSIZ,
    MAX_NODES,
    NetnsNames,
    check_name,
    check_nodes,
    host_address,
    loopback_candidates,
    node_address,
    node_name,
    pick_subnet,
    subnet_candidates,
)


@pytest.mark.parametrize("name", ["demo", "t4a", "a", "abcdefghijkl"])
def test_good_names(name):
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "Demo", "4ab", "a-b", "a_b", "abcdefghijklm", "../x", "a b"])
def test_bad_names_say_what_is_allowed(name):
    with pytest.raises(LabError, match="lowercase letters and digits"):
        check_name(name)


def test_node_count_bounds():
    assert check_nodes(1) == 1 and check_nodes(MAX_NODES) == MAX_NODES
    for bad in (0, MAX_NODES + 1):
        with pytest.raises(LabError, match=str(bad)):
            check_nodes(bad)


def test_node_names_sort_like_numbers():
    assert [node_name(i) for i in (1, 9, 10, 16)] == ["n01", "n09", "n10", "n16"]
    assert node_name(123) == "n123"


def test_interface_names_fit_the_kernel_limit_and_differ_between_labs():
    a, b = NetnsNames.of("abcdefghijkl"), NetnsNames.of("abcdefghijkm")
    for names in (a, b):
        assert len(names.bridge) <= IFNAMSIZ
        assert all(len(names.host_veth(i)) <= IFNAMSIZ for i in (1, 16, MAX_NODES))
    assert a.bridge != b.bridge and a.host_veth(1) != b.host_veth(1)
    assert NetnsNames.of("demo") == NetnsNames.of("demo")  # stable: teardown works without state


def test_ownership_does_not_reach_into_a_similar_lab():
    t4 = NetnsNames.of("t4")
    assert t4.owns_namespace("db-t4-n01") and t4.owns_namespace("db-t4-n123")
    assert not t4.owns_namespace("db-t4a-n01")
    assert not t4.owns_namespace("db-t4-n01x")
    assert t4.owns_link(t4.bridge) and t4.owns_link(t4.host_veth(7))
    assert not t4.owns_link(NetnsNames.of("t4a").host_veth(7))
    assert not t4.owns_link("eth0")


def test_subnets_are_private_24s_stable_and_distinct_per_lab():
    first = next(subnet_candidates("demo"))
    assert first == next(subnet_candidates("demo"))
    assert first.prefixlen == 24 and first.subnet_of(ipaddress.IPv4Network("10.0.0.0/8"))
    assert not first.subnet_of(ipaddress.IPv4Network("10.0.0.0/16"))
    assert len({next(subnet_candidates(f"lab{i}")) for i in range(50)}) > 45


def test_loopback_blocks_avoid_127_0_0_1():
    for i in range(100):
        net = next(loopback_candidates(f"l{i}"))
        assert net.subnet_of(ipaddress.IPv4Network("127.0.0.0/8"))
        assert not net.overlaps(ipaddress.IPv4Network("127.0.0.0/16"))


def test_pick_subnet_skips_taken_ones():
    cands = list(subnet_candidates("demo", count=3))
    assert len(set(cands)) == 3
    assert pick_subnet(cands, [ipaddress.IPv4Network("192.0.2.0/24")], "lab") == cands[0]
    assert pick_subnet(cands, cands[:2], "lab") == cands[2]


def test_pick_subnet_fails_with_a_way_out():
    cands = list(subnet_candidates("demo", count=2))
    with pytest.raises(LabError, match="lab down"):
        pick_subnet(cands, [ipaddress.IPv4Network("10.0.0.0/8")], "lab")


def test_addresses():
    net = ipaddress.IPv4Network("10.123.4.0/24")
    assert host_address(net) == "10.123.4.1"
    assert node_address(net, 1) == "10.123.4.11"
    assert node_address(net, MAX_NODES) == "10.123.4.210"
