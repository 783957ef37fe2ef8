"""Config matrices through Airflow's real scheduler (issue 14): deploybench_matrix on a 2-node lab.

- A 2 x 2 matrix (max_num_seqs x load_rate) where one cell was measured before by a manual run:
  three cells run as deploybench_run DAG runs (one at a time, labelled), one is skipped naming the
  run that measured it, the two cells differing only in load rate share one rollout (the second
  adopts the first's engines: its preflight, fanout and rollout say "reused from run ...", the lease
  passes from one to the other, the engines are stopped and the lease freed at the end), and the
  stored comparison names the best cell and which cells shared a rollout.
- Triggering the same matrix again runs nothing: every cell is skipped.
- A matrix with an invalid value is refused by its plan, naming cell, parameter and value; no run starts.
- A cell whose engine crashes (sim_crash_after) fails alone: the other cell is measured and the
  matrix run fails naming the failed cell; clearing a cell re-runs its deploybench_run.
- A run planted under a cell's run id is refused by its validate, and the cell refuses to reset it (issue 30).

Against ``airflow standalone`` (conftest's ``airflow``: ``AIRFLOW = "own"``, one of its own on a throwaway
PostgreSQL database) with a lab of this module's own (``lm2``), driven through the REST API as a script or the
UI's Trigger / Clear buttons would.
"""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import quote

import pytest

from deploybench import paths
from tests.support import lab_names
from tests.support import matrix_runs as mx

pytestmark = [pytest.mark.browser, pytest.mark.integration]

LAB = lab_names.unique("lm2")  # conftest's lab_inventory brings it up for this module
# An Airflow of its own (on PostgreSQL, as the shared one; it was on SQLite): the shared one's unit is long already.
# Split in two modules on two Airflows, the parallel part took longer (770 s, was 650 s): it is bound by CPU, and
# a third Airflow costs more than the shorter unit saves.
AIRFLOW = "own"
TIMES: dict[str, float] = {}


GRID = {"max_num_seqs": [8, 16], "load_rate": [2, 4]}


