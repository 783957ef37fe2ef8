"""Who may read which run on the results pages: Airflow's user, and Airflow's per-DAG read permission.

Airflow does not put its auth in front of a plugin's FastAPI app, so the app does it itself:
``require_airflow_user`` (a FastAPI dependency) finds the Airflow user of the request (the JWT
in the ``Authorization: Bearer`` header or the UI's ``_token`` cookie, through Airflow's own
``get_user``), refuses anyone who may not see the Airflow website (401/403), and leaves an
``AirflowReadAccess`` on the request for the routes.

**The rule** (``ReadAccess.may_read``): a run stored by an Airflow DAG run (it has an
``airflow_run_id``) is shown to a user the auth manager allows to read that DAG's runs:
``is_authorized_dag(method="GET", access_entity=DagAccessEntity.RUN, details=DagDetails(id=dag_id))``.
A run without an Airflow run (``deploybench run`` from the CLI, test series; its ``dag_id`` is a
label such as "cli", not a DAG) belongs to no DAG a permission could name: it is shown only to a
user who may read the runs of *every* DAG (the same call with no ``details``, which is how auth
managers ask about all DAGs; Admin and Viewer roles have it, a role limited to some DAGs does not).
Lists leave out the runs a user may not read; a page of one answers 403.

What is written once and shown to every reader of one run (its static HTML report) may only show
what *all* of them may read: ``RunReaders`` is that reader, for the report's history.

Nothing here imports Airflow at import time (the plugin file is imported by every component).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import HTTPException, Request
from fastapi.security import HTTPBearer

from deploybench.errors import DeploybenchError

log = logging.getLogger(__name__)

STATE_KEY = "deploybench_access"
_bearer = HTTPBearer(auto_error=False)


class AccessUnavailable(DeploybenchError):
    """Airflow's authentication cannot be used here (not importable, or not initialised)."""


class ReadAccess(Protocol):
    """What the routes ask: may this request's user read the runs of ``dag_id``?"""

    user_name: str

    def may_read_dag(self, dag_id: str) -> bool: ...

    def may_read_all_dags(self) -> bool: ...


def may_read(access: ReadAccess, dag_id: str, airflow_run_id: str | None) -> bool:
    """The rule of the module doc: a DAG run's results need its DAG; a run without one needs every DAG."""
    if airflow_run_id:
        return access.may_read_dag(dag_id)
    return access.may_read_all_dags()


def _airflow_run_id(row: Any) -> str | None:
    """The Airflow run id of a row of ``store.query.select_runs`` (a missing one may be NaN there)."""
    run_id = row["airflow_run_id"]
    return run_id if isinstance(run_id, str) and run_id else None


def may_read_row(access: ReadAccess, row: Any) -> bool:
    """``may_read`` for a row of ``store.query.select_runs``."""
    return may_read(access, str(row["dag_id"]), _airflow_run_id(row))


class AllowAll:
    """Every run is readable: an app created without ``auth`` (tests, a local CLI server)."""

    user_name = "anonymous"

    def may_read_dag(self, dag_id: str) -> bool:
        return True

    def may_read_all_dags(self) -> bool:
        return True


ALLOW_ALL = AllowAll()


class RunReaders:
    """What every user who may read one run may read, whoever they are: for a page written before anyone
    asks (the run's static report, served to each of them). By the rule, a run of an Airflow DAG is read
    by users who may read that DAG's runs, and may have no other permission: they share the runs of that
    DAG only. A run without an Airflow run is read only by users who may read every DAG: they share all."""

    def __init__(self, dag_id: str, airflow_run_id: str | None) -> None:
        self._dag_id = dag_id
        self._all = not airflow_run_id
        self.user_name = f"every reader of a run of {dag_id!r}"

    @classmethod
    def of_row(cls, row: Any) -> RunReaders:
        """The readers of the run of a row of ``store.query.select_runs``."""
        return cls(str(row["dag_id"]), _airflow_run_id(row))

    def may_read_dag(self, dag_id: str) -> bool:
        return self._all or dag_id == self._dag_id

    def may_read_all_dags(self) -> bool:
        return self._all


