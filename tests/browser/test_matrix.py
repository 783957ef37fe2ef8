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

Against ``airflow standalone`` (conftest's ``airflow``) with a lab of this module's own (``lm2``),
driven through the REST API as a script or the UI's Trigger / Clear buttons would.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from urllib.parse import quote

import pytest

from deploybench import paths
from tests.support import lab_names

pytestmark = [pytest.mark.browser, pytest.mark.integration]

MATRIX = "deploybench_matrix"
RUN = "deploybench_run"
LAB = lab_names.unique("lm2")  # conftest's lab_inventory brings it up for this module
# An Airflow of its own on SQLite, not the session's on PostgreSQL. There a run's conf is stored as JSONB,
# which orders an object's keys by length then name; the plan used to take the axes' order from the conf
# (fixed: the form's order, tests/unit/matrix/test_matrix.py). Back to the shared Airflow once it has run green there.
AIRFLOW_METADATA = "sqlite"
TIMEOUT_S = 1500
TIMES: dict[str, float] = {}


@pytest.fixture(scope="module")
def matrix_dag(airflow) -> str:
    def unpaused() -> bool:
        try:
            return airflow.request("PATCH", f"/api/v2/dags/{MATRIX}", {"is_paused": False})["is_paused"] is False
        except Exception as exc:  # noqa: BLE001 - 404 until the dag-processor has parsed it
            if "404" in str(exc):
                return False
            raise
    airflow.wait_for(f"{MATRIX} parsed and unpaused", unpaused, 240, every_s=2)
    return MATRIX


def _base(inventory: Path) -> dict:
    return {"inventory": str(inventory), "nodes": 2, "canary_nodes": 1, "iperf_seconds": 1, "link_threshold": 0.5,
            "gate_duration_s": 3, "load_duration_s": 5, "warmup_s": 1, "output_tokens": 16, "prompt_tokens": 64}


def _trigger(airflow, dag_id: str, conf: dict) -> str:
    return airflow.request("POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf})["dag_run_id"]


def _run(airflow, dag_id: str, run_id: str) -> dict:
    return airflow.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}")


def _wait_done(airflow, dag_id: str, run_id: str) -> str:
    return airflow.wait_for(f"{dag_id} run {run_id} to finish",
                            lambda: (s := _run(airflow, dag_id, run_id)["state"]) in ("success", "failed") and s,
                            TIMEOUT_S, every_s=3)


def _tis(airflow, dag_id: str, run_id: str) -> list[dict]:
    return airflow.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances"
                                  "?limit=100")["task_instances"]


def _cells(airflow, run_id: str) -> list[dict]:
    return sorted((t for t in _tis(airflow, MATRIX, run_id) if t["task_id"] == "cell"), key=lambda t: t["map_index"])


def _state(airflow, run_id: str, task_id: str) -> str:
    return next(t["state"] for t in _tis(airflow, MATRIX, run_id) if t["task_id"] == task_id)


def _xcom(airflow, run_id: str, task_id: str, key: str = "return_value"):
    return airflow.request("GET", f"/api/v2/dags/{MATRIX}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}"
                                  f"/xcomEntries/{key}?deserialize=true")["value"]


def _log(airflow, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
    got = airflow.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}"
                                 f"/logs/1?map_index={map_index}")
    content = got.get("content")  # structured entries: the exception's text is in their error_detail
    return "\n".join(json.dumps(e) if isinstance(e, dict) else str(e) for e in content) \
        if isinstance(content, list) else str(content)


def _why(airflow, matrix_run: str) -> str:
    """Why a matrix run failed: its finish task's error and, for each cell run that failed, the error of each
    task that failed in it (the Grid's red squares), so a failure in CI says which stage of which cell."""
    out = [_errors(_log(airflow, MATRIX, matrix_run, "finish"))]
    for r in airflow.request("GET", f"/api/v2/dags/{RUN}/dagRuns?limit=200")["dag_runs"]:
        if r["state"] != "failed" or matrix_run not in r["dag_run_id"]:
            continue
        for t in _tis(airflow, RUN, r["dag_run_id"]):
            if t["state"] in ("failed", "upstream_failed") and t["task_id"] != "finish":
                out.append(f"{r['dag_run_id']} {t['task_id']} {t['state']}: "
                           + _errors(_log(airflow, RUN, r["dag_run_id"], t["task_id"])))
    return "\n".join(out)


