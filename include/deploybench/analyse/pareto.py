"""Pareto fronts: configurations no other one beats on both axes (throughput against latency, cost against
latency), and the cheapest configuration at a latency target."""

from __future__ import annotations

from collections.abc import Hashable, Iterable


def pareto_front(points: Iterable[tuple[Hashable, float, float]]) -> list[Hashable]:
    """Keys of the points (key, throughput, latency) not dominated by another point.

    A point dominates another when its throughput is at least as high and its latency at
    least as low, and it is strictly better on one of them. Points with a missing value
    are never on the front. The result is ordered by throughput, lowest first.
    """
    pts = [(k, t, lat) for k, t, lat in points if t is not None and lat is not None and t == t and lat == lat]
    front = []
    for k, t, lat in pts:
        dominated = any(t2 >= t and l2 <= lat and (t2 > t or l2 < lat) for _, t2, l2 in pts)
        if not dominated:
            front.append((t, lat, k))
    return [k for _, _, k in sorted(front, key=lambda p: (p[0], p[1]))]


def cost_front(points: Iterable[tuple[Hashable, float | None, float | None, str | None]]) -> list[Hashable]:
    """Keys of the points (key, cost per million output tokens, P99 latency, currency) that no point of the same
    currency beats on both: cost at most as high and latency at most as low, strictly better on one. Costs in
    different currencies are not compared (neither dominates the other); a point with a value missing is never on
    the front. Ordered by cost, lowest first."""
    pts = [(k, c, lat, cur) for k, c, lat, cur in points
           if c is not None and lat is not None and cur and c == c and lat == lat]
    front = []
    for k, c, lat, cur in pts:
        dominated = any(cur2 == cur and c2 <= c and l2 <= lat and (c2 < c or l2 < lat) for _, c2, l2, cur2 in pts)
        if not dominated:
            front.append((c, lat, k))
    return [k for _, _, k in sorted(front, key=lambda p: (p[0], p[1]))]


def cheapest_within(points: Iterable[tuple[Hashable, float | None, float | None, str | None]],
                    p99_target_ms: float) -> dict[str, Hashable]:
    """Per currency, the key of the lowest cost per million output tokens among the points whose P99 latency is
    within ``p99_target_ms``: "which configuration is cheapest at our latency target". Points with a value
    missing are left out; a currency none of whose points meets the target is not listed."""
    best: dict[str, tuple[float, float, Hashable]] = {}
    for k, c, lat, cur in points:
        if c is None or lat is None or not cur or c != c or lat != lat or lat > p99_target_ms:
            continue
        if cur not in best or (c, lat) < best[cur][:2]:
            best[cur] = (c, lat, k)
    return {cur: v[2] for cur, v in sorted(best.items())}
