import itertools
import json

import pytest

from deploybench.config import LinkMode
from deploybench.preflight import LinkTest, NodeCheck, blame, link_pairs, parse_iperf3, schedule_rounds

NAMES = [f"n{i:02d}" for i in range(1, 17)]


def _disjoint(rounds):
    for rnd in rounds:
        used = [x for p in rnd for x in p]
        assert len(used) == len(set(used)), rnd


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 15, 16])
def test_mesh_covers_every_pair_once_in_disjoint_rounds(n):
    names = NAMES[:n]
    pairs = link_pairs(names, LinkMode.MESH)
    rounds = schedule_rounds(pairs)
    _disjoint(rounds)
    flat = [frozenset(p) for rnd in rounds for p in rnd]
    assert sorted(map(sorted, flat)) == sorted(map(sorted, (frozenset(c) for c in itertools.combinations(names, 2))))
    if n > 2:  # the optimum: N-1 rounds for even N, N for odd N (one node sits out each round)
        assert len(rounds) == (n - 1 if n % 2 == 0 else n)


def test_ring_of_two_is_one_test_as_each_test_measures_both_directions():
    assert link_pairs(NAMES[:2], LinkMode.RING) == [("n01", "n02")]


def test_ring_is_two_rounds_for_even_n():
    rounds = schedule_rounds(link_pairs(NAMES, LinkMode.RING))
    _disjoint(rounds)
    assert len(rounds) == 2
    assert sum(len(r) for r in rounds) == 16


def test_star_from_source():
    pairs = link_pairs(NAMES[:4], LinkMode.STAR, source="n03")
    assert pairs == [("n03", "n01"), ("n03", "n02"), ("n03", "n04")]


IPERF_JSON = {
    "start": {},
    "end": {
        "streams": [{"sender": {"mean_rtt": 1500}}],
        "sum_sent": {"bits_per_second": 9.5e8, "retransmits": 3},
        "sum_received": {"bits_per_second": 9.4e8},
    },
}


def test_parse_iperf3():
    got = parse_iperf3(json.dumps(IPERF_JSON))
    assert got["mbit"] == pytest.approx(940)
    assert got["retransmits"] == 3
    assert got["rtt_ms"] == pytest.approx(1.5)


def _lt(src, dst, ok):
    return LinkTest(src, dst, 0, 1000, mbit=950 if ok else 400, ratio=0.95 if ok else 0.4, ok=ok)


def test_blame_picks_the_node_whose_links_fail():
    names = ["a", "b", "c", "d"]
    links = [_lt("a", "b", True), _lt("b", "c", False), _lt("c", "d", False), _lt("d", "a", True)]
    checks = [NodeCheck(n, True) for n in names]
    bad = blame(names, checks, links)
    assert list(bad) == ["c"]
    assert "b -> c" in bad["c"] and "400 Mbit/s" in bad["c"] and "40%" in bad["c"]


def test_blame_keeps_failed_node_checks():
    checks = [NodeCheck("a", True), NodeCheck("b", False, ["node b: iperf3 is not installed"])]
    assert blame(["a", "b"], checks, []) == {"b": "node b: iperf3 is not installed"}


