"""Policy: who is blamed, what the run does under abort and exclude, and the words for it."""

from __future__ import annotations

import json

import pytest

from deploybench.config import Policy, PreflightSpec
from deploybench.preflight.links import _fill, client_argv, parse_iperf3, server_script, sweep_script
from deploybench.preflight.model import LinkTest, NodeCheck
from deploybench.preflight.policy import blame, decide, describe_link, matrix, worst_links


def _lt(src, dst, fwd, rev, nominal=1000.0, threshold=0.9):
    lt = LinkTest(src, dst, 0, nominal, threshold=threshold)
    _fill(lt, {"bidir": {"mbit": fwd, "retransmits": 1, "rtt_ms": 0.2, "reverse_mbit": rev,
                         "reverse_retransmits": 2}}, threshold)
    return lt


def test_a_link_is_as_good_as_its_slower_direction():
    lt = _lt("a", "b", 950, 410)
    assert not lt.ok and lt.mbit == 410 and lt.ratio == pytest.approx(0.41) and lt.retransmits == 3
    assert [(d.src, d.dst, d.mbit) for d in lt.directions] == [("a", "b", 950), ("b", "a", 410)]
    text = describe_link(lt)
    assert "a -> b" in text and "410 Mbit/s" in text and "41%" in text and "threshold 90%" in text
    assert "b -> a 410 Mbit/s" in text
    assert _lt("a", "b", 950, 920).ok


def test_sequential_directions_fill_the_same_fields():
    lt = LinkTest("a", "b", 0, 1000)
    _fill(lt, {"forward": {"mbit": 900, "retransmits": 0, "rtt_ms": 0.3},
               "reverse": {"mbit": 950, "retransmits": 4, "rtt_ms": None}}, 0.9)
    assert lt.ok and lt.mbit == 900 and lt.rtt_ms == 0.3 and len(lt.directions) == 2


def test_parse_iperf3_bidir():
    data = {"end": {"streams": [{"sender": {"mean_rtt": 400, "sender": True}}],
                    "sum_sent": {"bits_per_second": 4.8e8, "retransmits": 2},
                    "sum_received": {"bits_per_second": 4.7e8},
                    "sum_sent_bidir_reverse": {"bits_per_second": 4.9e8, "retransmits": 5},
                    "sum_received_bidir_reverse": {"bits_per_second": 4.6e8}}}
    got = parse_iperf3(json.dumps(data))
    assert got["mbit"] == pytest.approx(470) and got["reverse_mbit"] == pytest.approx(460)
    assert got["retransmits"] == 2 and got["reverse_retransmits"] == 5 and got["rtt_ms"] == pytest.approx(0.4)


def test_a_degraded_node_is_blamed_not_its_neighbours():
    names = ["a", "b", "c", "d"]
    links = [_lt("a", "b", 950, 950), _lt("b", "c", 400, 400), _lt("c", "d", 400, 400), _lt("d", "a", 950, 950)]
    bad = blame(names, [NodeCheck(n, True) for n in names], links)
    assert list(bad) == ["c"] and "b -> c" in bad["c"] and "c -> d" in bad["c"]


def test_a_single_bad_link_blames_both_ends_but_spares_the_source():
    names = ["a", "b", "c", "d"]
    links = [_lt("a", "b", 400, 950), _lt("b", "c", 950, 950), _lt("c", "d", 950, 950), _lt("d", "a", 950, 950)]
    checks = [NodeCheck(n, True) for n in names]
    bad = blame(names, checks, links)
    assert set(bad) == {"a", "b"} and "cannot tell which end" in bad["a"]
    assert set(blame(names, checks, links, source="a")) == {"b"}


def _decide(policy, excluded, min_nodes=1, source="a"):
    spec = PreflightSpec(policy=policy, min_nodes=min_nodes)
    return decide(["a", "b", "c", "d"], excluded, [], spec, source)


def test_decisions_under_both_policies():
    healthy, text, abort = _decide(Policy.ABORT, {})
    assert healthy == ["a", "b", "c", "d"] and not abort and "all 4 nodes passed" in text
    healthy, text, abort = _decide(Policy.ABORT, {"c": "link b -> c: 400 Mbit/s"})
    assert abort and "c: link b -> c: 400 Mbit/s" in text and "preflight_policy=exclude" in text
    healthy, text, abort = _decide(Policy.EXCLUDE, {"c": "slow"})
    assert not abort and healthy == ["a", "b", "d"] and text.startswith("exclude c")
    healthy, text, abort = _decide(Policy.EXCLUDE, {"c": "slow"}, min_nodes=4)
    assert abort and "min_nodes=4" in text
    healthy, text, abort = _decide(Policy.EXCLUDE, {"a": "down"})
    assert abort and "fan-out source a" in text


def test_matrix_and_worst_links():
    links = [_lt("a", "b", 950, 410), _lt("c", "d", 900, 930)]
    links.append(LinkTest("a", "c", 1, 1000, error="iperf3 bidir test failed (rc 1): unable to connect"))
    m = matrix(links)
    assert m["a"]["b"] == pytest.approx(0.95) and m["b"]["a"] == pytest.approx(0.41) and "c" not in m.get("a", {})
    worst = worst_links(links, k=2)
    assert worst[0].startswith("link a -> c: iperf3 bidir test failed")
    assert worst[1].startswith("b -> a: 410 Mbit/s, 41%") and worst[2].startswith("c -> d: 900")


def test_node_scripts_quote_everything():
    s = server_script("10.0.0.2", 5201, 3, "/run/x y/iperf3.pid", "/run/x y/iperf3.log", 30, one_off=True)
    assert "'/run/x y/iperf3.pid'" in s and "-p 5203" in s and "5204" not in s and "timeout -k 2 30 iperf3" in s
    assert "0200000A" in s  # 10.0.0.2 as /proc/net/tcp writes it
    assert "'/run/a b'/iperf3-*.pid" in sweep_script("/run/a b")
    argv = client_argv("10.0.0.2", "10.0.0.1", 5202, 2, "bidir")
    assert argv[-1] == "--bidir" and argv[argv.index("-p") + 1] == "5202" and argv[:2] == ["timeout", "-k"]