def _no_team(dag_id: str) -> str | None:
    return None


class AirflowReadAccess:
    """Airflow's auth manager asked once per DAG and request (answers are cached on the object).

    ``team_of`` names the team owning a DAG (multi-team Airflow), as Airflow's own API passes it in
    ``DagDetails``; the plugin gives ``DagModel.get_team_name``."""

    def __init__(self, auth_manager: Any, user: Any, team_of: Callable[[str], str | None] = _no_team) -> None:
        self._manager = auth_manager
        self._user = user
        self._team_of = team_of
        self._cache: dict[str | None, bool] = {}
        self.user_name = str(user.get_name())

    def _details(self, dag_id: str) -> Any:
        from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails

        try:
            team = self._team_of(dag_id)
        except Exception as exc:  # a metadata-database error: refuse, and say why
            raise AccessUnavailable(
                f"looking up the team of DAG {dag_id!r} in Airflow's metadata database failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return DagDetails(id=dag_id, team_name=team)

    def _ask(self, dag_id: str | None) -> bool:
        if dag_id not in self._cache:
            from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity

            self._cache[dag_id] = bool(
                self._manager.is_authorized_dag(
                    method="GET",
                    access_entity=DagAccessEntity.RUN,
                    details=None if dag_id is None else self._details(dag_id),
                    user=self._user,
                )
            )
            if not self._cache[dag_id]:
                log.info(
                    "results pages: user %r may not read runs of DAG %s", self.user_name, dag_id or "(all)"
                )
        return self._cache[dag_id]

    def may_read_dag(self, dag_id: str) -> bool:
        return self._ask(dag_id)

    def may_read_all_dags(self) -> bool:
        return self._ask(None)


def access_of(request: Request) -> ReadAccess:
    """The ReadAccess the auth dependency left on the request; ALLOW_ALL only for an app without auth."""
    access = getattr(request.state, STATE_KEY, None)
    if access is not None:
        return access
    if request.app.state.auth_required:
        # an auth dependency that did not say who the user is: refuse rather than show everything
        raise HTTPException(403, "no Airflow user on this request; the results pages refuse to guess")
    return ALLOW_ALL


def forbid(access: ReadAccess, what: str) -> HTTPException:
    """The 403 of a run (or series) the user may not read; says what to ask for."""
    return HTTPException(
        403,
        f"Airflow user {access.user_name!r} may not read {what}: reading results needs read access to the "
        f"runs of the DAG that produced them (runs started outside Airflow need access to all DAGs); ask an "
        f"Airflow admin for it",
    )


async def require_airflow_user(request: Request) -> None:
    """A FastAPI dependency: the request must carry an Airflow user (JWT in the Authorization header or
    the UI's ``_token`` cookie) who may see the Airflow website; else 401/403. It leaves the user's
    per-DAG ``AirflowReadAccess`` on the request. Only meaningful inside the api-server, where Airflow's
    auth manager is initialised; Airflow is imported on first use."""
    try:
        from airflow.api_fastapi.app import get_auth_manager
        from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
        from airflow.api_fastapi.core_api.security import get_user
        from airflow.models.dag import DagModel
    except ImportError as exc:
        raise AccessUnavailable(
            f"Airflow's authentication cannot be imported here ({exc}); refusing access"
        ) from exc
    user = await get_user(request, _oauth_token=None, bearer_credentials=await _bearer(request))
    manager = get_auth_manager()
    if not manager.is_authorized_view(access_view=AccessView.WEBSITE, user=user):
        raise HTTPException(403, f"Airflow user {user.get_name()!r} may not view Airflow's pages")
    setattr(request.state, STATE_KEY, AirflowReadAccess(manager, user, DagModel.get_team_name))
