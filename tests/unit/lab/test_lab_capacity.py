"""The lab's link speed from what its host carried (lab.capacity), without a lab: which pairs are probed, how a
measurement becomes a speed, and what iperf3's output is allowed to say."""

from __future__ import annotations

import json
import math

import pytest

from deploybench.errors import LabError
from deploybench.lab import capacity, cluster


def _iperf3(*bps: float) -> str:
    return json.dumps({"start": {}, "end": {"streams": [{"receiver": {"bits_per_second": b, "sender": i % 2 == 0}}
                                                        for i, b in enumerate(bps)]}})


def test_the_probe_runs_preflights_largest_round_disjoint_pairs():
    names = [f"n{i:02d}" for i in range(1, 6)]
    assert capacity.probe_pairs(names) == [("n01", "n02"), ("n03", "n04")]
    assert capacity.concurrent_pairs(48) == 24 and capacity.concurrent_pairs(1) == 0
    assert capacity.probe_pairs(["n01"]) == []
    assert len({n for p in capacity.probe_pairs([f"n{i:02d}" for i in range(48)]) for n in p}) == 48


def test_a_host_with_room_for_the_ceiling_keeps_the_ceiling():
    got = capacity.choose([1400.0, 1300.0, 1600.0, 1260.0], pairs=2)  # 40 % of the slowest: 504
    assert got.link_mbit == capacity.DEFAULT_LINK_MBIT
    assert "the ceiling" in got.note and "slowest 1260" in got.note
    # the slowest stream decides: one under 2.5 times the ceiling lowers every link
    assert capacity.choose([1400.0, 1300.0, 1600.0, 1240.0], pairs=2).link_mbit == 490


def test_a_cpu_bound_host_gets_40_percent_of_its_slowest_stream_rounded_down():
    # 24 pairs: streams at 290..400, the slowest 290 -> 116 -> 110 (steps of 10 past 100)
    rates = [290.0, 400.0] * 12 + [318.0] * 24
    got = capacity.choose(rates, pairs=24)
    assert got.link_mbit == math.floor(capacity.HEADROOM * min(rates) / 10) * 10 == 110
    assert "24 pairs at once" in got.note and "48 streams" in got.note and "slowest 290" in got.note
    assert capacity.choose([80.0, 78.0], pairs=1).link_mbit == 30  # 31.2: steps of 5 from 20 to 100
    assert capacity.choose([7.0, 7.5], pairs=1).link_mbit == 2  # 2.8: steps of 1 under 20


@pytest.mark.parametrize("rates", [[], [float("nan"), 300.0], [float("inf")], [-5.0, 300.0]])
def test_unusable_rates_are_refused_with_the_way_out(rates):
    with pytest.raises(LabError, match="--link-mbit"):
        capacity.choose(rates, pairs=1)


def test_a_host_too_busy_for_any_link_says_so():
    with pytest.raises(LabError, match="fewer nodes, or pass --link-mbit"):
        capacity.choose([1.0, 2.0], pairs=1)


def test_iperf3_output_is_read_as_hostile_input():
    assert capacity.stream_rates(_iperf3(300e6, 250e6)) == [300.0, 250.0]
    # a stream without a rate, a NaN or a negative rate is left out, not counted as 0
    text = json.dumps({"end": {"streams": [{"receiver": {"bits_per_second": 1e8}}, {"receiver": {}}, {},
                                           {"receiver": {"bits_per_second": "NaN"}},
                                           {"receiver": {"bits_per_second": -1}}]}})
    assert capacity.stream_rates(text) == [100.0]
    with pytest.raises(LabError, match="no JSON"):
        capacity.stream_rates("iperf3: error - unable to connect")
    with pytest.raises(LabError, match="unable to connect"):
        capacity.stream_rates(json.dumps({"error": "unable to connect to server"}))
    with pytest.raises(LabError, match="no stream"):
        capacity.stream_rates(json.dumps({"end": {"streams": []}}))


@pytest.mark.parametrize("mbit", [0, -10, float("nan"), float("inf")])
def test_an_asked_link_speed_must_be_a_positive_number(tmp_path, monkeypatch, mbit):
    monkeypatch.setenv("DEPLOYBENCH_HOME", str(tmp_path))
    with pytest.raises(LabError, match="--link-mbit .* must be a positive number"):
        cluster.up("demo", nodes=2, link_mbit=mbit, mode="loopback")
    assert not (tmp_path / "lab").exists()


