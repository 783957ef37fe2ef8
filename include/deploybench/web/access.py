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

The rule itself, with ``AllowAll`` and ``RunReaders`` (what every reader of one run may read: for its
static report, written once), is ``deploybench.store.access``, under the report that uses it too; this module
is Airflow's side of it (the user, the auth manager, the 401/403 of the pages).

Nothing here imports Airflow at import time (the plugin file is imported by every component).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException, Request
from fastapi.security import HTTPBearer

from deploybench.errors import DeploybenchError
from deploybench.store.access import (  # noqa: F401 - the rule, as the pages and their tests import it
    ALLOW_ALL,
    AllowAll,
    ReadAccess,
    RunReaders,
    may_read,
    may_read_row,
)

log = logging.getLogger(__name__)

STATE_KEY = "deploybench_access"
_bearer = HTTPBearer(auto_error=False)


class AccessUnavailable(DeploybenchError):
    """Airflow's authentication cannot be used here (not importable, or not initialised)."""


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
