"""The comparison report: one self-contained HTML file per comparison (``write_comparison_html``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from deploybench.report import plots
from deploybench.report.html import Html, document, esc, figure, fmt_change, fmt_money, fmt_p, fmt_pct, table

if TYPE_CHECKING:
    from deploybench.analyse.compare import Comparison

FIGURE_LABELS = {
    "capacity_rps": "capacity req/s", "goodput_rps": "goodput req/s", "achieved_rps": "achieved req/s",
    "output_tps": "output tok/s", "latency_p50_ms": "P50 ms", "latency_p99_ms": "P99 e2e ms",
    "ttft_p99_ms": "P99 TTFT ms", "error_rate": "error rate", "prefix_hit_rate": "prefix hit rate",
    "energy_per_output_token_j": "J per output token", "energy_per_request_j": "J per request",
    "cost_per_million_output_tokens": "cost per 1M output tokens",
}
_ABSENT_NOT_ZERO = ("prefix_hit_rate", "energy_per_output_token_j", "energy_per_request_j",
                    "cost_per_million_output_tokens")


def _shown(figure: str, v: Any, currency: Any = None) -> Any:
    """A figure as the table shows it; the engine's, the GPUs' and the cost say "absent" when not measured (an engine
    without a prefix cache, GPUs without power readings, nodes without a price), never a blank that reads as 0."""
    if figure not in _ABSENT_NOT_ZERO:
        return v
    if v is None or (isinstance(v, float) and v != v):
        return "absent"
    if figure == "cost_per_million_output_tokens":
        return fmt_money(v, currency)
    return fmt_pct(v, 1) if figure == "prefix_hit_rate" else f"{float(v):.4g}"


def config_label(row: Any) -> str:
    """A short name for a run's configuration: engine, replicas, the knobs that tell configs apart."""
    serving = row.get("serving") if isinstance(row.get("serving"), dict) else {}
    knobs = ", ".join(f"{k}={serving[k]}" for k in ("max_num_seqs", "tensor_parallel_size", "replicas")
                      if k in serving)
    return f"{row.get('engine') or '?'} {knobs}".strip() + f" [{str(row['run_key'])[-18:]}]"


def sections(cmp: Comparison, curves: dict[str, list[tuple[float, float]]] | None = None,
             run_link: Callable[[str, str], Html] | None = None) -> list[str]:
    """The comparison's body below its heading: per workload group the best configuration, the figures,
    the throughput-latency curves and the Pareto front; then the changes against the baseline. Shared by
    the report file and the results pages, which pass ``run_link(run_key, text)`` to link each run."""
    def name(key: str, text: str | None = None) -> Any:
        text = text if text is not None else key
        return run_link(key, text) if run_link else text

    t = cmp.table
    parts = [f"<p>{len(t)} runs &middot; selection: {esc(cmp.params.get('filter', ''))}"
             + (f" &middot; baseline <code>{esc(cmp.baseline)}</code>" if cmp.baseline else "") + "</p>"]
    if len(cmp.groups) > 1:
        parts.append(f"<p class='note'>The runs have {len(cmp.groups)} different workloads; each is compared "
                     "within its own group, never across groups.</p>")
    for n, (group, keys) in enumerate(cmp.groups.items(), start=1):
        sub = t[t["run_key"].isin(keys)]
        best = cmp.best.get(group)
        label = {str(r["run_key"]): config_label(r) for _, r in sub.iterrows()}
        names = sorted({str(w) for w in sub.get("workload_name", pd.Series(dtype=object)).dropna()})
        parts.append(f"<h2>Workload group {n}: {esc(', '.join(names) or 'unknown')} <code>{esc(group[:12])}</code>"
                     "</h2>")
        if best:
            parts.append(f"<p class='best-run'>Best configuration meeting the SLO: <b class='success'>"
                         f"{esc(label[best])}</b>, run {_cell_html(name(best))}</p>")
        else:
            parts.append("<p class='best-run'>Best configuration meeting the SLO: "
                         "<b class='failed'>none meets the SLO</b></p>")
        headers = ["configuration", *FIGURE_LABELS.values(), "SLO", "Pareto"]
        rows = [[name(str(r["run_key"]), label[str(r["run_key"])]),
                 *[_shown(f, r.get(f), r.get("cost_currency")) for f in FIGURE_LABELS],
                 "met" if r["slo_met"] else "not met", "yes" if r["pareto"] else ""] for _, r in sub.iterrows()]
        parts.append(table(headers, rows, ["best" if k == best else "" for k in sub["run_key"]]))
        pts = {label[str(r["run_key"])]: (r["capacity_rps"] if pd.notna(r["capacity_rps"]) else r["achieved_rps"],
                                         r["latency_p99_ms"]) for _, r in sub.iterrows()}
        mine = {label[str(r["run_key"])]: (curves or {}).get(r["run_key"]) for _, r in sub.iterrows()}
        shown = {k: v for k, v in mine.items() if v} or {k: [v] for k, v in pts.items() if pd.notna(v[1])}
        slo = float(sub["slo_p99_ms"].iloc[0]) if "slo_p99_ms" in sub else None
        parts.append(figure(plots.throughput_latency(shown, "Throughput vs P99 latency per configuration", slo),
                            "throughput-latency curves per configuration"))
        front = [label[k] for k in cmp.pareto.get(group, [])]
        parts.append(figure(plots.pareto(pts, front, "Pareto front: throughput up, P99 latency down", slo),
                            "Pareto front (green) and dominated configurations (grey)"))
        parts.append(f"<p>Pareto front (throughput up, P99 down): {esc(' → '.join(front) or 'empty')}</p>")
        parts.extend(_cost_section(cmp, group, sub, label, slo))
    if cmp.baseline is not None and not cmp.changes.empty:
        parts.append(f"<h2>Change against the baseline <code>{esc(cmp.baseline)}</code></h2>")
        c = cmp.changes
        parts.append(table(
            ["run", "figure", "baseline", "value", "change", "p-value", "significant", "direction"],
            [[name(str(r["run_key"])), FIGURE_LABELS.get(r["figure"], r["figure"]), r["baseline"], r["value"],
              fmt_change(r["change"], missing=""), fmt_p(r["p_value"]), "yes" if r["significant"] else "no",
              r["direction"]] for _, r in c.iterrows()],
            [r["direction"] if r["significant"] else "" for _, r in c.iterrows()]))
        parts.append(f"<p class='note'>p-values: {esc(cmp.params.get('method'))}, alpha {cmp.params.get('alpha')}; "
                     "capacity has none (one search per run).</p>")
    return parts


