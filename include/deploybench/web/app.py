"""The benchmark results pages: a small FastAPI application that Airflow mounts at /deploybench.

What it serves (paths relative to the mount point; these paths are stable, links and tests use them)::

    GET /                               recent runs, newest first; ?status=...&fingerprint=...&limit=...
                                        (tick runs and a baseline, "Compare selected runs" opens /compare)
    GET /runs/{run_key}                 one run: stages, load phases (cluster and per node), report link,
                                        a link to its series' history
    GET /runs/{run_key}/report          the run's HTML report (paths.run_dir(run_key)/report.html)
    GET /dag-runs/{dag_id}/{run_id}     the run of one Airflow DAG run (the "Benchmark results" tab); for a
                                        matrix DAG run, its cells and comparison (matrix_page)
    GET /compare?run=K&run=K[&baseline=K][&alpha=0.05]
                                        the comparison of the runs picked by key, or of a filter:
    GET /compare?model=M&series=FP&inventory=I&tag=k=v&since=ISO&until=ISO[&include_excluded=true]
                                        [&baseline=K][&alpha=0.05] (heading "Comparison")
    GET /series/{fingerprint}           the history of a series (full fingerprint or a unique prefix of
                                        8+ characters; heading "History of series <12 chars>")
    GET /api/runs, /api/runs/{run_key}  the runs as JSON

and nothing else: no OpenAPI schema or docs pages (``/openapi.json``, ``/docs``, ``/redoc``), which FastAPI
would serve outside the auth dependency. A comparison takes at most ``compare_page.MAX_RUNS`` runs.

Headings a person (and a browser test) finds: the run list "Benchmark runs", a run "Run <key>",
the comparison "Comparison", the history "History of series <first 12 characters>".

Everything is read from the results store (``deploybench.store``); the pages write nothing
(the store's own first open per process does apply pending migrations, as every reader does).

**Which database.** Resolved on every request, never at import: the Airflow connection
``deploybench_results`` (looked up lazily through ``deploybench.airflow.connections``, skipped when
Airflow is not importable), else ``DEPLOYBENCH_DSN``, else the embedded PostgreSQL *if it is
already running*. The first is what the DAG's store task writes to, so both agree. A web
server never starts a database server: with none of the three the pages answer 503 and say
how to configure one.

**Auth.** FastAPI apps of Airflow 3 plugins are mounted on the api-server as they are: Airflow
puts none of its authentication in front of them. ``create_app(auth=require_airflow_user)`` (what
the plugin does) runs ``deploybench.web.access.require_airflow_user`` before every route: it
reuses Airflow's own ``get_user`` (the JWT from the ``Authorization: Bearer`` header or the
``_token`` cookie that the Airflow UI sets, so the pages work inside the UI's iframe), asks the auth
manager whether the user may see the Airflow website (else 401/403), and then **per DAG**: a run
produced by DAG X is shown only to a user the auth manager allows to read X's runs; a run started
outside Airflow (CLI) only to a user who may read every DAG. Lists leave out what the user may not
read; a run page, report, JSON or comparison naming such a run answers 403; a series history with no
run the user may read answers 404, as an unknown series does (see web.access, history_page). A run's
static report (written once, at report time) shows only its own DAG's runs in its history (see
``deploybench.report.history_for``); the history page shows the whole series as the user may read it.
The pages show configurations, node names and error texts: still put the api-server behind your
SSO or proxy as you would for Airflow itself. ``create_app()`` without ``auth`` (every run readable)
is for tests.

Every value from the store is HTML-escaped, and every response carries a Content-Security-Policy
without script sources, so even a stored ``<script>`` could not run on Airflow's origin (where
it could use the user's session cookie against Airflow's API).

This module imports FastAPI/Starlette (they ship with Airflow) but not Airflow, and it opens no
connection at import time: the plugin file importing it is loaded by every Airflow component.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deploybench import paths, store
from deploybench.errors import DeploybenchError
from deploybench.store.errors import StoreError
from deploybench.store.rows import RunStatus  # pydantic only: no database, no SQLAlchemy
from deploybench.web import compare_page, history_page
from deploybench.web.access import (  # noqa: F401 - require_airflow_user: what the plugin imports
    AccessUnavailable,
    ReadAccess,
    access_of,
    forbid,
    may_read,
    require_airflow_user,
)
from deploybench.web.markup import (
    DEFAULT_LIMIT,
    RunRow,
    esc,
    headline_phase,
    page,
    render_run_list,
    render_run_page,
    run_href,
)

if TYPE_CHECKING:
    from deploybench.store import StoredRun

log = logging.getLogger(__name__)

MAX_LIMIT = 200
# a filtered list looks at this many of the newest runs (latest_runs has no filters of its own)
FILTER_WINDOW = 1000
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
        from deploybench.airflow.connections import results_dsn

        return results_dsn()
    except ImportError:  # Airflow (or its postgres provider) is not installed: tests, the CLI
        return None
    except Exception as exc:
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


# -- the application -------------------------------------------------------------------------
def _root(request: Request) -> str:
    """Where this app is mounted (e.g. '/deploybench'): every link is built from it."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def _wants_json(request: Request) -> bool:
    return request.url.path.removeprefix(_root(request)).startswith("/api/")


