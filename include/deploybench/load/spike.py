"""Spike: a step from the base rate to ``spike_factor`` x it, held, then back, and the time the SLO takes to return.

The phase's shape (one k6 run, ``ramping-arrival-rate``, so the schedule is k6's own and exact), after the warm-up
at the base rate (the sustained rate: ``sustained_fraction`` x a probed capacity, else ``load.rate`` as typed,
``phases.phase_spec``)::

    base for SPIKE_LEAD_S | step up in STEP_S | peak until spike_hold_s after the step | step down in STEP_S |
    base for the rest of spike_recovery_s

Measured times count from the measured window's start (the warm-up's end): the spike starts at ``SPIKE_LEAD_S``
and ends (rate back at base) at ``SPIKE_LEAD_S + spike_hold_s + STEP_S``; the recovery window runs from there to
the phase's end.

**Recovery time**, exactly (``recovery``): the per-request samples are grouped by send time into sliding windows of
``RECOVERY_WINDOW_S`` seconds starting every ``RECOVERY_STEP_S`` seconds from the spike's end, each ending within
the recovery window. A window is *healthy* when the P99 latency of its successful requests is under the SLO's
``p99_latency_ms`` and its error rate is at most ``max_error_rate`` (a window whose requests all failed is not); a
window in which nothing was sent is no evidence either way and is skipped. The recovery time is the start of the
first window from which every later window is healthy, in seconds after the spike's end. Windows are by *send*
time, so a window is healthy once the requests sent in it are answered in time: what a user arriving then sees.
It is:

* ``0.0`` when every window after the spike's end is healthy: the SLO held from the moment the rate was back at
  base (``slo_broken`` says whether the spike itself broke it); a flat run that never broke it gives 0 too;
* ``None`` (with ``reason``) when the last window of the recovery window is still unhealthy (the SLO did not come
  back and stay within ``spike_recovery_s``), or nothing was sent after the spike: never 0 then.

Its resolution is ``RECOVERY_STEP_S``; a window's P99 over ~1 s of requests is about its slowest request, so a
window is healthy about when its first request is answered in time.

With ``scale_up`` (``scale_up.ScaleUp``) the phase starts on fewer engines; when the spike starts the deployer
starts engines on the others, and k6's targets grow to include each once it is healthy (run.js re-reads the
target list from ``DB_TARGETS_URL``, a loopback page served here). The analysis then gives each added engine's
time from the spike's start to its health check passing, and the time from the spike's start to the SLO holding
again (``slo_again_s``: the recovery measure above, its windows starting at the spike's start instead of its end; 0
when the SLO never broke). Its base rate is then the first engines' share of a probed capacity (``base_share`` =
scale_up_from / all nodes; a typed load_rate stays as typed), and every node, added ones included, is scraped,
GPU-sampled and priced over the whole phase.

Iterations k6 dropped (no VU free) were never sent, so no window above holds them: they are counted in the lead, the
spike and the recovery (``dropped_spike``, ``dropped_recovery``), and any make ``dropped_note`` say the recovery is a
lower bound.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from pydantic import BaseModel

from deploybench.config import RECOVERY_WINDOW_S, SLO, SPIKE_LEAD_S, LoadSpec
from deploybench.engines import Metrics
from deploybench.load.results import Endpoint, LoadResult
from deploybench.load.runner import ApiFlavour, run_load
from deploybench.workloads import MAX_TOKENS

if TYPE_CHECKING:
    from deploybench.load.loadgen import Generators
    from deploybench.load.scale_up import ScaleUp

# SPIKE_LEAD_S (deploybench.config, for the phase's time budget): at the base rate before the step, measured
STEP_S = 0.001  # the step up and the step down (k6 stages need a duration): well within one second
# RECOVERY_WINDOW_S (deploybench.config: spike_recovery_s >= 2 x it): the sliding windows judged (module doc) ...
RECOVERY_STEP_S = 0.1  # ... and how far apart they start: the recovery time's resolution


class Recovery(BaseModel):
    """When the SLO came back after the spike (see the module doc)."""

    recovered: bool
    recovery_s: float | None  # None: not back within the recovery window (``reason``)
    reason: str
    window_s: float
    step_s: float
    windows: int  # judged (with requests)
    unhealthy_windows: int


class AddedEngine(BaseModel):
    node: str
    serving_s: float | None  # from the spike's start to its health check passing; None: it never did (``error``)
    targeted_s: float | None  # from the spike's start to k6's target list holding it
    requests: int  # requests it answered or failed in the phase (k6's samples tagged with its node)
    error: str | None = None


class SpikeAnalysis(BaseModel):
    base_rps: float
    peak_rps: float
    factor: float
    capacity_rps: float
    spike_start_s: float  # after the measured window's start
    spike_end_s: float
    hold_s: float
    recovery_window_s: float
    recovered: bool
    recovery_s: float | None
    recovery_reason: str
    slo_broken: bool  # some window from the spike's start on was unhealthy
    p99_before_ms: float | None  # requests sent in the lead, before the step
    peak_p99_ms: float | None  # the highest P99 of a sliding window from the spike's start to the phase's end
    requests_spike: int  # sent during the spike (step up to step down)
    failed_spike: int
    errors_by_kind_spike: dict[str, int]
    failed_recovery: int
    in_flight_peak: int | None  # client side: the most requests sent and not yet answered at once (every 0.1 s)
    in_flight_reason: str | None = None  # why in_flight_peak is None
    # iterations k6 dropped (no VU free when due: never sent, so never in the windows above); None: not counted
    dropped_spike: int | None = None
    dropped_recovery: int | None = None
    dropped_note: str | None = None  # set when any were dropped: the spike and recovery look healthier than they were
    waiting_peak: dict[str, float]  # engine side: each node's highest waiting-requests gauge (its /metrics); {}: absent
    waiting_reason: str | None = None
    # scaling up from fewer engines than a probed capacity was measured on: the base is their share of it
    base_share: float = 1.0
    # scale-up under load (``scale_up``): None when the phase did not scale up
    scale_up: dict[str, Any] | None = None


def shape(base_rps: float, spec: LoadSpec) -> tuple[float, list[tuple[float, float]]]:
    """(warm-up rate, stages) of the spike phase (module doc); their durations sum to lead + hold + recovery."""
    peak = spec.spike_factor * base_rps
    hold = max(STEP_S, spec.spike_hold_s - STEP_S)
    return base_rps, [(base_rps, SPIKE_LEAD_S), (peak, STEP_S), (peak, hold), (base_rps, STEP_S),
                      (base_rps, max(STEP_S, spec.spike_recovery_s - STEP_S))]


def timeline(spec: LoadSpec) -> tuple[float, float, float]:
    """(spike start, spike end, phase end) in seconds after the measured window's start."""
    _, stages = shape(1.0, spec)
    start = stages[0][1]
    end = start + stages[1][1] + stages[2][1] + stages[3][1]
    return start, end, sum(s for _, s in stages)


