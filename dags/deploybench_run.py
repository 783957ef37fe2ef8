"""deploybench_run: one deploy-and-benchmark run of an inference service on a cluster.

validate -> lease -> preflight -> fanout -> rollout (canary, then scale steps) -> load (probe,
sustained, overload) -> teardown -> lease release -> store -> report -> finish.

The tasks are declared by ``deploybench.airflow.stages.run_stages`` (the scheduled regression
benchmark declares the same ones); the trigger form's fields come from ``deploybench.params``: the
everyday ones (inventory, nodes, model, engine, preset, phases, rate, durations, SLO) open, the rest in
closed sections. A preset (``include/presets/``, or the operator's ``$DEPLOYBENCH_PRESETS``) fills in
the fields left at their defaults; the validate task's log and run.json say what it set.
Runs on one cluster never overlap: each holds the cluster's lease (a row in the results
database) from before preflight to after teardown, and a run that finds the cluster busy waits
for it deferred, or fails naming the holder (``lease_on_busy``). Runs on different clusters go
at once, up to ``max_active_runs``.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import dag

from deploybench.airflow.stages import run_params, run_stages


@dag(
    dag_id="deploybench_run",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    # the lease keeps runs on one cluster apart; this only bounds how many clusters one Airflow drives at once
    max_active_runs=8,
    params=run_params(),
    tags=["deploybench"],
    doc_md=__doc__,
)
def deploybench_run():
    run_stages()


deploybench_run()