def report_file(run_key: str, dsn: str | None = None) -> Path | None:
    """The run's report.html, or None. Call only with a key found in the store: the path comes from
    paths.run_dir, and is refused unless it is a plain file directly in a run folder (keys like '..') whose
    run.json names this very run key. With ``dsn``, a report not on this server's disk is first pulled from the
    results database (deploybench.store.run_files: the tasks' workers push their run folders there)."""
    if dsn is not None:
        from sqlalchemy.exc import SQLAlchemyError

        from deploybench.store.run_files import pull_wanted

        try:  # one small query of the two files' sha256: a stale report here is replaced, a current one kept
            pull_wanted(run_key, dsn, wanted=("run.json", "report.html"))
        except (StoreError, SQLAlchemyError, OSError) as exc:  # a hostile or unreadable row: "no report here"
            log.warning("run %r: its folder could not be pulled from the results database: %s", run_key, exc)
    folder = paths.run_dir(run_key).resolve()
    if folder.parent != paths.runs_dir().resolve():
        log.warning(
            "run key %r maps to %s, outside %s; not serving its report", run_key, folder, paths.runs_dir()
        )
        return None
    if (owner := paths.folder_run_key(folder)) not in (None, run_key):
        log.warning("run folder %s belongs to run %r, not %r; not serving its report", folder, owner, run_key)
        return None
    report = folder / "report.html"
    return report if report.is_file() and not report.is_symlink() else None


def _target(request: Request) -> str:
    """The DSN for this request (a dependency, so a 503 happens before any route code runs)."""
    return request.app.state.resolve_dsn()


Target = Annotated[str, Depends(_target)]
Access = Annotated[ReadAccess, Depends(access_of)]
Status = Annotated[RunStatus | None, Query()]
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT)]


def _readable(stored: StoredRun | None, access: ReadAccess) -> StoredRun | None:
    """The run if the user may read it; None if it is not stored; 403 if it is the DAG of someone else."""
    if stored is not None and not may_read(access, stored.run.dag_id, stored.run.airflow_run_id):
        raise forbid(access, f"run {stored.run.run_key!r}")
    return stored


def _load(target: str, run_key: str, access: ReadAccess) -> StoredRun:
    stored = _readable(store.load_run(target, run_key), access)
    if stored is None:
        raise HTTPException(
            404,
            f"no run {run_key!r} in the results store (a run appears there once the DAG's "
            f"store task has written it)",
        )
    return stored


