"""Figures from samples: percentiles, rates, goodput, per node and per window, and the SLO verdict.

Percentiles use linear interpolation over successful requests (failed ones count in the error rate).
A window is ``[start, start + duration)``: requests *started* in it give the counts and latencies,
requests *answered* in it (``ts + latency``) give ``achieved_rps`` and ``goodput_rps``.

Those answered counts alone see only the requests that came back (survivorship: a server falling behind
still answers at its capacity, and its queue is invisible in them). So a window also says whether the
server kept up: ``in_flight_start``/``in_flight_end`` (requests sent and not yet answered at the
window's edges; k6 lets every request end - answer or timeout - before it stops, so every sent request
is in the samples), ``kept_up`` (requests started in the window answered by its end + ``grace_s``: per
window, the window or twice the run's fastest latencies, whichever is longer; for a whole step, its
length) and
``latency_open_p99_ms`` (P99 over every request started in it, failed ones at the time the client gave
up: a lower bound of their latency).
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

from deploybench.config import SLO
from deploybench.load.results import Figures, NodeFigures, SloVerdict, WindowFigures


def _pct(values: pd.Series, q: float) -> float | None:
    return None if values.empty else round(float(values.quantile(q, interpolation="linear")), 3)


def _four(prefix: str, values: pd.Series) -> dict[str, float | None]:
    return {f"{prefix}_p50_ms": _pct(values, 0.50), f"{prefix}_p90_ms": _pct(values, 0.90),
            f"{prefix}_p99_ms": _pct(values, 0.99), f"{prefix}_p999_ms": _pct(values, 0.999)}


def within_slo(samples: pd.DataFrame, slo: SLO | None) -> pd.Series:
    """Per request: succeeded and within the SLO's latency limits (the goodput rule)."""
    ok = samples["error_kind"].isna()
    if slo is None:
        return ok
    ok &= samples["latency_ms"] <= slo.p99_latency_ms
    if slo.p99_ttft_ms:
        ok &= ~(samples["ttft_ms"] > slo.p99_ttft_ms)  # NaN (not sampled) is not held against it
    return ok


def in_flight(samples: pd.DataFrame, at: pd.Timestamp) -> int:
    """Requests sent before ``at`` and not answered (nor given up on by the client) by then."""
    answered_at = samples["ts"] + pd.to_timedelta(samples["latency_ms"], unit="ms")
    return int(((samples["ts"] < at) & (answered_at > at)).sum())


def figures(samples: pd.DataFrame, duration_s: float, *, start: pd.Timestamp | None = None,
            slo: SLO | None = None, grace_s: float | None = None) -> Figures:
    """Figures of the window ``[start, start + duration_s)`` (default start: the first measured request).

    Rows flagged ``warmup`` never count as started in the window, but their answers count as answered
    in it (they are the server's work in that time). ``grace_s`` (default: the window's length) is how
    long after the window's end a request started in it may be answered and still count in ``kept_up``."""
    measured = samples[~samples["warmup"]] if "warmup" in samples else samples
    if start is None:
        start = measured["ts"].min() if len(measured) else pd.Timestamp(0, tz="UTC")
    end = start + pd.Timedelta(seconds=duration_s)
    m = measured[(measured["ts"] >= start) & (measured["ts"] < end)]
    failed = m["error_kind"].notna()
    ok = m[~failed]
    n = len(m)
    answered_at = samples["ts"] + pd.to_timedelta(samples["latency_ms"], unit="ms")
    answered = samples[(answered_at >= start) & (answered_at < end)]
    good = int(within_slo(answered, slo).sum())
    grace = pd.Timedelta(seconds=duration_s if grace_s is None else grace_s)
    kept = int((~failed & (m["ts"] + pd.to_timedelta(m["latency_ms"], unit="ms") < end + grace)).sum())
    itl = ok["itl_ms"].dropna().explode().dropna().astype(float) if "itl_ms" in ok else pd.Series(dtype=float)
    lag = m["lag_ms"].dropna() if "lag_ms" in m else pd.Series(dtype=float)
    return Figures(
        requests=n,
        errors=int(failed.sum()),
        error_rate=float(failed.sum()) / n if n else 0.0,
        errors_by_kind={str(k): int(v) for k, v in m.loc[failed, "error_kind"].value_counts().sort_index().items()},
        achieved_rps=len(answered) / duration_s,
        output_tps=float(ok["output_tokens"].sum()) / duration_s,
        **_four("latency", ok["latency_ms"]),
        **_four("ttft", ok["ttft_ms"].dropna()),
        ttft_samples=int(ok["ttft_ms"].notna().sum()),
        **_four("itl", itl),
        sent_rps=n / duration_s,
        goodput_rps=good / duration_s,
        goodput_ratio=good / len(answered) if len(answered) else None,
        lag_p50_ms=_pct(lag, 0.5),
        lag_p99_ms=_pct(lag, 0.99),
        lag_max_ms=round(float(lag.max()), 3) if len(lag) else None,
        in_flight_start=in_flight(samples, start),
        in_flight_end=in_flight(samples, end),
        kept_up=kept,
        latency_open_p99_ms=_pct(m["latency_ms"], 0.99),
    )


