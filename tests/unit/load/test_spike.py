"""The spike phase's pure parts: its shape, the recovery time over sliding windows of per-request samples, and the
sim's closed form checked against the very scheduler that serves (on a virtual clock) through the same measure."""

from __future__ import annotations

import pandas as pd
import pytest

from deploybench.config import SLO, EngineSpec, LoadSpec, SimKnobs
from deploybench.load import spike
from deploybench.sim.service_model import ServiceParams, capacity, simulate, spike_recovery

T0 = pd.Timestamp("2026-12-01T00:00:00Z")
SLO_1S = SLO(p99_latency_ms=1000, max_error_rate=0.01)


def _frame(rows: list[tuple[float, float, str | None]]) -> pd.DataFrame:
    """(send time s after T0, latency ms, error kind or None) -> a samples frame."""
    return pd.DataFrame({"ts": [T0 + pd.Timedelta(seconds=t) for t, _, _ in rows],
                         "latency_ms": [float(lat) for _, lat, _ in rows],
                         "error_kind": pd.Series([e for _, _, e in rows], dtype=object),
                         "node": ["n1"] * len(rows)})


def _even(rate: float, start: float, end: float, latency, error=lambda t: None) -> list:
    n = int(round((end - start) * rate))
    return [(start + i / rate, latency(start + i / rate), error(start + i / rate)) for i in range(n)]


def test_the_shape_steps_within_a_second_and_sums_to_the_phase():
    spec = LoadSpec(phases=["spike"], spike_factor=3, spike_hold_s=4, spike_recovery_s=10)
    start, stages = spike.shape(10.0, spec)
    assert start == 10.0 and [t for t, _ in stages] == [10.0, 30.0, 30.0, 10.0, 10.0]
    assert stages[1][1] <= 1.0 and stages[3][1] <= 1.0  # the steps up and down
    s0, s1, total = spike.timeline(spec)
    assert s0 == spike.SPIKE_LEAD_S and s1 == pytest.approx(s0 + 4 + spike.STEP_S)
    assert total == pytest.approx(spike.SPIKE_LEAD_S + 4 + 10) == pytest.approx(sum(s for _, s in stages))


def test_recovery_is_where_latency_comes_back_under_the_slo_and_stays():
    # latency falls linearly from 3 s at the spike's end (t=0) to 0.2 s at t=5.6: under 1 s from t=4.0 on
    lat = lambda t: max(200.0, 3000.0 - 500.0 * t)  # noqa: E731
    rec = spike.recovery(_frame(_even(20, 0, 10, lat)), T0, T0 + pd.Timedelta(seconds=10), SLO_1S)
    assert rec.recovered and rec.recovery_s == pytest.approx(4.0, abs=spike.RECOVERY_STEP_S + 1e-9), rec
    assert rec.unhealthy_windows > 0 and "from 4" in rec.reason


def test_a_relapse_moves_the_recovery_past_it():
    lat = lambda t: 5000.0 if t < 1 or 5 <= t < 5.5 else 100.0  # noqa: E731 - back at 1 s, broken again at 5 s
    rec = spike.recovery(_frame(_even(20, 0, 10, lat)), T0, T0 + pd.Timedelta(seconds=10), SLO_1S)
    assert rec.recovered and rec.recovery_s == pytest.approx(5.5, abs=spike.RECOVERY_STEP_S + 1e-9)


def test_errors_alone_keep_it_unrecovered():
    err = lambda t: "http_503" if t < 3 else None  # noqa: E731 - fast answers, but 503s until 3 s
    rec = spike.recovery(_frame(_even(20, 0, 8, lambda t: 50.0, err)), T0, T0 + pd.Timedelta(seconds=8), SLO_1S)
    assert rec.recovery_s == pytest.approx(3.0, abs=spike.RECOVERY_STEP_S + 1e-9)