def _list(
    target: str, access: ReadAccess, status: str | None, fingerprint: str | None, limit: int
) -> tuple[list[RunRow], str]:
    fingerprint = (fingerprint or "").strip() or None
    # a user who may not read every DAG sees a filtered window, as a filter does
    filtered = bool(status or fingerprint) or not access.may_read_all_dags()
    runs = store.latest_runs(target, limit=FILTER_WINDOW if filtered else limit)
    note = (
        f"Filters apply to the newest {FILTER_WINDOW} runs."
        if filtered and len(runs) == FILTER_WINDOW
        else ""
    )
    runs = [
        r
        for r in runs
        if (not status or r.status == status)
        and (not fingerprint or r.fingerprint.startswith(fingerprint))
        and may_read(access, r.dag_id, r.airflow_run_id)
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
        # no /openapi.json, /docs, /redoc: FastAPI adds them as bare routes that the app's dependencies
        # (the auth) do not guard, so they would be served without login; the paths are in the module doc
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        dependencies=[Depends(auth)] if auth else [],
    )
    app.state.resolve_dsn = (lambda: dsn) if dsn else resolve_results_dsn
    app.state.auth_required = auth is not None

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
    app.add_exception_handler(AccessUnavailable, _unavailable)

    @app.get("/", response_class=HTMLResponse)
    def run_list(
        request: Request,
        target: Target,
        access: Access,
        status: Status = None,
        fingerprint: str | None = None,
        limit: Limit = DEFAULT_LIMIT,
    ) -> HTMLResponse:
        rows, note = _list(target, access, status, fingerprint, limit)
        return HTMLResponse(render_run_list(rows, _root(request), status, fingerprint, limit, note))

    @app.get("/api/runs")
    def api_runs(
        request: Request,
        target: Target,
        access: Access,
        status: Status = None,
        fingerprint: str | None = None,
        limit: Limit = DEFAULT_LIMIT,
    ) -> dict[str, Any]:
        rows, note = _list(target, access, status, fingerprint, limit)
        return {"runs": [row.to_json(_root(request)) for row in rows], "note": note or None}

    @app.get("/api/runs/{run_key:path}")
    def api_run(request: Request, target: Target, access: Access, run_key: str) -> dict[str, Any]:
        stored = _load(target, run_key, access)
        report = report_file(run_key, target)
        return {
            **stored.model_dump(mode="json"),
            "report_url": run_href(_root(request), run_key, "/report") if report else None,
        }

    def _run_page(request: Request, stored: StoredRun) -> HTMLResponse:
        root, key = _root(request), stored.run.run_key
        report_url = run_href(root, key, "/report") if report_file(key, _target(request)) else None
        return HTMLResponse(render_run_page(stored, root, report_url))

    # before /runs/{run_key:path}, which would take '<key>/report' for a key
    @app.get("/runs/{run_key:path}/report", response_class=FileResponse)
    def run_report(request: Request, target: Target, access: Access, run_key: str) -> Response:
        if _readable(store.load_run(target, run_key), access) is None:
            if (whole := _readable(store.load_run(target, f"{run_key}/report"), access)) is not None:
                return _run_page(request, whole)  # the page of a key that itself ends in '/report'
            raise HTTPException(404, f"no run {run_key!r} in the results store")
        report = report_file(run_key, target)
        if report is None:
            raise HTTPException(
                404,
                f"run {run_key!r} has no HTML report on this server (the report task writes it into "
                f"{paths.runs_dir()}, which the api-server must share, or into the results database when one is "
                "configured)",
            )
        return FileResponse(report, media_type="text/html; charset=utf-8")

    @app.get("/runs/{run_key:path}", response_class=HTMLResponse)
    def run_page(request: Request, target: Target, access: Access, run_key: str) -> HTMLResponse:
        return _run_page(request, _load(target, run_key, access))

    @app.get("/dag-runs/{dag_id}/{run_id:path}", response_class=HTMLResponse)
    def dag_run_page(
        request: Request, target: Target, access: Access, dag_id: str, run_id: str
    ) -> HTMLResponse:
        stored = _readable(store.load_run(target, paths.dag_run_key(dag_id, run_id)), access)
        if stored is None and access.may_read_dag(dag_id):  # a matrix run: the comparison of its cells
            from deploybench.web import matrix_page

            found = matrix_page.load(target, paths.dag_run_key(dag_id, run_id))
            if found is not None:
                return HTMLResponse(matrix_page.render(found, _root(request), access))
        if stored is None:
            raise HTTPException(
                404,
                f"no deploybench results for DAG run {run_id!r} of {dag_id!r} (they appear when its store "
                f"task has run; other DAGs have none)",
            )
        return _run_page(request, stored)

    @app.get("/compare", response_class=HTMLResponse)
    def comparison_page(
        request: Request,
        target: Target,
        access: Access,
        run: Annotated[list[str], Query()] = [],  # noqa: B006 - FastAPI copies query defaults
        baseline: str | None = None,
        model: str | None = None,
        series: str | None = None,
        inventory: str | None = None,
        tag: Annotated[list[str], Query()] = [],  # noqa: B006
        since: str | None = None,
        until: str | None = None,
        include_excluded: bool = False,
        alpha: Annotated[float, Query(gt=0, lt=1)] = compare_page.DEFAULT_ALPHA,
    ) -> HTMLResponse:
        root = _root(request)
        keys = compare_page.picked(run)  # the form shown with an error keeps them, unless there are too many
        query = compare_page.CompareQuery(runs=keys if len(keys) <= compare_page.MAX_RUNS else (), alpha=alpha)
        try:
            query = compare_page.CompareQuery.parse(
                run, baseline, model, series, inventory, tag, since, until, include_excluded, alpha
            )
            view = compare_page.build(target, query, access)
        except HTTPException as exc:  # the form again, with the reason
            page_html = compare_page.render(None, query, root, error=str(exc.detail))
            return HTMLResponse(page_html, status_code=exc.status_code)
        return HTMLResponse(compare_page.render(view, query, root))

    @app.get("/series/{fingerprint}", response_class=HTMLResponse)
    def series_page(request: Request, target: Target, access: Access, fingerprint: str) -> HTMLResponse:
        view = history_page.build(target, fingerprint, access)
        return HTMLResponse(history_page.render(view, _root(request)))

    return app
