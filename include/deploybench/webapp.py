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

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from deploybench import paths, store
from deploybench.errors import DeploybenchError
from deploybench.store.errors import StoreError
from deploybench.store.records import RunStatus  # pydantic only: no database, no SQLAlchemy
from deploybench.webapp_html import (
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
        from deploybench.airflow_glue import results_dsn

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
        stored = store.load_run(target, paths.dag_run_key(dag_id, run_id))
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