def test_never_back_under_the_slo_is_absent_with_its_reason_never_zero():
    rec = spike.recovery(_frame(_even(20, 0, 6, lambda t: 1500.0 + 10 * t)), T0, T0 + pd.Timedelta(seconds=6),
                         SLO_1S)
    assert not rec.recovered and rec.recovery_s is None
    assert "not back under the SLO within the 6 s" in rec.reason and "limit 1000 ms" in rec.reason
    # nothing sent after the spike: no evidence, absent too
    none = spike.recovery(_frame(_even(20, -3, 0, lambda t: 100.0)), T0, T0 + pd.Timedelta(seconds=6), SLO_1S)
    assert none.recovery_s is None and "no requests sent" in none.reason


def test_a_flat_run_recovers_in_zero_only_because_it_never_broke():
    spec = LoadSpec(phases=["spike"], spike_factor=2, spike_hold_s=2, spike_recovery_s=4, warmup_s=0)
    s0, s1, total = spike.timeline(spec)
    flat = _frame(_even(20, 0, total, lambda t: 100.0))
    rec = spike.recovery(flat, T0 + pd.Timedelta(seconds=s1), T0 + pd.Timedelta(seconds=total), SLO_1S)
    assert rec.recovered and rec.recovery_s == 0.0 and rec.unhealthy_windows == 0
    # a spike that broke the SLO and was back at once after it: 0 too, but slo_broken says it did break
    broke = _frame(_even(20, 0, total, lambda t: 3000.0 if s0 <= t < s1 - 0.5 else 100.0))
    from deploybench.load.results import LoadResult

    res = LoadResult.model_construct(started_at=T0.to_pydatetime(), metrics_path=None)
    an = spike.analyse(res, broke, 20.0, 10.0, SLO_1S, spec)
    assert an.recovery_s == 0.0 and an.slo_broken and an.peak_p99_ms == pytest.approx(3000.0)
    assert an.requests_spike == pytest.approx(20 * (s1 - s0), abs=2) and an.failed_spike == 0
    an_flat = spike.analyse(res, flat, 20.0, 10.0, SLO_1S, spec)
    assert an_flat.recovery_s == 0.0 and not an_flat.slo_broken and an_flat.p99_before_ms == pytest.approx(100.0)
    assert an_flat.waiting_peak == {} and "names no waiting" in an_flat.waiting_reason  # absent, with its reason


# one engine of 4 slots, 8-token answers: 8 x (20 / 4 + 2) + 0.01 x 32 ms = 56.3 ms per request, 17.8 req/s
ENGINE = EngineSpec(max_num_seqs=4, sim=SimKnobs(decode_base_ms=20.0, decode_per_seq_ms=2.0,
                                                 prefill_per_token_ms=0.01, queue_limit=512))


@pytest.mark.parametrize("factor,hold_s,slo_ms", [(3.0, 4.0, 600.0), (2.5, 4.0, 500.0), (4.0, 2.0, 1200.0)])
def test_the_closed_form_matches_the_scheduler_through_the_same_measure(factor, hold_s, slo_ms):
    """The serving scheduler on a virtual clock (``simulate``), requests at even times: base at half the capacity,
    a step to ``factor`` x it held ``hold_s``, base again; its per-request latencies go through ``spike.recovery``,
    the sliding-window measure the phase reports, and land on ``spike_recovery``'s closed form."""
    params = ServiceParams.from_config(ENGINE)
    mu = capacity(params, 32, 8).requests_per_s
    base, lead, recovery_s = 0.5 * mu, 2.0, 12.0
    peak = factor * base
    times = [i / base for i in range(int(lead * base))]
    times += [lead + i / peak for i in range(int(hold_s * peak))]
    end = lead + hold_s
    times += [end + i / base for i in range(int(recovery_s * base))]
    got = simulate(params, [(1000.0 * t, 32, 8) for t in times])
    assert got.refused == 0 and got.completed == len(times)
    sent = sorted(c - e for c, e in zip(got.completions_ms, got.e2e_ms))
    lat = {round(c - e, 6): e for c, e in zip(got.completions_ms, got.e2e_ms)}
    frame = _frame([(s / 1000.0, lat[round(s, 6)], None) for s in sent])
    rec = spike.recovery(frame, T0 + pd.Timedelta(seconds=end), T0 + pd.Timedelta(seconds=end + recovery_s),
                         SLO(p99_latency_ms=slo_ms))
    form = spike_recovery(params, 32, 8, 1, base, peak, hold_s, slo_ms)
    assert form.recovery_s > 1.0 and not form.refused  # a real recovery, not one at the spike's end
    assert rec.recovered and rec.recovery_s == pytest.approx(form.recovery_s, abs=0.35), (rec, form)


