"""Who may read which stored run: the rule the results pages apply for each user (deploybench.web.access asks
Airflow's auth manager) and the run report applies for all readers of a run at once (``RunReaders``).

**The rule** (``may_read``): a run stored by an Airflow DAG run (it has an ``airflow_run_id``) may be read by
a user who may read that DAG's runs; a run without an Airflow run (``deploybench run`` from the CLI, test
series; its ``dag_id`` is a label such as "cli", not a DAG) only by a user who may read the runs of *every*
DAG. What is written once and shown to every reader of one run (its static HTML report) may only show what
*all* of them may read: ``RunReaders`` is that reader.
"""

from __future__ import annotations

from typing import Any, Protocol


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
