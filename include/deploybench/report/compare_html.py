"""The comparison report: one self-contained HTML file per comparison (``write_comparison_html``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from deploybench.report import plots
from deploybench.report.html import document, esc, figure, table

if TYPE_CHECKING:
    from deploybench.analyse.compare import Comparison

_FIGURE_LABELS = {
    "capacity_rps": "capacity req/s", "goodput_rps": "goodput req/s", "achieved_rps": "achieved req/s",
    "output_tps": "output tok/s", "latency_p50_ms": "P50 ms", "latency_p99_ms": "P99 e2e ms",
    "ttft_p99_ms": "P99 TTFT ms", "error_rate": "error rate",
}


def config_label(row: Any) -> str:
    """A short name for a run's configuration: engine, replicas, the knobs that tell configs apart."""
    serving = row.get("serving") if isinstance(row.get("serving"), dict) else {}
    knobs = ", ".join(f"{k}={serving[k]}" for k in ("max_num_seqs", "tensor_parallel_size", "replicas")
                      if k in serving)
    return f"{row.get('engine') or '?'} {knobs}".strip() + f" [{str(row['run_key'])[-18:]}]"


def render(cmp: "Comparison", curves: dict[str, list[tuple[float, float]]] | None = None) -> str:
    t = cmp.table
    parts = [f"<h1>deploybench comparison{f' #{cmp.id}' if cmp.id else ''}</h1>",
             f"<p>{len(t)} runs &middot; selection: {esc(cmp.params.get('filter', ''))}"
             + (f" &middot; baseline <code>{esc(cmp.baseline)}</code>" if cmp.baseline else "") + "</p>"]
    if len(cmp.groups) > 1:
        parts.append(f"<p class='note'>The runs have {len(cmp.groups)} different workloads; each is compared "
                     "within its own group, never across groups.</p>")
    for n, (group, keys) in enumerate(cmp.groups.items(), start=1):
        sub = t[t["run_key"].isin(keys)]
        best = cmp.best.get(group)
        parts.append(f"<h2>Workload group {n} <code>{esc(group[:12])}</code></h2>")
        parts.append("<p>Best configuration meeting the SLO: "
                     + (f"<b class='success'>{esc(config_label(sub[sub['run_key'] == best].iloc[0]))}</b>" if best
                        else "<b class='failed'>none meets the SLO</b>") + "</p>")
        headers = ["configuration", *_FIGURE_LABELS.values(), "SLO", "Pareto"]
        rows = [[config_label(r), *[r[f] for f in _FIGURE_LABELS], "met" if r["slo_met"] else "not met",
                 "yes" if r["pareto"] else ""] for _, r in sub.iterrows()]
        parts.append(table(headers, rows, ["best" if k == best else "" for k in sub["run_key"]]))
        pts = {config_label(r): [(r["capacity_rps"] if pd.notna(r["capacity_rps"]) else r["achieved_rps"],
                                  r["latency_p99_ms"])] for _, r in sub.iterrows() if pd.notna(r["latency_p99_ms"])}
        mine = {config_label(r): (curves or {}).get(r["run_key"]) for _, r in sub.iterrows()}
        shown = {k: v for k, v in mine.items() if v} or pts
        slo = float(sub["slo_p99_ms"].iloc[0]) if "slo_p99_ms" in sub else None
        parts.append(figure(plots.throughput_latency(shown, "Throughput vs P99 latency per configuration", slo),
                            "throughput-latency curves per configuration"))
        front = [config_label(sub[sub["run_key"] == k].iloc[0]) for k in cmp.pareto.get(group, [])]
        parts.append(f"<p>Pareto front (throughput up, P99 down): {esc(' → '.join(front) or 'empty')}</p>")
    if cmp.baseline is not None and not cmp.changes.empty:
        parts.append(f"<h2>Change against the baseline <code>{esc(cmp.baseline)}</code></h2>")
        c = cmp.changes
        parts.append(table(
            ["run", "figure", "baseline", "value", "change", "p-value", "significant", "direction"],
            [[r["run_key"], _FIGURE_LABELS.get(r["figure"], r["figure"]), r["baseline"], r["value"],
              "" if pd.isna(r["change"]) else f"{r['change']:+.1%}",
              "n/a" if pd.isna(r["p_value"]) else f"{r['p_value']:.3g}", "yes" if r["significant"] else "no",
              r["direction"]] for _, r in c.iterrows()],
            [r["direction"] if r["significant"] else "" for _, r in c.iterrows()]))
        parts.append(f"<p class='note'>p-values: {esc(cmp.params.get('method'))}, alpha {cmp.params.get('alpha')}; "
                     "capacity has none (one search per run).</p>")
    return document(f"deploybench comparison {cmp.id or ''}", parts)


def write_comparison_html(cmp: "Comparison", path: Path,
                          curves: dict[str, list[tuple[float, float]]] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render(cmp, curves))
    tmp.replace(path)
    return path
