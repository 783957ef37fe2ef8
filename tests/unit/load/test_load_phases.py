"""Unit tests of the load phases' logic: the capacity search, drift, overload analysis, the shape of
the load, the /metrics parser and the SSE reader — no k6, no server."""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from deploybench import engines
from deploybench import params as form
from deploybench.config import SLO, LoadSpec
from deploybench.errors import ConfigError
from deploybench.load import Endpoint, overload, phases, probe, scrape, sustained
from deploybench.load.results import LoadResult, SloVerdict, WindowFigures
from deploybench.load.runner import build_env, offered_at, sampler_share
from deploybench.load.scrape import _quantile, engine_figures, keep_of, parse_metrics
from deploybench.load.ttft import _Stream, event_text, request_body

VLLM = engines.profile("vllm").metrics  # the names a vLLM page is read by
KEEP = keep_of(VLLM)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _result(rate: float, answered: float, p99: float = 100.0, errors: int = 0, dropped: int = 0,
            duration: float = 10.0) -> LoadResult:
    n = int(rate * duration)
    return LoadResult(
        requests=n, errors=errors, error_rate=errors / n if n else 0.0,
        errors_by_kind={"http_429": errors} if errors else {},
        achieved_rps=answered, output_tps=1.0, latency_p50_ms=p99 / 2, latency_p90_ms=p99 * 0.9,
        latency_p99_ms=p99, latency_p999_ms=p99, phase="probe", offered_rps=rate, duration_s=duration, warmup_s=1,
        started_at=T0, warmup_excluded=0, dropped_iterations=dropped, slo_ok=True,
        slo=SloVerdict(passed=True, reasons=[]),
        nodes=[], samples_path="s", warmup_samples_path=None, summary_path="x", k6_exit_code=0,
        k6_thresholds_crossed=[], k6_cpu_s=0.1, vus_pre=1, vus_max=2, tags={}, notes=[])


def _server(capacity: float, base_ms: float = 50.0):
    """A model server: answers min(rate, capacity); latency explodes past the capacity."""
    calls = []

    def step(n: int, rate: float) -> LoadResult:
        calls.append(rate)
        over = rate > capacity
        return _result(rate, min(rate, capacity), p99=base_ms * (40 if over else 1))

    return step, calls


# -- the capacity search -----------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [7.3, 33.0, 120.0, 999.0])
def test_search_brackets_the_capacity_within_tolerance(capacity):
    spec = LoadSpec(probe_start_rps=2, probe_max_rps=5000, probe_tolerance=0.03, probe_max_steps=30)
    step, calls = _server(capacity)
    got = probe.search(step, spec, SLO(p99_latency_ms=1000))
    low, high = got.bracket
    assert got.converged and low <= capacity < high and (high - low) / high <= 0.03
    assert got.capacity_rps == low and len(got.steps) == len(calls)
    assert calls[:3] == [2, 4, 8]  # doubling first
    assert [s.step for s in got.steps] == list(range(1, len(calls) + 1))


def test_search_halves_when_the_first_step_fails_and_stops_at_the_maximum():
    step, calls = _server(3.0)
    got = probe.search(step, LoadSpec(probe_start_rps=16, probe_tolerance=0.1), SLO(p99_latency_ms=1000))
    assert calls[:3] == [16, 8, 4] and got.converged and 2.7 <= got.capacity_rps <= 3.0
    step, calls = _server(1e9)
    got = probe.search(step, LoadSpec(probe_start_rps=10, probe_max_rps=50), SLO(p99_latency_ms=1000))
    assert calls == [10, 20, 40, 50] and not got.converged and got.capacity_rps == 50
    assert "at least that" in got.reason
    step, _ = _server(0.0)  # nothing ever passes
    got = probe.search(step, LoadSpec(probe_start_rps=1, probe_max_steps=20), SLO(p99_latency_ms=1000))
    assert got.capacity_rps is None and "no rate met the SLO" in got.reason


def test_search_respects_max_steps():
    step, calls = _server(77.0)
    got = probe.search(step, LoadSpec(probe_start_rps=1, probe_max_steps=4), SLO(p99_latency_ms=1000))
    assert len(calls) == 4 and not got.converged and "probe_max_steps=4" in got.reason


