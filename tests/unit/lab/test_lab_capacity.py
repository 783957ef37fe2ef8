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


def test_a_host_that_reaches_the_shaped_rate_keeps_the_ceiling():
    got = capacity.choose([480.0, 470.0, 495.0, 460.0], pairs=2)
    assert got.link_mbit == capacity.DEFAULT_LINK_MBIT
    assert "ceiling is reached" in got.note


def test_a_cpu_bound_host_gets_half_its_slowest_stream_rounded_down():
    # 24 pairs: streams at 230..400, the slowest 230 -> 115 -> 110 (steps of 10 past 100)
    rates = [230.0, 400.0] * 12 + [318.0] * 24
    got = capacity.choose(rates, pairs=24)
    assert got.link_mbit == math.floor(capacity.HEADROOM * min(rates) / 10) * 10 == 110
    assert "24 pairs at once" in got.note and "48 streams" in got.note and "slowest 230" in got.note
    # one slow stream below 90 % of the ceiling is enough to say the host, not the shaping, set the pace
    assert capacity.choose([500.0] * 7 + [440.0], pairs=4).link_mbit < capacity.DEFAULT_LINK_MBIT
    assert capacity.choose([64.0, 62.0], pairs=1).link_mbit == 30  # 31: steps of 5 from 20 to 100
    assert capacity.choose([5.0, 5.0], pairs=1).link_mbit == 2  # steps of 1 under 20


@pytest.mark.parametrize("rates", [[], [float("nan"), 300.0], [float("inf")], [-5.0, 300.0]])
def test_unusable_rates_are_refused_with_the_way_out(rates):
    with pytest.raises(LabError, match="--link-mbit"):
        capacity.choose(rates, pairs=1)


def test_a_host_too_busy_for_any_link_says_so():
    with pytest.raises(LabError, match="fewer nodes, or pass --link-mbit"):
        capacity.choose([0.5, 1.0], pairs=1)


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
