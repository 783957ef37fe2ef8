"""The throughput-latency Pareto front: configurations no other one beats on both axes."""

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