def _throughput_server(capacity: float, latency_bound: float | None = None, base_ms: float = 50.0):
    """A model server for the estimate-led search: past ``capacity`` it answers at ``capacity`` (an
    overloaded batch engine); with ``latency_bound`` its P99 breaks past that rate while it still answers
    all it is offered (a latency-bound engine). Ramps come with 8 windows along the ramp."""
    calls: list = []
    limit = latency_bound or capacity

    def fig(rate: float) -> dict:
        got = rate if latency_bound else min(rate, capacity)
        return {"achieved": got, "p99": base_ms * (40 if rate > limit else 1)}

    def step(n: int, rate: float) -> LoadResult:
        calls.append(("constant", rate))
        f = fig(rate)
        return _result(rate, f["achieved"], p99=f["p99"]).model_copy(update={"goodput_rps": f["achieved"]
                                                                              if rate <= limit else 0.4 * limit})

    def ramp(n: int, frm: float, to: float) -> LoadResult:
        calls.append(("ramp", frm, to))
        wins = []
        for i in range(8):
            offered = frm + (to - frm) * (i + 0.5) / 8
            f = fig(offered)
            w = _window(i * 0.5, f["achieved"], f["p99"], offered=offered)
            wins.append(w.model_copy(update={"duration_s": 0.5, "goodput_rps": f["achieved"] if offered <= limit
                                             else min(f["achieved"], limit)}))
        return _result(frm, min(frm, capacity)).model_copy(update={"windows": wins, "stages": [(to, 4.0)],
                                                                   "duration_s": 4.0, "offered_rps": (frm + to) / 2})

    return step, ramp, calls


@pytest.mark.parametrize("capacity", [0.7, 7.3, 60.1, 120.0, 999.0])
def test_estimate_led_search_reaches_5_percent_in_at_most_8_steps(capacity):
    spec = LoadSpec(probe_start_rps=1, probe_max_rps=5000, probe_tolerance=0.05)
    step, ramp, calls = _throughput_server(capacity)
    got = probe.search(step, spec, SLO(p99_latency_ms=1000), run_ramp=ramp)
    low, high = got.bracket
    assert got.converged and low <= capacity < high and (high - low) / high <= 0.05, (got.reason, calls)
    assert abs(got.capacity_rps / capacity - 1) <= 0.05 and len(got.steps) <= 8, calls
    ramps = [s for s in got.steps if s.kind == "ramp"]
    # a ramp claims nothing
    assert ramps and calls[0] == ("ramp", 1, probe.RAMP_FACTOR) and not any(s.passed for s in ramps)
    assert all(s.kind == "constant" for s in got.steps[len(ramps):]) and ramps[-1].estimate_rps is not None
    assert got.capacity_rps == max(s.rate for s in got.steps if s.passed)
    # the doubling search on the same server takes more steps for the same bracket (or runs out of them)
    step, _, old = _throughput_server(capacity)
    before = probe.search(step, spec, SLO(p99_latency_ms=1000))
    assert len(before.steps) > len(got.steps) and ("ramp",) not in {c[:1] for c in old}


def test_estimate_led_search_with_a_latency_bound_server_still_converges():
    spec = LoadSpec(probe_start_rps=1, probe_max_rps=5000, probe_tolerance=0.05, probe_max_steps=14)
    step, ramp, calls = _throughput_server(200.0, latency_bound=45.0)
    got = probe.search(step, spec, SLO(p99_latency_ms=1000), run_ramp=ramp)
    low, high = got.bracket
    assert got.converged and low <= 45.0 < high and (high - low) / high <= 0.05, calls
    assert len(got.steps) <= 10, calls


def test_ramp_estimate_is_the_throughput_after_the_break():
    step, ramp, _ = _throughput_server(30.0)
    res = ramp(1, 10, 80)
    est, why = probe.ramp_estimate(res, SLO(p99_latency_ms=1000), LoadSpec())
    assert est == pytest.approx(30.0) and "broke" in why and "latency_p99" in why
    est, why = probe.ramp_estimate(ramp(2, 1, 8), SLO(p99_latency_ms=1000), LoadSpec())
    assert est is None and "held up to" in why
    # a lone late window (k6 behind on a busy machine) before the real break is not the server's limit
    res = ramp(3, 10, 80)
    wins = list(res.windows)
    wins[0] = wins[0].model_copy(update={"latency_p99_ms": 5000.0, "goodput_rps": 3.0})
    est, why = probe.ramp_estimate(res.model_copy(update={"windows": wins}), SLO(p99_latency_ms=1000), LoadSpec())
    assert est == pytest.approx(30.0), why


def test_a_break_in_the_ramps_last_window_alone_is_read_with_the_window_before():
    """One 0.5 s window holds a handful of requests: its throughput alone is no estimate (llama.cpp's scout
    read 12 req/s so on a server that held 20). The estimate takes the window before it too."""
    slo, spec = SLO(p99_latency_ms=1000), LoadSpec(probe_tolerance=0.15)
    _, ramp, _ = _throughput_server(30.0)
    res = ramp(1, 1, 8)  # every window held
    wins = list(res.windows)
    wins[-1] = wins[-1].model_copy(update={"kept_up": 0, "goodput_rps": 2.0})  # the last one fell behind
    est, why = probe.ramp_estimate(res.model_copy(update={"windows": wins}), slo, spec)
    assert "broke (kept_up)" in why and f"at {wins[-1].offered_rps:.2f} req/s" in why, why
    assert est == pytest.approx(wins[-2].goodput_rps) and "median of 2 windows" in why, why


