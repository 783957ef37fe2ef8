"""The probe: the capacity of the cluster, searched for from Python with short k6 steps.

Each constant step offers one rate for ``probe_warmup_s`` (excluded) + ``probe_step_s`` and is judged:

* the SLO: P99 end-to-end latency, P99 time to first token (when the SLO sets one), error rate;
* achieved ÷ offered: the requests *answered* in the window must be at least ``min_achieved_ratio`` of
  those offered in it (one request of slack for the window's edges) — a server that falls behind
  fails here even while its latency still looks fine;
* no dropped iteration (k6's VUs are sized from the SLO, so a drop means the server is far behind).

The capacity is the highest constant rate that passed. Two ways to get there:

* **scout, then estimate** (``search`` with ``run_ramp``; what the load stage runs): a ramp step from
  ``probe_start_rps`` to ``RAMP_FACTOR`` x it (again from its top while nothing breaks), judged window
  by window (``overload.broken``); once a window breaks, the server's throughput in the windows from
  there on (requests answered within the SLO per second: an overloaded server answers at its
  capacity, whatever it is offered) is the estimate. Constant steps then start just under it
  (``MARGIN`` x tolerance) and close the bracket with a step one tolerance up; a failing step's own
  throughput re-estimates, and when the estimate says nothing (a latency-bound failure) the search
  walks by doubling gaps, then bisects. Against the simulated engine: 3-5 steps where doubling
  takes 9-12 (``bench/load_accuracy.py`` prints both).
* **doubling** (``run_ramp`` None; the earlier search, kept for the side-by-side bench): the rate
  doubles from ``probe_start_rps`` until a step fails (or ``probe_max_rps``), then the bracket
  [highest pass, lowest fail] is bisected. A failing first step halves the rate instead.

Either stops when the bracket is narrower than ``probe_tolerance`` of its top. A ramp step is stored
with the others (``kind="ramp"``, never ``passed``: it is not a capacity claim).

**Keeping up**, not only answering: counting answers alone is blind to a queue (an overloaded server
answers at its capacity; requests it has not answered are not counted anywhere). A constant step and a
ramp window hold only if the server keeps up: the requests started in it are answered by its end + a
grace (one window; ``kept_up``) to within ``probe_tolerance`` of those offered, the requests in flight
do not grow over it (beyond ``probe_tolerance`` of the offered count, at least 2, plus on a ramp what
Little's law adds for the rising rate), and the P99 latency counts every request started in it,
failed ones at the time the client gave up (``latency_open_p99_ms``).

**Draining**: a server may keep working on requests whose clients gave up (llama.cpp's server does), so
after a ramp or a failed step the search waits, through ``drain()`` (``phases.run_phase`` gives one:
the engine's running/waiting gauges at 0, else a lone request's latency back near the idle baseline
measured before the search; at most 2 x the request timeout) before the next step. The wait is
recorded on the step (``drain_s``, ``drained``) and is not a step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pydantic import BaseModel

from deploybench.config import SLO, LoadSpec
from deploybench.load.results import Figures, LoadResult

LOG = logging.getLogger(__name__)
MIN_RATE_FACTOR = 1 / 64  # a first step that fails is halved down to start x this
RAMP_FACTOR = 16.0  # a scout ramp ends at this multiple of where it starts (8 left a capacity near a ramp's top
# undetected, costing one more ramp; the ramp's overload is brief and an overloaded server answers at capacity)
RAMP_WINDOWS = 8  # windows a ramp step is judged in (at least MIN_RAMP_WINDOW_S each)
# the fewest windows a ramp's estimate is read from: a break in the ramp's last window alone leaves one
# window (0.5 s, a handful of requests) to say the throughput; llama.cpp's scout read 12.0 req/s from one
# such window on a server whose constant steps then passed at 20.15 and fell behind at 23.29
MIN_ESTIMATE_WINDOWS = 2
MIN_RAMP_WINDOW_S = 0.5
BEHIND = {"achieved_ratio", "kept_up", "in_flight"}  # ways a window says "behind", not "over the SLO"
MARGIN = 0.4  # the first constant step sits this fraction of the tolerance under the estimate
CLOSE = 0.9  # the step that closes a bracket sits this fraction of the tolerance above a pass


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
    kind: str = "constant"  # or "ramp": a scout step from rate_from to rate, never passed
    rate_from: float | None = None
    estimate_rps: float | None = None  # the capacity this step's throughput suggests (ramps, failed steps)
    gpu_util_pct: float | None = None  # mean GPU utilisation over the nodes that report one (None: absent)
    gpu_util_by_node: dict[str, float | None] = {}
    in_flight_start: int | None = None  # requests in flight at the measured window's start / end
    in_flight_end: int | None = None
    kept_up: int | None = None  # requests started in the window answered by its end + a grace
    drain_s: float | None = None  # the wait after this step for the server to be idle again (None: no wait)
    drained: str | None = None  # how the drain ended (idle by gauges / by a lone request, or the bound)


class CapacityResult(BaseModel):
    capacity_rps: float | None  # None: not even the lowest rate tried met the SLO
    bracket: tuple[float | None, float | None]  # (highest pass, lowest fail)
    converged: bool
    reason: str
    steps: list[ProbeStep]
    seconds: float


def judge(res: LoadResult, slo: SLO, spec: LoadSpec) -> tuple[bool, list[str], float]:
    """(passed, reasons, achieved ÷ offered) of one step."""
    from deploybench.load.stats import slo_verdict  # pandas: not for what only reads a probe's steps

    reasons = list(slo_verdict(res, slo).reasons)
    expected = res.offered_rps * res.duration_s
    answered = res.achieved_rps * res.duration_s
    ratio = answered / expected if expected else 0.0
    if answered < spec.min_achieved_ratio * expected - 1:
        reasons.append(f"answered {answered:.0f} of {expected:.0f} offered requests ({ratio:.1%}; at least "
                       f"{spec.min_achieved_ratio:.0%} needed): the server fell behind")
    if res.dropped_iterations:
        reasons.append(f"{res.dropped_iterations} iterations dropped: every VU was waiting on the server")
    reasons += [why for _, why in falls_behind(res, spec, slo)]
    return not reasons, reasons, ratio


def falls_behind(w: Figures, spec: LoadSpec, slo: SLO, slope: float = 0.0,
                 offered_rps: float | None = None, duration_s: float | None = None) -> list[tuple[str, str]]:
    """[(kind, why)] of the ways window (or step) ``w`` shows a server not keeping up (module doc).

    ``slope`` (req/s per s, a ramp) allows the growth of the requests in flight a rising rate brings by
    itself (Little's law: the rate's rise over the window x the median latency)."""
    rate = getattr(w, "offered_rps", 0.0) if offered_rps is None else offered_rps
    secs = getattr(w, "duration_s", 0.0) if duration_s is None else duration_s
    if w.sent_rps:  # the client's own shortfall is not held against the server (dropped iterations are)
        rate = min(rate, w.sent_rps)
    offered = rate * secs
    out = []
    tol = spec.probe_tolerance
    if offered and w.kept_up is not None and w.kept_up < (1 - tol) * offered - 1:
        out.append(("kept_up", f"{w.kept_up} of {offered:.0f} offered requests answered by the end of the window "
                               f"+ a grace ({w.kept_up / offered:.0%}; {1 - tol:.0%} needed): the server fell behind"))
    allowed = max(2.0, tol * offered) + slope * secs * (w.latency_p50_ms or 0.0) / 1000.0
    grew = (w.in_flight_end - w.in_flight_start) if w.in_flight_end is not None and w.in_flight_start is not None else 0
    if grew > allowed:
        out.append(("in_flight", f"requests in flight grew from {w.in_flight_start} to {w.in_flight_end} "
                                 f"(more than {allowed:.1f}): a queue is building"))
    lat = w.latency_open_p99_ms
    if w.requests and lat is not None and lat >= slo.p99_latency_ms and (w.latency_p99_ms or 0) < slo.p99_latency_ms:
        out.append(("latency_open", f"P99 latency counting the requests that never answered {lat:.0f} ms is over "
                                    f"the SLO's {slo.p99_latency_ms:.0f} ms"))
    return out


def next_rate(rate: float, passed: bool, low: float | None, high: float | None, spec: LoadSpec) -> float | None:
    """The next rate to try, or None when the search is over (see ``stop_reason``)."""
    if low is not None and high is not None:
        return None if (high - low) / high <= spec.probe_tolerance else (low + high) / 2
    if passed:  # no failure yet: double, up to the maximum
        return None if rate >= spec.probe_max_rps else min(rate * 2, spec.probe_max_rps)
    nxt = rate / 2  # no pass yet: halve
    return None if nxt < spec.probe_start_rps * MIN_RATE_FACTOR else nxt


def ramp_window_s(spec: LoadSpec) -> float:
    """The window a ramp step is judged in."""
    return max(MIN_RAMP_WINDOW_S, spec.probe_step_s / RAMP_WINDOWS)


def _step(n: int, rate: float, passed: bool, reasons: list[str], ratio: float, res: LoadResult, **extra) -> ProbeStep:
    gpu = {k: v.util_mean_pct for k, v in res.gpu.items()}
    return ProbeStep(
        step=n, rate=round(rate, 4), passed=passed, reasons=reasons, requests=res.requests,
        achieved_rps=res.achieved_rps, achieved_ratio=round(ratio, 4), latency_p99_ms=res.latency_p99_ms,
        ttft_p99_ms=res.ttft_p99_ms, error_rate=res.error_rate, errors_by_kind=res.errors_by_kind,
        dropped_iterations=res.dropped_iterations, started_at=res.started_at.isoformat(),
        duration_s=res.duration_s, samples_path=res.samples_path, metrics_path=res.metrics_path,
        gpu_util_pct=res.gpu_util_pct, gpu_util_by_node=gpu, in_flight_start=res.in_flight_start,
        in_flight_end=res.in_flight_end, kept_up=res.kept_up, **extra)


def ramp_estimate(res: LoadResult, slo: SLO, spec: LoadSpec) -> tuple[float | None, str]:
    """(capacity estimate, why) from a ramp step's windows; None when no window broke an objective.

    The estimate is the median throughput (answered within the SLO, per second) of the windows from the
    break on (the first window after which none held; at least the last ``MIN_ESTIMATE_WINDOWS``), capped
    by the offered rate there when latency or errors broke it."""
    from deploybench.load.overload import broken

    wins = res.windows
    if not wins:
        return None, "the ramp measured no window"
    slope = ((res.stages[-1][0] - res.offered_rps) / res.duration_s) if res.stages else 0.0
    slope = max(slope, 0.0)
    # on a rising ramp an overloaded server stays overloaded: the break is where every window from there
    # on is broken (a lone noisy window - k6 late on a busy machine - is not the server's limit)
    marks = [{**broken(w, slo, spec, slope), **dict(falls_behind(w, spec, slo, slope))} for w in wins]
    held = [not m for m in marks]
    first = next((i for i in range(len(wins)) if not any(held[i:])), None)
    if first is None:
        return None, f"every window held up to {wins[-1].offered_rps:.2f} req/s"
    w = wins[first]
    over = sorted(x.goodput_rps for x in wins[max(0, min(first, len(wins) - MIN_ESTIMATE_WINDOWS)):])
    through = over[len(over) // 2]
    kinds = set(marks[first])
    broke = ", ".join(sorted(kinds))
    if through <= 0:
        return None, f"broke ({broke}) at {w.offered_rps:.2f} req/s and answered nothing within the SLO after"
    # falling behind on a ramp shows late (answers lag the offered rate), so then the throughput alone
    # says it; a latency or error break is where the SLO ends, and the estimate is at most that rate
    est = through if kinds <= BEHIND else min(through, w.offered_rps)
    return est, (f"broke ({broke}) at {w.offered_rps:.2f} req/s offered; throughput from there "
                 f"{through:.2f} req/s (median of {len(over)} windows)")


def step_estimate(res: LoadResult, rate: float, spec: LoadSpec) -> float | None:
    """What a failed constant step says of the capacity: its throughput within the SLO when clearly below
    the offered rate (an overloaded server answers at its capacity); None when it says nothing."""
    got = res.goodput_rps
    return got if 0 < got < rate * (1 - spec.probe_tolerance / 2) else None


def _next_after_estimate(low: float | None, high: float | None, est: float | None, streak: int,
                         spec: LoadSpec) -> float | None:
    """The next constant rate of the estimate-led search (None: converged or nothing more to try)."""
    tol = spec.probe_tolerance
    guess = est * (1 - MARGIN * tol) if est else None
    if low is not None and high is not None:
        if (high - low) / high <= tol:
            return None
        step_up = low / (1 - CLOSE * tol)
        if guess is not None and max(low, step_up) < guess < high:
            return guess
        near = guess is not None and guess <= step_up * (1 + tol)  # the estimate says: just above the pass
        return step_up if step_up < high and near else (low + high) / 2
    if low is not None:  # passes only: walk up, with doubling gaps unless the estimate says it is right here
        if low >= spec.probe_max_rps:
            return None
        near = est is not None and est <= low * (1 + tol)
        up = low / (1 - CLOSE * tol) ** (1 if near else 2 ** streak)
        return min(spec.probe_max_rps, max(up, guess or 0.0))
    if high is None:  # nothing tried yet: start under the estimate (or at the first rate)
        return guess or spec.probe_start_rps
    down = high * (1 - CLOSE * tol) ** (2 ** streak)
    nxt = min(down, guess) if guess is not None and guess < high else down
    return None if nxt < spec.probe_start_rps * MIN_RATE_FACTOR else nxt


def search(run_step: Callable[[int, float], LoadResult], spec: LoadSpec, slo: SLO,
           run_ramp: Callable[[int, float, float], LoadResult] | None = None,
           drain: Callable[[], tuple[float, str]] | None = None) -> CapacityResult:
    """Search with ``run_step(step number, rate) -> LoadResult`` (k6 in production, a model in tests) and,
    when given, ``run_ramp(step number, from rate, to rate) -> LoadResult`` with windows of
    ``ramp_window_s`` (the scout); without it, the doubling search (module doc). ``drain() -> (seconds,
    how)`` waits for the server to be idle; it runs after every ramp and failed step that another follows."""
    t0 = time.monotonic()

    def settle(step: ProbeStep, more: bool) -> None:
        if drain is not None and more:
            secs, how = drain()
            step.drain_s, step.drained = round(secs, 3), how
            LOG.info("probe step %d: drained in %.2f s (%s)", step.step, secs, how)

    low = high = est = None
    steps: list[ProbeStep] = []
    rate: float | None = spec.probe_start_rps
    if run_ramp is not None:
        frm = spec.probe_start_rps
        while est is None and len(steps) < spec.probe_max_steps - 1:
            to = min(frm * RAMP_FACTOR, spec.probe_max_rps)
            res = run_ramp(len(steps) + 1, frm, to)
            est, why = ramp_estimate(res, slo, spec)
            steps.append(_step(len(steps) + 1, to, False, [f"scout ramp {frm:.2f} -> {to:.2f} req/s: {why}"],
                               res.achieved_rps / res.offered_rps if res.offered_rps else 0.0, res,
                               kind="ramp", rate_from=round(frm, 4), estimate_rps=est))
            LOG.info("probe step %d: ramp %.2f -> %.2f req/s: %s", len(steps), frm, to, why)
            settle(steps[-1], len(steps) < spec.probe_max_steps)
            if to >= spec.probe_max_rps:
                break
            frm = to
        rate = est * (1 - MARGIN * spec.probe_tolerance) if est else (
            spec.probe_max_rps if steps and steps[-1].rate >= spec.probe_max_rps else spec.probe_start_rps)
    streak, last = 0, None
    while rate is not None and len(steps) < spec.probe_max_steps:
        rate = round(rate, 4)  # the rate run is the rate stored
        res = run_step(len(steps) + 1, rate)
        passed, reasons, ratio = judge(res, slo, spec)
        seen = None if passed else step_estimate(res, rate, spec)
        steps.append(_step(len(steps) + 1, rate, passed, reasons, ratio, res, estimate_rps=seen))
        LOG.info("probe step %d at %.2f req/s: %s%s", len(steps), rate, "pass" if passed else "FAIL",
                 "" if passed else " - " + "; ".join(reasons))
        streak = streak + 1 if passed == last else 0
        last = passed
        if passed:
            low = rate if low is None else max(low, rate)
        else:
            high = rate if high is None else min(high, rate)
            est = seen if seen is not None else (est if est is not None and est < rate else None)
        if run_ramp is None:
            rate = next_rate(rate, passed, low, high, spec)
        else:
            rate = _next_after_estimate(low, high, est, streak, spec)
        if not passed:
            settle(steps[-1], rate is not None and len(steps) < spec.probe_max_steps)
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
