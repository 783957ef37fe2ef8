"""The regression DAG's own tasks (dags/deploybench_regression.py): publish the stored run, judge it.

Thin: the benchmark, the verdict and the message come from ``deploybench.regression``; this turns
them into Airflow's terms (an asset event, a failed task, notifiers called with the context).
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.sdk import get_current_context
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from deploybench import regression
from deploybench.airflow.stages import run_folder, run_key

log = logging.getLogger(__name__)


def _dsn() -> str | None:
    from deploybench.airflow.connections import results_dsn

    return results_dsn()


def _base_url() -> str:
    from airflow.configuration import conf

    return conf.get("api", "base_url", fallback="") or ""


def publish(name: str, asset: Any) -> dict[str, Any]:
    """The asset event of a stored run: its key, status, logical date, software and report link."""
    from deploybench.run import Run, run_status

    ctx = get_current_context()
    key = run_key(ctx)
    with run_folder(key):
        run = Run.open_if_validated(key)
    stored = run.stage("store") if run else None
    if run is None or stored is None or stored.status != "success":
        raise AirflowSkipException(f"run {key} was not stored (store: {stored.status if stored else 'did not run'}); "
                                   f"no results to announce")
    extra = {"benchmark": name, "run_key": key, "status": run_status(run.stages()),
             "logical_date": run.meta.get("logical_date"), "software": run.cfg.tags.get(regression.TAG_SOFTWARE),
             "report_url": regression.report_url(_base_url(), key)}
    ctx["outlet_events"][asset].extra = extra
    return extra


def judge(name: str) -> dict[str, Any]:
    """Judge the run; on a failing verdict send the benchmark's notifications, then fail the task."""
    from deploybench.airflow import notify

    ctx = get_current_context()
    bench = regression.by_name(name)
    key = run_key(ctx)
    try:
        with run_folder(key):  # the run's records in, its verdict file out
            verdict = regression.judge_run(bench, key, _dsn(), _base_url())
    except regression.RegressionFound as found:
        sent = notify.send(bench.notify, found.subject, found.text, ctx)
        log.error("%s\n%s\n(%d of %d notifications sent)", found.subject, found.text, sent, len(bench.notify))
        raise AirflowFailException(f"{found.verdict['verdict']}: {found.subject}") from None
    print(regression.describe(verdict))  # the task log's one line
    return {k: verdict.get(k) for k in ("verdict", "run_key", "software", "report_url")}