def test_judge_names_every_broken_criterion():
    spec, slo = LoadSpec(), SLO(p99_latency_ms=200, max_error_rate=0.01)
    ok, reasons, ratio = probe.judge(_result(10, 10), slo, spec)
    assert ok and reasons == [] and ratio == 1.0
    ok, reasons, ratio = probe.judge(_result(10, 9.5, p99=300, errors=5, dropped=2), slo, spec)
    assert not ok and ratio == pytest.approx(0.95)
    text = " | ".join(reasons)
    assert "P99 latency 300 ms" in text and "error rate" in text and "fell behind" in text
    assert "2 iterations dropped" in text
    # one request of slack at the window's edges: 99 of 100 at a 99 % bar passes, 97 does not
    assert probe.judge(_result(10, 9.8), slo, spec)[0] and not probe.judge(_result(10, 9.7), slo, spec)[0]


def _fifo_samples(rate: float, secs: float, service_s: float, backlog: int = 0):
    """Samples of a one-at-a-time FIFO server (service ``service_s``) offered ``rate`` req/s evenly for
    ``secs`` s, with ``backlog`` requests already queued at 0: (frame, start)."""
    import pandas as pd

    start = pd.Timestamp(T0)
    rows, free = [], backlog * service_s
    for i in range(int(rate * secs)):
        t = i / rate
        free = max(free, t) + service_s
        rows.append({"ts": start + pd.Timedelta(seconds=t), "phase": "p", "node": "n1", "status": 200,
                     "error_kind": None, "latency_ms": (free - t) * 1000, "ttft_ms": float("nan"), "prompt_tokens": 1,
                     "output_tokens": 1, "warmup": False, "lag_ms": 0.0, "itl_ms": None})
    return pd.DataFrame(rows), start


def test_windows_see_a_queue_that_answered_counts_do_not():
    from deploybench.load.stats import window_figures

    spec, slo = LoadSpec(probe_tolerance=0.05), SLO(p99_latency_ms=5000)
    # 10 req/s offered, a server of 8 req/s: it answers at its capacity, its queue grows 2 req/s, latency
    # stays far under the SLO for these 4 s
    df, start = _fifo_samples(10, 4, 0.125)
    wins = window_figures(df, start, 4, 0.5, lambda t: 10.0, slo=slo)
    late = wins[-1]
    assert late.latency_p99_ms < 1200 and late.achieved_rps == pytest.approx(8, abs=2.01)
    assert late.in_flight_end > late.in_flight_start  # +2 req/s over 0.5 s
    assert all(w.in_flight_end >= w.in_flight_start for w in wins) and wins[-1].in_flight_end >= 7
    kinds = [dict(probe.falls_behind(w, spec, slo)) for w in wins]
    assert any(kinds) and all("latency_p99" not in k for k in kinds)
    # over the whole 4 s as one step: 8 more in flight at the end than at the start
    from deploybench.load.stats import figures

    fig = figures(df, 4, start=start, slo=slo)
    why = dict(probe.falls_behind(fig, spec, slo, offered_rps=10, duration_s=4))
    assert set(why) == {"in_flight"} and "grew from 0 to 8" in why["in_flight"], why  # answered within 4 s grace
    assert "kept_up" in kinds[-1] and wins[-1].kept_up < 5  # per window, a grace of 0.5 s
    # the same server offered 7 req/s keeps up: nothing in flight grows, everything answered in time
    df, start = _fifo_samples(7, 4, 0.125)
    fig = figures(df, 4, start=start, slo=slo)
    assert probe.falls_behind(fig, spec, slo, offered_rps=7, duration_s=4) == [] and fig.kept_up == 28
    # a backlog left by an earlier step (a server still working on abandoned requests, invisible to this step's
    # client) holds this step's requests back: they pile up in flight, the step fails though it would pass alone
    df, start = _fifo_samples(7, 4, 0.125, backlog=30)
    fig = figures(df, 4, start=start, slo=slo)
    assert fig.in_flight_end >= 20 and "in_flight" in dict(probe.falls_behind(fig, spec, slo, offered_rps=7,
                                                                                 duration_s=4))


def test_ramp_over_a_server_falling_behind_breaks_on_its_queue():
    """The survivorship case: windows answering near what was offered (within the ramp's allowance), P99
    under the SLO, but the requests in flight grow window after window: the ramp breaks there, and its
    estimate is the server's throughput."""
    slo, spec = SLO(p99_latency_ms=5000), LoadSpec(probe_tolerance=0.15)
    _, ramp, _ = _throughput_server(1000.0)  # answers what it is offered: the answered counts see nothing
    res = ramp(1, 2, 32)
    wins = [w.model_copy(update={"in_flight_start": 0 if w.offered_rps < 10 else 3 * i,
                                 "in_flight_end": 0 if w.offered_rps < 10 else 3 * (i + 1),
                                 "kept_up": round(w.offered_rps * 0.5) if w.offered_rps < 10 else 5,
                                 "achieved_rps": min(w.offered_rps, 10.0), "goodput_rps": min(w.offered_rps, 10.0)})
            for i, w in enumerate(res.windows)]
    plain = [w.model_copy(update={"in_flight_start": None, "in_flight_end": None, "kept_up": None}) for w in wins]
    old_est, old_why = probe.ramp_estimate(res.model_copy(update={"windows": plain}), slo, spec)
    est, why = probe.ramp_estimate(res.model_copy(update={"windows": wins}), slo, spec)
    assert est == pytest.approx(10.0) and "in_flight" in why, why
    import re

    def at(text: str) -> float:
        return float(re.search(r"at ([0-9.]+) req/s offered", text).group(1))

    # the answered counts alone see it late (a ramp's answers lag its offered rate) or not at all
    assert old_est is None or at(old_why) > at(why) + 2, (old_why, why)


