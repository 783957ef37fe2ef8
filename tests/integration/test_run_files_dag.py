"""The deploybench_run DAG as a distributed executor runs it: every other task on a worker with its own disk.

dag.test() runs the tasks in this process one after the other; here each task starts with DEPLOYBENCH_HOME
switched between two folders, as two Celery workers with their own disks would run them (the lab, the cluster
they both reach, is in both). The run's stage records, the load stage's samples and the report travel through the
results database (deploybench.store.run_files). The run must succeed; storing and reporting it again from one
complete folder must give the same rows and the same report; and without the database's hand-over (the shared
mode) the same alternation must fail, so that the success above is the hand-over's doing.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

import pytest

from deploybench import paths
from deploybench.store import db
from tests.support import lab_names
from tests.support import store_fixtures as fx

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.time_limit(600)]

LAB = lab_names.unique("rfdag")
DAGS = Path(__file__).resolve().parents[2] / "dags"


@pytest.fixture(scope="module")
def lab():
    from deploybench.lab import cluster

    inv = cluster.up(LAB, nodes=2, link_mbit=200, mode="loopback", model_mb=1)
    yield inv
    cluster.down(LAB)


@pytest.fixture
def two_workers(lab, airflow_db, dsn, tmp_path, monkeypatch):
    """(run the DAG with alternating homes -> (DagRun, [(task_id, home)]), home A, home B). Home A is the session's
    (Airflow's metadata DB and the lab live there); home B has only the lab."""
    from airflow.sdk.execution_time import supervisor

    home_a = Path(os.environ["DEPLOYBENCH_HOME"])
    home_b = tmp_path / "worker-b"
    home_b.mkdir()
    (home_b / "lab").symlink_to(home_a / "lab")
    monkeypatch.setenv(db.ENV_DSN, dsn)
    monkeypatch.setenv("AIRFLOW_CONN_DEPLOYBENCH_RESULTS", fx.airflow_connection(dsn))
    real = supervisor.run_task_in_process

    def run(conf: dict) -> tuple[object, list[tuple[str, Path]]]:
        from airflow.dag_processing.dagbag import DagBag

        ran: list[tuple[str, Path]] = []

        def on_the_next_worker(ti, task):
            home = (home_a, home_b)[len(ran) % 2]
            os.environ["DEPLOYBENCH_HOME"] = str(home)
            ran.append((ti.task_id, home))
            return real(ti=ti, task=task)

        monkeypatch.setattr(supervisor, "run_task_in_process", on_the_next_worker)
        try:
            dr = DagBag(dag_folder=str(DAGS)).dags["deploybench_run"].test(run_conf=conf)
        finally:
            os.environ["DEPLOYBENCH_HOME"] = str(home_a)
            monkeypatch.setattr(supervisor, "run_task_in_process", real)
        return dr, ran

    return run, home_a, home_b


def _conf() -> dict:
    return {"inventory": str(paths.lab_dir(LAB) / "inventory.json"), "nodes": 2, "canary_nodes": 1,
            "iperf_seconds": 1, "link_threshold": 0.1, "max_num_seqs": 4, "prompt_tokens": 16, "output_tokens": 8,
            "load_phases": ["sustained"], "load_rate": 8, "warmup_s": 1, "load_duration_s": 4,
            "slo_p99_latency_ms": 5000}


def _facts(dsn: str, key: str) -> dict:
    from deploybench.store import load_run

    stored = load_run(dsn, key)
    assert stored is not None
    return {"status": stored.run.status, "stages": sorted((s.stage, s.status) for s in stored.stages),
            "phases": sorted((p.model_dump(mode="json") for p in stored.phases), key=lambda p: (p["phase"], p["node"])),
            "samples": stored.sample_count, "windows": len(stored.node_windows),
            "findings": sorted(f.model_dump_json() for f in stored.findings)}


def _report_text(path: Path) -> str:
    """The report without what differs between two renderings of one run: times, element ids, and the rows of the
    store and report stages themselves (a second rendering lists the first, and its store replaced one)."""
    html = re.sub(r"<tr><td>(?:store|report)</td>.*?</tr>", "", path.read_text())
    html = re.sub(r"\d{4}-\d\d-\d\dT?[ \d:.]*(?:\+00:00|Z| UTC)?", "<time>", html)
    html = re.sub(r'id="[^"]*"', 'id=""', html)
    return re.sub(r"#[mp][0-9a-f]{10}\b", "#<ref>", html)  # matplotlib's ids of clip paths and markers


def test_a_run_whose_tasks_alternate_between_two_disks_succeeds_through_the_database(two_workers, dsn, tmp_path,
                                                                                    monkeypatch):
    from deploybench import pipeline
    from deploybench.store import run_files

    run, home_a, home_b = two_workers
    dr, ran = run(_conf())
    key = paths.dag_run_key("deploybench_run", dr.run_id)
    homes = {t.rsplit(".", 1)[-1]: h for t, h in ran}  # "lease.acquire" -> "acquire"
    folder_of = {h: h / "runs" / paths.run_folder_name(key) for h in (home_a, home_b)}
    stages = {}
    for h in (home_b, home_a):
        for p in (folder_of[h] / "stages").glob("*.json"):
            stages.setdefault(p.stem, p.read_text())
    assert dr.state == "success", {t: h.name for t, h in ran} | {"records": stages}
    # the stages really ran on both disks: validate and the load phase on one, the lease and the report on either
    assert {h for _, h in ran} == {home_a, home_b} and len(ran) >= 10, ran
    assert homes["validate"] != homes["acquire"], ran
    distributed = _facts(dsn, key)
    assert distributed["status"] == "success" and distributed["samples"] > 0, distributed
    report_home = homes["render"]
    report = folder_of[report_home] / "report.html"
    assert report.is_file()

    # one complete folder on a third disk: store and report again there -> the same rows, the same report
    home_c = tmp_path / "one-disk"
    (home_c / "lab").parent.mkdir(parents=True, exist_ok=True)
    (home_c / "lab").symlink_to(home_a / "lab")
    monkeypatch.setenv("DEPLOYBENCH_HOME", str(home_c))
    run_files.pull(key, dsn)
    whole = paths.run_dir(key)
    assert {p.relative_to(whole).as_posix() for p in whole.rglob("*") if p.is_file()} >= {
        "run.json", "report.html", *(f"stages/{s}.json" for s in ("validate", "lease", "preflight", "fanout",
                                                                   "rollout", "load", "teardown", "store"))}
    distributed_report = _report_text(whole / "report.html")
    pipeline.run_stage("store", key, dsn=dsn)
    pipeline.run_stage("report", key, dsn=dsn)
    assert _facts(dsn, key) == distributed
    again = _report_text(whole / "report.html")
    assert again == distributed_report, "".join(difflib.unified_diff(
        distributed_report.splitlines(True), again.splitlines(True), "distributed", "one disk", n=0))[:3000]


def test_without_the_hand_over_the_same_alternation_fails(two_workers, monkeypatch):
    """The control: with the database hand-over off (as if the workers shared a folder they do not), the second
    task finds no validated run on its disk."""
    from deploybench.store import run_files

    run, home_a, home_b = two_workers
    monkeypatch.setenv(run_files.MODE_ENV, "shared")
    dr, ran = run(_conf())
    assert dr.state == "failed", ran
    key = paths.dag_run_key("deploybench_run", dr.run_id)
    assert (home_a / "runs" / paths.run_folder_name(key) / "run.json").is_file()  # validate ran on disk A
    assert not (home_b / "runs" / paths.run_folder_name(key) / "run.json").exists()