def _healthy(win: pd.DataFrame, slo: SLO) -> tuple[bool, float | None, float]:
    """(healthy, P99 of the successes or None, error rate) of the requests ``win``."""
    failed = win["error_kind"].notna()
    ok = win.loc[~failed, "latency_ms"]
    p99 = float(ok.quantile(0.99)) if len(ok) else None
    err = float(failed.mean()) if len(win) else 0.0
    return (p99 is not None and p99 < slo.p99_latency_ms and err <= slo.max_error_rate), p99, err


def _ns(values: Any) -> np.ndarray:
    """UTC nanoseconds since the epoch (int64) of a datetime Series or array, whatever its unit."""
    return np.asarray(pd.DatetimeIndex(values).as_unit("ns").asi8, dtype="int64")


def _ns1(t: pd.Timestamp) -> int:
    return int(pd.Timestamp(t).as_unit("ns").value)


def sliding(samples: pd.DataFrame, start: pd.Timestamp, end: pd.Timestamp, slo: SLO,
            width_s: float = RECOVERY_WINDOW_S, step_s: float = RECOVERY_STEP_S
            ) -> list[tuple[float, bool, float | None, float, int]]:
    """(offset s after ``start``, healthy, P99 ms, error rate, requests) of every sliding window of ``width_s`` by
    send time that starts at ``start`` + k x ``step_s`` and ends by ``end``; windows without requests left out.
    ``samples`` are sorted by ``ts`` (as load_samples gives them): each window's rows are found by binary search, so
    the cost is the windows' requests, not windows x samples."""
    if width_s <= 0 or step_s <= 0:
        raise ValueError(f"width_s={width_s} and step_s={step_s} must be > 0")
    ts = samples["ts"]
    if not ts.is_monotonic_increasing:
        samples = samples.sort_values("ts", kind="stable").reset_index(drop=True)
        ts = samples["ts"]
    span = (end - start).total_seconds()
    n = int(math.floor((span - width_s) / step_s + 1e-9)) + 1 if span + 1e-9 >= width_s else 0
    if n <= 0 or samples.empty:
        return []
    at = _ns(ts)  # one unit for both sides (samples are stored in ms or us, the grid is in ns)
    starts = np.array([_ns1(start + pd.Timedelta(seconds=k * step_s)) for k in range(n)], dtype="int64")
    width = int(round(width_s * 1e9))
    lo = np.searchsorted(at, starts, side="left")
    hi = np.searchsorted(at, starts + width, side="left")
    out = []
    for k in range(n):
        if hi[k] > lo[k]:
            ok, p99, err = _healthy(samples.iloc[lo[k]:hi[k]], slo)
            out.append((round(k * step_s, 6), ok, p99, err, int(hi[k] - lo[k])))
    return out