def test_search_drains_after_ramps_and_failed_steps_and_does_not_count_it():
    spec = LoadSpec(probe_start_rps=1, probe_max_rps=5000, probe_tolerance=0.05)
    step, ramp, calls = _throughput_server(60.1)
    drains: list[int] = []

    def drain() -> tuple[float, str]:
        drains.append(len(calls))
        return 1.5, "idle: test"

    got = probe.search(step, spec, SLO(p99_latency_ms=1000), run_ramp=ramp, drain=drain)
    assert got.converged and len(got.steps) == len(calls) <= 8  # a drain is not a step
    waited = [s for s in got.steps if s.drain_s is not None]
    last = got.steps[-1]
    assert {s.step for s in waited} == {s.step for s in got.steps[:-1] if not s.passed}, got.steps
    assert all(s.drain_s == 1.5 and s.drained == "idle: test" for s in waited) and last.drain_s is None
    assert drains == [s.step for s in waited]  # right after its step, before the next one


# -- sustained: drift --------------------------------------------------------------------------------
def _window(start: float, achieved: float, p99: float | None, offered: float = 10.0, sent: float | None = None,
            errors: dict | None = None, p50: float | None = None) -> WindowFigures:
    n = int(round((sent if sent is not None else offered) * 2))
    nerr = sum((errors or {}).values())
    return WindowFigures(
        start_s=start, duration_s=2.0, offered_rps=offered, requests=n, errors=nerr, error_rate=nerr / n if n else 0,
        errors_by_kind=errors or {}, achieved_rps=achieved, output_tps=1.0, latency_p50_ms=p50 or (p99 and p99 / 2),
        latency_p90_ms=p99, latency_p99_ms=p99, latency_p999_ms=p99, sent_rps=sent if sent is not None else offered)


def test_drift_compares_first_and_last_window():
    flat = [_window(0, 10, 100), _window(2, 10.2, 104), _window(4, 9.8, 108)]
    d = sustained.drift(flat, 0.1)
    assert not d.drifted and d.achieved_change == pytest.approx(-0.02) and d.latency_p99_change == pytest.approx(0.08)
    d = sustained.drift([_window(0, 10, 100), _window(2, 8.5, 130)], 0.1)
    assert d.drifted and len(d.reasons) == 2 and "-15.0%" in d.reasons[0] and "+30.0%" in d.reasons[1]
    d = sustained.drift([_window(0, 10, 100)], 0.1)
    assert not d.drifted and "needs two" in d.reasons[0]
    # Poisson windows offer more or less: answering what each offered is no drift; falling behind it is
    bursts = [_window(0, 7.6, 100, offered=7.6), _window(2, 9.3, 100, offered=9.4)]
    assert not sustained.drift(bursts, 0.1).drifted
    d = sustained.drift([_window(0, 7.6, 100, offered=7.6), _window(2, 7.5, 100, offered=9.4)], 0.1)
    assert d.drifted and "of 7.60 -> 9.40 offered" in d.reasons[0]
    assert d.achieved_change == pytest.approx(7.5 / 9.4 - 1, abs=1e-3)


# -- overload: where each objective broke, recovery ------------------------------------------------------
def test_overload_finds_break_rates_and_recovery():
    spec = LoadSpec(overload_ramp_s=8, recovery_s=6, overload_factor=2, sustained_fraction=0.5)
    slo = SLO(p99_latency_ms=500, max_error_rate=0.01)
    windows = [
        _window(0, 10, 100, offered=10), _window(2, 15, 200, offered=15),
        _window(4, 17, 900, offered=20),  # falls behind and over the latency limit at 20 req/s
        _window(6, 17, 1500, offered=25, errors={"http_429": 8}),
        _window(8.001, 20, 800, offered=5),  # recovery: draining the backlog
        _window(10.001, 5, 120, offered=5), _window(12.001, 5, 110, offered=5),
    ]
    res = _result(10, 10).model_copy(update={"windows": windows})
    an = overload.analyse(res, 10.0, slo, spec)
    assert an.broke_at["latency_p99"].rate == 20 and an.broke_at["latency_p99"].value == 900
    assert an.broke_at["achieved_ratio"].rate == 20 and an.broke_at["error_rate"].rate == 25
    assert an.broke_at["ttft_p99"] is None  # the SLO has no TTFT objective
    assert an.errors_by_kind_ramp == {"http_429": 8} and an.errors_by_kind_recovery == {}
    assert an.recovered and an.recovery_s == pytest.approx(2.0)
    assert an.recovery_by_objective_s["latency_p99"] == pytest.approx(2.0) and an.client_limited_windows == []