def _cost_section(cmp: Comparison, group: str, sub: pd.DataFrame, label: dict[str, str],
                  slo: float | None) -> list[str]:
    """Cost per million output tokens against P99: the front, and the cheapest configuration meeting the SLO (per
    currency); a note when no run of the group was priced."""
    priced = {label[str(r["run_key"])]: (float(r["cost_per_million_output_tokens"]), r["latency_p99_ms"])
              for _, r in sub.iterrows() if pd.notna(r.get("cost_per_million_output_tokens"))}
    if not priced:
        return ["<p class='note'>Cost per million output tokens: absent (no inventory of these runs sets a price per "
                "node-hour).</p>"]
    currencies = sorted({str(c) for c in sub.get("cost_currency", pd.Series(dtype=object)).dropna()})
    front = [label[k] for k in cmp.cost_pareto.get(group, [])]
    out = [figure(plots.pareto(priced, front, "Cost against P99 latency", slo,
                               xlabel=f"cost per million output tokens ({', '.join(currencies)})"),
                  "cost-latency front (green) and dominated configurations (grey)"),
           f"<p>Cost-latency front (cost down, P99 down): {esc(' → '.join(front) or 'empty')}</p>"]
    cheap = cmp.cheapest.get(group) or {}
    if not cheap:
        out.append("<p class='cheapest'>Cheapest configuration meeting the SLO: <b class='failed'>none</b> (no priced "
                   "run meets it)</p>")
    for cur, key in cheap.items():
        row = sub[sub["run_key"] == key].iloc[0]
        out.append(f"<p class='cheapest'>Cheapest configuration meeting the SLO (P99 within {slo or 0:g} ms): "
                   f"<b class='success'>{esc(label[key])}</b> at "
                   f"{esc(fmt_money(row['cost_per_million_output_tokens'], cur))} per million output tokens</p>")
    return out


def _cell_html(value: Any) -> str:
    return value if isinstance(value, Html) else f"<code>{esc(value)}</code>"


def render(cmp: Comparison, curves: dict[str, list[tuple[float, float]]] | None = None) -> str:
    heading = f"<h1>deploybench comparison{f' #{cmp.id}' if cmp.id else ''}</h1>"
    return document(f"deploybench comparison {cmp.id or ''}", [heading, *sections(cmp, curves)])


def write_comparison_html(cmp: Comparison, path: Path,
                          curves: dict[str, list[tuple[float, float]]] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render(cmp, curves))
    tmp.replace(path)
    return path
