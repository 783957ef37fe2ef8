"""The benchmark results pages: a small FastAPI application that Airflow mounts at /deploybench.

What it serves (paths relative to the mount point)::

    GET /                               recent runs, newest first; ?status=...&fingerprint=...&limit=...
    GET /runs/{run_key}                 one run: stages, load phases (cluster and per node), report link
    GET /runs/{run_key}/report          the run's HTML report (paths.run_dir(run_key)/report.html)
    GET /dag-runs/{dag_id}/{run_id}     the run of one Airflow DAG run (the "dag_run" tab of the plugin)
    GET /api/runs, /api/runs/{run_key}  the same as JSON

Everything is read from the results store (``deploybench.store``); the pages write nothing
(the store's own first open per process does apply pending migrations, as every reader does).

**Which database.** Resolved on every request, never at import: the Airflow connection
``deploybench_results`` (looked up lazily through ``deploybench.airflow_glue``, skipped when
Airflow is not importable), else ``DEPLOYBENCH_DSN``, else the embedded PostgreSQL *if it is
already running*. The first is what the DAG's store task writes to, so both agree. A web
server never starts a database server: with none of the three the pages answer 503 and say
how to configure one.

**Auth.** FastAPI apps of Airflow 3 plugins are mounted on the api-server as they are: Airflow
puts none of its authentication in front of them. Anyone who can reach the api-server could
read these pages unless the app checks for itself. ``create_app(auth=require_airflow_user)``
(what the plugin does) adds a dependency to every route that reuses Airflow's own
``get_user`` (the JWT from the ``Authorization: Bearer`` header or the ``_token`` cookie that
the Airflow UI sets, so the pages work inside the UI's iframe) and asks the auth manager whether
the user may see the Airflow website; otherwise the answer is 401/403. The pages are read-only,
but they show configurations, node names and error texts: still put the api-server behind your
SSO or proxy as you would for Airflow itself. ``create_app()`` without ``auth`` is for tests.

Every value from the store is HTML-escaped, and every response carries a Content-Security-Policy
without script sources, so even a stored ``<script>`` could not run on Airflow's origin (where
it could use the user's session cookie against Airflow's API).

This module imports FastAPI/Starlette (they ship with Airflow) but not Airflow, and it opens no
connection at import time: the plugin file importing it is loaded by every Airflow component.
"""

from __future__ import annotations

import html
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, get_args
from urllib.parse import quote, urlencode

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from deploybench import paths, store
from deploybench.errors import DeploybenchError
from deploybench.store.errors import StoreError
from deploybench.store.records import RunStatus  # pydantic only: no database, no SQLAlchemy

if TYPE_CHECKING:
    from deploybench.store import PhaseRecord, RunRecord, StageRecord, StoredRun

log = logging.getLogger(__name__)

