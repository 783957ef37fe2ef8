"""Plots for the reports, as inline SVG strings (matplotlib's object API, no pyplot, no display).

Each function takes plain data (lists of dicts or DataFrames already read) and returns an
``<svg>`` element, or "" when there is nothing to draw. Figures are small and their text is
kept as text (``svg.fonttype = none``), so a browser (and a test) can read titles and labels.
"""

from __future__ import annotations

import io
import math
from typing import Any

import matplotlib
import pandas as pd
from matplotlib.figure import Figure

matplotlib.rcParams["svg.fonttype"] = "none"
WINDOW_S = 1.0


def _svg(fig: Figure) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _fig(title: str, w: float = 6.4, h: float = 3.2) -> tuple[Figure, Any]:
    fig = Figure(figsize=(w, h))
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    return fig, ax


def lengths(samples: pd.DataFrame) -> str:
    """Histograms of the requests' prompt and answer lengths (tokens), side by side."""
    if samples is None or samples.empty:
        return ""
    fig = Figure(figsize=(8.0, 2.8))
    for k, (col, title) in enumerate((("prompt_tokens", "prompt tokens sent"),
                                      ("output_tokens", "answer tokens received"))):
        ax = fig.add_subplot(1, 2, k + 1)
        values = samples[col].dropna()
        if col == "output_tokens" and "error_kind" in samples:
            values = samples.loc[samples["error_kind"].isna(), col].dropna()
        ax.hist(values, bins=min(40, max(5, int(values.nunique()))), color="#4c72b0")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("tokens")
        ax.set_ylabel("requests")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return _svg(fig)


def windows(samples: pd.DataFrame, window_s: float = WINDOW_S) -> pd.DataFrame:
    """Per-window figures of raw samples: t (s from the first), req/s, ok req/s, error rate, P99 ms."""
    if samples is None or samples.empty:
        return pd.DataFrame(columns=["t", "rps", "ok_rps", "error_rate", "p99_ms"])
    ts = pd.to_datetime(samples["ts"], utc=True)
    t = (ts - ts.min()).dt.total_seconds()
    win = (t // window_s).astype(int)
    frame = samples.assign(win=win, ok=samples["status"] == 200)
    g = frame.groupby("win")
    sizes = g.size()
    if len(sizes) > 2 and sizes.iloc[-1] < 0.5 * sizes.median():
        frame = frame[frame["win"] != sizes.index[-1]]  # the last window is cut short by the end of the phase
        g = frame.groupby("win")
    out = pd.DataFrame({
        "t": g.size().index * window_s,
        "rps": g.size().to_numpy() / window_s,
        "ok_rps": g["ok"].sum().to_numpy() / window_s,
        "error_rate": 1 - g["ok"].mean().to_numpy(),
        # a window without a successful request has no P99 (NaN)
        "p99_ms": frame[frame["ok"]].groupby("win")["latency_ms"].quantile(0.99).reindex(g.size().index).to_numpy(),
    })
    return out


def over_time(samples: pd.DataFrame, title: str, slo_ms: float | None = None) -> str:
    """Throughput and P99 latency per window over a phase (sustained, overload + recovery)."""
    w = windows(samples)
    if w.empty:
        return ""
    fig, ax = _fig(title)
    ax.plot(w["t"], w["ok_rps"], color="tab:blue", label="successful req/s")
    if (w["error_rate"] > 0).any():
        ax.plot(w["t"], w["rps"] - w["ok_rps"], color="tab:red", label="errors/s")
    ax.set_xlabel("seconds into the phase")
    ax.set_ylabel("requests/s")
    ax2 = ax.twinx()
    ax2.plot(w["t"], w["p99_ms"], color="tab:orange", label="P99 latency ms")
    if slo_ms:
        ax2.axhline(slo_ms, color="tab:orange", ls="--", lw=0.8, label="SLO P99")
    ax2.set_ylabel("P99 latency (ms)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower right")
    return _svg(fig)


def throughput_latency(curves: dict[str, list[tuple[float, float]]], title: str, slo_ms: float | None = None) -> str:
    """One curve per configuration: achieved throughput (x) against P99 latency (y)."""
    curves = {k: sorted(v) for k, v in curves.items() if v}
    if not curves:
        return ""
    fig, ax = _fig(title)
    for name, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name[:40])
    if slo_ms:
        ax.axhline(slo_ms, color="grey", ls="--", lw=0.8, label="SLO P99")
    ax.set_xlabel("achieved requests/s")
    ax.set_ylabel("P99 latency (ms)")
    ax.legend(fontsize=7)
    return _svg(fig)


