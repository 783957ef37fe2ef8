"""The matrix DAGs: parse cleanly and light, declare plan -> share -> mapped cells -> cleanup -> compare -> finish."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

DAGS = Path(__file__).resolve().parents[2] / "dags"


@pytest.fixture(scope="module")
def bag():
    from airflow.dag_processing.dagbag import DagBag

    b = DagBag(dag_folder=str(DAGS))
    assert b.import_errors == {}
    return b


@pytest.mark.parametrize("dag_id,schedule", [("deploybench_matrix", None), ("deploybench_matrix_daily", "@daily")])
def test_matrix_dag_declares_plan_cells_compare_finish(bag, dag_id, schedule):
    dag = bag.dags[dag_id]
    assert dag.max_active_runs == 1
    assert dag.schedule == schedule
    assert set(dag.task_ids) == {"plan", "share", "cell", "cleanup", "compare", "finish"}
    # cleanup (stops engines kept for a cell that never took them) is the teardown of the cells' setup:
    # it runs however the cells ended, and when a person marks the matrix run failed
    share, cleanup = dag.get_task("share"), dag.get_task("cleanup")
    assert share.is_setup and cleanup.is_teardown and "share" in cleanup.upstream_task_ids
    assert "cell" in cleanup.upstream_task_ids and "cleanup" in dag.get_task("compare").upstream_task_ids
    cell = dag.get_task("cell")
    assert cell.partial_kwargs["max_active_tis_per_dagrun"] == 1
    assert cell.partial_kwargs["trigger_dag_id"] == "deploybench_run"
    assert cell.partial_kwargs["wait_for_completion"] and cell.partial_kwargs["reset_dag_run"]
    assert cell.partial_kwargs["deferrable"]
    assert cell.map_index_template == "{{ task.cell_label }}"
    assert "share" in cell.upstream_task_ids and "cell" in dag.get_task("compare").upstream_task_ids
    for tid in ("compare", "finish"):
        assert dag.get_task(tid).trigger_rule == "all_done", tid
    assert [t.task_id for t in dag.leaves] == ["finish"]
    assert set(dag.params.keys()) == {"base", "axes", "treatments", "constraints", "repeats", "on_measured",
                                      "reuse_s"}


def test_matrix_params_refuse_bad_values(bag):
    from airflow.sdk.definitions.param import ParamsDict

    params = bag.dags["deploybench_matrix"].params
    ok = ParamsDict({k: params.get_param(k) for k in params})
    ok.validate()
    from airflow.sdk.exceptions import ParamValidationError

    for name, value in (("repeats", 0), ("on_measured", "sometimes"), ("axes", {"load_rate": []}),
                        ("reuse_s", -1), ("reuse_s", 86401)):
        with pytest.raises(ParamValidationError, match=name):
            ok[name] = value


def test_skipped_cell_skips_with_its_reason():
    from airflow.sdk.exceptions import AirflowSkipException

    from deploybench.airflow.matrix import MatrixCellOperator

    op = MatrixCellOperator(task_id="c", trigger_dag_id="deploybench_run", cell_label="load_rate=2",
                            skip_reason="already measured by run k")
    assert {"cell_label", "skip_reason", "conf", "trigger_run_id"} <= set(op.template_fields)
    with pytest.raises(AirflowSkipException, match="cell load_rate=2: already measured by run k"):
        op.execute({})


def test_matrix_dag_file_does_not_import_heavy_modules():
    code = (
        f"import sys, runpy; runpy.run_path({str(DAGS / 'deploybench_matrix.py')!r}); "
        "bad=[m for m in ('pandas','paramiko','psycopg','deploybench.pipeline',"
        "'deploybench.matrix.store','deploybench.matrix.result') if m in sys.modules]; "
        "print('HEAVY=' + ','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                         timeout=120)
    assert out.returncode == 0, out.stderr[-1500:]
    assert [ln for ln in out.stdout.splitlines() if ln.startswith("HEAVY=")] == ["HEAVY="], out.stdout[-1500:]
