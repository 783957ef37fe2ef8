"""Runs that Airflow's real scheduler can clear and stop (issue 11): the rollout is the setup of the
engine teardown, the lease acquire the setup of its release.

- Clearing ``load.sustained`` of a finished run clears its setups and teardowns with it: the
  scheduler takes the lease again, re-deploys, runs the phase, stops the engines and releases.
- Marking a running run failed still runs the teardowns: the engines stop and the cluster is free.

Against ``airflow standalone`` (scheduler, triggerer, LocalExecutor) and a 2-node lab, through the
REST API as a script or the UI's Clear / Mark-as buttons would call it.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from urllib.parse import quote

import pytest

from deploybench import http, paths
from deploybench.inventory import Inventory
from tests.support import lab_names

pytestmark = [pytest.mark.browser, pytest.mark.integration]

DAG_ID = "deploybench_run"
LAB = lab_names.unique("t3lc")  # lab_inventory brings it up; not the UI module's lab (own series, own lease)
RUN_TIMEOUT_S = 480


def _conf(inventory, **extra) -> dict:
    return {"inventory": str(inventory), "nodes": 2, "canary_nodes": 1, "iperf_seconds": 1, "link_threshold": 0.5,
            "load_rate": 4, "load_duration_s": 4, "warmup_s": 1, "output_tokens": 16, "prompt_tokens": 64, **extra}


def _trigger(airflow, conf: dict) -> str:
    run = airflow.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})
    return run["dag_run_id"]


def _run(airflow, run_id: str) -> dict:
    return airflow.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}")


def _tis(airflow, run_id: str) -> dict[str, dict]:
    got = airflow.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances?limit=100")
    return {ti["task_id"]: ti for ti in got["task_instances"]}


def _why(airflow, run_id: str) -> str:
    """For a failed assertion: each task's state, and the error of every stage the run recorded as failed."""
    states = {tid: ti["state"] for tid, ti in _tis(airflow, run_id).items()}
    stages = paths.run_dir(paths.dag_run_key(DAG_ID, run_id)) / "stages"
    errors = {f.stem: rec.get("error") for f in sorted(stages.glob("*.json"))
              if (rec := json.loads(f.read_text())).get("status") == "failed"} if stages.is_dir() else {}
    return f"tasks {states}; failed stages {errors}; failed tasks' logs {airflow.failed_task_logs(DAG_ID, run_id)}"


def _wait_done(airflow, run_id: str, timeout_s: float = RUN_TIMEOUT_S) -> str:
    state = airflow.wait_for(f"run {run_id} to finish",
                             lambda: (s := _run(airflow, run_id)["state"]) in ("success", "failed") and s,
                             timeout_s, every_s=2)
    return state


def _stage(run_id: str, name: str) -> dict:
    return json.loads((paths.run_dir(paths.dag_run_key(DAG_ID, run_id)) / "stages" / f"{name}.json").read_text())


def _serving(inv: Inventory, port: int = 8000) -> list[str]:
    return [n.name for n in inv.nodes if http.is_up(f"http://{n.address}:{port}/health", timeout=1)]


def _lease_free(inv: Inventory, dsn: str) -> bool:
    from deploybench.lease import LeaseStore

    info = LeaseStore(dsn).status(inv.name)
    return info is None or info.free


def test_clearing_a_load_phase_redeploys_before_it_and_tears_down_after(airflow, lab_inventory, results_dsn):
    inv = Inventory.load(lab_inventory)
    run_id = _trigger(airflow, _conf(lab_inventory))
    assert _wait_done(airflow, run_id) == "success", _why(airflow, run_id)
    first_rollout = _stage(run_id, "rollout")
    first_sustained = _stage(run_id, "load")
    assert _serving(inv) == [] and _lease_free(inv, results_dsn)

    body = {"dry_run": True, "task_ids": ["load.sustained"], "dag_run_id": run_id, "include_upstream": False,
            "include_downstream": False, "only_failed": False, "reset_dag_runs": True}
    dry = airflow.request("POST", f"/api/v2/dags/{DAG_ID}/clearTaskInstances", body)
    cleared = {ti["task_id"] for ti in dry["task_instances"]}
    # the phase brings its setups and teardowns, nothing else
    assert cleared == {"load.sustained", "rollout.canary_then_scale", "teardown", "lease.acquire", "lease.release"}, \
        cleared
    airflow.request("POST", f"/api/v2/dags/{DAG_ID}/clearTaskInstances", {**body, "dry_run": False})
    assert _wait_done(airflow, run_id) == "success", _why(airflow, run_id)

    tis = _tis(airflow, run_id)
    for tid in ("rollout.canary_then_scale", "load.sustained", "teardown", "lease.acquire", "lease.release"):
        assert tis[tid]["try_number"] == 2 and tis[tid]["state"] == "success", (tid, tis[tid])
    for tid in ("preflight.nodes_and_links", "fanout.copy_and_verify", "store.write_results"):
        assert tis[tid]["try_number"] == 1, (tid, tis[tid])  # not re-run
    again_rollout, again_load, down = _stage(run_id, "rollout"), _stage(run_id, "load"), _stage(run_id, "teardown")
    t = datetime.fromisoformat
    assert t(again_rollout["started_at"]) > t(first_sustained["finished_at"])  # re-deployed for the cleared phase
    assert t(first_rollout["started_at"]) < t(again_rollout["started_at"]) < t(again_load["started_at"])
    assert t(down["started_at"]) >= t(again_load["finished_at"])  # and stopped after it
    assert again_load["status"] == "success"
    assert _serving(inv) == [], "the re-deployed engines were left running"
    assert _lease_free(inv, results_dsn), "the lease was not released after the cleared phase"


def test_marking_a_running_run_failed_still_stops_the_engines_and_frees_the_cluster(
    airflow, lab_inventory, results_dsn
):
    inv = Inventory.load(lab_inventory)
    run_id = _trigger(airflow, _conf(lab_inventory, load_duration_s=120))
    airflow.wait_for("load.sustained running",
                     lambda: _tis(airflow, run_id).get("load.sustained", {}).get("state") == "running",
                     RUN_TIMEOUT_S, every_s=2)
    assert _serving(inv), "no engine serving while the load runs"
    t0 = time.monotonic()
    airflow.request("PATCH", f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}", {"state": "failed"})
    airflow.wait_for("the teardowns after 'mark failed'",
                     lambda: all(_tis(airflow, run_id)[t]["state"] in ("success", "failed")
                                 for t in ("teardown", "lease.release")), 180, every_s=2)
    tis = _tis(airflow, run_id)
    assert tis["teardown"]["state"] == "success" and tis["lease.release"]["state"] == "success", tis
    assert _serving(inv) == [], "engines still serving after the run was marked failed"
    assert _lease_free(inv, results_dsn)
    assert time.monotonic() - t0 < 120  # not the 120 s load running to its end
