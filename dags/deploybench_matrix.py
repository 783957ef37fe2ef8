"""deploybench_matrix: sweep a grid of configurations, skip what is already measured, name the best.

plan -> share -> cell (one deploybench_run per cell, one at a time, labelled e.g. ``max_num_seqs=64
load_rate=4``) -> cleanup -> compare -> finish. The plan validates every cell before anything runs and
logs how many run, how many are skipped (and why) and the expected wall time. Each cell is a full
deploybench_run (every stage in its own Grid, under the cluster's lease); a failed cell does not stop
the others and ``finish`` names it. Cells that differ only in load or SLO parameters run on one
rollout: the next cell adopts the engines, preflight and fan-out of the previous one while they are
at most ``reuse_s`` old (default 900 s; its Grid label ends "(on c01's rollout)", its preflight,
fanout and rollout tasks log "reused from run ... (age N s)"), and the lease passes from cell to
cell; ``cleanup`` (a teardown: it always runs) stops engines that a cell kept for a next one that
never took them over. ``compare`` stores the comparison and writes its report; the matrix run's
"Benchmark results" tab shows the cells and links the comparison.

``deploybench_matrix_daily`` is the same matrix on a schedule (paused when created), so that
``airflow backfill create --dag-id deploybench_matrix_daily --from-date ... --to-date ...
--dag-run-conf '{...}'`` fills a matrix's gaps date by date with the same skip rule.
Tasks are declared by ``deploybench.airflow.matrix``; the logic is ``deploybench.matrix``.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import dag

from deploybench.airflow.matrix import matrix_params, matrix_tasks


def matrix_dag(dag_id: str, schedule: str | None):
    @dag(
        dag_id=dag_id,
        schedule=schedule,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        max_active_runs=1,  # a matrix plans against what earlier matrices stored: one after the other
        params=matrix_params(),
        tags=["deploybench", "matrix"],
        doc_md=__doc__,
    )
    def matrix():
        matrix_tasks()

    return matrix()


deploybench_matrix = matrix_dag("deploybench_matrix", None)
deploybench_matrix_daily = matrix_dag("deploybench_matrix_daily", "@daily")
