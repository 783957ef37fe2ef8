"""deploybench_regression__<benchmark>: a reference benchmark on a schedule, judged against its history.

One DAG per benchmark file in include/benchmarks/ (``<name>.benchmark.json``; another folder with
$DEPLOYBENCH_BENCHMARKS_DIR). Its schedule and start date are the file's ``schedule`` and
``start_date``: change them there, not here. Each run:

    plan (the benchmark's parameters + the software of the logical date, from the versions file)
      -> the same stages as deploybench_run (validate, lease, preflight, fanout, rollout, load,
         teardown, lease release, store, report, finish)
      -> results (the Asset ``deploybench://results/<benchmark>``, for DAGs scheduled on fresh results)
      -> judge (the run against the benchmark's earlier runs, by logical date): a regression fails
         the run and notifies the file's channels; ``fail_on_suspect`` does the same for a suspect

Backfill (UI: Backfill on the DAG's page; CLI: ``airflow backfill create --dag-id
deploybench_regression__<benchmark> --from-date 2026-03-01 --to-date 2026-03-08 --max-active-runs 1``)
runs each date with the software of that date, oldest first; its runs queue for the cluster's
lease like any other. Unpausing the DAG also starts today's scheduled run (catchup is off) unless
the file's ``end_date`` has passed.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import Asset, dag, task

from deploybench import regression
from deploybench.airflow.stages import run_stages


def results_asset(name: str) -> Asset:
    return Asset(name=f"deploybench_results__{name}", uri=f"deploybench://results/{name}", group="deploybench")


def _utc(day):
    return pendulum.datetime(day.year, day.month, day.day, tz="UTC") if day else None


def regression_dag(info: dict):
    name = info["name"]

    @dag(
        dag_id=info["dag_id"],
        schedule=info["schedule"],
        start_date=_utc(info["start_date"]),
        end_date=_utc(info["end_date"]),
        catchup=False,
        max_active_runs=1,  # a series is judged in date order; backfills: --max-active-runs 1
        tags=["deploybench", "regression"],
        doc_md=(info["description"] + "\n\n" if info["description"] else "") + __doc__,
    )
    def benchmark_dag():
        @task
        def plan(logical_date=None) -> dict:
            """The flat parameters of this date's run (the software current on the logical date)."""
            return regression.params_for(regression.by_name(name), logical_date)

        @task(outlets=[results_asset(name)])
        def results() -> dict:
            """Announces the stored run as an asset event (skipped when nothing was stored)."""
            from deploybench.airflow.regression_tasks import publish

            return publish(name, results_asset(name))

        @task(retries=0)
        def judge() -> dict:
            """The verdict; a regression fails the run and notifies (no retries: one message per run).
            A leaf, so its failure is the run's."""
            from deploybench.airflow.regression_tasks import judge

            return judge(name)

        stages = run_stages(conf=plan())
        stages["report"] >> results() >> judge()

    return benchmark_dag()


for _info in regression.schedules():
    globals()[_info["dag_id"]] = regression_dag(_info)