def test_overload_without_recovery_and_client_limited_windows():
    spec = LoadSpec(overload_ramp_s=4, recovery_s=4)
    windows = [_window(0, 10, 100, offered=10), _window(2, 12, 100, offered=20, sent=12),  # k6 could not send
               _window(4.001, 5, 5000, offered=5), _window(6.001, 5, 5000, offered=5)]
    an = overload.analyse(_result(10, 10).model_copy(update={"windows": windows}), 10.0, SLO(p99_latency_ms=500), spec)
    assert an.client_limited_windows == [2]
    assert an.broke_at["achieved_ratio"] is None  # judged against what was sent
    assert not an.recovered and an.recovery_s is None


def test_overload_shape():
    start, stages = overload.shape(100.0, LoadSpec(sustained_fraction=0.8, overload_factor=3, overload_ramp_s=20,
                                                   recovery_s=10))
    assert start == 80 and stages == [(300, 20), (50, overload.DROP_S), (50, 10)]


# -- what the sustained and overload phases offer: the load rate as typed, or a fraction of the probed capacity ---
@pytest.fixture
def offered(monkeypatch) -> dict:
    """phase -> (rate, stages) that phase asked k6 for (run_load stood in for; no k6, no server)."""
    asked: dict = {}

    def run_load(endpoints, spec, slo, out_dir, phase="sustained", rate=None, stages=None, **_):
        asked[phase] = (rate, stages)
        return _result(rate, rate).model_copy(update={"phase": phase})

    monkeypatch.setattr(sustained, "run_load", run_load)
    monkeypatch.setattr(overload, "run_load", run_load)
    return asked


EPS = [Endpoint("n1", "http://127.0.0.1:9", "m")]


def test_without_the_probe_the_sustained_phase_offers_the_load_rate_as_typed(offered, tmp_path):
    """load_rate 60 offers 60 req/s (it offered 0.8 x 60 = 48 before: the default sustained_fraction applied to
    the typed rate); overload starts there and ramps to overload_factor x it."""
    spec = LoadSpec(rate=60, phases=["sustained", "overload"], overload_factor=2, overload_ramp_s=20, recovery_s=10,
                    scrape_interval_s=0)
    assert spec.sustained_fraction == 0.8  # the default, not applied to a typed rate
    out = phases.run_phase("sustained", EPS, spec, SLO(), tmp_path)
    assert offered["sustained"] == (60, None) and out["analysis"]["capacity_source"] == "config"
    phases.run_phase("overload", EPS, spec, SLO(), tmp_path)
    assert offered["overload"] == (60, [(120, 20), (30, overload.DROP_S), (30, 10)])


def test_with_the_probe_the_sustained_phase_offers_its_fraction_of_the_capacity(offered, tmp_path):
    phases._write(tmp_path, "probe", {"phase": "probe", "status": "success", "analysis": {"capacity_rps": 50.0}})
    spec = LoadSpec(rate=60, phases=["probe", "sustained", "overload"], overload_factor=2, overload_ramp_s=20,
                    recovery_s=10, scrape_interval_s=0)
    out = phases.run_phase("sustained", EPS, spec, SLO(), tmp_path)
    assert offered["sustained"] == (40, None) and out["analysis"]["capacity_source"] == "probe"
    phases.run_phase("overload", EPS, spec, SLO(), tmp_path)
    assert offered["overload"] == (40, [(100, 20), (25, overload.DROP_S), (25, 10)])
    assert phases.phase_spec(spec, "probe") is spec and phases.phase_spec(spec, "config").sustained_fraction == 1


# -- load shape and environment -------------------------------------------------------------------------
def test_offered_rate_along_a_ramp():
    stages = [(30.0, 4.0), (5.0, 0.001), (5.0, 3.0)]
    assert offered_at(10, None, 99) == 10
    assert offered_at(10, stages, 0) == 10 and offered_at(10, stages, 2) == pytest.approx(20)
    assert offered_at(10, stages, 4.0005) == pytest.approx(17.5) and offered_at(10, stages, 6) == 5


def test_sampler_share_is_bounded():
    assert sampler_share(LoadSpec(ttft_sample_rps=1), 10, None) == 1
    assert sampler_share(LoadSpec(ttft_sample_rps=5), 4, [(2.0, 1.0)]) == 1  # half the lowest rate
    assert sampler_share(LoadSpec(ttft_sample_rps=0), 10, None) == 0
    assert sampler_share(LoadSpec(ttft_sample_rps=1), 0.05, None) == 0  # too small to be worth it


