"""HTML rendering of the results pages (pure functions over store records; unit-tested).

Every value from the store goes through ``esc``; ``deploybench.webapp`` serves what these build.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, get_args
from urllib.parse import quote, urlencode

from deploybench.store.records import CLUSTER, RunStatus

RUN_STATUSES: tuple[str, ...] = get_args(RunStatus)
DEFAULT_LIMIT = 25

if TYPE_CHECKING:
    from deploybench.store import PhaseRecord, RunRecord, StageRecord, StoredRun

# -- formatting (pure; unit-tested) ----------------------------------------------------------
def esc(value: Any) -> str:
    """HTML-escaped text of a value (quotes too, so it is safe inside attributes); None is empty."""
    return html.escape("" if value is None else str(value), quote=True)


def fmt_num(value: float | None, digits: int = 2) -> str:
    """Thousands separated, ``digits`` decimals for floats; None and NaN are 'n/a'."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def fmt_ms(value: float | None) -> str:
    """A latency in milliseconds; None (no request succeeded) is 'n/a'."""
    return fmt_num(value, 1)


def fmt_pct(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:.2%}"


def fmt_time(value: datetime | None) -> str:
    return "" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def run_href(root: str, run_key: str, suffix: str = "", *, api: bool = False) -> str:
    """The URL of a run's page (``suffix`` e.g. '/report'; ``api`` for its JSON); the key is
    percent-encoded, '/' included."""
    return f"{root}{'/api' if api else ''}/runs/{quote(run_key, safe='')}{suffix}"


def headline_phase(phases: list[PhaseRecord]) -> PhaseRecord | None:
    """The cluster-level phase a run is summarised by: 'sustained' if there is one, else the last."""
    cluster = [p for p in phases if p.node == CLUSTER]
    return next((p for p in cluster if p.phase == "sustained"), cluster[-1] if cluster else None)


def stage_summary(stage: StageRecord) -> str:
    """The one-line summary the pipeline wrote, else the summary dict as compact JSON."""
    text = stage.summary.get("summary")
    if isinstance(text, str):
        return text
    return json.dumps(stage.summary, sort_keys=True, default=str)[:300] if stage.summary else ""


def engine_of(run: RunRecord) -> str:
    engine = run.config.get("engine")
    return str(engine.get("profile", "")) if isinstance(engine, dict) else ""


def _status(value: str) -> str:
    return f"<span class='st {esc(value)}'>{esc(value)}</span>"


def _table(headers: list[str], rows: list[list[str]], numeric_from: int = 99) -> str:
    """A table from already-escaped cells; columns from ``numeric_from`` on are right-aligned."""
    head = "".join(
        f"<th{' class=n' if i >= numeric_from else ''}>{esc(h)}</th>" for i, h in enumerate(headers)
    )
    body = "".join(
        "<tr>"
        + "".join(f"<td{' class=n' if i >= numeric_from else ''}>{c}</td>" for i, c in enumerate(r))
        + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_CSS = """
:root{color-scheme:light dark;--fg:#1d2433;--muted:#5b6475;--line:#d8dde6;--bg:#fff;--head:#f3f5f8;
--ok:#11743a;--bad:#b3261e;--run:#8a5a00;--link:#1a5fb4}
@media (prefers-color-scheme:dark){:root{--fg:#e4e7ec;--muted:#a0a8b6;--line:#3a4150;--bg:#171a21;
--head:#222733;--ok:#5fd38d;--bad:#ff8a80;--run:#ffcc66;--link:#8ab4f8}}
body{font:14px/1.45 system-ui,sans-serif;color:var(--fg);background:var(--bg);margin:1.2em 1.5em}
a{color:var(--link)}h1{font-size:1.35em;margin:.2em 0 .6em}h2{font-size:1.1em;margin:1.4em 0 .4em}
table{border-collapse:collapse;margin:.4em 0;width:100%}th,td{border-bottom:1px solid var(--line);
padding:.3em .55em;text-align:left;vertical-align:top}
th{background:var(--head);font-weight:600;white-space:nowrap}
.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
code,pre{font-family:ui-monospace,monospace}
pre{white-space:pre-wrap;margin:0;max-height:20em;overflow:auto}.muted{color:var(--muted)}
.st{font-weight:600}.success{color:var(--ok)}.failed{color:var(--bad)}.running,.skipped{color:var(--run)}
form{display:flex;gap:.8em;align-items:end;margin:.4em 0 .8em}label{display:flex;flex-direction:column;
font-size:.9em;color:var(--muted)}dl{display:grid;grid-template-columns:max-content 1fr;gap:.15em 1em}
dt{color:var(--muted)}dd{margin:0}.err{color:var(--bad)}
"""


def page(title: str, body: str, root: str) -> str:
    """A whole self-contained HTML document (inline CSS, no script, no external asset)."""
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width,initial-scale=1'>"
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>"
        f"<p class='muted'><a href='{esc(root)}/'>deploybench results</a></p>{body}</body></html>"
    )


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


