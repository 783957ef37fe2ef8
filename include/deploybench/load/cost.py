"""The cost of a load phase per million output tokens, from the inventory's price per node-hour.

    cost per 1M output tokens = (sum over the serving nodes of price/h x the measured window in hours)
                                / output tokens of that window x 1e6

The serving nodes are those whose engines served the phase (the endpoints scraped, also behind a load balancer);
the window and the tokens are the phase's measured window (warm-up excluded), as for the energy per token
(deploybench.load.gpu.attach). Absent (None, with the reason in ``sources["cost"]``), never 0, when a serving node
has no price or the window answered no output token: a partial sum would flatter the configuration.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deploybench.inventory import Price
    from deploybench.load.results import LoadResult

TOKENS = 1_000_000  # the unit of the cost: per million output tokens (inference-perf's and InferenceX's "$/1M")


def per_million_tokens(prices_per_hour: Sequence[float], window_s: float, output_tokens: float) -> float | None:
    """The cost of ``output_tokens`` made in ``window_s`` seconds by nodes priced ``prices_per_hour`` each, per
    million tokens; None when there is no node, no window or no token (nothing to divide by is not free)."""
    if not prices_per_hour or not window_s > 0 or not output_tokens > 0:
        return None
    return sum(prices_per_hour) * (window_s / 3600.0) / output_tokens * TOKENS


def attach(res: LoadResult, prices: Mapping[str, Price | None] | None, serving: Sequence[str]) -> LoadResult:
    """``res`` with ``cost_per_million_output_tokens``, ``cost_currency`` and ``cost_per_hour`` set from the
    ``prices`` of the ``serving`` nodes (node -> the inventory's ``price_of``), and the reason in
    ``sources["cost"]``."""
    sources = dict(res.sources)
    got = {n: (prices or {}).get(n) for n in serving}
    missing = sorted(n for n, p in got.items() if p is None)
    tokens = res.output_tps * res.duration_s
    update: dict = {"cost_per_million_output_tokens": None, "cost_currency": None, "cost_per_hour": None}
    if not serving:
        sources["cost"] = "absent: no serving node"
    elif missing:
        sources["cost"] = (f"absent: the inventory gives no price per node-hour for {', '.join(missing)} (set "
                           "'price' in the inventory, or on each node)")
    else:
        priced = [p for p in got.values() if p is not None]
        per_hour = sum(p.per_node_hour for p in priced)
        currency = priced[0].currency  # the inventory holds one currency (Inventory._one_currency)
        cost = per_million_tokens([p.per_node_hour for p in priced], res.duration_s, tokens)
        update.update(cost_currency=currency, cost_per_hour=round(per_hour, 6),
                      cost_per_million_output_tokens=None if cost is None else round(cost, 6))
        sources["cost"] = (f"{len(priced)} serving nodes at {per_hour:g} {currency}/h together x the measured window "
                           f"({res.duration_s:g} s) per million output tokens" if cost is not None else
                           "absent: no output token in the measured window")
    return res.model_copy(update={**update, "sources": sources})
