"""HTML rendering of the results pages: the page frame, the run list and the run page (pure
functions over store records; unit-tested). The comparison and history pages are rendered by
``compare_page`` and ``history_page`` with the same frame.

Escaping, number formatting, tables and the document frame are the project's one HTML toolkit,
``deploybench.report.html`` (re-exported here: ``esc``, ``fmt_num``, ``fmt_ms``, ``fmt_pct``,
``fmt_time``); this module adds the pages' style, navigation and links. Every value from the store
goes through ``esc`` or through ``table``, which escapes every cell that is not ``Html``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args
from urllib.parse import quote, urlencode

from deploybench.analyse.findings import ANALYSED_PHASES
from deploybench.report import node_windows
from deploybench.report.findings_html import findings_section
from deploybench.report.html import (
    Html,
    document,
    esc,
    fmt_money,
    fmt_ms,
    fmt_num,
    fmt_pct,
    fmt_time,
    fmt_util,
    table,
)
from deploybench.store.rows import CLUSTER, RunStatus

RUN_STATUSES: tuple[str, ...] = get_args(RunStatus)
DEFAULT_LIMIT = 25

__all__ = [
    "DEFAULT_LIMIT", "Html", "RunRow", "compare_href", "esc", "fmt_ms", "fmt_num", "fmt_pct", "fmt_time",
    "headline_phase", "link", "page", "render_run_list", "render_run_page", "run_href", "series_href",
    "status_html", "table", "when",
]

if TYPE_CHECKING:
    from deploybench.store import PhaseRecord, RunRecord, StageRow, StoredRun


# -- links (the page paths documented in deploybench.web.app) ---------------------------------
def run_href(root: str, run_key: str, suffix: str = "", *, api: bool = False) -> str:
    """The URL of a run's page (``suffix`` e.g. '/report'; ``api`` for its JSON); the key is
    percent-encoded, '/' included."""
    return f"{root}{'/api' if api else ''}/runs/{quote(run_key, safe='')}{suffix}"


def series_href(root: str, fingerprint: str) -> str:
    """The history page of a series."""
    return f"{root}/series/{quote(fingerprint, safe='')}"


def compare_href(root: str, **query: Any) -> str:
    """The comparison page with a query (lists become repeated parameters, e.g. run=a&run=b)."""
    pairs = [(k, v) for k, vs in query.items() for v in (vs if isinstance(vs, (list, tuple)) else [vs])
             if v not in (None, "")]
    return f"{root}/compare" + (f"?{urlencode(pairs)}" if pairs else "")


# -- small pieces ----------------------------------------------------------------------------
def headline_phase(phases: list[PhaseRecord]) -> PhaseRecord | None:
    """The cluster-level phase a run is summarised by: 'sustained' if there is one, else the last."""
    cluster = [p for p in phases if p.node == CLUSTER]
    return next((p for p in cluster if p.phase == "sustained"), cluster[-1] if cluster else None)


def stage_summary(stage: StageRow) -> str:
    """The one-line summary the pipeline wrote, else the summary dict as compact JSON."""
    text = stage.summary.get("summary")
    if isinstance(text, str):
        return text
    return json.dumps(stage.summary, sort_keys=True, default=str)[:300] if stage.summary else ""


def engine_of(run: RunRecord) -> str:
    engine = run.config.get("engine")
    return str(engine.get("profile", "")) if isinstance(engine, dict) else ""


def status_html(value: str) -> Html:
    return Html(f"<span class='st {esc(value)}'>{esc(value)}</span>")


def when(value: Any) -> Html:
    """A time stamp that does not wrap inside a table cell."""
    return Html(f"<span class='t'>{esc(fmt_time(value))}</span>")


def link(href: str, text: str, *, code: bool = False, title: str | None = None) -> Html:
    """A link whose text (and title) are escaped; ``code`` sets the text in <code>."""
    inner = f"<code>{esc(text)}</code>" if code else esc(text)
    title_attr = f" title='{esc(title)}'" if title else ""
    return Html(f"<a href='{esc(href)}'{title_attr}>{inner}</a>")


_CSS = """
:root{color-scheme:light dark;--fg:#1d2433;--muted:#5b6475;--line:#d8dde6;--bg:#fff;--head:#f3f5f8;
--ok:#11743a;--bad:#b3261e;--run:#8a5a00;--link:#1a5fb4;--mark:#fff3c4;--good:#e6f4ea}
@media (prefers-color-scheme:dark){:root{--fg:#e4e7ec;--muted:#a0a8b6;--line:#3a4150;--bg:#171a21;
--head:#222733;--ok:#5fd38d;--bad:#ff8a80;--run:#ffcc66;--link:#8ab4f8;--mark:#4a3f12;--good:#1e3a28}}
body{font:14px/1.45 system-ui,sans-serif;color:var(--fg);background:var(--bg);margin:1.2em 1.5em}
a{color:var(--link)}h1{font-size:1.35em;margin:.2em 0 .6em}h2{font-size:1.1em;margin:1.4em 0 .4em}
h3{font-size:1em;margin:1em 0 .3em}
table{border-collapse:collapse;margin:.4em 0;width:100%}th,td{border-bottom:1px solid var(--line);
padding:.3em .55em;text-align:left;vertical-align:top}
th{background:var(--head);font-weight:600;white-space:nowrap}
.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
code,pre{font-family:ui-monospace,monospace}
pre{white-space:pre-wrap;margin:0;max-height:20em;overflow:auto}.muted,.note{color:var(--muted)}
.st{font-weight:600}.success,.better,.improvement{color:var(--ok)}.failed,.worse,.regression{color:var(--bad)}
.running,.skipped{color:var(--run)}
form.filter{display:flex;flex-wrap:wrap;gap:.8em;align-items:end;margin:.4em 0 .8em}
form.filter label{display:flex;flex-direction:column;font-size:.9em;color:var(--muted)}
dl{display:grid;grid-template-columns:max-content 1fr;gap:.15em 1em}
dt{color:var(--muted)}dd{margin:0}.err{color:var(--bad)}
tr.diff td{background:var(--mark)}tr.best td{background:var(--good)}
tr.changepoint td{border-top:2px solid var(--bad)}.t{white-space:nowrap}
tr.excluded td{color:var(--muted);opacity:.55}tr.excluded a{color:var(--muted)}
figure{margin:.8em 0}figure svg{max-width:100%;height:auto;background:#fff}figcaption{color:var(--muted)}
nav{margin-bottom:.6em}
"""


def page(title: str, body: str, root: str) -> str:
    """A whole page: the toolkit's document frame with the pages' style and navigation."""
    nav = f"<a href='{esc(root)}/'>deploybench results</a> &middot; <a href='{esc(root)}/compare'>compare</a>"
    return document(title, body, css=_CSS, nav=f"<nav class='muted'>{nav}</nav>")


# -- the run list ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RunRow:
    """One line of the run list: the run and the cluster-level phase it is summarised by."""

    run: RunRecord
    phase: PhaseRecord | None

    def to_json(self, root: str) -> dict[str, Any]:
        return {
            **self.run.model_dump(mode="json"),
            "headline_phase": None if self.phase is None else self.phase.model_dump(mode="json"),
            "url": run_href(root, self.run.run_key),
        }


LIST_COLUMNS = ["compare", "baseline", "run", "DAG", "status", "started", "nodes", "engine", "config", "phase",
                "achieved req/s", "P99 ms", "error rate"]
PHASE_COLUMNS = ["phase", "node", "offered req/s", "achieved req/s", "GPU util %", "output tok/s", "requests", "errors",
                 "error rate", "dropped", "P50 ms", "P90 ms", "P99 ms", "P99.9 ms", "TTFT P50 ms", "TTFT P99 ms",
                 "prefix hit rate", "J per output token", "J per request", "cost per 1M output tokens",
                 "seconds"]


def render_run_list(
    rows: list[RunRow],
    root: str,
    status: str | None = None,
    fingerprint: str | None = None,
    limit: int = DEFAULT_LIMIT,
    note: str = "",
) -> str:
    """The run list: a filter form, and the runs in a form that opens the comparison page with the
    ticked runs (``run=``) and the chosen baseline (``baseline=``)."""
    options = "".join(
        f"<option value='{esc(s)}'{' selected' if s == (status or '') else ''}>{esc(s or 'any')}</option>"
        for s in ("", *RUN_STATUSES)
    )
    form = (
        f"<form class='filter' method='get' action='{esc(root)}/'>"
        f"<label>status<select name='status'>{options}</select></label><label>fingerprint (prefix)"
        f"<input name='fingerprint' value='{esc(fingerprint)}' size='16'></label>"
        f"<label>rows<input name='limit' value='{limit}' size='4'></label><button>filter</button>"
        f"<a href='{esc(root)}/'>clear</a></form>"
    )
    table_rows = []
    for row in rows:
        r, p = row.run, row.phase
        fp_link = f"{root}/?{urlencode({'fingerprint': r.fingerprint})}"
        table_rows.append(
            [
                Html(f"<input type='checkbox' name='run' value='{esc(r.run_key)}' aria-label='compare'>"),
                Html(f"<input type='radio' name='baseline' value='{esc(r.run_key)}' aria-label='baseline'>"),
                link(run_href(root, r.run_key), r.run_key, code=True),
                r.dag_id,
                status_html(r.status),
                when(r.started_at),
                r.node_count,
                engine_of(r),
                link(fp_link, r.fingerprint[:12], code=True, title=r.fingerprint),
                p.phase if p else "n/a",
                fmt_num(p.achieved_rps if p else None),
                fmt_ms(p.latency_p99_ms if p else None),
                fmt_pct(p.error_rate if p else None),
            ]
        )
    if rows:
        listing = (
            f"<form method='get' action='{esc(root)}/compare'>"
            + table(LIST_COLUMNS, table_rows, numeric_from=10)
            + "<p><button>Compare selected runs</button> <span class='muted'>tick two or more runs; the "
            "baseline (optional) is the run every other one is tested against</span></p></form>"
        )
    else:
        listing = "<p>No runs match.</p>"
    note_html = f"<p class='muted'>{esc(note)}</p>" if note else ""
    return page(
        "deploybench results",
        f"<h1>Benchmark runs</h1>{form}{listing}{note_html}"
        f"<p class='muted'><a href='{esc(root)}/api/runs'>JSON</a></p>",
        root,
    )


# -- one run ---------------------------------------------------------------------------------
def gpu_utilisation(stages: list[StageRow]) -> dict[tuple[str, str], float | None]:
    """{(phase, node or '*'): mean GPU utilisation %} from the stored load stage's result (its LoadResults
    carry ``gpu_util_pct`` and ``gpu``; see deploybench.load.gpu). A pair missing, or None: not measured."""
    load = next((s for s in stages if s.stage == "load"), None)
    result = ((load.summary if load else {}) or {}).get("result") or {}
    phases: dict = result["phases"] if isinstance(result.get("phases"), dict) else {}
    out: dict[tuple[str, str], float | None] = {}
    for name, ph in phases.items():
        res = (ph or {}).get("result") if isinstance(ph, dict) else None
        if not isinstance(res, dict):
            continue
        out[(name, CLUSTER)] = _pct(res.get("gpu_util_pct"))
        gpu = res.get("gpu")
        for node, g in (gpu if isinstance(gpu, dict) else {}).items():
            out[(name, str(node))] = _pct(g.get("util_mean_pct")) if isinstance(g, dict) else None
    return out


def _pct(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _phase_rows(phases: list[PhaseRecord], gpu: dict[tuple[str, str], float | None] | None = None) -> list[list[Any]]:
    ordered = sorted(phases, key=lambda p: (p.phase, p.node != CLUSTER, p.node))
    return [
        [
            p.phase,
            Html("<b>cluster</b>") if p.node == CLUSTER else p.node,
            fmt_num(p.offered_rps),
            fmt_num(p.achieved_rps),
            fmt_util((gpu or {}).get((p.phase, p.node))),
            fmt_num(p.output_tps, 1),
            fmt_num(p.requests),
            fmt_num(p.errors),
            fmt_pct(p.error_rate),
            fmt_num(p.dropped_iterations),
            fmt_ms(p.latency_p50_ms),
            fmt_ms(p.latency_p90_ms),
            fmt_ms(p.latency_p99_ms),
            fmt_ms(p.latency_p999_ms),
            fmt_ms(p.ttft_p50_ms),
            fmt_ms(p.ttft_p99_ms),
            # the engine's and the GPUs' own figures: absent when not measured (no prefix cache, no power reading)
            fmt_pct(p.prefix_hit_rate, 1, missing="absent"),
            "absent" if p.energy_per_output_token_j is None else f"{p.energy_per_output_token_j:.4g}",
            "absent" if p.energy_per_request_j is None else f"{p.energy_per_request_j:.4g}",
            fmt_money(p.cost_per_million_output_tokens, p.cost_currency),  # the cluster row's; absent when not priced
            fmt_num(p.duration_s, 1),
        ]
        for p in ordered
    ]


def _spike_section(phases: list[PhaseRecord]) -> str:
    """The spike phase's recovery and scale-up times (its cluster row), under the load phases; '' without one."""
    from deploybench.report.spike import stored_facts

    row = next((p for p in phases if p.phase == "spike" and p.node == CLUSTER), None)
    if row is None:
        return ""
    # the stored flag: a scale-up that failed (both times absent) is shown, with why; rows stored before the flag
    # (None) fall back to the times
    scaled = (row.scale_up if row.scale_up is not None else
              row.scale_up_serving_s is not None or row.scale_up_slo_s is not None)
    got = stored_facts(row.spike_recovery_s, row.spike_recovery_reason, row.scale_up_serving_s, row.scale_up_slo_s,
                       scaled)
    return "<h3>Spike</h3><dl>" + "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in got) + "</dl>"


def _series_fact(stored: StoredRun, root: str) -> Html:
    fp = stored.series_fingerprint
    if not fp:
        return Html("<span class='muted'>none (stored without identities: no history)</span>")
    return Html(
        f"{link(series_href(root, fp), f'History of series {fp[:12]}')} &middot; "
        f"{link(compare_href(root, series=fp), 'compare the runs of this series')}"
        + (f" &middot; <span class='muted'>excluded from analysis: {esc(stored.exclude_reason)}</span>"
           if stored.excluded else "")
    )


def render_run_page(stored: StoredRun, root: str, report_url: str | None) -> str:
    r = stored.run
    facts: list[tuple[str, str]] = [
        ("status", status_html(r.status)),
        ("DAG", esc(r.dag_id)),
        ("Airflow run", esc(r.airflow_run_id or "")),
        ("started", esc(fmt_time(r.started_at))),
        ("finished", esc(fmt_time(r.finished_at))),
        ("inventory", esc(r.inventory)),
        ("nodes", esc(r.node_count)),
        ("engine", esc(engine_of(r))),
        ("workload", esc(((r.config or {}).get("load") or {}).get("workload") or "synthetic")),
        ("config fingerprint", f"<code>{esc(r.fingerprint)}</code>"),
        ("series", _series_fact(stored, root)),
        ("raw samples", esc(fmt_num(stored.sample_count))),
        ("tags", esc(", ".join(f"{k}={v}" for k, v in sorted(r.tags.items())))),
    ]
    links = [f"<a href='{esc(run_href(root, r.run_key, api=True))}'>JSON</a>"]
    if stored.series_fingerprint:
        links.insert(0, link(series_href(root, stored.series_fingerprint), "History of this series"))
    if report_url:
        links.insert(0, f"<a href='{esc(report_url)}'>HTML report</a>")
    stages = (
        table(
            ["stage", "status", "started", "seconds", "summary", "error"],
            [
                [
                    s.stage,
                    status_html(s.status),
                    when(s.started_at),
                    fmt_num(s.seconds, 1),
                    stage_summary(s),
                    Html(f"<pre class='err'>{esc(s.error)}</pre>") if s.error else "",
                ]
                for s in stored.stages
            ],
        )
        if stored.stages
        else "<p>No stage was stored.</p>"
    )
    phases = (
        table(PHASE_COLUMNS, _phase_rows(stored.phases, gpu_utilisation(stored.stages)), numeric_from=2)
        if stored.phases
        else "<p>No load phase was stored (the run stopped before the load stage).</p>"
    )
    body = (
        f"<h1>Run <code>{esc(r.run_key)}</code></h1><p>{' &middot; '.join(links)}</p>"
        "<dl>" + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts) + "</dl>"
        f"<h2>Stages</h2>{stages}<h2>Load phases</h2>{phases}{_spike_section(stored.phases)}"
        + "".join(node_windows.section(stored.node_windows, level=2)) +
        f"{findings_section(stored.findings, analysed=any(p.phase in ANALYSED_PHASES for p in stored.phases))}"
        f"<h2>Configuration</h2><details><summary>RunConfig</summary>"
        f"<pre>{esc(json.dumps(r.config, indent=1, sort_keys=True))}</pre></details>"
    )
    return page(f"deploybench run {r.run_key}", body, root)
