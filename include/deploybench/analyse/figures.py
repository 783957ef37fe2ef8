"""One row of figures per stored run, for comparison, history and reports.

The figures of a run are those of its *main phase*: ``sustained`` when it ran, else the
first cluster-wide phase stored. ``capacity_rps`` is the highest offered rate among the
capacity-search steps that met the SLO (None without a probe phase). ``goodput_rps`` is
the rate of requests that succeeded within the SLO's P99 latency bound, from the raw samples.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from sqlalchemy import Engine, and_, case, func, select

from deploybench.store.db import open_store
from deploybench.store.models import RequestSample
from deploybench.store.query import capacity_figures, phase_figures

MAIN_PHASES = ("sustained", "load", "probe", "overload")
FIGURES = ("capacity_rps", "goodput_rps", "achieved_rps", "output_tps", "latency_p50_ms", "latency_p99_ms",
           "ttft_p99_ms", "error_rate")
# what the engine and the GPUs said of the main phase, shown beside the figures (no rank test: one value per run)
ENGINE_FIGURES = ("prefix_hit_rate", "energy_per_output_token_j", "energy_per_request_j")
# what the main phase cost per million output tokens (the inventory's prices), in ``cost_currency``
COST_FIGURES = ("cost_per_million_output_tokens",)
# figures where higher is better (the others: lower is better)
HIGHER_IS_BETTER = {"capacity_rps", "goodput_rps", "achieved_rps", "output_tps"}


def main_phase(phases: list[str]) -> str | None:
    for name in MAIN_PHASES:
        if name in phases:
            return name
    return phases[0] if phases else None


def slo_of(config: dict[str, Any]) -> dict[str, float]:
    slo = (config or {}).get("slo") or {}
    return {"p99_latency_ms": float(slo.get("p99_latency_ms", 2000.0)),
            "max_error_rate": float(slo.get("max_error_rate", 0.01))}


def run_figures(target: Engine | str | None, runs: pd.DataFrame) -> pd.DataFrame:
    """``runs`` (from query.select_runs) joined with the figures of each run's main phase."""
    keys = list(runs["run_key"])
    phases = phase_figures(target, keys)
    caps = capacity_figures(target, keys)
    rows = []
    for _, run in runs.iterrows():
        mine = phases[phases["run_key"] == run["run_key"]] if not phases.empty else phases
        phase = main_phase(list(mine["phase"])) if not mine.empty else None
        p = mine[mine["phase"] == phase].iloc[0] if phase else None
        slo = slo_of(run["config"])
        steps = caps[(caps["run_key"] == run["run_key"]) & caps["slo_ok"]] if not caps.empty else caps
        row = {"run_key": run["run_key"], "phase": phase,
               "capacity_rps": float(steps["offered_rps"].max()) if len(steps) else None}
        for f in ("achieved_rps", "output_tps", "latency_p50_ms", "latency_p99_ms", "ttft_p99_ms", "error_rate",
                  "duration_s", "requests", *ENGINE_FIGURES, *COST_FIGURES):
            row[f] = None if p is None or f not in p or pd.isna(p[f]) else float(p[f])
        cur = None if p is None or "cost_currency" not in p else p["cost_currency"]
        row["cost_currency"] = cur if isinstance(cur, str) else None
        row["workload_name"] = ((run["config"] or {}).get("load") or {}).get("workload") or "synthetic"

        row["slo_met"] = bool(p is not None and row["latency_p99_ms"] is not None
                              and row["latency_p99_ms"] <= slo["p99_latency_ms"]
                              and row["error_rate"] <= slo["max_error_rate"])
        row["slo_p99_ms"] = slo["p99_latency_ms"]
        rows.append(row)
    out = pd.DataFrame(rows)
    out["goodput_rps"] = _goodput(target, out)
    return runs.merge(out, on="run_key", how="left")


def _goodput(target: Engine | str | None, figs: pd.DataFrame) -> list[float | None]:
    """Requests that succeeded within the SLO latency per second of the main phase, from the samples."""
    engine = open_store(target)
    values: list[float | None] = []
    with engine.connect() as conn:
        for _, r in figs.iterrows():
            # a run stopped before the load stage has no phase (NaN once pandas holds it): no goodput
            if pd.isna(r["phase"]) or not r["phase"] or pd.isna(r["duration_s"]) or not r["duration_s"]:
                values.append(None)
                continue
            good = func.sum(case((and_(RequestSample.status == 200, RequestSample.latency_ms <= r["slo_p99_ms"]), 1),
                                 else_=0))
            n = conn.execute(select(good).where(RequestSample.run_key == r["run_key"],
                                                RequestSample.phase == r["phase"])).scalar()
            values.append(None if n is None else float(n) / float(r["duration_s"]))
    return values