def recovery(samples: pd.DataFrame, spike_end: pd.Timestamp, window_end: pd.Timestamp, slo: SLO,
             width_s: float = RECOVERY_WINDOW_S, step_s: float = RECOVERY_STEP_S, since: str = "the spike's end"
             ) -> Recovery:
    """The recovery time after ``spike_end`` (module doc): ``samples`` need ``ts`` (send time, UTC), ``latency_ms``
    and ``error_kind`` (None: a success); measured (not warm-up) requests only."""
    wins = sliding(samples, spike_end, window_end, slo, width_s, step_s)
    bad = sum(1 for w in wins if not w[1])
    common = dict(window_s=width_s, step_s=step_s, windows=len(wins), unhealthy_windows=bad)
    span = (window_end - spike_end).total_seconds()
    if not wins:
        return Recovery(recovered=False, recovery_s=None, **common,
                        reason=f"no requests sent in the {span:g} s after {since} (no window of {width_s:g} s to "
                               "judge): the recovery is not measured")
    last = wins[-1]
    if not last[1]:
        p99 = "none answered" if last[2] is None else f"{last[2]:.0f} ms"
        return Recovery(recovered=False, recovery_s=None, **common,
                        reason=f"not back under the SLO within the {span:g} s after {since}: the last window "
                               f"({last[0]:g}-{last[0] + width_s:g} s) had P99 {p99} (limit {slo.p99_latency_ms:g} ms) "
                               f"and {100 * last[3]:.1f} % errors (limit {100 * slo.max_error_rate:g} %); lengthen "
                               "spike_recovery_s, lower spike_factor or spike_hold_s, or add capacity")
    first_good = len(wins)
    while first_good > 0 and wins[first_good - 1][1]:
        first_good -= 1
    at = wins[first_good][0]
    why = (f"the SLO held in every window from {since}" if first_good == 0 else
           f"P99 and errors under the SLO in every window of {width_s:g} s from {at:g} s after {since} on "
           f"({bad} window(s) over it before)")
    return Recovery(recovered=True, recovery_s=round(at, 3), reason=why, **common)


