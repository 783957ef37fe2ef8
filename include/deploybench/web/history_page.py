"""The history page of a series (``GET /series/{fingerprint}``): each metric over the series' runs,
with the change points and the newest run's verdict from ``deploybench.analyse.history``.

What a person sees: the heading "History of series <first 12 characters>", what the series is
(model, cluster, engine, workload), the verdict on the newest run per metric and the change-point
table (the run report's own section), one plot per metric over time (change points as dashed red
lines labelled with direction and size, excluded and failed runs as grey hollow points), and every
run of the series in time order: change-point runs marked, excluded and failed runs greyed with
the reason, each linked to its run page.

The analysis is computed on the fly over the runs the user may read (successful, not excluded),
with the same method and parameters the report uses, and is not saved (a page view writes nothing).

What the user may read is applied *before* the prefix is resolved into a series: runs of DAGs the user
may not read are dropped first, so an ambiguous prefix names only series the user may read, and a series
of which the user may read no run answers the same 404 as a series that does not exist. A reader learns
nothing about the series of DAGs they may not read; within a series they may read, the page says how
many runs of other DAGs it leaves out. The prefix is matched literally (``store.query`` escapes ``%`` and
``_``), so no prefix of 8 wildcards selects every series.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import HTTPException

from deploybench.report.html import Html, esc, figure, fmt_change, fmt_num, table
from deploybench.web.access import ReadAccess, may_read_row
from deploybench.web.markup import compare_href, link, page, run_href, status_html, when

if TYPE_CHECKING:
    import pandas as pd

    from deploybench.analyse.history import History

log = logging.getLogger(__name__)

MIN_PREFIX = 8
MAX_RUNS = 500  # the newest runs of a long series (every run costs a goodput query)


@dataclass
class HistoryView:
    fingerprint: str
    runs: pd.DataFrame  # every readable run of the series with its figures, oldest first
    history: History | None  # None: no run is left to analyse (all excluded or failed)
    hidden: int = 0  # runs of DAGs the user may not read
    note: str = ""


def build(target: str, fingerprint: str, access: ReadAccess) -> HistoryView:
    """The series ``fingerprint`` (or a prefix of 8+ characters unique among the series the user may read)
    as the user may read it. HTTPException 400 (too short, ambiguous), 404 (no series with a run the user
    may read: none stored, or none readable; the two answer alike)."""
    fingerprint = fingerprint.strip()
    if len(fingerprint) < MIN_PREFIX:
        raise HTTPException(400, f"series {fingerprint!r} is too short: give {MIN_PREFIX} or more characters of "
                                 "its fingerprint (the run page links to its series)")
    from deploybench.analyse.figures import run_figures
    from deploybench.analyse.history import analyse_figures
    from deploybench.store.db import open_store
    from deploybench.store.query import EmptySelection, RunFilter, select_runs

    unknown = HTTPException(404, f"no series {fingerprint!r} with a run you may read in the results store (a "
                                 "run page links to its series; runs of DAGs you may not read are not shown)")
    engine = open_store(target)
    try:
        matched = select_runs(engine, RunFilter(series=fingerprint, status=None, include_excluded=True))
    except EmptySelection as exc:
        raise unknown from exc
    frame = matched[[may_read_row(access, r) for _, r in matched.iterrows()]]  # before anything is listed
    if frame.empty:
        raise unknown
    series = sorted(set(frame["series"]))
    if len(series) > 1:
        raise HTTPException(400, f"{fingerprint!r} starts {len(series)} series: "
                                 f"{', '.join(s[:16] for s in series)}; give more characters")
    hidden = int((matched["series"] == series[0]).sum()) - len(frame)
    note = ""
    if len(frame) > MAX_RUNS:
        note = f"The series has {len(frame)} runs; the newest {MAX_RUNS} are shown and analysed."
        frame = frame.tail(MAX_RUNS)
    figs = run_figures(engine, frame).reset_index(drop=True)
    analysed = figs[(figs["status"] == "success") & ~figs["excluded"].astype(bool)]
    hist = (analyse_figures(int(figs["series_id"].iloc[0]), series[0], analysed) if len(analysed) else None)
    return HistoryView(series[0], figs, hist, hidden, note)


# -- rendering (pure) ------------------------------------------------------------------------
def _left_out(row: Any) -> str:
    """Why a run is not in the analysis ('' when it is)."""
    if bool(row["excluded"]):
        return f"excluded: {row['exclude_reason'] or 'no reason given'}"
    if row["status"] != "success":
        return f"{row['status']}: not analysed"
    return ""


def _plots(view: HistoryView) -> list[str]:
    from deploybench.analyse.history import METRICS
    from deploybench.report import plots
    from deploybench.report.compare_html import FIGURE_LABELS

    runs = view.runs
    # x: the run's logical date (a backfilled run at the date it stands for), else its start
    at = "order_at" if "order_at" in runs else "started_at"
    when = {str(r["run_key"]): r[at] for _, r in runs.iterrows()}
    parts = ["<h2>Metrics over time</h2>"]
    for metric in METRICS:
        label = FIGURE_LABELS.get(metric, metric)
        points = [{"t": r[at], "value": None if r[metric] is None else float(r[metric]),
                   "excluded": bool(_left_out(r))} for _, r in runs.iterrows()]
        hist = view.history
        changes = [{"t": when[c.run_key], "text": f"change point: {c.direction} {fmt_change(c.magnitude)}"}
                   for c in (hist.changes if hist else []) if c.metric == metric and c.run_key in when]
        verdict = hist.verdicts.get(metric) if hist else None
        title = label
        if verdict:
            title += f" (newest run: {verdict['verdict']}, {fmt_change(verdict['magnitude'])})"
        svg = plots.metric_history(points, changes, title, label)
        parts.append(figure(svg, f"{label} over the series' runs"))
    return parts


def _run_table(view: HistoryView, root: str) -> str:
    hist = view.history
    marks: dict[str, list[str]] = {}
    for c in hist.changes if hist else []:
        marks.setdefault(c.run_key, []).append(f"change point in {c.metric}: {c.direction} {fmt_change(c.magnitude)}")
    newest = hist.newest if hist else None
    rows, classes = [], []
    for _, r in view.runs.iterrows():
        key = str(r["run_key"])
        note = [_left_out(r)] if _left_out(r) else []
        note += marks.get(key, [])
        if key == newest and hist is not None:
            note.append("newest analysed run: " + ", ".join(
                f"{m} {v['verdict']}" for m, v in hist.verdicts.items()))
        rows.append([when(r["started_at"]), link(run_href(root, key), key, code=True), r["dag_id"],
                     status_html(str(r["status"])), fmt_num(r["capacity_rps"]), fmt_num(r["latency_p99_ms"], 1),
                     fmt_num(r["latency_p50_ms"], 1), fmt_num(r["output_tps"], 1), "; ".join(note)])
        classes.append("excluded" if _left_out(r) else ("changepoint" if key in marks else ""))
    return "<h2>Runs of this series</h2>" + table(
        ["started", "run", "DAG", "status", "capacity req/s", "P99 ms", "P50 ms", "output tok/s", "note"],
        rows, classes, numeric_from=4)


def _identity(view: HistoryView) -> str:
    newest = view.runs.iloc[-1]  # the identity columns are the same on every run of a series
    facts = [("fingerprint", Html(f"<code>{esc(view.fingerprint)}</code>")), ("model", newest.get("model")),
             ("cluster", newest.get("cluster")), ("engine", newest.get("engine")),
             ("workload", Html(f"<code>{esc(str(newest.get('workload') or '')[:12])}</code>"))]
    n = len(view.runs)
    analysed = 0 if view.history is None else len(view.history.runs)
    items = "".join(f"<dt>{esc(k)}</dt><dd>{v if isinstance(v, Html) else esc(v)}</dd>" for k, v in facts)
    hidden = (f" {view.hidden} run{'s' if view.hidden != 1 else ''} of DAGs you may not read "
              f"{'are' if view.hidden != 1 else 'is'} left out." if view.hidden else "")
    note = f" {view.note}" if view.note else ""
    return (f"<dl>{items}</dl><p>{n} runs; {analysed} analysed, {n - analysed} excluded or failed "
            f"(greyed).{esc(hidden)}{esc(note)}</p>")


def _verdict_line(hist: History, root: str) -> str:
    parts = [f"<span class='{esc(v['verdict'])}'>{esc(m)}: <b>{esc(v['verdict'])}</b> "
             f"({esc(fmt_change(v['magnitude']))})</span>" for m, v in hist.verdicts.items()]
    newest = link(run_href(root, hist.newest), hist.newest, code=True)
    return f"<p class='verdict'>Verdict on the newest run {newest}: {'; '.join(parts)}</p>"


def render(view: HistoryView, root: str) -> str:
    """The whole history page."""
    from deploybench.report.run_html import history_section

    fp = view.fingerprint
    parts = [f"<h1>History of series <code>{esc(fp[:12])}</code></h1>", _identity(view),
             f"<p>{link(compare_href(root, series=fp), 'Compare the runs of this series')}</p>"]
    if view.history is None:
        parts.append("<p class='note'>No run of this series can be analysed: every run is excluded or "
                     "failed.</p>")
    else:
        parts.append(_verdict_line(view.history, root))
        parts += history_section(view.history, "Verdict and change points")
    parts += _plots(view)
    parts.append(_run_table(view, root))
    return page(f"deploybench history {fp[:12]}", "".join(parts), root)
