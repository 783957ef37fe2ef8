"""Each node's figures over each load window, with the source of each (issue 29): the report's and the run page's
section. Rows are ``NodeWindow``-shaped (the load result's, or the store's ``NodeWindowRow``: phase, step, node,
metric, source, unit, mean, max, samples, reason); an absent figure says ``absent`` and why, never 0."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from deploybench.report.html import esc, table

HEADING = "Node figures per window, by source"
SOURCES = {"prometheus": "Prometheus (query_range over the window)",
           "scrape": "deploybench's own scrape of the engine's /metrics"}
_ORDER = ("probe", "sustained", "spike", "overload")


def _num(v: Any) -> str:
    if v is None:
        return "absent"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def _get(row: Any, key: str) -> Any:
    return row.get(key) if isinstance(row, dict) else getattr(row, key, None)


def section(rows: Iterable[Any], level: int = 3) -> list[str]:
    """A heading, what the sources are, and one table per phase (and probe step): node, figure, source, mean, max,
    samples and, for an absent figure, why. [] when there are no rows (no Prometheus source was given)."""
    by_window: dict[tuple[str, int], list[Any]] = defaultdict(list)
    for r in rows:
        by_window[(str(_get(r, "phase")), int(_get(r, "step") or 0))].append(r)
    if not by_window:
        return []
    parts = [f"<h{level}>{HEADING}</h{level}>",
             "<p>" + "; ".join(f"<b>{esc(k)}</b>: {esc(v)}" for k, v in SOURCES.items())
             + ". Where both measured a figure, both rows are shown.</p>"]
    key = lambda w: (_ORDER.index(w[0]) if w[0] in _ORDER else len(_ORDER), w[0], w[1])  # noqa: E731
    for phase, step in sorted(by_window, key=key):
        got = sorted(by_window[(phase, step)], key=lambda r: (_get(r, "node"), _get(r, "metric"), _get(r, "source")))
        title = phase + (f", step {step}" if step else "")
        parts += [f"<h{level + 1}>{esc(title)}</h{level + 1}>",
                  table(["node", "figure", "unit", "source", "mean", "max", "samples", "note"],
                        [[_get(r, "node"), _get(r, "metric"), _get(r, "unit"), _get(r, "source"),
                          _num(_get(r, "mean")), _num(_get(r, "max")) if _get(r, "mean") is not None or
                          _get(r, "max") is not None else "absent", _get(r, "samples") or 0,
                          _get(r, "reason") or ""] for r in got], numeric_from=4)]
    return parts


def of_load(phases: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of a load stage's phase outcomes (``PhaseOutcome.node_windows``, by step)."""
    out = []
    for name, ph in phases.items():
        windows = _get(ph, "node_windows") or {}
        for step, figs in windows.items():
            for w in figs:
                d = w if isinstance(w, dict) else w.model_dump()
                out.append({**d, "phase": name, "step": int(step)})
    return out
