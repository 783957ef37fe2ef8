"""The reports: a readable summary for the terminal, one self-contained HTML file per run
(``write_html``, sections and plots in ``run_html``) and per comparison (``compare_html``).

The run report is built from the run's stage records and files in its folder, so a failed
run gets a report too: it shows which stage failed and why, beside everything measured
before, and it does not depend on the store having worked.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from deploybench.engines import profile_name
from deploybench.run import STAGES, run_status

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from deploybench.analyse.history import History
    from deploybench.records import Capacity
    from deploybench.run import Run

log = logging.getLogger(__name__)


def summary_text(run: Run) -> str:
    recs = run.stages()
    lines = [f"deploybench run {run.key}: {run_status(recs).upper()}",
             f"  config {run.cfg.fingerprint()[:12]}  nodes {len(run.nodes)}  engine {profile_name(run.cfg.engine)}",
             "", f"  {'stage':<10} {'status':<8} {'seconds':>8}  what happened"]
    for s in STAGES:
        r = recs.get(s)
        if r is None:
            lines.append(f"  {s:<10} {'skipped':<8} {'':>8}")
            continue
        lines.append(f"  {s:<10} {r.status:<8} {r.seconds or 0:>8.1f}  {r.summary}")
    ld = run.load_result()
    res = ld.headline() if ld is not None else None
    if res is not None:
        lines += ["", f"  load result, phase {res.phase} (warm-up of {res.warmup_s:g} s excluded; "
                  "end-to-end latency measured by k6 on the client):",
                  f"    requests/s     {res.achieved_rps:.2f} (offered {res.offered_rps:g}, "
                  f"{res.requests} requests in {res.duration_s:g} s)",
                  *(_sessions_lines(ld.capacity, res.offered_rps, res.achieved_rps) if ld is not None else []),
                  f"    output tok/s   {res.output_tps:.1f}",
                  f"    latency P50    {_ms(res.latency_p50_ms)}",
                  f"    latency P99    {_ms(res.latency_p99_ms)}",
                  f"    error rate     {res.error_rate:.2%} {res.errors_by_kind or ''}",
                  f"    dropped        {res.dropped_iterations} iterations",
                  "    SLO            " + ("met" if res.slo_ok else
                                            "NOT met: " + "; ".join(res.slo.reasons))]
    sp = ld.phases.get("spike") if ld is not None else None
    if sp is not None and sp.analysis:
        from deploybench.report.spike import facts

        lines += ["", "  spike phase (recovery: sliding 1 s windows by send time, from the spike's end):",
                  *(f"    {k:<22} {v}" for k, v in facts(sp.analysis))]
    truth = sim_capacity(run)
    if truth:
        lines += [f"    ground truth   the simulated engine saturates at {truth[0]:.2f} req/s per node, "
                  f"{truth[0] * truth[1]:.1f} req/s for {truth[1]} nodes (closed form; SLO not considered)"]
    rep = run.typed("report")
    if rep is not None and rep.path:
        lines += ["", f"  report: {rep.path}"]
    return "\n".join(lines)


def _sessions_lines(cap: Capacity, offered: float, achieved: float) -> list[str]:
    """A workload rated in sessions: its rates in conversations/s beside the requests/s (its turns)."""
    per = cap.requests_per_session
    if cap.rate_unit != "sessions" or not per:
        return []
    out = [f"    sessions/s     {achieved / per:.2f} (offered {offered / per:.3g}; conversations of "
           f"{per:.2f} turns on average)"]
    if cap.capacity_sessions_per_s is not None:
        out.append(f"    capacity       {cap.capacity_sessions_per_s:.2f} sessions/s ({cap.capacity_rps:.2f} req/s)")
    return out


def sim_capacity(run: Run) -> tuple[float, int] | None:
    """(saturation req/s per engine, engines) for the simulated engine, from its closed form."""
    if run.cfg.engine.profile.value != "sim":
        return None
    from deploybench.sim.service_model import ServiceParams, capacity

    endpoints = run.endpoints()
    cap = capacity(ServiceParams.from_config(run.cfg.engine), run.cfg.load.prompt_tokens, run.cfg.load.output_tokens)
    return cap.requests_per_s, len(endpoints) or len(run.nodes)


def _ms(v) -> str:
    return "n/a" if v is None else f"{v:.0f} ms"


def history_for(run: Run, dsn: str | None = None) -> History | None:
    """Change points of the run's series and the verdict on its newest run, as the report shows them.

    The series is analysed over all its runs and that state is written back to the store
    (``analyse_series``). The report, though, is a file written now and served later to everyone
    who may read *this* run, so the history it shows is over the runs all of them may read
    (``store.access.RunReaders``): a DAG run's report keeps the runs of its own DAG, a run started
    outside Airflow (read only by users who may read every DAG) the whole series. Filtering the
    served file per reader instead would mean editing HTML on the way out; the series across DAGs
    is on the results pages' history, filtered per reader when it is asked for.

    None, with a warning, when the run is not in the store (its store stage failed): the
    report is then written from the run folder alone. None, too, when no analysable run of the
    series (successful, not excluded) is one that every reader of this run may read.
    """
    from deploybench.analyse.history import analyse_series
    from deploybench.errors import DeploybenchError
    from deploybench.store.db import open_store

    try:
        engine = open_store(dsn)
        return _as_its_readers_see_it(engine, run.key, analyse_series(engine, run.key))
    except DeploybenchError as exc:
        log.warning("report of %s: no history (%s)", run.key, exc)
        return None


def _as_its_readers_see_it(engine: Engine, run_key: str, hist: History) -> History | None:
    """``hist`` analysed again over only the runs every reader of ``run_key`` may read (the same one when
    that is all of them)."""
    from deploybench.analyse.history import analyse_figures
    from deploybench.store.access import RunReaders, may_read_row
    from deploybench.store.query import RunFilter, select_runs

    rows = select_runs(engine, RunFilter(run_keys=(run_key, *hist.runs["run_key"])))  # run_key's row first
    readers = RunReaders.of_row(rows.iloc[0])
    keep = {str(r["run_key"]) for _, r in rows.iterrows() if may_read_row(readers, r)}
    figs = hist.runs[hist.runs["run_key"].isin(keep)]
    if len(figs) == len(hist.runs):
        return hist
    log.info("report of %s: its history shows the %d of %d runs of series %s that every reader of the run may "
             "read", run_key, len(figs), len(hist.runs), hist.fingerprint[:12])
    return analyse_figures(hist.series_id, hist.fingerprint, figs, hist.params) if len(figs) else None


def verdict_line(history: History) -> str:
    parts = [f"{m} {v['verdict']} ({v['magnitude']:+.1%})" for m, v in history.verdicts.items()]
    return f"history of {len(history.runs)} runs: " + ", ".join(parts)


def write_html(run: Run, history: History | None = None) -> Path:
    """The run's report, ``<run folder>/report.html``: one file, plots inline as SVG."""
    from deploybench.report.run_html import render

    path = run.dir / "report.html"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render(run, history))
    tmp.replace(path)
    return path
