"""Compare stored runs: configurations x figures, the best one meeting the SLO, changes against a
baseline with their significance, the throughput-latency Pareto front, and where the inventories price their
nodes the cost-latency front and the cheapest configuration meeting the SLO (cost per million output tokens).

Significance comes from the per-request samples, never from a bare percentage: end-to-end
latency and time to first token with a two-sided Mann-Whitney U test (scipy) on the
successful requests' values; achieved req/s and output tokens/s with the same test on their
per-second counts; the error rate with Fisher's exact test on (errors, successes). Capacity
is one number per run (the capacity search), so it has no p-value.

Runs of different workloads (prompt/output lengths, API, SLO) measure different things: they
are put in separate groups, each with its own best configuration and Pareto front, and a
baseline only yields changes for runs of its own workload.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats
from sqlalchemy import Engine, case, func, insert, select

from deploybench.analyse import AnalysisError
from deploybench.analyse.figures import FIGURES, HIGHER_IS_BETTER, run_figures
from deploybench.analyse.pareto import cheapest_within, cost_front, pareto_front
from deploybench.store.db import open_store
from deploybench.store.models import Comparison as ComparisonRow
from deploybench.store.models import RequestSample
from deploybench.store.query import RunFilter, UnknownRuns, select_runs

log = logging.getLogger(__name__)

METHOD = "mannwhitneyu-two-sided+fisher-exact"
_SAMPLE_TESTS = {"latency_p50_ms": "latency_ms", "latency_p99_ms": "latency_ms", "ttft_p99_ms": "ttft_ms"}
_RATE_TESTS = {"achieved_rps": "requests", "output_tps": "output_tokens", "goodput_rps": "requests"}


@dataclass
class Comparison:
    table: pd.DataFrame  # one row per run: identity columns + FIGURES + slo_met + pareto + group
    groups: dict[str, list[str]]  # workload hash (or "unknown") -> run keys
    best: dict[str, str | None]  # workload -> best run key meeting the SLO (None if none meets it)
    pareto: dict[str, list[str]]  # workload -> run keys on the front, by throughput
    baseline: str | None = None
    changes: pd.DataFrame = field(default_factory=pd.DataFrame)  # run_key, figure, baseline, value, change, p
    params: dict[str, Any] = field(default_factory=dict)
    id: int | None = None  # set once saved
    # workload -> run keys on the cost-latency front (cost per million output tokens down, P99 down), by cost
    cost_pareto: dict[str, list[str]] = field(default_factory=dict)
    # workload -> {currency: the cheapest run meeting the SLO (its P99 within the SLO's, errors within)}
    cheapest: dict[str, dict[str, str]] = field(default_factory=dict)

    def run_keys(self) -> list[str]:
        return list(self.table["run_key"])


def compare(target: Engine | str | None, flt: RunFilter, baseline: str | None = None, *, alpha: float = 0.05,
            save: bool = True) -> Comparison:
    """Compare the runs ``flt`` selects (by key or filter); see the module doc."""
    target = open_store(target)  # resolve once: every query below reuses the engine
    runs = select_runs(target, flt)
    if baseline is not None and baseline not in set(runs["run_key"]):
        try:
            extra = select_runs(target, RunFilter(run_keys=(baseline,)))
        except UnknownRuns as exc:
            raise UnknownRuns(f"baseline {baseline!r} is not a stored run; list runs with `deploybench store runs`") \
                from exc
        runs = pd.concat([extra, runs], ignore_index=True)
    table = run_figures(target, runs)
    table["group"] = table["workload"].fillna("unknown")
    groups = {str(g): [str(k) for k in t["run_key"]] for g, t in table.groupby("group", sort=False)}
    best: dict[str, str | None] = {}
    front: dict[str, list[str]] = {}
    table["pareto"] = False
    for g, keys in groups.items():
        sub = table[table["run_key"].isin(keys)]
        ok = sub[sub["slo_met"]]
        rank = ok["capacity_rps"].fillna(ok["goodput_rps"]).fillna(ok["achieved_rps"]) if len(ok) else None
        best[g] = None if rank is None or rank.isna().all() else str(ok.at[rank.idxmax(), "run_key"])
        front[g] = [str(k) for k in pareto_front(
            (r["run_key"], r["capacity_rps"] if pd.notna(r["capacity_rps"]) else r["achieved_rps"],
             r["latency_p99_ms"]) for _, r in sub.iterrows())]
        table.loc[table["run_key"].isin(front[g]), "pareto"] = True
    costs, cheapest = _cost_fronts(table, groups)
    result = Comparison(table=table, groups=groups, best=best, pareto=front, baseline=baseline,
                        params={"alpha": alpha, "method": METHOD, "filter": flt.describe()}, cost_pareto=costs,
                        cheapest=cheapest)
    if baseline is not None:
        result.changes = _changes(target, table, baseline, alpha)
    if save:
        result.id = save_comparison(target, result)
    return result


def _cost_fronts(table: pd.DataFrame, groups: dict[str, list[str]]) -> tuple[dict[str, list[str]],
                                                                           dict[str, dict[str, str]]]:
    """Per workload group: the cost-latency front, and per currency the cheapest run meeting the SLO."""
    def num(v: Any) -> float | None:
        return None if v is None or pd.isna(v) else float(v)

    fronts: dict[str, list[str]] = {}
    cheapest: dict[str, dict[str, str]] = {}
    for g, keys in groups.items():
        sub = table[table["run_key"].isin(keys)]
        pts = [(str(r["run_key"]), num(r.get("cost_per_million_output_tokens")), num(r["latency_p99_ms"]),
                r.get("cost_currency") if isinstance(r.get("cost_currency"), str) else None)
               for _, r in sub.iterrows()]
        fronts[g] = [str(k) for k in cost_front(pts)]
        met = {str(k) for k in sub.loc[sub["slo_met"], "run_key"]}
        target = float(sub["slo_p99_ms"].min()) if "slo_p99_ms" in sub and sub["slo_p99_ms"].notna().any() else None
        cheapest[g] = ({} if target is None else
                       {cur: str(k) for cur, k in cheapest_within([p for p in pts if p[0] in met], target).items()})
    return fronts, cheapest


def _changes(target: Engine | str | None, table: pd.DataFrame, baseline: str, alpha: float) -> pd.DataFrame:
    base = table[table["run_key"] == baseline].iloc[0]
    same = table[(table["group"] == base["group"]) & (table["run_key"] != baseline)]
    if same.empty:
        others = ", ".join(table.loc[table["run_key"] != baseline, "run_key"])
        raise AnalysisError(
            f"baseline {baseline!r} has another workload than every compared run ({others}); changes against a "
            f"baseline need the same workload; choose a baseline among runs of the same prompt set, lengths and SLO")
    rows = []
    with open_store(target).connect() as conn:
        read = _SampleReads(conn, baseline)
        for _, run in same.iterrows():
            for fig in FIGURES:
                b, v = base[fig], run[fig]
                if b is None or v is None or pd.isna(b) or pd.isna(v):
                    continue
                change = (v - b) / b if b else (0.0 if v == b else None)
                p = _p_value(read, fig, (baseline, base["phase"]), (run["run_key"], run["phase"]))
                better = (v > b) == (fig in HIGHER_IS_BETTER)
                significant = p is not None and p < alpha
                rows.append({"run_key": run["run_key"], "figure": fig, "baseline": float(b), "value": float(v),
                             "change": change, "p_value": p, "significant": significant,
                             "direction": "same" if v == b else ("better" if better else "worse")})
    return pd.DataFrame(rows)


class _SampleReads:
    """What the tests read of the samples (values of a column, per-second totals, error counts), from the
    store once per run, phase and kind: the baseline's are kept for every run tested against it, another
    run's only until the next run is read (a comparison of 40 runs holds two runs' samples, not 40)."""

    def __init__(self, conn: Any, keep: str) -> None:
        self._conn, self._keep = conn, keep
        self._memo: dict[tuple[str, str, str, str], Any] = {}

    def __call__(self, kind: str, name: str, run_key: str, phase: str) -> Any:
        key = (kind, name, run_key, phase)
        if key not in self._memo:
            if run_key != self._keep:
                self._memo = {k: v for k, v in self._memo.items() if k[2] in (self._keep, run_key)}
            if kind == "values":
                self._memo[key] = _values(self._conn, getattr(RequestSample, name), run_key, phase)
            elif kind == "per_second":
                self._memo[key] = _per_second(self._conn, name, run_key, phase)
            else:
                self._memo[key] = _error_counts(self._conn, run_key, phase)
        return self._memo[key]


def _p_value(read: _SampleReads, fig: str, base: tuple[str, str], run: tuple[str, str]) -> float | None:
    """The p-value of ``fig`` between the baseline and a run, each given as (run key, phase)."""
    sides = (base, run)
    if fig in _SAMPLE_TESTS:
        a, b = (read("values", _SAMPLE_TESTS[fig], k, ph) for k, ph in sides)
        if len(a) < 2 or len(b) < 2:
            return None
        return float(stats.mannwhitneyu(a, b, alternative="two-sided").pvalue)
    if fig in _RATE_TESTS:
        a, b = (read("per_second", _RATE_TESTS[fig], k, ph) for k, ph in sides)
        if len(a) < 2 or len(b) < 2:
            return None
        return float(stats.mannwhitneyu(a, b, alternative="two-sided").pvalue)
    if fig == "error_rate":
        ea, eb = (read("errors", "", k, ph) for k, ph in sides)
        if ea[0] + eb[0] == 0 or sum(ea) == 0 or sum(eb) == 0:  # no error on either side: nothing to test
            return None
        return float(stats.fisher_exact([ea, eb]).pvalue)
    return None


def _values(conn, col, run_key: str, phase: str) -> np.ndarray:
    rows = conn.execute(select(col).where(RequestSample.run_key == run_key, RequestSample.phase == phase,
                                          RequestSample.status == 200, col.is_not(None))).scalars().all()
    return np.asarray(rows, dtype=float)


def _per_second(conn, what: str, run_key: str, phase: str) -> np.ndarray:
    """Per-second totals (requests, or output tokens) of successful requests, full seconds only."""
    sec = func.date_trunc("second", RequestSample.ts)
    agg = func.count() if what == "requests" else func.sum(RequestSample.output_tokens)
    rows = conn.execute(select(sec, agg).where(RequestSample.run_key == run_key, RequestSample.phase == phase,
                                               RequestSample.status == 200).group_by(sec).order_by(sec)).all()
    values = np.asarray([r[1] for r in rows], dtype=float)
    return values[1:-1] if len(values) > 2 else values  # the first and last second are partial


def _error_counts(conn, run_key: str, phase: str) -> list[int]:
    errors = func.sum(case((RequestSample.status != 200, 1), else_=0))
    row = conn.execute(select(errors, func.count()).where(RequestSample.run_key == run_key,
                                                          RequestSample.phase == phase)).one()
    return [int(row[0] or 0), int(row[1] or 0) - int(row[0] or 0)]


def save_comparison(target: Engine | str | None, cmp: Comparison) -> int:
    """Write the comparison back (runs, baseline, parameters, what came out); returns its id."""
    summary = {
        "best": cmp.best, "pareto": cmp.pareto, "groups": cmp.groups, "cost_pareto": cmp.cost_pareto,
        "cheapest": cmp.cheapest,
        "table": _jsonable(cmp.table.drop(columns=["config", "serving"], errors="ignore")),
        "changes": _jsonable(cmp.changes),
    }
    engine = open_store(target)
    with engine.begin() as conn:
        return int(conn.execute(insert(ComparisonRow).values(
            run_keys=cmp.run_keys(), baseline_run_key=cmp.baseline, method=METHOD, params=cmp.params,
            result=summary).returning(ComparisonRow.id)).scalar_one())


def _jsonable(frame: pd.DataFrame) -> list[dict[str, Any]]:
    if frame.empty:
        return []
    return [{str(k): (None if _isna(v) else (v.isoformat() if hasattr(v, "isoformat") else
                                          (v.item() if hasattr(v, "item") else v)))
             for k, v in row.items()} for row in frame.to_dict("records")]


def _isna(v: Any) -> bool:
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


def curves(target: Engine | str | None, run_keys: list[str]) -> dict[str, list[tuple[float, float]]]:
    """run_key -> (achieved req/s, P99 ms) of each capacity-search step, for throughput-latency curves."""
    from deploybench.store.query import capacity_figures

    steps = capacity_figures(target, run_keys)
    out: dict[str, list[tuple[float, float]]] = {}
    for key, g in steps.groupby("run_key") if not steps.empty else []:
        pts = [(float(a), float(p)) for a, p in zip(g["achieved_rps"], g["latency_p99_ms"]) if pd.notna(a)
               and pd.notna(p)]
        if pts:
            out[str(key)] = pts
    return out


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested configuration as dotted keys ('engine.max_num_seqs'); lists stay whole values."""
    out: dict[str, Any] = {}
    for key, value in (config or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten_config(value, f"{name}."))
        else:
            out[name] = value
    return out


def config_diff(configs: dict[str, dict[str, Any]]) -> list[tuple[str, list[Any], bool]]:
    """The configurations of runs side by side: (dotted key, the value in each run in the order given,
    whether the values differ), the differing keys first, each part sorted by key. A key a run lacks
    has None there (and differs from a run that has it)."""
    flat = [flatten_config(c) for c in configs.values()]
    keys = sorted({k for f in flat for k in f})
    rows = [(k, [f.get(k) for f in flat], len({repr(f.get(k)) for f in flat}) > 1) for k in keys]
    return [r for r in rows if r[2]] + [r for r in rows if not r[2]]
