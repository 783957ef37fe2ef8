"""The comparison page (``GET /compare``): runs picked by key or by a filter, compared by
``deploybench.analyse.compare`` exactly as ``deploybench compare`` does, and rendered with the
comparison report's sections (``report.compare_html.sections``) inside the results pages' frame.

What a person sees, top to bottom: the heading "Comparison", a form (filter fields, the baseline,
alpha), the runs' configurations side by side with the keys that differ highlighted, and per
workload group the best configuration meeting the SLO (named, linked to its run), the figures
table, the throughput-latency curves, the Pareto front plot; then each figure's change against
the baseline with its p-value.

Only runs the user may read are compared (``web.access``): a run given by key that the user may
not read answers 403; a filter silently leaves such runs out. The page saves nothing (the CLI
stores its comparisons; a page view is not a result).

What one request may cost is bounded: at most ``MAX_RUNS`` runs, whether picked by key (more keys
answer 400, before the store is read) or by a filter (its newest ``MAX_RUNS``); the baseline's samples
are read once for all the runs tested against it (``analyse.compare``).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from fastapi import HTTPException

from deploybench.report.html import Html, esc, table
from deploybench.web.access import ReadAccess, forbid, may_read_row
from deploybench.web.markup import link, page, run_href

if TYPE_CHECKING:
    from deploybench.analyse.compare import Comparison
    from deploybench.store.query import RunFilter

log = logging.getLogger(__name__)

MAX_RUNS = 40  # runs per comparison, picked or filtered (the newest): each run costs a rank test per figure
DEFAULT_ALPHA = 0.05


def picked(runs: list[str]) -> tuple[str, ...]:
    """The distinct run keys of the query string (``run=``), blank ones dropped, in the order given."""
    return tuple(dict.fromkeys(r for r in runs if r.strip()))


@dataclass(frozen=True)
class CompareQuery:
    """What the comparison form asks for: run keys, or a filter; a baseline and alpha in both cases."""

    runs: tuple[str, ...] = ()
    baseline: str | None = None
    model: str | None = None
    series: str | None = None
    inventory: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    since: datetime | None = None
    until: datetime | None = None
    include_excluded: bool = False
    alpha: float = DEFAULT_ALPHA

    @classmethod
    def parse(cls, runs: list[str], baseline: str | None, model: str | None, series: str | None,
              inventory: str | None, tags: list[str], since: str | None, until: str | None,
              include_excluded: bool, alpha: float) -> CompareQuery:
        """From the query string (empty form fields are absent); HTTPException 400 naming a bad value."""
        from deploybench.cli.analyse import parse_tag, parse_when

        def text(v: str | None) -> str | None:
            return (v or "").strip() or None

        try:
            pairs = dict(parse_tag(t.strip()) for t in tags if t.strip())
            start = parse_when(s) if (s := text(since)) else None
            end = parse_when(u) if (u := text(until)) else None
        except argparse.ArgumentTypeError as exc:
            raise HTTPException(400, f"bad filter: {exc}") from exc
        fp = text(series)
        if fp is not None and len(fp) < 8:
            raise HTTPException(
                400, f"series {fp!r} is too short: give 8 or more characters of its fingerprint")
        keys = picked(runs)
        if len(keys) > MAX_RUNS:
            raise HTTPException(
                400, f"{len(keys)} runs picked; a comparison takes at most {MAX_RUNS}: tick fewer runs, or "
                     f"compare by a filter (model, series, inventory, tag, since, until), which compares the "
                     f"newest {MAX_RUNS} runs it matches")
        return cls(runs=keys, baseline=text(baseline),
                   model=text(model), series=fp, inventory=text(inventory), tags=pairs, since=start, until=end,
                   include_excluded=include_excluded, alpha=alpha)

    @property
    def has_filter(self) -> bool:
        return any((self.model, self.series, self.inventory, self.tags, self.since, self.until))

    def run_filter(self) -> RunFilter:
        from deploybench.store.query import RunFilter

        return RunFilter(model=self.model, inventory=self.inventory, since=self.since, until=self.until,
                         tags=dict(self.tags), series=self.series, include_excluded=self.include_excluded)


@dataclass
class ComparisonView:
    cmp: Comparison
    curves: dict[str, list[tuple[float, float]]]
    note: str = ""


def _readable_or_403(frame: Any, access: ReadAccess, role: str = "run") -> None:
    for _, row in frame.iterrows():
        if not may_read_row(access, row):
            raise forbid(access, f"{role} {row['run_key']!r}")


def build(target: str, q: CompareQuery, access: ReadAccess) -> ComparisonView | None:
    """The comparison the query asks for, over runs the user may read; None when it selects nothing yet.
    HTTPException 400 (both keys and a filter, an impossible baseline), 403, 404 (unknown keys, no match)."""
    if not q.runs and not q.has_filter:
        return None
    if q.runs and q.has_filter:
        raise HTTPException(400, "give runs (run=...) or a filter (model, series, inventory, tag, since, "
                                 "until), not both: clear the filter fields, or untick the runs")
    from deploybench.analyse import AnalysisError
    from deploybench.analyse.compare import compare, curves
    from deploybench.store.db import open_store
    from deploybench.store.query import EmptySelection, RunFilter, UnknownRuns, select_runs

    engine = open_store(target)
    note = ""
    try:
        if q.runs:
            frame = select_runs(engine, RunFilter(run_keys=q.runs))
            _readable_or_403(frame, access)
            described = f"{len(q.runs)} runs picked"
        else:
            frame = select_runs(engine, q.run_filter())
            keep = [may_read_row(access, r) for _, r in frame.iterrows()]
            hidden = len(frame) - sum(keep)
            frame = frame[keep]
            if frame.empty:
                raise HTTPException(404, f"no run you may read matches {q.run_filter().describe()}")
            if len(frame) > MAX_RUNS:
                note = f"The filter matches {len(frame)} runs; the newest {MAX_RUNS} are compared."
                frame = frame.tail(MAX_RUNS)
            if hidden:
                log.info("comparison for %r: %d runs of unreadable DAGs left out", access.user_name, hidden)
            described = q.run_filter().describe()
        if q.baseline:
            _readable_or_403(select_runs(engine, RunFilter(run_keys=(q.baseline,))), access, "baseline run")
        keys = tuple(str(k) for k in frame["run_key"])
        cmp = compare(engine, RunFilter(run_keys=keys), q.baseline, alpha=q.alpha, save=False)
    except UnknownRuns as exc:
        raise HTTPException(404, str(exc)) from exc
    except EmptySelection as exc:
        raise HTTPException(404, str(exc)) from exc
    except AnalysisError as exc:
        raise HTTPException(400, str(exc)) from exc
    cmp.params["filter"] = described
    return ComparisonView(cmp, curves(engine, cmp.run_keys()), note)


# -- rendering (pure) ------------------------------------------------------------------------
def _value(v: Any) -> str:
    if v is None:
        return "—"
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True)


def configurations(cmp: Comparison, root: str) -> str:
    """The runs' configurations side by side: the keys whose values differ in a table, highlighted
    (class diff); the keys equal in every run below them, folded (<details>, no script needed)."""
    from deploybench.analyse.compare import config_diff

    rows = {str(r["run_key"]): r for _, r in cmp.table.iterrows()}
    diff = config_diff({k: (r["config"] if isinstance(r["config"], dict) else {}) for k, r in rows.items()})
    headers = [Html("config key"), *[link(run_href(root, k), k, code=True) for k in rows]]

    def body(differ: bool) -> list[list[Any]]:
        return [[Html(f"<code>{esc(key)}</code>"), *[_value(v) for v in values]]
                for key, values, d in diff if d == differ]

    differing, same = body(True), body(False)
    verb = "s differ" if len(differing) != 1 else " differs"
    return (
        "<h2>Configurations side by side</h2>"
        f"<p>{len(differing)} configuration key{verb} between the runs (highlighted); "
        f"{len(same)} are the same in every run.</p>"
        + (table(headers, differing, ["diff"] * len(differing)) if differing else "")
        + (f"<details><summary>the {len(same)} keys that are the same in every run</summary>"
           + table(headers, same) + "</details>" if same else "")
    )


def _form(q: CompareQuery, root: str, choices: list[str]) -> str:
    def field_(label: str, name: str, value: Any, placeholder: str = "", size: int = 14) -> str:
        return (f"<label>{esc(label)}<input name='{name}' value='{esc(value or '')}' size='{size}' "
                f"placeholder='{esc(placeholder)}'></label>")

    hidden = "".join(f"<input type='hidden' name='run' value='{esc(k)}'>" for k in q.runs)
    options = "<option value=''>none</option>" + "".join(
        f"<option value='{esc(k)}'{' selected' if k == q.baseline else ''}>{esc(k)}</option>" for k in choices)
    tags = [f"{k}={v}" for k, v in q.tags.items()] + [""]
    return (
        f"<form class='filter' method='get' action='{esc(root)}/compare'>{hidden}"
        + ("" if q.runs else
           field_("model", "model", q.model) + field_("series (fingerprint, 8+ chars)", "series", q.series)
           + field_("inventory", "inventory", q.inventory)
           + "".join(field_("tag", "tag", t, "key=value", 12) for t in tags)
           + field_("since", "since", q.since.isoformat() if q.since else "", "2026-12-01", 12)
           + field_("until", "until", q.until.isoformat() if q.until else "", "2026-12-02T08:00", 12)
           + "<label>excluded runs<input type='checkbox' name='include_excluded' value='true'"
           + (" checked" if q.include_excluded else "") + "></label>")
        + f"<label>baseline<select name='baseline'>{options}</select></label>"
        + field_("alpha", "alpha", q.alpha, "", 5)
        + "<button>Compare</button>"
        + (f"<a href='{esc(root)}/compare'>new filter</a>" if q.runs else "")
        + "</form>"
    )


def render(view: ComparisonView | None, q: CompareQuery, root: str, error: str | None = None) -> str:
    """The whole comparison page (also with an error, or before anything is selected)."""
    from deploybench.report.compare_html import sections

    picked = view.cmp.run_keys() if view else list(q.runs)
    choices = list(dict.fromkeys([*picked, *([q.baseline] if q.baseline else [])]))
    parts = ["<h1>Comparison</h1>", _form(q, root, choices)]
    if error:
        parts.append(f"<p class='err'>{esc(error)}</p>")
    if view is None and not error:
        parts.append("<p>Pick runs: tick them on the <a href='" + esc(root) + "/'>run list</a> and press "
                     "“Compare selected runs”, or filter here by model, series, inventory, tags or time.</p>")
    if view is not None:
        if view.note:
            parts.append(f"<p class='note'>{esc(view.note)}</p>")
        if view.cmp.baseline:
            base = link(run_href(root, view.cmp.baseline), view.cmp.baseline, code=True)
            parts.append(f"<p>Baseline: {base} — every other run of its workload is tested against it.</p>")
        parts.append(configurations(view.cmp, root))
        parts += sections(view.cmp, view.curves, lambda key, text: link(run_href(root, key), text))
    return page("deploybench comparison", "".join(parts), root)