def _in_flight_peak(samples: pd.DataFrame, start: pd.Timestamp, end: pd.Timestamp,
                    step_s: float = 0.1) -> tuple[int | None, str | None]:
    """(the most requests sent and not yet answered at one instant of the grid ``start`` + k x ``step_s`` up to
    ``end``, or None; why None). A sweep: +1 at each send, -1 at each answer, summed in time order and read at the
    grid's instants (a request is in flight at t when sent < t < done)."""
    if samples.empty:
        return None, "no request was sent in the phase: nothing was in flight"
    grid = _ns(pd.date_range(start, end, freq=pd.Timedelta(seconds=step_s)))
    if not len(grid):
        return None, "the spike has no instant to count at"
    timed = samples[samples["latency_ms"].notna()]  # a request without a latency has no answer time to count to
    t_sent = _ns(timed["ts"])
    sent = np.sort(t_sent)
    done = np.sort(t_sent + np.round(timed["latency_ms"].clip(lower=0).to_numpy(dtype="float64") * 1e6)
                   .astype("int64"))
    # sent strictly before t less done at or before t
    live = np.searchsorted(sent, grid, side="left") - np.searchsorted(done, grid, side="right")
    return int(max(0, live.max())), None


def _waiting(res: LoadResult, metrics: Metrics | None, start: pd.Timestamp) -> tuple[dict[str, float], str | None]:
    """Each node's highest waiting-requests gauge from the spike's start on (the engine profile's ``waiting``)."""
    from deploybench.load.scrape import read_series

    name = (metrics.names if metrics else {}).get("waiting")
    if not name:
        return {}, "the engine profile names no waiting-requests gauge"
    if not res.metrics_path:
        return {}, "the engines' /metrics were not scraped (scrape_interval_s=0)"
    peak: dict[str, float] = {}
    for p in read_series(res.metrics_path):
        v = p.get("value")
        if p.get("metric") != name or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            continue  # hostile or absent: a NaN or negative gauge is not a queue
        try:
            at = pd.Timestamp(str(p.get("ts")))
        except (TypeError, ValueError):
            continue
        if at.tzinfo is not None and at >= start:
            peak[str(p.get("node"))] = max(peak.get(str(p.get("node")), 0.0), float(v))
    return peak, None if peak else f"no {name} values scraped during the spike"


def analyse(res: LoadResult, samples: pd.DataFrame, capacity_rps: float, base_rps: float, slo: SLO, spec: LoadSpec,
            metrics: Metrics | None = None, grown: dict[str, Any] | None = None) -> SpikeAnalysis:
    """The phase's figures from its measured samples (``samples``: the run's samples file, warm-up excluded)."""
    t0 = pd.Timestamp(res.started_at)
    s0, s1, total = timeline(spec)
    at = lambda s: t0 + pd.Timedelta(seconds=s)  # noqa: E731
    rec = recovery(samples, at(s1), at(total), slo)
    ts = samples["ts"]
    lead = samples[(ts >= t0) & (ts < at(s0))]
    spike = samples[(ts >= at(s0)) & (ts < at(s1))]
    after = samples[ts >= at(s1)]
    wins = sliding(samples, at(s0), at(total), slo)
    p99s = [w[2] for w in wins if w[2] is not None]
    failed = spike["error_kind"].notna()
    waiting, why = _waiting(res, metrics, at(s0))
    ok_lead = lead.loc[lead["error_kind"].isna(), "latency_ms"]
    in_flight, in_flight_why = _in_flight_peak(samples, at(s0), at(total))
    scale = None
    if grown is not None:
        # the same measure from the spike's start: the added engines may bring the SLO back before the spike ends
        again = recovery(samples, at(s0), at(total), slo, since="the spike's start")
        scale = {**grown, "slo_again_s": again.recovery_s, "slo_again_reason": again.reason}
    d_spike, d_rec = res.dropped_in.get("spike"), res.dropped_in.get("recovery")
    note = None
    if d_spike or d_rec:
        note = (f"k6 dropped {d_spike or 0} iterations in the spike and {d_rec or 0} after it (no VU free when due): "
                "those requests were never sent, so the windows judged above are healthier than what users saw; "
                "the recovery time is a lower bound. Give k6 more VUs (load generators) or lower spike_factor")
    return SpikeAnalysis(
        dropped_spike=d_spike, dropped_recovery=d_rec, dropped_note=note,
        base_rps=round(base_rps, 6), peak_rps=round(spec.spike_factor * base_rps, 6), factor=spec.spike_factor,
        capacity_rps=capacity_rps, spike_start_s=s0, spike_end_s=round(s1, 6), hold_s=spec.spike_hold_s,
        recovery_window_s=round(total - s1, 6), recovered=rec.recovered, recovery_s=rec.recovery_s,
        recovery_reason=rec.reason, slo_broken=any(not w[1] for w in wins),
        p99_before_ms=round(float(ok_lead.quantile(0.99)), 3) if len(ok_lead) else None,
        peak_p99_ms=round(max(p99s), 3) if p99s else None,
        requests_spike=len(spike), failed_spike=int(failed.sum()),
        errors_by_kind_spike={str(k): int(v) for k, v in spike.loc[failed, "error_kind"].value_counts().items()},
        failed_recovery=int(after["error_kind"].notna().sum()),
        in_flight_peak=in_flight, in_flight_reason=in_flight_why,
        waiting_peak=waiting, waiting_reason=why, scale_up=scale,
    )


