"""Overload: a ramp past the capacity, then a recovery period at half of it.

After the warm-up at the sustained rate (``sustained_fraction`` x a probed capacity; without the probe
the capacity is ``load.rate`` and the warm-up runs at it: ``phases.phase_spec``), the offered rate
ramps linearly to ``overload_factor`` x capacity over ``overload_ramp_s``, drops to 0.5 x capacity
and stays there for ``recovery_s``. Judged window by window (``window_figures`` of the run):

* ``broke_at``: for each objective (P99 latency, P99 TTFT, error rate, achieved ÷ offered), the offered
  rate of the first ramp window that broke it (None: it held through the ramp);
* ``errors_by_kind`` during the ramp and during the recovery (HTTP 429/503, timeouts, resets...);
* ``client_limited_windows``: windows where k6 itself could not send on schedule (its schedule lag
  shows why): there the achieved rate is judged against what was sent, and the figures describe the
  load generator's limit as much as the server's;
* ``recovered`` / ``recovery_s``: from the start of the recovery period, the time until every window
  from then on meets every objective (None: it did not recover within ``recovery_s``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

from deploybench.config import SLO, LoadSpec
from deploybench.engines import Metrics
from deploybench.load.results import Endpoint, LoadResult, WindowFigures
from deploybench.load.runner import ApiFlavour, run_load
from deploybench.workloads import MAX_TOKENS

if TYPE_CHECKING:
    from deploybench.load.kube_load import KubeLoad
    from deploybench.load.loadgen import Generators

DROP_S = 0.001  # the step down to the recovery rate (k6 stages need a duration)
OBJECTIVES = ("latency_p99", "ttft_p99", "error_rate", "achieved_ratio")
CLIENT_OK = 0.95  # a window where the client sent less than this of the offered rate: the client was the limit


class BreakPoint(BaseModel):
    rate: float
    at_s: float
    value: float | None


class OverloadAnalysis(BaseModel):
    capacity_rps: float
    peak_rps: float
    recovery_rps: float
    broke_at: dict[str, BreakPoint | None]
    errors_by_kind_ramp: dict[str, int]
    errors_by_kind_recovery: dict[str, int]
    recovered: bool
    recovery_s: float | None
    recovery_by_objective_s: dict[str, float | None]
    client_limited_windows: list[float]  # start_s of windows where k6 sent < CLIENT_OK of the offered rate


def broken(w: WindowFigures, slo: SLO, spec: LoadSpec, slope: float = 0.0) -> dict[str, float | None]:
    """The objectives window ``w`` breaks, with the value that broke each.

    On a ramp (``slope`` req/s per s) the answers in a window are those of requests sent one latency
    earlier, at a lower rate: the rate expected to be answered is taken one median latency back."""
    out: dict[str, float | None] = {}
    if w.requests and (w.latency_p99_ms is None or w.latency_p99_ms >= slo.p99_latency_ms):
        out["latency_p99"] = w.latency_p99_ms
    if slo.p99_ttft_ms and w.ttft_p99_ms is not None and w.ttft_p99_ms >= slo.p99_ttft_ms:
        out["ttft_p99"] = w.ttft_p99_ms
    if w.requests and w.error_rate > slo.max_error_rate:
        out["error_rate"] = w.error_rate
    lag_s = (w.latency_p50_ms or 0.0) / 1000.0
    # what the server was given: the client's own shortfall (client_limited) is not held against it
    expected = max(0.0, min(w.offered_rps, w.sent_rps) - slope * lag_s) * w.duration_s
    if w.achieved_rps * w.duration_s < spec.min_achieved_ratio * expected - 1:
        out["achieved_ratio"] = round(w.achieved_rps / w.offered_rps, 4) if w.offered_rps else None
    return out


def analyse(res: LoadResult, capacity_rps: float, slo: SLO, spec: LoadSpec) -> OverloadAnalysis:
    ramp = [w for w in res.windows if w.start_s < spec.overload_ramp_s]
    rec_start = spec.overload_ramp_s + DROP_S
    rec = [w for w in res.windows if w.start_s >= spec.overload_ramp_s]
    broke: dict[str, BreakPoint | None] = {k: None for k in OBJECTIVES}
    slope = (spec.overload_factor - spec.sustained_fraction) * capacity_rps / spec.overload_ramp_s
    for w in ramp:
        for k, v in broken(w, slo, spec, slope).items():
            if broke[k] is None:
                broke[k] = BreakPoint(rate=w.offered_rps, at_s=w.start_s, value=v)
    marks = [broken(w, slo, spec) for w in rec]

    def since(keys: tuple[str, ...]) -> float | None:
        for i in range(len(rec)):
            if all(not (set(m) & set(keys)) for m in marks[i:]):
                return round(max(0.0, rec[i].start_s - rec_start), 3)
        return None

    rec_all = since(OBJECTIVES) if rec else None
    return OverloadAnalysis(
        capacity_rps=capacity_rps,
        peak_rps=spec.overload_factor * capacity_rps,
        recovery_rps=0.5 * capacity_rps,
        broke_at=broke,
        errors_by_kind_ramp=dict(sum((Counter(w.errors_by_kind) for w in ramp), Counter())),
        errors_by_kind_recovery=dict(sum((Counter(w.errors_by_kind) for w in rec), Counter())),
        recovered=rec_all is not None,
        recovery_s=rec_all,
        recovery_by_objective_s={k: since((k,)) if rec else None for k in OBJECTIVES},
        client_limited_windows=[w.start_s for w in res.windows
                                if w.sent_rps * w.duration_s < CLIENT_OK * w.offered_rps * w.duration_s - 1],
    )


def shape(capacity_rps: float, spec: LoadSpec) -> tuple[float, list[tuple[float, float]]]:
    """(warm-up rate, stages) of the overload phase."""
    return (spec.sustained_fraction * capacity_rps,
            [(spec.overload_factor * capacity_rps, spec.overload_ramp_s), (0.5 * capacity_rps, DROP_S),
             (0.5 * capacity_rps, spec.recovery_s)])


def run(endpoints: list[Endpoint], spec: LoadSpec, slo: SLO, out_dir: Path, capacity_rps: float, *,
        tags: dict | None = None, api: ApiFlavour | None = None, seed: int = 0,
        scrape_endpoints: list[Endpoint] | None = None, metrics: Metrics | None = None,
        max_model_len: int = MAX_TOKENS, generators: Generators | KubeLoad | None = None,
        remote_write: str | None = None
        ) -> tuple[LoadResult, OverloadAnalysis]:
    start, stages = shape(capacity_rps, spec)
    # windows short enough to place the break on the ramp (ten over it), long enough to count (1 s)
    spec = spec.model_copy(update={"window_s": min(spec.window_s, max(1.0, spec.overload_ramp_s / 10))})
    res = run_load(endpoints, spec, slo, out_dir, phase="overload", tags=tags, rate=start, stages=stages,
                   api=api, seed=seed, scrape_endpoints=scrape_endpoints, metrics=metrics, max_model_len=max_model_len,
                   generators=generators, remote_write=remote_write)
    return res, analyse(res, capacity_rps, slo, spec)