def test_the_sampler_left_to_itself_takes_enough_for_its_p99():
    """Unset: 100 samples over the measured window, at least 1/s, at most a quarter of the shape's lowest rate."""
    auto = LoadSpec()
    assert auto.ttft_sample_rps is None
    assert sampler_share(auto, 20, None, 30) == pytest.approx(100 / 30)  # the 30 s at 20 req/s: 100, not 30
    assert sampler_share(auto, 20, None, 600) == 1.0  # a long phase: 1/s gives 600
    assert sampler_share(auto, 10, None, 6) == 2.5  # a short probe step: a quarter of the rate
    assert sampler_share(auto, 40, [(4.0, 10.0), (40.0, 10.0)], 20) == 1.0  # a ramp: a quarter of its lowest rate
    assert sampler_share(auto, 0.1, None, 30) == 0  # a quarter of 0.1/s is too small to be worth it


def test_env_carries_step_stages_and_peak_sized_vus():
    eps = [Endpoint("n1", "http://127.0.0.1:1", "m")]
    env = build_env(eps, LoadSpec(output_spread=0.3), SLO(p99_latency_ms=1000), phase="overload", rate=10,
                    duration_s=5, step=3, stages=[(40.0, 5.0)], warmup_s=0)
    assert env["DB_STEP"] == "3" and env["DB_STAGES"] == "[[40.0, 5.0]]" and env["DB_OUTPUT_SPREAD"] == "0.3"
    assert env["DB_MAX_VUS"] == "160"  # sized for the peak of the ramp: 40 req/s x 1 s x 4
    with pytest.raises(ConfigError, match="step"):
        build_env(eps, LoadSpec(), SLO(), phase="p", rate=1, duration_s=1, tags={"step": "x"})


# -- config and form ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("flat", "words"), [
    ({"load_phases": ["probe", "probe"]}, "phases"),
    ({"load_phases": ["warmup"]}, "phases"),
    ({"probe_start_rps": 50, "probe_max_rps": 10}, "probe_max_rps"),
    ({"sustained_fraction": 0}, "sustained_fraction"),
    ({"overload_factor": 1.0}, "overload_factor"),
    ({"probe_tolerance": 0.9}, "probe_tolerance"),
    ({"target_url": "not a url"}, "target_url"),
    ({"slo_p99_ttft_ms": -1}, "slo_p99_ttft_ms"),
])
def test_bad_load_params_are_refused_before_anything_runs(flat, words):
    with pytest.raises(ConfigError, match=words):
        form.to_config({"inventory": "x", **flat})


def test_form_schema_bounds_the_new_fields():
    fields = {f.name: f for f in form.FIELDS}
    assert fields["load_phases"].schema["items"]["enum"] == ["probe", "sustained", "spike", "overload"]
    assert fields["overload_factor"].schema["exclusiveMinimum"] == 1
    assert fields["sustained_fraction"].section == "Phase settings"
    assert fields["slo_p99_ttft_ms"].section is form.EVERYDAY  # the SLO is among the fields the form shows open
    assert form.to_config({"inventory": "x"}).load.phases == ["sustained"]  # the default: one phase


# -- /metrics ----------------------------------------------------------------------------------------
METRICS = """# HELP vllm:num_requests_running x
vllm:num_requests_running{model_name="m"} 3
vllm:time_to_first_token_seconds_bucket{model_name="m",le="0.01"} %d
vllm:time_to_first_token_seconds_bucket{model_name="m",le="0.02"} %d
vllm:time_to_first_token_seconds_bucket{model_name="m",le="+Inf"} %d
vllm:time_to_first_token_seconds_sum{model_name="m"} %s
vllm:time_to_first_token_seconds_count{model_name="m"} %d
process_cpu_seconds_total 12
"""


def test_parse_metrics_keeps_engine_families_with_labels():
    got = parse_metrics(METRICS % (1, 2, 2, "0.03", 2), KEEP)
    assert ("vllm:num_requests_running", {"model_name": "m"}, 3.0) in got
    assert ("vllm:time_to_first_token_seconds_bucket", {"model_name": "m", "le": "+Inf"}, 2.0) in got
    assert not any(n.startswith("process_") for n, _, _ in got)


def test_engine_figures_between_the_scrapes_around_the_window():
    def scrape(t: datetime, b1: int, b2: int, total: float) -> list[dict]:
        base = {"ts": t.isoformat(), "node": "n1", "phase": "p", "step": 0}
        pts = [{**base, "metric": "up", "labels": {}, "value": 1.0}]
        return pts + [{**base, "metric": n, "labels": lb, "value": v}
                      for n, lb, v in parse_metrics(METRICS % (b1, b2, b2, repr(total), b2), KEEP)]

    points = scrape(T0, 5, 5, 0.05) + scrape(T0 + timedelta(seconds=2), 10, 10, 0.1)  # warm-up: 10 fast
    points += scrape(T0 + timedelta(seconds=4), 10, 20, 0.25)  # measured: 10 more, between 10 and 20 ms
    points.append({"ts": (T0 + timedelta(seconds=5)).isoformat(), "node": "n1", "phase": "p", "step": 0,
                   "metric": "up", "labels": {}, "value": 0.0})
    fig = engine_figures(points, start=T0 + timedelta(seconds=3), metrics=VLLM)["n1"]
    assert fig["ttft_count"] == 10 and fig["ttft_mean_ms"] == pytest.approx(15.0)
    assert fig["ttft_p50_ms"] == pytest.approx(15.0) and fig["scrapes"] == 3 and fig["scrape_errors"] == 1
    assert fig["running_max"] == 3.0