def run(endpoints: list[Endpoint], spec: LoadSpec, slo: SLO, out_dir: Path, capacity_rps: float, *,
        tags: dict | None = None, api: ApiFlavour | None = None, seed: int = 0,
        scrape_endpoints: list[Endpoint] | None = None, metrics: Metrics | None = None,
        max_model_len: int = MAX_TOKENS, generators: Generators | None = None, remote_write: str | None = None,
        grow: ScaleUp | None = None, base_share: float = 1.0) -> tuple[LoadResult, SpikeAnalysis]:
    """One spike phase at ``sustained_fraction`` x ``capacity_rps`` x ``base_share`` as its base
    (``phases.phase_spec``; ``base_share``: scaling up from fewer engines than the capacity was probed on, their
    share of it, ``phases.run_phase``).

    ``grow``: scale up under load (``scale_up.ScaleUp``): ``endpoints`` are the engines serving before the spike;
    the others join k6's targets once healthy. Not with load generators (their k6 cannot reach the target page
    served on this machine's loopback): refused."""
    from deploybench.errors import ConfigError
    from deploybench.load.samples import load_samples

    if not 0 < base_share <= 1:
        raise ValueError(f"base_share={base_share} must be in (0, 1]")
    base = spec.sustained_fraction * capacity_rps * base_share
    start, stages = shape(base, spec)
    s0, s1, total = timeline(spec)
    if grow is not None and generators is not None and generators.names:
        raise ConfigError("scale_up runs the spike phase's k6 on the controller (its target list is served on this "
                          "machine's loopback), but the inventory names load generators; remove their loadgen role "
                          "for this run or set scale_up=false")
    extra: dict[str, Any] = {}
    if grow is not None:
        # the deployer is asked s0 s after k6's first look at the target page (its scenario's start) + the warm-up
        extra = {"targets_url": grow.serve(endpoints, spec.warmup_s + s0), "more_nodes": grow.added}
    try:
        res = run_load(endpoints, spec, slo, out_dir, phase="spike", tags=tags, rate=start, stages=stages, api=api,
                       seed=seed, scrape_endpoints=scrape_endpoints, metrics=metrics, max_model_len=max_model_len,
                       generators=generators, remote_write=remote_write, preallocate=True,
                       spans={"lead": (0.0, s0), "spike": (s0, s1), "recovery": (s1, total)}, **extra)
    finally:
        grown = grow.finish() if grow is not None else None
    samples = load_samples(res.samples_path) if res.samples_path else pd.DataFrame(
        columns=["ts", "latency_ms", "error_kind", "node"])
    if grown is not None:
        spike_at = pd.Timestamp(res.started_at) + pd.Timedelta(seconds=s0)
        for a in grown["added"]:
            mine = samples[samples["node"] == a["node"]]
            a["requests"] = len(mine)
            a["first_request_s"] = round((mine["ts"].min() - spike_at).total_seconds(), 3) if len(mine) else None
    an = analyse(res, samples, capacity_rps, base, slo, spec, metrics, grown)
    return res, an.model_copy(update={"base_share": round(base_share, 6)})
