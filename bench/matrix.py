"""Matrix overhead: what a cell of deploybench_matrix costs over the same run started alone.

    python bench/matrix.py [--cells 3] [--alone 2] [--no-unshared]

On ``airflow standalone`` (scheduler, triggerer, LocalExecutor; the browser tests' fixture) with a
2-node lab of its own (``lmb``) and a throwaway results database, side by side in one session:

- the run started alone: deploybench_run triggered through the REST API, timed from the POST to the
  state Airflow reports as final (``--alone`` times: before the matrix and one after it);
- the same run as matrix cells: deploybench_matrix with ``repeats=--cells`` and ``on_measured=rerun``
  (identical cells, one deployment group). The cells share one rollout: the first deploys and keeps
  its engines, each next one adopts them (no preflight, fan-out or rollout of its own). Per cell: its
  triggered run's own duration, the cell task's duration (trigger + run + the triggerer's poke), and
  its share of the matrix's own tasks (plan, share, cleanup, compare, finish and the scheduling
  between them);
- the same matrix with ``reuse_s=0`` (every cell deploys on its own, what the matrix did before
  cells shared a rollout), unless ``--no-unshared``.

Printed per cell: the cell's wall time in the matrix (cell task + its share), the matrix's own part
of it (that minus the cell's run: triggering, the triggerer's poll, the share), the median run
alone, the overhead (wall time minus the run alone, negative = cheaper than alone) and the ratio,
then the mean for cells that deployed and for cells that ran on a shared rollout, and what sharing
saves per cell against the run alone and against the unshared matrix. The aim of issue 14: under
10 s of overhead per cell.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from urllib.parse import quote

_OWN_HOME = "DEPLOYBENCH_HOME" not in os.environ  # the lab, runs and database of this benchmark only
if _OWN_HOME:
    os.environ["DEPLOYBENCH_HOME"] = tempfile.mkdtemp(prefix="deploybench-bench-matrix-")
sys.path.append(str(Path(__file__).resolve().parents[1]))  # the checkout: tests.browser, tests.support

from deploybench import paths  # noqa: E402
from tests.browser import conftest as harness  # noqa: E402 - the browser tests' Airflow: one way to start and stop it

LAB = "lmb"
RUN, MATRIX = "deploybench_run", "deploybench_matrix"


def _t(text: str | None) -> float:
    return datetime.fromisoformat(text).timestamp()


def _wait(af, dag_id: str, run_id: str, timeout_s: float = 1800) -> dict:
    path = f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}"
    return af.wait_for(f"{dag_id} {run_id}", lambda: (r := af.request("GET", path))["state"] in ("success", "failed")
                       and r, timeout_s, every_s=1)


def _trigger(af, dag_id: str, conf: dict) -> tuple[str, float]:
    t0 = time.monotonic()
    run_id = af.request("POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf})["dag_run_id"]
    run = _wait(af, dag_id, run_id)
    if run["state"] != "success":
        raise SystemExit(f"{dag_id} run {run_id} ended {run['state']}: the benchmark needs successful runs")
    return run_id, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", type=int, default=3)
    ap.add_argument("--alone", type=int, default=2)
    ap.add_argument("--no-unshared", action="store_true", help="skip the matrix whose cells each deploy")
    args = ap.parse_args()
    from deploybench.lab import cluster
    from deploybench.store import embedded

    cluster.up(LAB, nodes=2, link_mbit=200, model_mb=4)
    inventory = paths.lab_dir(LAB) / "inventory.json"
    conf = {"inventory": str(inventory), "nodes": 2, "canary_nodes": 1, "iperf_seconds": 1, "link_threshold": 0.5,
            "gate_duration_s": 3, "load_rate": 4, "load_duration_s": 5, "warmup_s": 1, "output_tokens": 16,
            "prompt_tokens": 64}
    try:
        with contextlib.ExitStack() as stack:
            dsn = stack.enter_context(contextlib.contextmanager(harness.results_dsn.__wrapped__)())
            af = stack.enter_context(contextlib.contextmanager(harness.airflow.__wrapped__)(dsn, inventory))
            af.wait_for(f"{MATRIX} unpaused", lambda: _unpause(af), 240, every_s=2)
            print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
            alone = [_trigger(af, RUN, conf)[1] for _ in range(max(1, args.alone - 1))]
            spec = {"base": conf, "axes": {"load_rate": [4]}, "repeats": args.cells, "on_measured": "rerun"}
            shared = _trigger(af, MATRIX, spec)
            alone.append(_trigger(af, RUN, conf)[1])
            unshared = None if args.no_unshared else _trigger(af, MATRIX, {**spec, "reuse_s": 0})
            base = statistics.median(alone)
            print(f"run alone (POST -> final state): {', '.join(f'{a:.1f} s' for a in alone)}; median {base:.1f} s")
            got = _report(af, *shared, base, "cells share one rollout")
            if unshared:
                flat = _report(af, *unshared, base, "reuse_s=0: every cell deploys on its own")
                print(f"sharing saves {statistics.mean(flat) - statistics.mean(got):.1f} s per cell on average "
                      f"({statistics.mean(got):+.1f} s vs {statistics.mean(flat):+.1f} s over the run alone), "
                      f"measured side by side in this session")
    finally:
        cluster.down(LAB)
        embedded.stop()
        if _OWN_HOME:
            shutil.rmtree(os.environ["DEPLOYBENCH_HOME"], ignore_errors=True)
    return 0


def _unpause(af) -> bool:
    try:
        return af.request("PATCH", f"/api/v2/dags/{MATRIX}", {"is_paused": False})["is_paused"] is False
    except Exception as exc:  # noqa: BLE001 - 404 until parsed
        if "404" in str(exc):
            return False
        raise


def _deploy_s(af, run_id: str) -> float:
    """Seconds from the start of a run's preflight task to the end of its rollout task (what sharing removes)."""
    tis = af.request("GET", f"/api/v2/dags/{RUN}/dagRuns/{quote(run_id, safe='')}/taskInstances?limit=100")
    by = {t["task_id"]: t for t in tis["task_instances"]}
    first, last = by["preflight.nodes_and_links"], by["rollout.canary_then_scale"]
    return _t(last["end_date"]) - _t(first["start_date"])