def test_parse_metrics_leaves_out_samples_that_are_not_finite_and_counts_why():
    page = (METRICS % (1, 2, 2, "0.03", 2)
            + 'vllm:num_requests_waiting{model_name="m"} NaN\nvllm:num_requests_waiting{model_name="m"} -Inf\n'
            + 'vllm:num_requests_waiting 1e300\nvllm:num_requests_waiting 12abc\n'
            + "".join(f'vllm:time_to_first_token_seconds_bucket{{le="{le}"}} 1\n' for le in ("fast", "NaN", "-Inf"))
            + "vllm:num_requests_running{" + ",".join(f'l{i}="v"' for i in range(scrape.MAX_LABELS + 1)) + "} 1\n"
            + f'vllm:num_requests_running{{model_name="{"m" * (scrape.MAX_LABEL_CHARS + 1)}"}} 1\n')
    dropped: Counter[str] = Counter()
    got = parse_metrics(page, KEEP, dropped=dropped)
    assert got == parse_metrics(METRICS % (1, 2, 2, "0.03", 2), KEEP)  # le="+Inf" is a bucket bound: kept
    assert dropped == {"value NaN, infinite, out of range or not a number": 4, "le not a number (nor +Inf)": 3,
                       f"more than {scrape.MAX_LABELS} labels": 1,
                       f"a name or label longer than {scrape.MAX_LABEL_CHARS} characters": 1}


def test_parse_metrics_refuses_a_page_past_its_sample_bound(monkeypatch):
    monkeypatch.setattr(scrape, "MAX_SAMPLES", 3)
    page = "vllm:a 1\n" * 3 + "# many comments and other families are not counted\nx 1\n"
    assert len(parse_metrics(page, ("vllm:",))) == 3
    with pytest.raises(scrape.MetricsPageError, match="more than 3 samples"):
        parse_metrics("vllm:a 1\n" * 4, ("vllm:",))


def test_engine_figures_of_a_hostile_page_are_absent_never_nan():
    """A bucket with a non-numeric bound is left out of its histogram; a quotient that overflows (a _sum over a
    _count of 1e-300) is absent: nothing the stage record is written from is NaN or infinite."""
    def scrape_(t: float, n: float, total: float, le: str) -> list[dict]:
        base = {"ts": (T0 + timedelta(seconds=t)).isoformat(), "node": "n1", "phase": "p", "step": 0}
        page = (f'vllm:time_to_first_token_seconds_bucket{{le="0.01"}} {n}\n'
                f'vllm:time_to_first_token_seconds_bucket{{le="{le}"}} {n}\n'
                f'vllm:time_to_first_token_seconds_bucket{{le="+Inf"}} {n}\n'
                f"vllm:time_to_first_token_seconds_sum {total}\nvllm:time_to_first_token_seconds_count {n}\n"
                f"vllm:num_requests_running NaN\n")
        return [{**base, "metric": "up", "labels": {}, "value": 1.0}] + [
            {**base, "metric": m, "labels": lb, "value": v} for m, lb, v in parse_metrics(page, KEEP)]

    fig = engine_figures(scrape_(0, 0, 0, "fast") + scrape_(1, 1e-300, 1e18, "NaN"), start=T0, metrics=VLLM)["n1"]
    assert fig["ttft_count"] == 0 and fig["ttft_p50_ms"] == 5.0  # the 0.01 bucket: "fast" and "NaN" left out
    assert fig["ttft_mean_ms"] is None and fig["running_max"] is None  # 1e18 / 1e-300 overflows: absent
    json.dumps(fig, allow_nan=False)


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = [(0.1, 10.0), (0.2, 30.0), (float("inf"), 40.0)]
    assert _quantile(0.5, buckets) == pytest.approx(0.15) and _quantile(0.9, buckets) == 0.2
    assert _quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


