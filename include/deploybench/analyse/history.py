"""History of a series: change points in capacity and latency over time, and a verdict on the newest run.

Method (recorded with every result, so a stored change point says how it was found):

1. the series' runs, oldest first, without excluded or failed runs; one value per run and metric
   (``figures.run_figures``);
2. candidate change points from ruptures' PELT (``rpt.Pelt(model, min_size, jump=1)``) on the
   values standardised by the run-to-run noise (median absolute successive difference, floored
   at ``noise_floor`` of the level), with penalty ``penalty x log(n)``;
3. each candidate is kept when a Welch t-test (``scipy.stats.ttest_ind(equal_var=False)``)
   between the runs of the segment before and after it gives ``p < alpha`` and the means differ
   by at least ``min_change`` (relative) — the same confirm-by-test step Apache Otava applies
   to its E-divisive candidates.

A change point is stored at the first run after the change. The newest run's verdict is the
direction of the most recent change point (regression / improvement, with its magnitude and
p-value) when there is one, else "no change" with its difference from the series' mean. Runs
at the very end cannot open a segment shorter than ``min_size``: a slowdown on the newest run
alone is seen once ``min_size`` runs show it.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import Engine, delete, insert
from sqlalchemy.dialects.postgresql import insert as pg_insert

from deploybench.analyse import AnalysisError
from deploybench.analyse.figures import HIGHER_IS_BETTER, run_figures
from deploybench.store.db import open_store
from deploybench.store.models import ChangePoint, Verdict
from deploybench.store.query import RunFilter, select_runs, series_of

log = logging.getLogger(__name__)

METRICS = ("capacity_rps", "latency_p99_ms", "latency_p50_ms", "output_tps")
METHOD = "ruptures-pelt+welch-ttest"


@dataclass(frozen=True)
class Params:
    model: str = "l2"
    min_size: int = 3
    penalty: float = 2.0  # x log(n) (BIC-like), on values standardised by the run-to-run noise
    noise_floor: float = 0.005  # relative: noise below this is taken as this (a perfectly steady series)
    alpha: float = 0.01
    min_change: float = 0.03  # relative


@dataclass
class Change:
    metric: str
    run_key: str
    index: int
    direction: str  # regression | improvement
    mean_before: float
    mean_after: float
    magnitude: float  # relative change of the mean, signed
    p_value: float


@dataclass
class History:
    series_id: int
    fingerprint: str
    runs: pd.DataFrame  # run_key, started_at and the metric values, oldest first
    changes: list[Change] = field(default_factory=list)
    verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)  # metric -> verdict of the newest run
    params: Params = field(default_factory=Params)

    @property
    def newest(self) -> str:
        return str(self.runs["run_key"].iloc[-1])

    def flagged(self, metric: str | None = None) -> list[str]:
        return [c.run_key for c in self.changes if metric is None or c.metric == metric]


def change_points(values: np.ndarray, params: Params) -> list[tuple[int, float, float, float]]:
    """Confirmed change points of one metric: (index of the first run after it, mean before, after, p)."""
    x = np.asarray(values, dtype=float)
    if len(x) < 2 * params.min_size or not np.isfinite(x).all():
        return []
    import ruptures as rpt  # imported here: seconds of import time, needed only for a series long enough
    from scipy import stats

    # run-to-run noise from successive differences (robust to a step: only one difference spans it)
    level = float(np.median(np.abs(x))) or 1.0
    noise = float(np.median(np.abs(np.diff(x)))) / (0.6745 * np.sqrt(2))
    signal = ((x - np.median(x)) / max(noise, params.noise_floor * level)).reshape(-1, 1)
    algo = rpt.Pelt(model=params.model, min_size=params.min_size, jump=1).fit(signal)
    bkps = algo.predict(pen=params.penalty * np.log(len(x)))[:-1]
    out = []
    edges = [0, *bkps, len(x)]
    for i, b in enumerate(bkps, start=1):
        before, after = x[edges[i - 1]:b], x[b:edges[i + 1]]
        if len(before) < 2 or len(after) < 2:
            continue
        p = float(stats.ttest_ind(before, after, equal_var=False).pvalue)
        m0, m1 = float(before.mean()), float(after.mean())
        if p < params.alpha and m0 and abs(m1 - m0) / abs(m0) >= params.min_change:
            out.append((b, m0, m1, p))
    return out


def analyse_series(target: Engine | str | None, run_key: str, params: Params | None = None, *,
                   baseline: str | None = None, save: bool = True) -> History:
    """Change points of the series ``run_key`` belongs to, and the verdict on its newest run.

    ``baseline`` (optional) must be a run of the same series: the verdict then compares the
    newest run with it instead of with the level before the last change point.
    """
    params = params or Params()
    target = open_store(target)  # resolve once: every query below reuses the engine
    series_id, fingerprint = series_of(target, run_key)
    if baseline is not None:
        b_series, b_fp = series_of(target, baseline)
        if b_series != series_id:
            raise AnalysisError(
                f"baseline {baseline!r} belongs to series {b_fp[:12]}, run {run_key!r} to series {fingerprint[:12]}; "
                f"a baseline must be an earlier run of the same series (same cluster, software, model, serving "
                f"config and workload)")
    runs = select_runs(target, RunFilter(series=fingerprint))
    hist = analyse_figures(series_id, fingerprint, run_figures(target, runs), params, baseline=baseline)
    if save:
        _save(target, hist)
    log.info("series %s: %d runs, change points %s", fingerprint[:12], len(hist.runs),
             [(c.metric, c.run_key, f"{c.magnitude:+.1%}") for c in hist.changes])
    return hist


def analyse_figures(series_id: int, fingerprint: str, figs: pd.DataFrame, params: Params | None = None, *,
                    baseline: str | None = None) -> History:
    """Change points and the newest run's verdict over ``figs`` (``figures.run_figures`` of the series' runs
    to analyse, oldest first); no database. ``analyse_series`` selects the runs; the results pages pass
    the runs a user may read."""
    params = params or Params()
    figs = figs.reset_index(drop=True)
    hist = History(series_id, fingerprint, figs[["run_key", "started_at", *METRICS]], params=params)
    for metric in METRICS:
        values = figs[metric].to_numpy(dtype=float)
        if np.isnan(values).any():
            continue
        for idx, m0, m1, p in change_points(values, params):
            worse = (m1 < m0) if metric in HIGHER_IS_BETTER else (m1 > m0)
            hist.changes.append(Change(metric, str(figs["run_key"].iloc[idx]), idx,
                                       "regression" if worse else "improvement", m0, m1, (m1 - m0) / m0, p))
        hist.verdicts[metric] = _verdict(hist, metric, values, figs, baseline)
    return hist


def _verdict(hist: History, metric: str, values: np.ndarray, figs: pd.DataFrame,
             baseline: str | None) -> dict[str, Any]:
    newest = values[-1]
    if baseline is not None:
        b = float(figs.loc[figs["run_key"] == baseline, metric].iloc[0])
        mag = (newest - b) / b if b else 0.0
        worse = (mag < 0) if metric in HIGHER_IS_BETTER else (mag > 0)
        verdict = "no change" if abs(mag) < hist.params.min_change else ("regression" if worse else "improvement")
        return {"verdict": verdict, "magnitude": mag, "p_value": None, "against": baseline}
    mine = [c for c in hist.changes if c.metric == metric]
    if mine:
        last = mine[-1]
        return {"verdict": last.direction, "magnitude": last.magnitude, "p_value": last.p_value,
                "against": f"runs before {last.run_key}"}
    others = values[:-1]
    mag = float((newest - others.mean()) / others.mean()) if len(others) and others.mean() else 0.0
    steady = len(others) < 2 or others.std() <= 1e-9 * abs(others.mean())
    if steady:
        p = None
    else:
        from scipy import stats

        p = float(stats.ttest_1samp(others, newest).pvalue)
    return {"verdict": "no change", "magnitude": mag, "p_value": p, "against": "the series' earlier runs"}


def _save(target: Engine | str | None, hist: History) -> None:
    """Replace this series' change points (per metric, this method) and upsert the newest run's verdicts."""
    params = asdict(hist.params)
    engine = open_store(target)
    with engine.begin() as conn:
        conn.execute(delete(ChangePoint).where(ChangePoint.series_id == hist.series_id, ChangePoint.method == METHOD))
        if hist.changes:
            conn.execute(insert(ChangePoint), [
                {"series_id": hist.series_id, "metric": c.metric, "run_key": c.run_key, "method": METHOD,
                 "params": params, "direction": c.direction, "mean_before": c.mean_before, "mean_after": c.mean_after,
                 "magnitude": c.magnitude, "p_value": c.p_value} for c in hist.changes])
        for metric, v in hist.verdicts.items():
            stmt = pg_insert(Verdict).values(
                series_id=hist.series_id, run_key=hist.newest, metric=metric, method=METHOD,
                params={**params, "against": v["against"]}, verdict=v["verdict"], magnitude=v["magnitude"],
                p_value=v["p_value"])
            conn.execute(stmt.on_conflict_do_update(
                index_elements=[Verdict.run_key, Verdict.metric, Verdict.method],
                set_={k: stmt.excluded[k] for k in ("params", "verdict", "magnitude", "p_value", "series_id")}))
