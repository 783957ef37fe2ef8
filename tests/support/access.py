"""A stand-in for Airflow's auth manager in the results pages' tests (deploybench.store.access.ReadAccess)."""

from __future__ import annotations


class Access:
    """Reads the runs of the DAGs in ``dags``; of every DAG when ``all_dags``."""

    def __init__(self, dags: set[str], all_dags: bool = False, user_name: str = "tester") -> None:
        self.dags, self.all_dags, self.user_name = dags, all_dags, user_name

    def may_read_dag(self, dag_id: str) -> bool:
        return self.all_dags or dag_id in self.dags

    def may_read_all_dags(self) -> bool:
        return self.all_dags