def node_figures(samples: pd.DataFrame, duration_s: float, nodes: list[str], *,
                 start: pd.Timestamp | None = None, slo: SLO | None = None) -> list[NodeFigures]:
    if start is None:
        measured = samples[~samples["warmup"]] if "warmup" in samples else samples
        start = measured["ts"].min() if len(measured) else None
    return [
        NodeFigures(node=node, **figures(samples[samples["node"] == node], duration_s, start=start,
                                         slo=slo).model_dump())
        for node in nodes
    ]


def window_figures(samples: pd.DataFrame, start: pd.Timestamp, duration_s: float, window_s: float,
                   offered: Callable[[float], float], dropped: list[pd.Timestamp] | None = None,
                   slo: SLO | None = None) -> list[WindowFigures]:
    """Figures per window of ``window_s`` over ``[start, start + duration_s)``; ``offered(t)`` is the
    offered rate at ``t`` seconds after ``start`` (the mean over a window is taken at its middle)."""
    out: list[WindowFigures] = []
    t = 0.0
    # a request started at a window's end is answered one service time later even by an idle server: the grace
    # is the window, at least twice the fastest requests' latency (5th percentile of the run's successes)
    done = samples.loc[samples["error_kind"].isna(), "latency_ms"]
    grace = max(window_s, 2 * float(done.quantile(0.05)) / 1000 if len(done) else 0.0)
    while t < duration_s - 1e-9:
        w = min(window_s, duration_s - t)
        if w < window_s / 2 and out:  # a short tail: not a window of its own
            break
        ws = start + pd.Timedelta(seconds=t)
        we = ws + pd.Timedelta(seconds=w)
        drops = sum(1 for d in dropped or [] if ws <= d < we)
        fig = figures(samples, w, start=ws, slo=slo, grace_s=grace)
        out.append(WindowFigures(start_s=round(t, 3), duration_s=w, offered_rps=round(offered(t + w / 2), 4),
                                 dropped_iterations=drops, **fig.model_dump()))
        t += w
    return out


def slo_verdict(fig: Figures, slo: SLO) -> SloVerdict:
    """Pass/fail against the SLO, with one reason per broken objective (value, limit)."""
    reasons = []
    if fig.requests == 0:
        reasons.append("no request was measured (after the warm-up)")
    elif fig.latency_p99_ms is None:
        reasons.append(f"no request succeeded ({fig.errors} of {fig.requests} failed)")
    elif fig.latency_p99_ms >= slo.p99_latency_ms:
        reasons.append(f"P99 latency {fig.latency_p99_ms:.0f} ms is over the SLO's {slo.p99_latency_ms:.0f} ms")
    if slo.p99_ttft_ms and fig.ttft_p99_ms is not None and fig.ttft_p99_ms >= slo.p99_ttft_ms:
        reasons.append(f"P99 time to first token {fig.ttft_p99_ms:.0f} ms (client, {fig.ttft_samples} sampled) "
                       f"is over the SLO's {slo.p99_ttft_ms:.0f} ms")
    if fig.requests and fig.error_rate > slo.max_error_rate:
        kinds = ", ".join(f"{k}: {v}" for k, v in fig.errors_by_kind.items())
        reasons.append(
            f"error rate {fig.error_rate:.2%} ({fig.errors} of {fig.requests}; {kinds}) is over the "
            f"SLO's {slo.max_error_rate:.2%}"
        )
    if slo.min_rps and fig.achieved_rps < slo.min_rps:
        reasons.append(f"achieved {fig.achieved_rps:.2f} req/s is under the SLO's {slo.min_rps:.2f} req/s")
    return SloVerdict(passed=not reasons, reasons=reasons)


def thresholds_crossed(summary: dict) -> list[str]:
    """Threshold names that failed in a ``--summary-export`` file (there ``true`` means FAILED)."""
    crossed = []
    for metric, body in sorted(summary.get("metrics", {}).items()):
        for expr, failed in (body.get("thresholds") or {}).items():
            if failed:
                crossed.append(f"{metric}: {expr}")
    return crossed