# -- the SSE reader of the TTFT sampler -----------------------------------------------------------------
def test_sse_events_of_openai_chat_and_triton():
    s = _Stream()
    assert s.feed(b'data: {"choices":[{"text":" a"}]}\r\n\r\ndata: {"cho') == ['{"choices":[{"text":" a"}]}']
    assert s.feed(b'ices":[{"delta":{"content":"b"}}]}\n\n: ping\ndata: [DONE]\n') == [
        '{"choices":[{"delta":{"content":"b"}}]}', "[DONE]"]
    assert event_text('{"choices":[{"text":" a"}]}') == (" a", None)
    assert event_text('{"choices":[{"delta":{"content":"b"}}]}') == ("b", None)
    assert event_text('{"text_output":"c"}') == ("c", None)
    # Triton's vLLM backend counts each response's new tokens when asked (return_num_output_tokens)
    assert event_text('{"text_output":"c d","num_output_tokens":[2],"num_input_tokens":7}') == (
        "c d", {"prompt_tokens": 7, "output_delta": 2})
    assert event_text('{"choices":[],"usage":{"completion_tokens":2}}') == ("", {"completion_tokens": 2})
    assert event_text("not json") == ("", None)


def test_streamed_request_bodies():
    path, body = request_body("triton", "my model", "hi", 4)
    got = json.loads(body)
    # vllm_backend src/utils/request.py: stream and exclude_input_in_output are inputs, the sampling parameters in
    # "parameters" (a stream there fails the request)
    assert path == "/v2/models/my%20model/generate_stream" and got["stream"] is True
    assert got["exclude_input_in_output"] is True and got["return_num_output_tokens"] is True
    assert "stream" not in got["parameters"] and got["parameters"]["max_tokens"] == 4
    path, body = request_body("chat", "m", "hi", 4)
    assert path == "/v1/chat/completions" and b'"include_usage": true' in body and b'"messages"' in body


def _pages(*pages: str, keep: tuple[str, ...]) -> list[dict]:
    """Scrapes of one node, a second apart, from Prometheus pages."""
    out = []
    for i, text in enumerate(pages):
        base = {"ts": (T0 + timedelta(seconds=i)).isoformat(), "node": "n1", "phase": "p", "step": 0}
        out.append({**base, "metric": "up", "labels": {}, "value": 1.0})
        out += [{**base, "metric": n, "labels": lb, "value": v} for n, lb, v in parse_metrics(text, keep)]
    return out


def test_engine_figures_are_computed_by_the_roles_the_profile_maps():
    """Issue 28: the names come from the profile's map only. Triton's counters give the mean queue and compute
    time per request and the average batch size (inferences / executions, docs/user_guide/metrics.md); vLLM's
    prefix-cache counters a hit rate, read with or without prometheus_client's _total. A role the profile does
    not map has no figure; one it maps that the page lacks is None (absent, never 0)."""
    tri = engines.profile("triton").metrics
    lb = '{model="m",version="1"}'

    def triton(success: int, inferences: int, execs: int, queue_us: int, compute_us: int) -> str:
        return (f"nv_inference_request_success{lb} {success}\nnv_inference_request_failure{lb} 0\n"
                f"nv_inference_count{lb} {inferences}\nnv_inference_exec_count{lb} {execs}\n"
                f"nv_inference_queue_duration_us{lb} {queue_us}\nnv_inference_compute_infer_duration_us{lb} "
                f"{compute_us}\nnv_inference_pending_request_count{lb} 2\nvllm:num_requests_running 9\n")

    pts = _pages(triton(10, 10, 10, 1000, 50_000), triton(30, 50, 20, 41_000, 2_050_000), keep=keep_of(tri))
    fig = engine_figures(pts, start=T0, metrics=tri)["n1"]
    assert fig["success"] == 20 and fig["failure"] == 0 and fig["batch_mean"] == pytest.approx(40 / 10)
    assert fig["queue_mean_ms"] == pytest.approx(40_000 / 20 / 1000) and fig["compute_mean_ms"] == pytest.approx(100)
    assert fig["waiting_max"] == 2 and fig["ttft_count"] is None and fig["ttft_mean_ms"] is None  # mapped, absent
    assert "running_max" not in fig and "prefix_hit_rate" not in fig  # not mapped: no figure at all

    vl = engines.profile("vllm").metrics
    page = ('vllm:prefix_cache_queries_total{{model_name="m"}} {}\nvllm:prefix_cache_hits_total{{model_name="m"}} {}\n'
            'vllm:num_preemptions_total{{model_name="m"}} {}\nvllm:kv_cache_usage_perc{{model_name="m"}} {}\n')
    fig = engine_figures(_pages(page.format(100, 10, 0, 0.2), page.format(1100, 760, 3, 0.6), keep=keep_of(vl)),
                         start=T0, metrics=vl)["n1"]
    assert fig["prefix_queries"] == 1000 and fig["prefix_hit_rate"] == pytest.approx(0.75)
    assert fig["preemptions"] == 3 and fig["kv_usage_max"] == 0.6 and fig["running_max"] is None

    sg = engines.profile("sglang").metrics  # the same page read by another engine's names: nothing of vLLM's
    fig = engine_figures(_pages(page.format(1, 1, 1, 1), page.format(2, 2, 2, 2), keep=keep_of(sg)),
                         start=T0, metrics=sg)["n1"]
    assert fig["scrapes"] == 2 and all(v is None for k, v in fig.items() if k not in ("scrapes", "scrape_errors"))