def _errors(log: str) -> str:
    """The error lines of a task log (level error, or an exception's text), else its last 2000 characters."""
    lines = [ln for ln in log.splitlines() if '"level": "error"' in ln or "exc_value" in ln]
    return "\n".join(ln[:3000] for ln in lines) or log[-2000:]


def _run_ids(airflow) -> set[str]:
    return {r["dag_run_id"] for r in airflow.request("GET", f"/api/v2/dags/{RUN}/dagRuns?limit=200")["dag_runs"]}


def _comparison(dsn: str, matrix_key: str) -> dict:
    from sqlalchemy import select

    from deploybench.store.db import open_store
    from deploybench.store.models import Comparison

    with open_store(dsn).connect() as conn:
        rows = conn.execute(select(Comparison.params, Comparison.result, Comparison.run_keys)
                            .order_by(Comparison.id.desc())).all()
    return next({"params": p, "result": r, "run_keys": k} for p, r, k in rows
                if (p.get("matrix") or {}).get("key") == matrix_key)


GRID = {"max_num_seqs": [8, 16], "load_rate": [2, 4]}


def test_matrix_runs_the_gaps_skips_the_measured_cell_and_names_the_best(airflow, matrix_dag, lab_inventory,
                                                                          results_dsn):
    from deploybench.store import load_run

    base = _base(lab_inventory)
    t0 = time.monotonic()
    manual = _trigger(airflow, RUN, {**base, "max_num_seqs": 16, "load_rate": 4})
    assert _wait_done(airflow, RUN, manual) == "success"
    TIMES["one manual run"] = time.monotonic() - t0

    t0 = time.monotonic()
    mrun = _trigger(airflow, MATRIX, {"base": base, "axes": GRID})
    state = _wait_done(airflow, MATRIX, mrun)
    TIMES["2x2 matrix, 3 cells run"] = time.monotonic() - t0
    assert state == "success", _why(airflow, mrun)

    plan_log = _log(airflow, MATRIX, mrun, "plan")
    assert "4 cells - 3 will run, 1 skipped (already measured)" in plan_log, plan_log[-3000:]
    assert "expected, at most" in plan_log
    assert "cells c01, c02 run on the rollout of c01" in plan_log, plan_log[-3000:]
    cells = _cells(airflow, mrun)
    labels = [c["rendered_map_index"] for c in cells]
    # the cells differing only in load rate are adjacent: one deployment each; the Grid says who reuses a rollout
    assert labels == ["max_num_seqs=8 load_rate=2", "max_num_seqs=8 load_rate=4 (on c01's rollout)",
                      "max_num_seqs=16 load_rate=2", "max_num_seqs=16 load_rate=4"], labels
    assert [c["state"] for c in cells] == ["success", "success", "success", "skipped"], cells
    # one cell at a time: each started after the previous one ended
    ran = cells[:3]
    for a, b in zip(ran, ran[1:]):
        assert a["end_date"] <= b["start_date"], (a, b)

    matrix_key = paths.dag_run_key(MATRIX, mrun)
    out = _xcom(airflow, mrun, "compare")
    skipped = [c for c in out["cells"] if c["status"] == "skipped"]
    assert len(skipped) == 1 and skipped[0]["label"] == "max_num_seqs=16 load_rate=4"
    assert skipped[0]["run_key"] == paths.dag_run_key(RUN, manual)
    assert f"already measured by run {paths.dag_run_key(RUN, manual)}" in skipped[0]["reason"]
    assert out["failed"] == []
    assert len(out["best"]) == 1, out["best"]
    best = out["best"][0]
    assert best["run_key"] in {c["run_key"] for c in out["cells"]}
    assert Path(out["report"]).is_file() and best["label"] in Path(out["report"]).read_text()
    assert f"best configuration meeting the SLO: {best['cell_id']} {best['label']}" in _log(
        airflow, MATRIX, mrun, "compare")

    stored = _comparison(results_dsn, matrix_key)
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
    assert "reused from run" in _log(airflow, RUN, c02.removeprefix(RUN + "__"), "rollout.canary_then_scale")
    # c02 stopped them; the lease went c01 -> c02 and is free now, with nothing left for anyone to clean
    from deploybench.lease import LeaseStore

    assert not any(_up(e["url"]) for e in reused["rollout"]["result"]["endpoints"])
    from deploybench.run import Run

    lease = LeaseStore(results_dsn).status(Run.open(c01).inventory.name)
    assert lease.free and lease.pending_cleanup == [], lease
    handed = [e["detail"].get("handed_over_to") for e in LeaseStore(results_dsn).events(run_key=c01)]
    assert c02 in handed, handed
    assert _state(airflow, mrun, "cleanup") == "success"
    assert stored["result"]["best"] and best["run_key"] in stored["result"]["best"].values()

    # a cell is a deploybench_run like a manual one: same stages stored, the cell's conf, the matrix tags
    cell_run = load_run(results_dsn, out["cells"][2]["run_key"])
    manual_run = load_run(results_dsn, paths.dag_run_key(RUN, manual))
    assert cell_run.run.dag_id == RUN and cell_run.run.status == "success"
    assert [s.stage for s in cell_run.stages] == [s.stage for s in manual_run.stages]
    assert cell_run.run.tags == {"matrix": matrix_key, "matrix_cell": "max_num_seqs=16 load_rate=2",
                                 "matrix_deployment": "d2"}
    assert cell_run.run.config["engine"]["max_num_seqs"] == 16 and cell_run.run.config["load"]["rate"] == 2
    assert {k: v for k, v in cell_run.run.config.items() if k not in ("load", "tags")} == \
        {k: v for k, v in manual_run.run.config.items() if k not in ("load", "tags")}

    # the matrix run's "Benchmark results" tab shows the cells and links the comparison
    page = _page(airflow, f"/deploybench/dag-runs/{MATRIX}/{quote(mrun, safe='')}")
    assert "Matrix" in page and "max_num_seqs=8 load_rate=2" in page and "/deploybench/compare?" in page

    # re-triggering the same matrix runs nothing
    before = _run_ids(airflow)
    t0 = time.monotonic()
    again = _trigger(airflow, MATRIX, {"base": base, "axes": GRID})
    assert _wait_done(airflow, MATRIX, again) == "success"
    TIMES["same matrix again, nothing runs"] = time.monotonic() - t0
    assert [c["state"] for c in _cells(airflow, again)] == ["skipped"] * 4
    assert _run_ids(airflow) == before
    assert "4 cells - 0 will run, 4 skipped" in _log(airflow, MATRIX, again, "plan")