def render_run_list(
    rows: list[RunRow],
    root: str,
    status: str | None = None,
    fingerprint: str | None = None,
    limit: int = DEFAULT_LIMIT,
    note: str = "",
) -> str:
    options = "".join(
        f"<option value='{s}'{' selected' if s == (status or '') else ''}>{s or 'any'}</option>"
        for s in ("", *RUN_STATUSES)
    )
    form = (
        f"<form method='get' action='{esc(root)}/'>"
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
                f"<a href='{esc(run_href(root, r.run_key))}'><code>{esc(r.run_key)}</code></a>",
                esc(r.dag_id),
                _status(r.status),
                esc(fmt_time(r.started_at)),
                esc(r.node_count),
                esc(engine_of(r)),
                f"<a href='{esc(fp_link)}' title='{esc(r.fingerprint)}'>"
                f"<code>{esc(r.fingerprint[:12])}</code></a>",
                esc(p.phase if p else "n/a"),
                esc(fmt_num(p.achieved_rps if p else None)),
                esc(fmt_ms(p.latency_p99_ms if p else None)),
                esc(fmt_pct(p.error_rate if p else None)),
            ]
        )
    table = _table(LIST_COLUMNS, table_rows, numeric_from=8) if rows else "<p>No runs match.</p>"
    note_html = f"<p class='muted'>{esc(note)}</p>" if note else ""
    return page(
        "deploybench results",
        f"<h1>Benchmark runs</h1>{form}{table}{note_html}"
        f"<p class='muted'><a href='{esc(root)}/api/runs'>JSON</a></p>",
        root,
    )


LIST_COLUMNS = ["run", "DAG", "status", "started", "nodes", "engine", "config", "phase", "achieved req/s", "P99 ms", "error rate"]
PHASE_COLUMNS = ["phase", "node", "offered req/s", "achieved req/s", "output tok/s", "requests", "errors", "error rate", "dropped", "P50 ms", "P90 ms", "P99 ms", "P99.9 ms", "TTFT P50 ms", "TTFT P99 ms", "seconds"]


def _phase_rows(phases: list[PhaseRecord]) -> list[list[str]]:
    ordered = sorted(phases, key=lambda p: (p.phase, p.node != CLUSTER, p.node))
    return [
        [
            esc(p.phase),
            "<b>cluster</b>" if p.node == CLUSTER else esc(p.node),
            esc(fmt_num(p.offered_rps)),
            esc(fmt_num(p.achieved_rps)),
            esc(fmt_num(p.output_tps, 1)),
            esc(fmt_num(p.requests)),
            esc(fmt_num(p.errors)),
            esc(fmt_pct(p.error_rate)),
            esc(fmt_num(p.dropped_iterations)),
            esc(fmt_ms(p.latency_p50_ms)),
            esc(fmt_ms(p.latency_p90_ms)),
            esc(fmt_ms(p.latency_p99_ms)),
            esc(fmt_ms(p.latency_p999_ms)),
            esc(fmt_ms(p.ttft_p50_ms)),
            esc(fmt_ms(p.ttft_p99_ms)),
            esc(fmt_num(p.duration_s, 1)),
        ]
        for p in ordered
    ]


def render_run_page(stored: StoredRun, root: str, report_url: str | None) -> str:
    r = stored.run
    facts = [
        ("status", _status(r.status)),
        ("DAG", esc(r.dag_id)),
        ("Airflow run", esc(r.airflow_run_id or "")),
        ("started", esc(fmt_time(r.started_at))),
        ("finished", esc(fmt_time(r.finished_at))),
        ("inventory", esc(r.inventory)),
        ("nodes", esc(r.node_count)),
        ("engine", esc(engine_of(r))),
        ("config fingerprint", f"<code>{esc(r.fingerprint)}</code>"),
        ("raw samples", esc(fmt_num(stored.sample_count))),
        ("tags", esc(", ".join(f"{k}={v}" for k, v in sorted(r.tags.items())))),
    ]
    links = [f"<a href='{esc(run_href(root, r.run_key, api=True))}'>JSON</a>"]
    if report_url:
        links.insert(0, f"<a href='{esc(report_url)}'>HTML report</a>")
    stages = (
        _table(
            ["stage", "status", "started", "seconds", "summary", "error"],
            [
                [
                    esc(s.stage),
                    _status(s.status),
                    esc(fmt_time(s.started_at)),
                    esc(fmt_num(s.seconds, 1)),
                    esc(stage_summary(s)),
                    f"<pre class='err'>{esc(s.error)}</pre>" if s.error else "",
                ]
                for s in stored.stages
            ],
        )
        if stored.stages
        else "<p>No stage was stored.</p>"
    )
    phases = (
        _table(PHASE_COLUMNS, _phase_rows(stored.phases), numeric_from=2)
        if stored.phases
        else "<p>No load phase was stored (the run stopped before the load stage).</p>"
    )
    body = (
        f"<h1>Run <code>{esc(r.run_key)}</code></h1><p>{' &middot; '.join(links)}</p>"
        "<dl>" + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts) + "</dl>"
        f"<h2>Stages</h2>{stages}<h2>Load phases</h2>{phases}"
        f"<h2>Configuration</h2><details><summary>RunConfig</summary>"
        f"<pre>{esc(json.dumps(r.config, indent=1, sort_keys=True))}</pre></details>"
    )
    return page(f"deploybench run {r.run_key}", body, root)
