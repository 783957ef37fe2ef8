"""Config matrices that fail, through Airflow's real scheduler (issue 14 and issue 30's hole 4), on a 2-node lab:

- A matrix with an invalid value is refused by its plan, naming cell, parameter and value; no run starts.
- A cell whose engine crashes (sim_crash_after) fails alone: the other cell is measured and the
  matrix run fails naming the failed cell; clearing a cell re-runs its deploybench_run.
- A run planted under a cell's run id is refused by its validate, and the cell refuses to reset it.

Beside tests/browser/test_matrix.py (the matrix that succeeds), each on an Airflow of its own (``AIRFLOW = "own"``)
and a lab of its own (``lm3``), so that the two run at once in `make test`'s parallel part.
"""

from __future__ import annotations

import time

import pytest

from tests.support import lab_names
from tests.support import matrix_runs as mx

pytestmark = [pytest.mark.browser, pytest.mark.integration]

LAB = lab_names.unique("lm3")  # conftest's lab_inventory brings it up for this module
AIRFLOW = "own"
TIMES: dict[str, float] = {}


def test_invalid_cell_is_refused_before_any_run_starts(airflow, matrix_dag, lab_inventory):
    before = mx.run_ids(airflow)
    mrun = mx.trigger(airflow, mx.MATRIX, {"base": mx.base(lab_inventory), "axes": {"max_num_seqs": [8, 0],
                                                                              "load_rate": [2]}})
    assert mx.wait_done(airflow, mx.MATRIX, mrun) == "failed"
    assert mx.state(airflow, mrun, "plan") == "failed"
    log = mx.log(airflow, mx.MATRIX, mrun, "plan")
    assert "cell 2 (max_num_seqs=0 load_rate=2): max_num_seqs=0 is refused" in log, log[-3000:]
    assert "nothing was started" in log
    assert mx.run_ids(airflow) == before
    assert "the plan refused it" in mx.log(airflow, mx.MATRIX, mrun, "finish")


def test_failing_cell_is_isolated_named_and_clearing_a_cell_reruns_it(airflow, matrix_dag, lab_inventory):
    base = mx.base(lab_inventory)
    t0 = time.monotonic()
    mrun = mx.trigger(airflow, mx.MATRIX, {"base": {**base, "max_num_seqs": 8, "load_rate": 3},
                                      "treatments": [{"sim_crash_after": 2}, {"sim_crash_after": 0}]})
    assert mx.wait_done(airflow, mx.MATRIX, mrun) == "failed"
    TIMES["2 cells, one crashing"] = time.monotonic() - t0
    cells = mx.cells(airflow, mrun)
    assert [(c["rendered_map_index"], c["state"]) for c in cells] == [
        ("sim_crash_after=2", "failed"), ("sim_crash_after=0", "success")], cells
    out = mx.xcom(airflow, mrun, "compare")
    assert [c["status"] for c in out["cells"]] == ["failed", "success"]
    assert [f["label"] for f in out["failed"]] == ["sim_crash_after=2"]
    finish = mx.log(airflow, mx.MATRIX, mrun, "finish")
    assert "1 of 2 cells failed: c01 (sim_crash_after=2): failed" in finish, finish[-3000:]
    assert mx.state(airflow, mrun, "compare") == "success"

    # clearing the good cell re-triggers the same deploybench_run run id (reset) and measures it again
    run_id = out["cells"][1]["run_key"].removeprefix(mx.RUN + "__")
    first = mx.run(airflow, mx.RUN, run_id)
    body = {"dry_run": False, "task_ids": [["cell", 1]], "dag_run_id": mrun, "include_upstream": False,
            "include_downstream": True, "only_failed": False, "reset_dag_runs": True}
    airflow.request("POST", f"/api/v2/dags/{mx.MATRIX}/clearTaskInstances", body)
    assert mx.wait_done(airflow, mx.MATRIX, mrun) == "failed"  # the crashing cell still failed
    again = mx.run(airflow, mx.RUN, run_id)
    assert again["state"] == "success" and again["start_date"] > first["end_date"], (first, again)


def test_a_run_planted_under_a_cells_run_id_is_refused_not_reset(airflow, matrix_dag, lab_inventory):
    """Issue 30, hole 4, through the real scheduler: someone who may trigger runs creates a deploybench_run under
    the run id a matrix's cell will have (``matrix__<matrix run id>__c01``, predictable for a scheduled matrix)
    with a configuration of their own, before the matrix runs. Its validate refuses it (no such plan), and the
    matrix's cell refuses to reset it (Airflow's reset keeps a run's conf): it is never measured as the cell."""
    import secrets

    base = mx.base(lab_inventory)
    mrun = f"mx-planted-{secrets.token_hex(3)}"
    planted = f"matrix__{mrun}__c01"
    got = airflow.request("POST", f"/api/v2/dags/{mx.RUN}/dagRuns",
                          {"dag_run_id": planted, "logical_date": None,
                           "conf": {**base, "load_rate": 9, "sim_slowdown": 4}})
    assert got["dag_run_id"] == planted
    assert mx.wait_done(airflow, mx.RUN, planted) == "failed"
    assert "no plan" in mx.log(airflow, mx.RUN, planted, "validate")
    before = mx.run(airflow, mx.RUN, planted)

    t0 = time.monotonic()
    airflow.request("POST", f"/api/v2/dags/{mx.MATRIX}/dagRuns",
                    {"dag_run_id": mrun, "logical_date": None,
                     "conf": {"base": {**base, "max_num_seqs": 8}, "treatments": [{"load_rate": 2}],
                              "on_measured": "rerun"}})  # measured by the first test: a cell to run, not skip
    assert mx.wait_done(airflow, mx.MATRIX, mrun) == "failed"
    TIMES["a planted cell refused"] = time.monotonic() - t0
    assert [c["state"] for c in mx.cells(airflow, mrun)] == ["failed"]
    log = mx.log(airflow, mx.MATRIX, mrun, "cell", map_index=0)
    assert "refused, not reset" in log and "sim_slowdown=4.0 (planned 1.0)" in log, log[-3000:]
    after = mx.run(airflow, mx.RUN, planted)
    assert (after["state"], after["start_date"], after["end_date"]) == \
        (before["state"], before["start_date"], before["end_date"]), "the planted run was reset"
    out = mx.xcom(airflow, mrun, "compare")
    assert [c["status"] for c in out["cells"]] == ["not stored"]


def test_report_wall_times():
    print("\nmatrix failure test wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in TIMES.items()))