def _report(af, mrun: str, matrix_s: float, base: float, what: str) -> list[float]:
    """Print one matrix run's cells against the run alone; returns each cell's overhead (s)."""
    tis = af.request("GET", f"/api/v2/dags/{MATRIX}/dagRuns/{quote(mrun, safe='')}/taskInstances?limit=100")
    cells = sorted((t for t in tis["task_instances"] if t["task_id"] == "cell"), key=lambda t: t["map_index"])
    own = {
        t["task_id"]: _t(t["end_date"]) - _t(t["start_date"])
        for t in tis["task_instances"]
        if t["task_id"] != "cell"
    }
    cell_s = [_t(c["end_date"]) - _t(c["start_date"]) for c in cells]
    share = (matrix_s - sum(cell_s)) / len(cells)  # plan, compare, finish and the scheduling between tasks
    print(f"\nmatrix of {len(cells)} identical cells, {what}: {matrix_s:.1f} s; own tasks "
          + ", ".join(f"{k} {v:.1f} s" for k, v in own.items()) + f"; share per cell {share:.1f} s")
    print(f"{'cell':<40} {'its run':>8} {'deploy':>7} {'cell task':>9} {'+ share':>8} {'matrix part':>11} "
          f"{'alone':>7} {'overhead':>9} {'ratio':>6}")
    planned = af.request("GET", f"/api/v2/dags/{MATRIX}/dagRuns/{quote(mrun, safe='')}/taskInstances/plan/xcomEntries"
                                f"/plan?deserialize=true")["value"]
    overheads, deployed, reused, own_deploy, reused_deploy = [], [], [], [], []
    for c, s, cell in zip(cells, cell_s, planned["cells"]):
        run_id = cell["trigger_run_id"]
        run = af.request("GET", f"/api/v2/dags/{RUN}/dagRuns/{quote(run_id, safe='')}")
        own_run = _t(run["end_date"]) - _t(run["start_date"])
        deploy = _deploy_s(af, run_id)
        (reused_deploy if cell.get("rollout_of") else own_deploy).append(deploy)
        total = s + share
        overheads.append(total - base)
        (reused if cell.get("rollout_of") else deployed).append(total - base)
        print(
            f"{c['rendered_map_index']:<40} {own_run:7.1f}s {deploy:6.1f}s {s:8.1f}s {total:7.1f}s "
            f"{total - own_run:10.1f}s "
            f"{base:6.1f}s "
            f"{total - base:+8.1f}s {total / base:6.2f}"
        )
    print(f"mean overhead per cell {statistics.mean(overheads):+.1f} s (aim of issue 14: under 10 s); the cell task "
          f"waits for its run by polling every few seconds, so up to that interval is part of each cell's overhead")
    if reused:
        print(f"preflight + fanout + rollout tasks (start of the first to end of the last): "
              f"{statistics.mean(own_deploy):.1f} s in cells that deployed, {statistics.mean(reused_deploy):.1f} s in "
              f"cells on a shared rollout ({statistics.mean(own_deploy) - statistics.mean(reused_deploy):.1f} s less)")
        print(f"cells that deployed: {statistics.mean(deployed):+.1f} s over the run alone; cells on a shared rollout: "
              f"{statistics.mean(reused):+.1f} s, i.e. {-statistics.mean(reused):.1f} s saved per sharing cell "
              f"({statistics.mean(reused) / base + 1:.2f} x the run alone)")
    return overheads


if __name__ == "__main__":
    sys.exit(main())