RUN_STATUSES: tuple[str, ...] = get_args(RunStatus)
DEFAULT_LIMIT = 25
MAX_LIMIT = 200
# a filtered list looks at this many of the newest runs (latest_runs has no filters of its own)
FILTER_WINDOW = 1000
# how dags/deploybench_run.py keys a run (its _run_key()); used by the per-DAG-run tab
DAG_RUN_KEY = "{dag_id}__{run_id}"
SECURITY_HEADERS = {
    # no script source at all: these pages need none, and a stored <script> must never run here
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
    "form-action 'self'; base-uri 'none'; frame-ancestors 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class ResultsUnavailable(DeploybenchError):
    """The results database cannot be named or reached; the pages answer 503 with this message."""


# -- which database --------------------------------------------------------------------------
def _airflow_connection_dsn() -> str | None:
    """The DSN of the Airflow connection ``deploybench_results``; None without Airflow or the connection."""
    try:
        from deploybench.airflow_glue import results_dsn

        return results_dsn()
    except ImportError:  # Airflow (or its postgres provider) is not installed: tests, the CLI
        return None
    except Exception as exc:  # noqa: BLE001 - any failure of Airflow's secrets lookup becomes a 503 with its reason
        raise ResultsUnavailable(
            f"reading the Airflow connection 'deploybench_results' failed: {type(exc).__name__}: {exc}"
        ) from exc


def resolve_results_dsn() -> str:
    """Airflow connection > DEPLOYBENCH_DSN > the embedded PostgreSQL if it runs (never started here)."""
    from deploybench.store import db, embedded

    dsn = _airflow_connection_dsn()
    if dsn:
        return dsn
    if os.environ.get(db.ENV_DSN, "").strip():
        return db.resolve_dsn(start_embedded=False).dsn  # StoreError (-> 503) if it is not a PostgreSQL URL
    running = embedded.running_dsn()
    if running:
        return running
    raise ResultsUnavailable(
        f"no results database: create the Airflow connection 'deploybench_results', set {db.ENV_DSN} for the "
        f"api-server, or start the embedded PostgreSQL (`deploybench store dsn`; this page never starts one)"
    )


# -- formatting (pure; unit-tested) ----------------------------------------------------------
def esc(value: Any) -> str:
    """HTML-escaped text of a value (quotes too, so it is safe inside attributes); None is empty."""
    return html.escape("" if value is None else str(value), quote=True)


def fmt_num(value: float | int | None, digits: int = 2) -> str:
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
    return "" if value is None else value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def run_href(root: str, run_key: str, suffix: str = "", *, api: bool = False) -> str:
    """The URL of a run's page (``suffix`` e.g. '/report'; ``api`` for its JSON); the key is
    percent-encoded, '/' included."""
    return f"{root}{'/api' if api else ''}/runs/{quote(run_key, safe='')}{suffix}"


def headline_phase(phases: list[PhaseRecord]) -> PhaseRecord | None:
    """The cluster-level phase a run is summarised by: 'sustained' if there is one, else the last."""
    cluster = [p for p in phases if p.node == store.CLUSTER]
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


LIST_COLUMNS = ("run|DAG|status|started|nodes|engine|config|phase|achieved req/s|P99 ms|error rate").split(
    "|"
)
PHASE_COLUMNS = (
    "phase|node|offered req/s|achieved req/s|output tok/s|requests|errors|error rate|dropped|"
    "P50 ms|P90 ms|P99 ms|P99.9 ms|TTFT P50 ms|TTFT P99 ms|seconds"
).split("|")


def _phase_rows(phases: list[PhaseRecord]) -> list[list[str]]:
    ordered = sorted(phases, key=lambda p: (p.phase, p.node != store.CLUSTER, p.node))
    return [
        [
            esc(p.phase),
            "<b>cluster</b>" if p.node == store.CLUSTER else esc(p.node),
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


# -- the application -------------------------------------------------------------------------
def _root(request: Request) -> str:
    """Where this app is mounted (e.g. '/deploybench'): every link is built from it."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def _wants_json(request: Request) -> bool:
    return request.url.path.removeprefix(_root(request)).startswith("/api/")


def report_file(run_key: str) -> Path | None:
    """The run's report.html, or None. Call only with a key found in the store: the path comes from
    paths.run_dir, and is refused unless it is a plain file directly in a run folder (keys like '..')."""
    folder = paths.run_dir(run_key).resolve()
    if folder.parent != paths.runs_dir().resolve():
        log.warning(
            "run key %r maps to %s, outside %s; not serving its report", run_key, folder, paths.runs_dir()
        )
        return None
    report = folder / "report.html"
    return report if report.is_file() and not report.is_symlink() else None


def _target(request: Request) -> str:
    """The DSN for this request (a dependency, so a 503 happens before any route code runs)."""
    return request.app.state.resolve_dsn()


Target = Annotated[str, Depends(_target)]
Status = Annotated[RunStatus | None, Query()]
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT)]


def _load(target: str, run_key: str) -> StoredRun:
    stored = store.load_run(target, run_key)
    if stored is None:
        raise HTTPException(
            404,
            f"no run {run_key!r} in the results store (a run appears there once the DAG's "
            f"store task has written it)",
        )
    return stored


def _list(target: str, status: str | None, fingerprint: str | None, limit: int) -> tuple[list[RunRow], str]:
    fingerprint = (fingerprint or "").strip() or None
    filtered = bool(status or fingerprint)
    runs = store.latest_runs(target, limit=FILTER_WINDOW if filtered else limit)
    note = (
        f"Filters apply to the newest {FILTER_WINDOW} runs."
        if filtered and len(runs) == FILTER_WINDOW
        else ""
    )
    runs = [
        r
        for r in runs
        if (not status or r.status == status) and (not fingerprint or r.fingerprint.startswith(fingerprint))
    ][:limit]
    rows = []
    for run in runs:
        stored = store.load_run(target, run.run_key)  # None if deleted meanwhile
        rows.append(RunRow(run, headline_phase(stored.phases) if stored else None))
    return rows, note


def create_app(dsn: str | None = None, auth: Callable[..., Any] | None = None) -> FastAPI:
    """The results application. ``dsn`` fixes the database (tests); else it is resolved per request.
    ``auth`` is a FastAPI dependency run before every route (the plugin passes ``require_airflow_user``)."""
    app = FastAPI(
        title="deploybench results",
        docs_url=None,
        redoc_url=None,
        dependencies=[Depends(auth)] if auth else [],
    )
    app.state.resolve_dsn = (lambda: dsn) if dsn else resolve_results_dsn

    @app.middleware("http")
    async def _headers(request: Request, call_next: Callable[[Request], Any]) -> Response:
        response = await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        return response

    def _error(request: Request, code: int, message: str) -> Response:
        if _wants_json(request):
            return JSONResponse({"detail": message}, status_code=code)
        body = f"<h1>{code}</h1><p>{esc(message)}</p>"
        return HTMLResponse(page(f"deploybench: {code}", body, _root(request)), status_code=code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        response = _error(request, exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def _bad_query(request: Request, exc: RequestValidationError) -> Response:
        reasons = "; ".join(f"{'.'.join(str(x) for x in e['loc'][1:])}: {e['msg']}" for e in exc.errors())
        return _error(request, 400, f"bad request: {reasons}")

    async def _unavailable(request: Request, exc: Exception) -> Response:
        log.warning("results pages: %s", exc)  # the reason, never a traceback
        return _error(request, 503, f"the results store is unavailable: {exc}")

    app.add_exception_handler(StoreError, _unavailable)  # unreachable, failed migration or query
    app.add_exception_handler(ResultsUnavailable, _unavailable)

    @app.get("/", response_class=HTMLResponse)
    def run_list(
        request: Request,
        target: Target,
        status: Status = None,
        fingerprint: str | None = None,
        limit: Limit = DEFAULT_LIMIT,
    ) -> HTMLResponse:
        rows, note = _list(target, status, fingerprint, limit)
        return HTMLResponse(render_run_list(rows, _root(request), status, fingerprint, limit, note))

    @app.get("/api/runs")
    def api_runs(
        request: Request,
        target: Target,
        status: Status = None,
        fingerprint: str | None = None,
        limit: Limit = DEFAULT_LIMIT,
    ) -> dict[str, Any]:
        rows, note = _list(target, status, fingerprint, limit)
        return {"runs": [row.to_json(_root(request)) for row in rows], "note": note or None}

    @app.get("/api/runs/{run_key:path}")
    def api_run(request: Request, target: Target, run_key: str) -> dict[str, Any]:
        stored = _load(target, run_key)
        report = report_file(run_key)
        return {
            **stored.model_dump(mode="json"),
            "report_url": run_href(_root(request), run_key, "/report") if report else None,
        }

    def _run_page(request: Request, stored: StoredRun) -> HTMLResponse:
        root, key = _root(request), stored.run.run_key
        report_url = run_href(root, key, "/report") if report_file(key) else None
        return HTMLResponse(render_run_page(stored, root, report_url))

    # before /runs/{run_key:path}, which would take '<key>/report' for a key
    @app.get("/runs/{run_key:path}/report", response_class=FileResponse)
    def run_report(request: Request, target: Target, run_key: str) -> Response:
        if store.load_run(target, run_key) is None:
            if (whole := store.load_run(target, f"{run_key}/report")) is not None:
                return _run_page(request, whole)  # the page of a key that itself ends in '/report'
            raise HTTPException(404, f"no run {run_key!r} in the results store")
        report = report_file(run_key)
        if report is None:
            raise HTTPException(
                404,
                f"run {run_key!r} has no HTML report on this server (the report task writes it into "
                f"{paths.runs_dir()}, which the api-server must share)",
            )
        return FileResponse(report, media_type="text/html; charset=utf-8")

    @app.get("/runs/{run_key:path}", response_class=HTMLResponse)
    def run_page(request: Request, target: Target, run_key: str) -> HTMLResponse:
        return _run_page(request, _load(target, run_key))

    @app.get("/dag-runs/{dag_id}/{run_id:path}", response_class=HTMLResponse)
    def dag_run_page(request: Request, target: Target, dag_id: str, run_id: str) -> HTMLResponse:
        stored = store.load_run(target, DAG_RUN_KEY.format(dag_id=dag_id, run_id=run_id))
        if stored is None:
            raise HTTPException(
                404,
                f"no deploybench results for DAG run {run_id!r} of {dag_id!r} (they appear when its store "
                f"task has run; other DAGs have none)",
            )
        return _run_page(request, stored)

    return app


# -- Airflow's auth, borrowed lazily ---------------------------------------------------------
_bearer = HTTPBearer(auto_error=False)


async def require_airflow_user(request: Request) -> None:
    """A FastAPI dependency: the request must carry an Airflow user (JWT in the Authorization header or
    the UI's ``_token`` cookie) who may see the Airflow website; else 401/403. Only meaningful inside
    the api-server, where Airflow's auth manager is initialised; Airflow is imported on first use."""
    try:
        from airflow.api_fastapi.app import get_auth_manager
        from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
        from airflow.api_fastapi.core_api.security import get_user
    except ImportError as exc:
        raise ResultsUnavailable(
            f"Airflow's authentication cannot be imported here ({exc}); refusing access"
        ) from exc
    user = await get_user(request, _oauth_token=None, bearer_credentials=await _bearer(request))
    if not get_auth_manager().is_authorized_view(access_view=AccessView.WEBSITE, user=user):
        raise HTTPException(403, f"Airflow user {user.get_name()!r} may not view Airflow's pages")