def test_tests_run_concurrently_in_round_order_per_node_never_two_at_once():
    """The runner behind the stage: a test whose nodes are both free but which is not yet next for
    one of them must wait (otherwise it overtakes an earlier round's test and delays it a whole test)."""
    import random
    import threading
    import time

    from deploybench.preflight.links import _concurrent

    rounds = schedule_rounds(link_pairs(NAMES[:8], LinkMode.MESH))
    plan = [(i, pair) for i, rnd in enumerate(rounds) for pair in rnd]
    lock, active, started, most = threading.Lock(), set(), [], [0]
    cond = threading.Condition(lock)
    rng = random.Random(7)
    delays = {pair: rng.choice([0.001, 0.004, 0.02]) for _, pair in plan}

    def one(i, pair):
        with lock:
            assert not active & set(pair), f"{pair} started while {active} busy"
            active.update(pair)
            started.append((i, pair))
            most[0] = max(most[0], len(active) // 2)
            cond.notify_all()
            # give the round's other tests a second to start (a busy machine starts threads late): a runner
            # that starts them together reaches four at once, a sequential one never does
            cond.wait_for(lambda: len(active) // 2 >= 4, timeout=1.0)
        time.sleep(delays[pair])
        with lock:
            active.difference_update(pair)
        return LinkTest(pair[0], pair[1], i, 100.0)

    out = _concurrent(plan, rounds, one)
    assert [(lt.src, lt.dst) for lt in out] == [pair for _, pair in plan]  # plan order, whatever the timing
    for node in NAMES[:8]:
        mine = [i for i, pair in started if node in pair]
        assert mine == sorted(mine), f"{node} took its tests out of round order: {mine}"
    assert most[0] == 4  # four disjoint tests at once on eight nodes


class _NoServers:
    """Stands in for links.Servers (which starts iperf3 servers over SSH): these tests are about what
    run_rounds does with the readings; the lab tests (test_preflight_lab) run the real servers."""

    made: list = []  # the instances run_rounds made, newest last

    def __init__(self, *args, **kwargs):
        self.ports, self.errors, self.restarted = {}, {}, []
        _NoServers.made.append(self)

    def start_all(self, names):
        self.ports = {n: [5201] for n in names}

    def restart(self, name):
        self.restarted.append(name)

    def stop_all(self):
        pass


def _rounds_with_readings(monkeypatch, readings):
    """run_rounds on one link n01 <-> n02 whose successive tests read ``readings`` (a fraction of nominal,
    or an error text); returns (the LinkTest, how many tests ran, the servers restarted after a failed test)."""
    from types import SimpleNamespace

    from deploybench.config import PreflightSpec
    from deploybench.preflight import links

    calls = []

    def fake_test_link(cluster, src, dst, rnd, seconds, threshold, **kw):
        got = readings[len(calls)]
        calls.append(got)
        lt = LinkTest(src.name, dst.name, rnd, 1000.0, threshold=threshold, seconds=1.0)
        if isinstance(got, str):
            lt.error = got
        else:
            lt.mbit, lt.ratio, lt.ok = 1000.0 * got, got, got >= threshold
        return lt

    monkeypatch.setattr(links, "test_link", fake_test_link)
    monkeypatch.setattr(links, "Servers", _NoServers)
    inv = SimpleNamespace(node=lambda name: SimpleNamespace(name=name, link_mbit=1000.0))
    spec = PreflightSpec(link_threshold=0.9, iperf_seconds=1)
    _NoServers.made.clear()
    out = links.run_rounds(SimpleNamespace(inventory=inv), [[("n01", "n02")]], spec)
    return out[0], len(calls), _NoServers.made[0].restarted


def test_a_link_reading_low_once_is_tested_again_and_passes_on_its_second_reading(monkeypatch):
    lt, tests, restarted = _rounds_with_readings(monkeypatch, [0.62, 0.93])
    assert tests == 2 and restarted == [] and lt.ok and lt.ratio == 0.93
    assert lt.first_ratio == 0.62 and lt.seconds == 2.0
    from deploybench.preflight.policy import describe_link

    assert "tested twice, the first test read 62%" in describe_link(lt)


def test_a_slow_link_reads_low_twice_and_fails(monkeypatch):
    lt, tests, restarted = _rounds_with_readings(monkeypatch, [0.41, 0.43])
    assert tests == 2 and restarted == [] and not lt.ok and lt.ratio == 0.43 and lt.first_ratio == 0.41


def test_a_link_that_passes_or_cannot_be_measured_is_tested_once(monkeypatch):
    lt, tests, restarted = _rounds_with_readings(monkeypatch, [0.95])
    assert tests == 1 and restarted == [] and lt.ok and lt.first_ratio is None
    lt, tests, restarted = _rounds_with_readings(monkeypatch, ["iperf3 bidir test failed (rc 1): unable to connect"])
    assert tests == 1 and lt.error and lt.first_ratio is None
    assert restarted == ["n02"]  # a failed test's server is restarted (it can wedge on a half-open connection)


def test_a_retest_that_cannot_measure_leaves_the_first_low_reading_standing(monkeypatch):
    no_reading = "iperf3 bidir test failed (rc 1): unable to connect"
    lt, tests, restarted = _rounds_with_readings(monkeypatch, [0.41, no_reading])
    assert tests == 2 and restarted == ["n02"] and not lt.ok and lt.error is None and lt.ratio == 0.41