def _up(url: str) -> bool:
    from deploybench import http

    return http.is_up(url + "/health", timeout=2)


def _page(airflow, path: str) -> str:
    """An HTML page of the results plugin, as the logged-in UI's iframe gets it (Bearer token)."""
    import urllib.request

    req = urllib.request.Request(airflow.url + path, headers={"Authorization": f"Bearer {airflow.token()}",
                                                              "Accept": "text/html"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=60) as resp:
        return resp.read().decode()


def test_invalid_cell_is_refused_before_any_run_starts(airflow, matrix_dag, lab_inventory):
    before = _run_ids(airflow)
    mrun = _trigger(airflow, MATRIX, {"base": _base(lab_inventory), "axes": {"max_num_seqs": [8, 0],
                                                                              "load_rate": [2]}})
    assert _wait_done(airflow, MATRIX, mrun) == "failed"
    assert _state(airflow, mrun, "plan") == "failed"
    log = _log(airflow, MATRIX, mrun, "plan")
    assert "cell 2 (max_num_seqs=0 load_rate=2): max_num_seqs=0 is refused" in log, log[-3000:]
    assert "nothing was started" in log
    assert _run_ids(airflow) == before
    assert "the plan refused it" in _log(airflow, MATRIX, mrun, "finish")


def test_failing_cell_is_isolated_named_and_clearing_a_cell_reruns_it(airflow, matrix_dag, lab_inventory):
    base = _base(lab_inventory)
    t0 = time.monotonic()
    mrun = _trigger(airflow, MATRIX, {"base": {**base, "max_num_seqs": 8, "load_rate": 3},
                                      "treatments": [{"sim_crash_after": 2}, {"sim_crash_after": 0}]})
    assert _wait_done(airflow, MATRIX, mrun) == "failed"
    TIMES["2 cells, one crashing"] = time.monotonic() - t0
    cells = _cells(airflow, mrun)
    assert [(c["rendered_map_index"], c["state"]) for c in cells] == [
        ("sim_crash_after=2", "failed"), ("sim_crash_after=0", "success")], cells
    out = _xcom(airflow, mrun, "compare")
    assert [c["status"] for c in out["cells"]] == ["failed", "success"]
    assert [f["label"] for f in out["failed"]] == ["sim_crash_after=2"]
    finish = _log(airflow, MATRIX, mrun, "finish")
    assert "1 of 2 cells failed: c01 (sim_crash_after=2): failed" in finish, finish[-3000:]
    assert _state(airflow, mrun, "compare") == "success"

    # clearing the good cell re-triggers the same deploybench_run run id (reset) and measures it again
    run_id = out["cells"][1]["run_key"].removeprefix(RUN + "__")
    first = _run(airflow, RUN, run_id)
    body = {"dry_run": False, "task_ids": [["cell", 1]], "dag_run_id": mrun, "include_upstream": False,
            "include_downstream": True, "only_failed": False, "reset_dag_runs": True}
    airflow.request("POST", f"/api/v2/dags/{MATRIX}/clearTaskInstances", body)
    assert _wait_done(airflow, MATRIX, mrun) == "failed"  # the crashing cell still failed
    again = _run(airflow, RUN, run_id)
    assert again["state"] == "success" and again["start_date"] > first["end_date"], (first, again)


def test_a_run_planted_under_a_cells_run_id_is_refused_not_reset(airflow, matrix_dag, lab_inventory):
    """Issue 30, hole 4, through the real scheduler: someone who may trigger runs creates a deploybench_run under
    the run id a matrix's cell will have (``matrix__<matrix run id>__c01``, predictable for a scheduled matrix)
    with a configuration of their own, before the matrix runs. Its validate refuses it (no such plan), and the
    matrix's cell refuses to reset it (Airflow's reset keeps a run's conf): it is never measured as the cell."""
    import secrets

    base = _base(lab_inventory)
    mrun = f"mx-planted-{secrets.token_hex(3)}"
    planted = f"matrix__{mrun}__c01"
    got = airflow.request("POST", f"/api/v2/dags/{RUN}/dagRuns",
                          {"dag_run_id": planted, "logical_date": None,
                           "conf": {**base, "load_rate": 9, "sim_slowdown": 4}})
    assert got["dag_run_id"] == planted
    assert _wait_done(airflow, RUN, planted) == "failed"
    assert "no plan" in _log(airflow, RUN, planted, "validate")
    before = _run(airflow, RUN, planted)

    t0 = time.monotonic()
    airflow.request("POST", f"/api/v2/dags/{MATRIX}/dagRuns",
                    {"dag_run_id": mrun, "logical_date": None,
                     "conf": {"base": {**base, "max_num_seqs": 8}, "treatments": [{"load_rate": 2}],
                              "on_measured": "rerun"}})  # measured by the first test: a cell to run, not skip
    assert _wait_done(airflow, MATRIX, mrun) == "failed"
    TIMES["a planted cell refused"] = time.monotonic() - t0
    assert [c["state"] for c in _cells(airflow, mrun)] == ["failed"]
    log = _log(airflow, MATRIX, mrun, "cell", map_index=0)
    assert "refused, not reset" in log and "sim_slowdown=4.0 (planned 1.0)" in log, log[-3000:]
    after = _run(airflow, RUN, planted)
    assert (after["state"], after["start_date"], after["end_date"]) == \
        (before["state"], before["start_date"], before["end_date"]), "the planted run was reset"
    out = _xcom(airflow, mrun, "compare")
    assert [c["status"] for c in out["cells"]] == ["not stored"]


def test_report_wall_times():
    print("\nmatrix test wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in TIMES.items()))