def test_the_closed_form_is_zero_within_capacity_and_refuses_a_base_above_it():
    params = ServiceParams.from_config(ENGINE)
    mu = capacity(params, 32, 8).requests_per_s
    assert spike_recovery(params, 32, 8, 2, 0.5 * mu, 1.5 * mu, 5, 600).recovery_s == 0.0  # 2 engines: 2 mu
    two = spike_recovery(params, 32, 8, 2, mu, 6 * mu, 2, 600)
    assert two.capacity_rps == pytest.approx(2 * mu) and two.queue == pytest.approx(8 * mu)
    assert two.drain_s == pytest.approx(8.0)
    from deploybench.errors import ConfigError

    with pytest.raises(ConfigError, match="at or above the capacity"):
        spike_recovery(params, 32, 8, 1, mu, 2 * mu, 2, 600)


def test_the_reports_say_absent_with_the_reason_never_zero():
    from deploybench.report.spike import facts, stored_facts

    an = {"base_rps": 10, "peak_rps": 30, "factor": 3, "hold_s": 4, "recovery_window_s": 10, "recovery_s": None,
          "recovery_reason": "not back under the SLO within the 10 s after the spike's end", "peak_p99_ms": 4000.0,
          "p99_before_ms": 200.0, "requests_spike": 120, "failed_spike": 3, "errors_by_kind_spike": {"http_429": 3},
          "failed_recovery": 0, "in_flight_peak": 40, "waiting_peak": {}, "waiting_reason": "not scraped",
          "scale_up": {"nodes_before": ["n1"], "nodes_after": ["n1"], "all_serving_s": None,
                       "all_serving_reason": "an added engine never served (its error)", "slo_again_s": None,
                       "slo_again_reason": "not back", "added": [{"node": "n2", "serving_s": None, "error": "boom"}]}}
    got = dict(facts(an))
    assert got["recovery time"] == "absent (not back under the SLO within the 10 s after the spike's end)"
    assert got["added engines serving"].startswith("absent (an added engine never served")
    assert "n2 NOT serving: boom" in got["scale-up"] and "waiting gauge absent (not scraped)" in got["queued"]
    assert "3 failed {'http_429': 3}" in got["during the spike"]
    assert dict(stored_facts(None, "not back", None, None, False)) == {"recovery time": "absent (not back)"}
    back = dict(stored_facts(2.5, "ok", 1.25, 3.0, True))
    assert back["recovery time"] == "2.5 s" and back["SLO holding again"] == "3 s after the spike's start"


def test_the_fast_windows_and_in_flight_sweep_match_the_brute_force_count():
    """searchsorted windows and the +1/-1 sweep give what a scan of every sample at every instant gives."""
    import numpy as np

    rng = np.random.default_rng(7)
    sends = np.sort(rng.uniform(0, 20, 3000))
    lat = rng.exponential(400, len(sends))
    err = rng.random(len(sends)) < 0.02
    df = _frame([(t, lat_ms, "timeout" if e else None) for t, lat_ms, e in zip(sends, lat, err, strict=True)])
    df["ts"] = df["ts"].dt.floor("ms").astype("datetime64[ms, UTC]")  # as stored samples are: not in ns
    # a start off the samples' unit (a measured start in ns, e.g. 1796600344611999999 ns)
    start, end = T0 + pd.Timedelta(nanoseconds=1_999_999_999), T0 + pd.Timedelta(nanoseconds=17_999_999_999)
    got = spike.sliding(df, start, end, SLO_1S)
    k, brute = 0, []
    while k * 0.1 + 1.0 <= 16 + 1e-9:
        a = start + pd.Timedelta(seconds=k * 0.1)
        win = df[(df["ts"] >= a) & (df["ts"] < a + pd.Timedelta(seconds=1))]
        if len(win):
            ok, p99, e = spike._healthy(win, SLO_1S)
            brute.append((round(k * 0.1, 6), ok, p99, e, len(win)))
        k += 1
    assert got == brute and len(got) == 151
    done = df["ts"] + pd.to_timedelta(df["latency_ms"], unit="ms")
    grid = pd.date_range(start, end, freq=pd.Timedelta(seconds=0.1))
    expect = max(int(((df["ts"] < t) & (done > t)).sum()) for t in grid)
    assert spike._in_flight_peak(df, start, end) == (expect, None) and expect > 5
    none, why = spike._in_flight_peak(df.iloc[:0], start, end)
    assert none is None and "no request" in why