def test_matrix_runs_the_gaps_skips_the_measured_cell_and_names_the_best(airflow, matrix_dag, lab_inventory,
                                                                          results_dsn):
    from deploybench.store import load_run

    base = mx.base(lab_inventory)
    t0 = time.monotonic()
    manual = mx.trigger(airflow, mx.RUN, {**base, "max_num_seqs": 16, "load_rate": 4})
    assert mx.wait_done(airflow, mx.RUN, manual) == "success"
    TIMES["one manual run"] = time.monotonic() - t0

    t0 = time.monotonic()
    mrun = mx.trigger(airflow, mx.MATRIX, {"base": base, "axes": GRID})
    state = mx.wait_done(airflow, mx.MATRIX, mrun)
    TIMES["2x2 matrix, 3 cells run"] = time.monotonic() - t0
    assert state == "success", mx.why(airflow, mrun)

    plan_log = mx.log(airflow, mx.MATRIX, mrun, "plan")
    assert "4 cells - 3 will run, 1 skipped (already measured)" in plan_log, plan_log[-3000:]
    assert "expected, at most" in plan_log
    assert "cells c01, c02 run on the rollout of c01" in plan_log, plan_log[-3000:]
    cells = mx.cells(airflow, mrun)
    labels = [c["rendered_map_index"] for c in cells]
    # the cells differing only in load rate are adjacent: one deployment each; the Grid says who reuses a rollout
    assert labels == ["max_num_seqs=8 load_rate=2", "max_num_seqs=8 load_rate=4 (on c01's rollout)",
                      "max_num_seqs=16 load_rate=2", "max_num_seqs=16 load_rate=4"], labels
    assert [c["state"] for c in cells] == ["success", "success", "success", "skipped"], cells
    # one cell at a time: each started after the previous one ended
    ran = cells[:3]
    for a, b in zip(ran, ran[1:]):
        assert a["end_date"] <= b["start_date"], (a, b)

    matrix_key = paths.dag_run_key(mx.MATRIX, mrun)
    out = mx.xcom(airflow, mrun, "compare")
    skipped = [c for c in out["cells"] if c["status"] == "skipped"]
    assert len(skipped) == 1 and skipped[0]["label"] == "max_num_seqs=16 load_rate=4"
    assert skipped[0]["run_key"] == paths.dag_run_key(mx.RUN, manual)
    assert f"already measured by run {paths.dag_run_key(mx.RUN, manual)}" in skipped[0]["reason"]
    assert out["failed"] == []
    assert len(out["best"]) == 1, out["best"]
    best = out["best"][0]
    assert best["run_key"] in {c["run_key"] for c in out["cells"]}
    assert Path(out["report"]).is_file() and best["label"] in Path(out["report"]).read_text()
    assert f"best configuration meeting the SLO: {best['cell_id']} {best['label']}" in mx.log(
        airflow, mx.MATRIX, mrun, "compare")

    stored = mx.comparison(results_dsn, matrix_key)
    assert set(stored["run_keys"]) == {c["run_key"] for c in out["cells"]}
    assert stored["params"]["matrix"]["deployments"] == {"d1": ["c01", "c02"], "d2": ["c03", "c04"]}

    # the two cells that differ only in load rate share one rollout (c03 alone: c04 was measured before)
    c01, c02, c03 = (c["run_key"] for c in out["cells"][:3])
    assert [c["rollout_run"] for c in out["cells"][:3]] == [c01, c01, c03]
    assert stored["params"]["matrix"]["shared_rollouts"] == {c01: ["c01", "c02"]}
    first, second = load_run(results_dsn, c01), load_run(results_dsn, c02)
    reused = {s.stage: s.summary for s in second.stages if s.stage in ("preflight", "fanout", "rollout")}
    assert all(v["summary"].startswith(f"reused from run {c01} (age ") for v in reused.values()), reused
    assert reused["rollout"]["result"]["endpoints"] == next(
        s.summary for s in first.stages if s.stage == "rollout")["result"]["endpoints"]
    teardown = {s.stage: s.summary for s in first.stages}["teardown"]
    assert teardown["summary"].startswith(f"engines of run {c01} left running"), teardown
    assert second.run.config["deployment"]["adopt"] == c01 and second.run.status == "success"
    assert "reused from run" in mx.log(airflow, mx.RUN, c02.removeprefix(mx.RUN + "__"), "rollout.canary_then_scale")
    # c02 stopped them; the lease went c01 -> c02 and is free now, with nothing left for anyone to clean
    from deploybench.lease import LeaseStore

    assert not any(mx.up(e["url"]) for e in reused["rollout"]["result"]["endpoints"])
    from deploybench.run import Run

    lease = LeaseStore(results_dsn).status(Run.open(c01).inventory.name)
    assert lease.free and lease.pending_cleanup == [], lease
    handed = [e["detail"].get("handed_over_to") for e in LeaseStore(results_dsn).events(run_key=c01)]
    assert c02 in handed, handed
    assert mx.state(airflow, mrun, "cleanup") == "success"
    assert stored["result"]["best"] and best["run_key"] in stored["result"]["best"].values()

    # a cell is a deploybench_run like a manual one: same stages stored, the cell's conf, the matrix tags
    cell_run = load_run(results_dsn, out["cells"][2]["run_key"])
    manual_run = load_run(results_dsn, paths.dag_run_key(mx.RUN, manual))
    assert cell_run.run.dag_id == mx.RUN and cell_run.run.status == "success"
    assert [s.stage for s in cell_run.stages] == [s.stage for s in manual_run.stages]
    assert cell_run.run.tags == {"matrix": matrix_key, "matrix_cell": "max_num_seqs=16 load_rate=2",
                                 "matrix_deployment": "d2"}
    assert cell_run.run.config["engine"]["max_num_seqs"] == 16 and cell_run.run.config["load"]["rate"] == 2
    assert {k: v for k, v in cell_run.run.config.items() if k not in ("load", "tags")} == \
        {k: v for k, v in manual_run.run.config.items() if k not in ("load", "tags")}

    # the matrix run's "Benchmark results" tab shows the cells and links the comparison
    page = mx.page(airflow, f"/deploybench/dag-runs/{mx.MATRIX}/{quote(mrun, safe='')}")
    assert "Matrix" in page and "max_num_seqs=8 load_rate=2" in page and "/deploybench/compare?" in page

    # re-triggering the same matrix runs nothing
    before = mx.run_ids(airflow)
    t0 = time.monotonic()
    again = mx.trigger(airflow, mx.MATRIX, {"base": base, "axes": GRID})
    assert mx.wait_done(airflow, mx.MATRIX, again) == "success"
    TIMES["same matrix again, nothing runs"] = time.monotonic() - t0
    assert [c["state"] for c in mx.cells(airflow, again)] == ["skipped"] * 4
    assert mx.run_ids(airflow) == before
    assert "4 cells - 0 will run, 4 skipped" in mx.log(airflow, mx.MATRIX, again, "plan")


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
    print("\nmatrix test wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in TIMES.items()))
