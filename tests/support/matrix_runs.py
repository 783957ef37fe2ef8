"""What the matrix browser tests (tests/browser/test_matrix.py) do to and read from a real Airflow: trigger a DAG
run, wait for it, read its task instances, logs and XComs through the REST API, as a script or the UI would."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import quote

MATRIX = "deploybench_matrix"
RUN = "deploybench_run"
TIMEOUT_S = 1500


def base(inventory: Path) -> dict:
    """A short run on the module's 2-node lab: canary_nodes = nodes, a rollout of one step with one gate (the matrix
    tests are about cells and shared rollouts; the rollout's steps are tests/integration/test_rollout_lab.py's)."""
    return {"inventory": str(inventory), "nodes": 2, "canary_nodes": 2, "iperf_seconds": 1, "link_threshold": 0.5,
            "gate_duration_s": 3, "load_duration_s": 5, "warmup_s": 1, "output_tokens": 16, "prompt_tokens": 64}


def trigger(airflow, dag_id: str, conf: dict) -> str:
    return airflow.request("POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf})["dag_run_id"]


def run(airflow, dag_id: str, run_id: str) -> dict:
    return airflow.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}")


def wait_done(airflow, dag_id: str, run_id: str) -> str:
    return airflow.wait_for(f"{dag_id} run {run_id} to finish",
                            lambda: (s := run(airflow, dag_id, run_id)["state"]) in ("success", "failed") and s,
                            TIMEOUT_S, every_s=3)


def tis(airflow, dag_id: str, run_id: str) -> list[dict]:
    return airflow.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances"
                                  "?limit=100")["task_instances"]


def cells(airflow, run_id: str) -> list[dict]:
    return sorted((t for t in tis(airflow, MATRIX, run_id) if t["task_id"] == "cell"), key=lambda t: t["map_index"])


def state(airflow, run_id: str, task_id: str) -> str:
    return next(t["state"] for t in tis(airflow, MATRIX, run_id) if t["task_id"] == task_id)


def xcom(airflow, run_id: str, task_id: str, key: str = "return_value"):
    return airflow.request("GET", f"/api/v2/dags/{MATRIX}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}"
                                  f"/xcomEntries/{key}?deserialize=true")["value"]


def log(airflow, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
    got = airflow.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}"
                                 f"/logs/1?map_index={map_index}")
    content = got.get("content")  # structured entries: the exception's text is in their error_detail
    return "\n".join(json.dumps(e) if isinstance(e, dict) else str(e) for e in content) \
        if isinstance(content, list) else str(content)


def why(airflow, matrix_run: str) -> str:
    """Why a matrix run failed: its finish task's error and, for each cell run that failed, the error of each
    task that failed in it (the Grid's red squares), so a failure in CI says which stage of which cell."""
    out = [errors(log(airflow, MATRIX, matrix_run, "finish"))]
    for r in airflow.request("GET", f"/api/v2/dags/{RUN}/dagRuns?limit=200")["dag_runs"]:
        if r["state"] != "failed" or matrix_run not in r["dag_run_id"]:
            continue
        for t in tis(airflow, RUN, r["dag_run_id"]):
            if t["state"] in ("failed", "upstream_failed") and t["task_id"] != "finish":
                out.append(f"{r['dag_run_id']} {t['task_id']} {t['state']}: "
                           + errors(log(airflow, RUN, r["dag_run_id"], t["task_id"])))
    return "\n".join(out)


def errors(log: str) -> str:
    """The error lines of a task log (level error, or an exception's text), else its last 2000 characters."""
    lines = [ln for ln in log.splitlines() if '"level": "error"' in ln or "exc_value" in ln]
    return "\n".join(ln[:3000] for ln in lines) or log[-2000:]


def run_ids(airflow) -> set[str]:
    return {r["dag_run_id"] for r in airflow.request("GET", f"/api/v2/dags/{RUN}/dagRuns?limit=200")["dag_runs"]}


def comparison(dsn: str, matrix_key: str) -> dict:
    from sqlalchemy import select

    from deploybench.store.db import open_store
    from deploybench.store.models import Comparison

    with open_store(dsn).connect() as conn:
        rows = conn.execute(select(Comparison.params, Comparison.result, Comparison.run_keys)
                            .order_by(Comparison.id.desc())).all()
    return next({"params": p, "result": r, "run_keys": k} for p, r, k in rows
                if (p.get("matrix") or {}).get("key") == matrix_key)


def up(url: str) -> bool:
    from deploybench import http

    return http.is_up(url + "/health", timeout=2)


def page(airflow, path: str) -> str:
    """An HTML page of the results plugin, as the logged-in UI's iframe gets it (Bearer token)."""
    import urllib.request

    req = urllib.request.Request(airflow.url + path, headers={"Authorization": f"Bearer {airflow.token()}",
                                                              "Accept": "text/html"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=60) as resp:
        return resp.read().decode()