def capacity_steps(steps: list[dict[str, Any]], capacity: float | None = None) -> str:
    """The capacity search: offered rate per step, green when the SLO held, red when it broke."""
    if not steps:
        return ""
    fig, ax = _fig("Capacity search steps")
    xs = list(range(1, len(steps) + 1))
    rates = [s["offered_rps"] for s in steps]
    ax.plot(xs, rates, color="grey", lw=0.8)
    ax.scatter(xs, rates, c=["tab:green" if s["slo_ok"] else "tab:red" for s in steps], zorder=3)
    for x, s in zip(xs, steps):
        if s.get("achieved_rps") is not None:
            ax.annotate(f"{s['achieved_rps']:.1f}", (x, s["offered_rps"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
    if capacity:
        ax.axhline(capacity, color="tab:green", ls="--", lw=0.8, label=f"capacity {capacity:g} req/s")
        ax.legend(fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("offered requests/s")
    return _svg(fig)


def per_node_bars(nodes: list[dict[str, Any]]) -> str:
    """Requests/s and P99 latency per node."""
    if not nodes:
        return ""
    fig = Figure(figsize=(6.4, 3.0))
    names = [n["node"] for n in nodes]
    for i, (key, label, color) in enumerate((("achieved_rps", "requests/s", "tab:blue"),
                                             ("latency_p99_ms", "P99 latency (ms)", "tab:orange"))):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.bar(names, [n.get(key) or 0 for n in nodes], color=color)
        ax.set_title(f"Per node: {label}", fontsize=9)
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    fig.tight_layout()
    return _svg(fig)


def bandwidth_matrix(links: list[dict[str, Any]]) -> str:
    """Heat map of measured Mbit/s from each source (rows) to each destination (columns)."""
    # a bidirectional test lists each direction: plot those, so the matrix is not symmetric by construction
    links = [d for lt in links for d in (lt.get("directions") or [lt]) if d.get("src") and d.get("dst")]
    if not links:
        return ""
    names = sorted({lt["src"] for lt in links} | {lt["dst"] for lt in links})
    idx = {n: i for i, n in enumerate(names)}
    grid = [[math.nan] * len(names) for _ in names]
    mbit = [[None] * len(names) for _ in names]
    for lt in links:
        grid[idx[lt["src"]]][idx[lt["dst"]]] = lt["ratio"] if lt.get("ratio") is not None else math.nan
        mbit[idx[lt["src"]]][idx[lt["dst"]]] = lt.get("mbit")
    size = max(3.0, 0.45 * len(names) + 1.5)
    fig = Figure(figsize=(size + 1.2, size))
    ax = fig.add_subplot()
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(len(names)), names, rotation=60, fontsize=7)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xlabel("to")
    ax.set_ylabel("from")
    ax.set_title("Preflight bandwidth (colour: % of nominal; label: Mbit/s and %)", fontsize=10)
    for i in range(len(names)):
        for j in range(len(names)):
            if grid[i][j] == grid[i][j]:
                shown = f"{mbit[i][j]:.0f}\n{grid[i][j]:.0%}" if mbit[i][j] is not None else f"{grid[i][j]:.0%}"
                ax.text(j, i, shown, ha="center", va="center", fontsize=6, color="black")
    fig.colorbar(im, ax=ax, label="measured / nominal")
    return _svg(fig)


def fanout_timeline(nodes: list[dict[str, Any]]) -> str:
    """When each node's copy started and how long it took (seconds after the stage began)."""
    nodes = [n for n in nodes if n.get("status") != "source"]
    if not nodes:
        return ""
    fig, ax = _fig("Fan-out timeline", h=max(2.0, 0.3 * len(nodes) + 1))
    colors: dict[str | None, str] = {"copied": "tab:blue", "skipped": "tab:grey", "failed": "tab:red"}
    for i, n in enumerate(nodes):
        ax.barh(i, max(n.get("seconds") or 0, 0.01), left=n.get("started_at") or 0,
                color=colors.get(n.get("status"), "tab:purple"))
    ax.set_yticks(range(len(nodes)), [n["node"] for n in nodes], fontsize=7)
    ax.set_xlabel("seconds after fan-out began")
    return _svg(fig)


def _plain(text: str) -> str:
    """A label shown as typed: '$' would start matplotlib's mathtext (and a lone one can fail to parse)."""
    return str(text).replace("$", r"\$")


def pareto(points: dict[str, tuple[float, float]], front: list[str], title: str,
           slo_ms: float | None = None, xlabel: str = "throughput (capacity, else achieved requests/s)") -> str:
    """Every configuration as a point (throughput x, P99 latency y); the Pareto front joined and
    labelled, the dominated points grey. ``front`` lists labels of ``points``, by throughput (or, for the
    cost front, by cost with ``xlabel`` naming it)."""
    points = {k: v for k, v in points.items() if v[0] is not None and v[1] is not None
              and math.isfinite(v[0]) and math.isfinite(v[1])}
    if not points:
        return ""
    fig, ax = _fig(title)
    on = [k for k in front if k in points]
    off = [k for k in points if k not in on]
    if off:
        ax.scatter([points[k][0] for k in off], [points[k][1] for k in off], color="tab:grey", alpha=0.6,
                   label="dominated")
    if on:
        ax.plot([points[k][0] for k in on], [points[k][1] for k in on], color="tab:green", marker="o",
                label="Pareto front")
    for k, (x, y) in points.items():
        ax.annotate(_plain(k[:40]), (x, y), fontsize=6, xytext=(4, 4), textcoords="offset points",
                    color="black" if k in on else "dimgrey")
    if slo_ms:
        ax.axhline(slo_ms, color="tab:orange", ls="--", lw=0.8, label="SLO P99")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("P99 latency (ms)")
    ax.legend(fontsize=7)
    return _svg(fig)


def metric_history(runs: list[dict[str, Any]], changes: list[dict[str, Any]], title: str, ylabel: str) -> str:
    """One metric over a series' runs: ``runs`` are {"t": datetime, "value", "excluded": bool} (excluded
    runs drawn as grey hollow points, not joined); ``changes`` are {"t", "text"}: a dashed red line at
    the first run after each change point, labelled with ``text``."""
    shown = [r for r in runs if r.get("value") is not None and r["value"] == r["value"]]
    if not shown:
        return ""
    fig, ax = _fig(title, h=2.8)
    kept = [r for r in shown if not r.get("excluded")]
    out = [r for r in shown if r.get("excluded")]
    if kept:
        ax.plot([r["t"] for r in kept], [r["value"] for r in kept], color="tab:blue", marker="o", ms=4,
                label="analysed runs")
    if out:
        ax.scatter([r["t"] for r in out], [r["value"] for r in out], facecolors="none", edgecolors="tab:grey",
                   label="excluded or failed (not analysed)")
    for c in changes:
        ax.axvline(c["t"], color="tab:red", ls="--", lw=1)
        ax.annotate(_plain(c["text"]), (c["t"], 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                    color="tab:red", xytext=(3, -10), textcoords="offset points")
    ax.set_ylabel(ylabel)
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    ax.legend(fontsize=7, loc="lower left")
    return _svg(fig)
