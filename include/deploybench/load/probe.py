"""The probe: the capacity of the cluster, searched for from Python with short k6 steps.

Each step offers one constant rate for ``probe_warmup_s`` (excluded) + ``probe_step_s`` and is judged:

* the SLO: P99 end-to-end latency, P99 time to first token (when the SLO sets one), error rate;
* achieved ÷ offered: the requests *answered* in the window must be at least ``min_achieved_ratio`` of
  those offered in it (one request of slack for the window's edges) — a server that falls behind
  fails here even while its latency still looks fine;
* no dropped iteration (k6's VUs are sized from the SLO, so a drop means the server is far behind).

The rate doubles from ``probe_start_rps`` until a step fails (or ``probe_max_rps``), then the bracket
[highest pass, lowest fail] is bisected until it is narrower than ``probe_tolerance`` of its top. A
failing first step halves the rate instead. The capacity is the highest rate that passed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pydantic import BaseModel

from deploybench.config import SLO, LoadSpec
from deploybench.load.figures import slo_verdict
from deploybench.load.records import LoadResult

LOG = logging.getLogger(__name__)
MIN_RATE_FACTOR = 1 / 64  # a first step that fails is halved down to start x this


class ProbeStep(BaseModel):
    """One step of the search, as stored with the run (``capacity.steps``)."""

    step: int
    rate: float
    passed: bool
    reasons: list[str]
    requests: int
    achieved_rps: float
    achieved_ratio: float
    latency_p99_ms: float | None
    ttft_p99_ms: float | None
    error_rate: float
    errors_by_kind: dict[str, int]
    dropped_iterations: int
    started_at: str
    duration_s: float
    samples_path: str
    metrics_path: str | None


class CapacityResult(BaseModel):
    capacity_rps: float | None  # None: not even the lowest rate tried met the SLO
    bracket: tuple[float | None, float | None]  # (highest pass, lowest fail)
    converged: bool
    reason: str
    steps: list[ProbeStep]
    seconds: float


def judge(res: LoadResult, slo: SLO, spec: LoadSpec) -> tuple[bool, list[str], float]:
    """(passed, reasons, achieved ÷ offered) of one step."""
    reasons = list(slo_verdict(res, slo).reasons)
    expected = res.offered_rps * res.duration_s
    answered = res.achieved_rps * res.duration_s
    ratio = answered / expected if expected else 0.0
    if answered < spec.min_achieved_ratio * expected - 1:
        reasons.append(f"answered {answered:.0f} of {expected:.0f} offered requests ({ratio:.1%}; at least "
                       f"{spec.min_achieved_ratio:.0%} needed): the server fell behind")
    if res.dropped_iterations:
        reasons.append(f"{res.dropped_iterations} iterations dropped: every VU was waiting on the server")
    return not reasons, reasons, ratio


def next_rate(rate: float, passed: bool, low: float | None, high: float | None, spec: LoadSpec) -> float | None:
    """The next rate to try, or None when the search is over (see ``stop_reason``)."""
    if low is not None and high is not None:
        return None if (high - low) / high <= spec.probe_tolerance else (low + high) / 2
    if passed:  # no failure yet: double, up to the maximum
        return None if rate >= spec.probe_max_rps else min(rate * 2, spec.probe_max_rps)
    nxt = rate / 2  # no pass yet: halve
    return None if nxt < spec.probe_start_rps * MIN_RATE_FACTOR else nxt


def search(run_step: Callable[[int, float], LoadResult], spec: LoadSpec, slo: SLO) -> CapacityResult:
    """Search with ``run_step(step number, rate) -> LoadResult`` (k6 in production, a model in tests)."""
    t0 = time.monotonic()
    low = high = None
    steps: list[ProbeStep] = []
    rate: float | None = spec.probe_start_rps
    while rate is not None and len(steps) < spec.probe_max_steps:
        res = run_step(len(steps) + 1, rate)
        passed, reasons, ratio = judge(res, slo, spec)
        steps.append(ProbeStep(
            step=len(steps) + 1, rate=round(rate, 4), passed=passed, reasons=reasons, requests=res.requests,
            achieved_rps=res.achieved_rps, achieved_ratio=round(ratio, 4), latency_p99_ms=res.latency_p99_ms,
            ttft_p99_ms=res.ttft_p99_ms, error_rate=res.error_rate, errors_by_kind=res.errors_by_kind,
            dropped_iterations=res.dropped_iterations, started_at=res.started_at.isoformat(),
            duration_s=res.duration_s, samples_path=res.samples_path, metrics_path=res.metrics_path,
        ))
        LOG.info("probe step %d at %.2f req/s: %s%s", len(steps), rate, "pass" if passed else "FAIL",
                 "" if passed else " - " + "; ".join(reasons))
        if passed:
            low = rate if low is None else max(low, rate)
        else:
            high = rate if high is None else min(high, rate)
        rate = next_rate(rate, passed, low, high, spec)
    converged = rate is None and low is not None and high is not None
    if converged:
        reason = f"bracket [{low:.2f}, {high:.2f}] req/s is within {spec.probe_tolerance:.0%}"
    elif low is None:
        reason = f"no rate met the SLO, down to {steps[-1].rate:.3g} req/s"
    elif high is None and rate is None:
        reason = f"every rate met the SLO up to probe_max_rps={spec.probe_max_rps:g}: the capacity is at least that"
    else:
        reason = f"stopped after probe_max_steps={spec.probe_max_steps} steps, bracket [{low}, {high}]"
    return CapacityResult(capacity_rps=low, bracket=(low, high), converged=converged, reason=reason, steps=steps,
                          seconds=round(time.monotonic() - t0, 2))