def test_dropped_iterations_in_the_spike_are_counted_and_flag_the_recovery():
    from deploybench.load.results import LoadResult, SloVerdict

    spec = LoadSpec(phases=["spike"], spike_factor=2, spike_hold_s=2, spike_recovery_s=4, warmup_s=0)
    s0, s1, total = spike.timeline(spec)
    rows = _even(10, 0, total, lambda t: 100.0)
    res = LoadResult(
        requests=len(rows), errors=0, error_rate=0.0, errors_by_kind={}, achieved_rps=10.0, output_tps=1.0,
        latency_p50_ms=100, latency_p90_ms=100, latency_p99_ms=100, latency_p999_ms=100, phase="spike",
        offered_rps=10.0, duration_s=total, warmup_s=0, started_at=T0.to_pydatetime(), warmup_excluded=0,
        dropped_iterations=7, slo_ok=True, slo=SloVerdict(passed=True, reasons=[]), nodes=[], samples_path="s",
        warmup_samples_path=None, summary_path="x", k6_exit_code=0, k6_thresholds_crossed=[], k6_cpu_s=0.1,
        vus_pre=1, vus_max=2, tags={}, notes=[], dropped_in={"lead": 0, "spike": 5, "recovery": 2})
    an = spike.analyse(res, _frame(rows), 20.0, 10.0, SLO_1S, spec)
    assert an.recovered and (an.dropped_spike, an.dropped_recovery) == (5, 2)
    assert "dropped 5 iterations in the spike and 2 after it" in an.dropped_note and "lower bound" in an.dropped_note
    clean = spike.analyse(res.model_copy(update={"dropped_in": {"lead": 0, "spike": 0, "recovery": 0}}),
                          _frame(rows), 20.0, 10.0, SLO_1S, spec)
    assert (clean.dropped_spike, clean.dropped_note) == (0, None)
    old = spike.analyse(res.model_copy(update={"dropped_in": {}}), _frame(rows), 20.0, 10.0, SLO_1S, spec)
    assert old.dropped_spike is None  # not counted: absent, never 0
    from deploybench.report.spike import facts

    assert dict(facts(an.model_dump()))["dropped by k6"].startswith("5 in the spike, 2 after it: k6 dropped")
    assert dict(facts(old.model_dump()))["dropped by k6"] == "absent (not counted)"


def test_a_failed_scale_up_shows_on_the_run_page_from_the_stored_flag():
    """Both times absent (no engine added served): the run page still says a scale-up was asked, and why absent."""
    from deploybench.store.ingest import spike_columns
    from deploybench.store.rows import PhaseRecord
    from deploybench.web.markup import _spike_section

    an = {"recovery_s": None, "recovery_reason": "not back", "scale_up": {
        "all_serving_s": None, "slo_again_s": None, "added": [{"node": "n2", "serving_s": None, "error": "boom"}]}}
    cols = spike_columns(an)
    assert cols["scale_up"] is True and cols["scale_up_serving_s"] is None and cols["scale_up_slo_s"] is None
    assert spike_columns({"recovery_s": 1.0, "recovery_reason": "ok"})["scale_up"] is False
    row = PhaseRecord(phase="spike", offered_rps=1, achieved_rps=1, output_tps=1, requests=1, errors=0, error_rate=0,
                      duration_s=1, started_at=T0.to_pydatetime(), **cols)
    page = _spike_section([row])
    assert "added engines serving" in page and "absent (not every added engine served)" in page
    plain = _spike_section([row.model_copy(update={"scale_up": False})])
    assert "recovery time" in plain and "added engines serving" not in plain
