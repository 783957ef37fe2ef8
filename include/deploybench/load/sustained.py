"""Sustained: a constant arrival rate at ``sustained_fraction`` x the capacity, held for ``duration_s``.
The capacity is the probe's; without the probe the phase offers ``load.rate`` as typed (the fraction is
1 then: ``phases.phase_spec``).

Figures per window (``window_s``) come with the result (``LoadResult.windows``); drift compares the
first and the last full window: throughput (requests answered per second, against what each window offered
when that differs: Poisson arrivals, a trace) and P99 end-to-end latency moving by more than
``drift_threshold`` (relative) is reported, with the values.
"""

from __future__ import annotations

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


class Drift(BaseModel):
    drifted: bool
    threshold: float
    achieved_rps: tuple[float, float] | None  # (first window, last window)
    achieved_change: float | None
    latency_p99_ms: tuple[float, float] | None
    latency_p99_change: float | None
    reasons: list[str]


def _change(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return round((b - a) / a, 4)


def drift(windows: list[WindowFigures], threshold: float) -> Drift:
    """Drift between the first and the last window (needs two windows; else not drifted, with a reason)."""
    if len(windows) < 2:
        return Drift(drifted=False, threshold=threshold, achieved_rps=None, achieved_change=None,
                     latency_p99_ms=None, latency_p99_change=None,
                     reasons=[f"{len(windows)} window(s): drift needs two; make duration_s >= 2 x window_s"])
    first, last = windows[0], windows[-1]
    # throughput against what each window offered: Poisson or a trace offers more in one window than another,
    # which is no drift of the server (with even arrivals the offered rate is the same, and this is the plain change)
    if first.offered_rps > 0 and last.offered_rps > 0 and first.offered_rps != last.offered_rps:
        thr = _change(first.achieved_rps / first.offered_rps, last.achieved_rps / last.offered_rps)
    else:
        thr = _change(first.achieved_rps, last.achieved_rps)
    p99 = _change(first.latency_p99_ms, last.latency_p99_ms)
    reasons = []
    if thr is not None and abs(thr) > threshold:
        against = ("" if first.offered_rps == last.offered_rps else
                   f" of {first.offered_rps:.2f} -> {last.offered_rps:.2f} offered")
        reasons.append(f"throughput moved {thr:+.1%} ({first.achieved_rps:.2f} -> {last.achieved_rps:.2f} req/s"
                       f"{against})")
    if p99 is not None and abs(p99) > threshold:
        reasons.append(f"P99 latency moved {p99:+.1%} ({first.latency_p99_ms:.0f} -> {last.latency_p99_ms:.0f} ms)")
    both = first.latency_p99_ms is not None and last.latency_p99_ms is not None
    return Drift(drifted=bool(reasons), threshold=threshold, achieved_rps=(first.achieved_rps, last.achieved_rps),
                 achieved_change=thr, latency_p99_ms=(first.latency_p99_ms, last.latency_p99_ms) if both else None,
                 latency_p99_change=p99, reasons=reasons)


def run(endpoints: list[Endpoint], spec: LoadSpec, slo: SLO, out_dir: Path, capacity_rps: float, *,
        tags: dict | None = None, api: ApiFlavour | None = None, seed: int = 0,
        scrape_endpoints: list[Endpoint] | None = None, metrics: Metrics | None = None,
        max_model_len: int = MAX_TOKENS, generators: Generators | KubeLoad | None = None,
        remote_write: str | None = None) -> tuple[LoadResult, Drift]:
    res = run_load(endpoints, spec, slo, out_dir, phase="sustained", tags=tags,
                   rate=spec.sustained_fraction * capacity_rps, duration_s=spec.duration_s, api=api, seed=seed,
                   scrape_endpoints=scrape_endpoints, metrics=metrics, max_model_len=max_model_len,
                   generators=generators, remote_write=remote_write)
    return res, drift(res.windows, spec.drift_threshold)