def test_a_loopback_lab_measures_its_links_when_none_is_asked(tmp_path, monkeypatch):
    """The probe's real iperf3 on two loopback nodes: the speed chosen, said in the state and the inventory."""
    import shutil

    if shutil.which("iperf3") is None:
        pytest.skip("iperf3 is not installed")
    monkeypatch.setenv("DEPLOYBENCH_HOME", str(tmp_path))
    from tests.support import lab_names

    name = lab_names.unique("cap")
    try:
        inv = cluster.up(name, nodes=3, mode="loopback", model_mb=1)
        st = cluster.status(name)
        assert st.link_note is not None and "1 pair at once (2 streams" in st.link_note, st.link_note
        assert 0 < st.link_mbit <= capacity.DEFAULT_LINK_MBIT
        assert {n.link_mbit for n in inv.nodes} == {st.link_mbit}
    finally:
        cluster.down(name)


def test_the_chosen_speed_is_checked_shaped_and_lowered_until_the_round_carries_it():
    """settle: shape, run the round again; a speed whose slowest stream reads under 90 % of it is lowered by 0.7
    (rounded down) and checked again; the speed that passed (93 %) is kept, and the note gives every check."""
    first = capacity.choose([780.0, 800.0], pairs=1)  # 312 -> 310
    shaped: list[float] = []
    # this host carries 240 Mbit/s a stream once shaped, whatever the shaping promises
    got = capacity.settle(first, lambda: [min(shaped[-1], 240.0), min(shaped[-1], 250.0)], shaped.append)
    assert shaped == [310.0, 210.0]
    assert got.link_mbit == 210.0 and got.checked == [(310.0, 240.0 / 310.0), (210.0, 1.0)]
    assert "shaped to 310: slowest 77%; shaped to 210: slowest 100%" in got.note and "unverified" not in got.note
    # what a shaped veth link reads in a 1-second test when the host has room: 94 % passes the check first time
    shaped.clear()
    kept = capacity.settle(first, lambda: [shaped[-1] * 0.94, shaped[-1] * 0.97], shaped.append)
    assert shaped == [310.0] and kept.link_mbit == 310.0 and "unverified" not in kept.note
    # a host that never carries it: three checks, each read alike, the lowest speed kept and said to be unverified
    shaped.clear()
    worst = capacity.settle(first, lambda: [shaped[-1] * 0.5], shaped.append)
    assert shaped == [310.0, 210.0, 140.0] and worst.link_mbit == 140.0
    assert "none reached 93%: the one read best is kept (140), unverified" in worst.note
    # lower speeds read worse (a 48-node lab: 91 % at 130 Mbit/s, 89 % at 90, 72 % at 60): the best-read speed is
    # kept, and the links are shaped back to it
    shaped.clear()
    reads = {310.0: 0.91, 210.0: 0.89, 140.0: 0.72}
    best = capacity.settle(first, lambda: [shaped[-1] * reads[shaped[-1]]], shaped.append)
    assert shaped == [310.0, 210.0, 140.0, 310.0] and best.link_mbit == 310.0
    assert "none reached 93%: the one read best is kept (310), unverified" in best.note
    # within the noise of each other (1 point, under BEST_MARGIN): the slower one is kept
    shaped.clear()
    reads = {310.0: 0.85, 210.0: 0.84, 140.0: 0.70}
    near = capacity.settle(first, lambda: [shaped[-1] * reads[shaped[-1]]], shaped.append)
    assert shaped == [310.0, 210.0, 140.0, 210.0] and near.link_mbit == 210.0


def test_without_iperf3_a_loopback_lab_keeps_the_ceiling_and_says_it_was_not_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPLOYBENCH_HOME", str(tmp_path))
    monkeypatch.setattr(cluster.shutil, "which", lambda name, *a, **k: None)
    from tests.support import lab_names

    name = lab_names.unique("capx")
    try:
        inv = cluster.up(name, nodes=2, mode="loopback", model_mb=1)
        st = cluster.status(name)
        assert st.link_mbit == capacity.DEFAULT_LINK_MBIT == inv.nodes[0].link_mbit
        assert st.link_note is not None and "not measured: iperf3 is not installed" in st.link_note
    finally:
        cluster.down(name)
