"""End to end: the deploybench_run DAG through Airflow's dag.test() on a real 4-node lab.

Every stage runs for real: iperf3 between namespaced nodes, rsync over SSH with pinned
host keys, the simulated engine started through SSH, k6 against every endpoint, rows
in PostgreSQL. A broken stage fails these tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploybench import http, paths
from deploybench.inventory import Inventory
from tests.support import store_fixtures as fx

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

DAGS = Path(__file__).resolve().parents[2] / "dags"


@pytest.fixture(scope="module")
def lab(netns_lab):
    """A 4-node lab (the fixtures' Lab: name, inv, files) in the session's home, where dag.test()'s Airflow
    and the embedded PostgreSQL live."""
    return netns_lab("e2e", nodes=4, link_mbit=200, model_mb=8, own_home=False)


@pytest.fixture(scope="module")
def dag(airflow_db):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {}
    return bag.dags["deploybench_run"]


def _conf(lab, **extra) -> dict:
    return {
        "inventory": str(lab.files.inventory),
        "nodes": 4,
        "canary_nodes": 1,
        "iperf_seconds": 1,
        # this test is about the pipeline, not link quality: 1 s iperf3 tests on a busy 2-core machine
        # can read 70 % of nominal during TCP slow start (preflight's own tests check thresholds)
        "link_threshold": 0.5,
        "load_rate": 6,
        "load_duration_s": 8,
        "warmup_s": 2,
        "output_tokens": 16,
        "prompt_tokens": 64,
        **extra,
    }


def _key(dr) -> str:
    return paths.dag_run_key("deploybench_run", dr.run_id)


def _engines_down(inv: Inventory, port: int = 8000) -> bool:
    return not any(http.is_up(f"http://{n.address}:{port}/health", timeout=1) for n in inv.nodes)


def test_full_run_succeeds_and_lands_in_postgres(lab, dag):
    from deploybench.store import count_samples, load_run

    dr = dag.test(run_conf=_conf(lab))
    key = _key(dr)
    stages = {p.stem: json.loads(p.read_text()) for p in (paths.run_dir(key) / "stages").glob("*.json")}
    assert dr.state == "success", {s: r.get("error") for s, r in stages.items() if r.get("error")}

    stored = load_run(None, key)
    assert stored is not None and stored.run.status == "success"
    got = {s.stage: s.status for s in stored.stages}
    for s in ("validate", "preflight", "fanout", "rollout", "load", "teardown"):
        assert got.get(s) == "success", got
    cluster_phase = [p for p in stored.phases if p.node == "*"]
    assert len(cluster_phase) == 1
    ph = cluster_phase[0]
    assert ph.errors == 0
    # open model at 6 req/s for 8 s: about 48 requests measured (warm-up excluded)
    assert 36 <= ph.requests <= 60, ph
    assert ph.output_tps > 0
    assert {p.node for p in stored.phases if p.node != "*"} == {n.name for n in lab.inv.nodes}
    assert count_samples(None, key) >= ph.requests

    pre = stages["preflight"]["result"]
    assert len(pre["links"]) == 4 and all(lt["ok"] for lt in pre["links"])
    fan = stages["fanout"]["result"]
    assert sorted(fan["verified_nodes"]) == sorted(n.name for n in lab.inv.nodes)
    report = Path(stages["report"]["result"]["path"])
    assert report.is_file() and "success" in report.read_text()
    assert _engines_down(lab.inv), "teardown left an engine running"
    # only sustained was asked for: the other phases show as skipped, not as green
    states = {ti.task_id: ti.state for ti in dr.get_task_instances()}
    assert states["load.probe"] == "skipped" and states["load.overload"] == "skipped", states
    assert states["load.sustained"] == "success" and states["teardown"] == "success", states


def test_with_a_results_connection_store_and_report_use_that_database(lab, dag, monkeypatch, fresh_dsn):
    """AIRFLOW_CONN_DEPLOYBENCH_RESULTS set: the run, its stages and the report's verdict go to that
    database, and nothing of the run reaches the embedded default one."""
    from deploybench.store import db, load_run

    dsn = fresh_dsn
    monkeypatch.setenv("AIRFLOW_CONN_DEPLOYBENCH_RESULTS", fx.airflow_connection(dsn))
    dr = dag.test(run_conf=_conf(lab, load_duration_s=4))
    key = _key(dr)
    assert dr.state == "success"
    stored = load_run(dsn, key)
    assert stored is not None and {s.stage for s in stored.stages} >= {"preflight", "load", "teardown"}
    report = json.loads((paths.run_dir(key) / "stages" / "report.json").read_text())
    assert report["status"] == "success" and report["result"]["verdicts"] is not None, report
    with db.open_store(dsn).connect() as c:  # the verdict was written back to the connection's database
        n = c.execute(db.text("SELECT count(*) FROM verdicts WHERE run_key = :k"), {"k": key}).scalar()
    assert n > 0
    assert load_run(None, key) is None, "the run leaked into the embedded default database"


def test_with_a_prometheus_connection_each_node_is_read_from_it_per_window(lab, dag, monkeypatch):
    """AIRFLOW_CONN_DEPLOYBENCH_PROMETHEUS set to the lab's own Prometheus: the load task reads each node's figures
    over its window from it, stored beside the scraped ones."""
    from urllib.parse import urlsplit

    from deploybench.store import load_run

    url = lab.inv.lab.get("prometheus") if lab.inv.lab else None
    if not url:
        pytest.skip("the lab runs without Prometheus (apt-get install prometheus prometheus-node-exporter)")
    u = urlsplit(url)
    monkeypatch.setenv("AIRFLOW_CONN_DEPLOYBENCH_PROMETHEUS", json.dumps(
        {"conn_type": "http", "host": u.hostname, "port": u.port, "schema": "http", "extra": {"step_s": 1}}))
    dr = dag.test(run_conf=_conf(lab, load_duration_s=4, scrape_interval_s=1))
    assert dr.state == "success"
    stored = load_run(None, _key(dr))
    assert stored is not None
    got = {(w.node, w.metric): w for w in stored.node_windows if w.source == "prometheus" and w.phase == "sustained"}
    for node in lab.inv.nodes:
        for metric in ("cpu_busy_pct", "net_rx_bytes_per_s", "gpu_util_pct", "engine_running"):
            assert got[(node.name, metric)].mean is not None and got[(node.name, metric)].samples >= 2, got


def test_unreachable_node_fails_the_run_and_everything_is_cleaned(lab, dag):
    """A node down: preflight aborts, nothing is deployed, the failed run is stored with its reason."""
    from deploybench.lab import cluster
    from deploybench.store import load_run

    victim = lab.inv.nodes[2].name
    cluster.kill_node(lab.name, victim)
    try:
        dr = dag.test(run_conf=_conf(lab))
    finally:
        cluster.down(lab.name)
        cluster.up(lab.name, nodes=4, link_mbit=200, model_mb=8)
    assert dr.state == "failed"
    key = _key(dr)
    pre = json.loads((paths.run_dir(key) / "stages" / "preflight.json").read_text())
    assert pre["status"] == "failed" and victim in pre["error"]
    assert not (paths.run_dir(key) / "stages" / "rollout.json").exists()
    stored = load_run(None, key)
    assert stored is not None and stored.run.status == "failed"
    assert {s.stage: s.status for s in stored.stages}["preflight"] == "failed"
    assert _engines_down(lab.inv)


def test_form_refuses_values_outside_the_schema(lab, dag):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match="load_rate"):
        dag.test(run_conf=_conf(lab, load_rate=-1))
    with pytest.raises(ParamValidationError, match="engine_profile"):
        dag.test(run_conf=_conf(lab, engine_profile="tgi"))


def test_params_that_do_not_fit_the_cluster_are_refused_before_any_node_is_touched(lab, dag):
    dr = dag.test(run_conf=_conf(lab, canary_nodes=9))
    assert dr.state == "failed"
    tis = {ti.task_id: ti for ti in dr.get_task_instances()}
    states = {tid: ti.state for tid, ti in tis.items()}
    assert states["validate"] == "failed" and states["teardown"] != "failed", states  # nothing to stop
    # the task may retry once (a process killed before its verdict), but a verdict is not retried
    assert tis["validate"].max_tries == 1 and tis["validate"].try_number == 1, tis["validate"]
    assert states["store.write_results"] == "success" and states["finish"] == "failed", states
    rec = json.loads((paths.run_dir(_key(dr)) / "stages" / "validate.json").read_text())
    assert "canary_nodes" in rec["error"]
    assert not (paths.run_dir(_key(dr)) / "stages" / "preflight.json").exists()


def test_a_run_waits_deferred_for_a_busy_cluster_or_fails_naming_the_holder(lab, dag):
    """Another run holds the lab's lease: with lease_on_busy=fail the DAG run fails at lease.acquire
    naming that holder, before any node is touched; with wait it defers (AcquireLease ->
    LeaseFreeTrigger) and goes on once the holder releases, and its lease record says how long it waited."""
    import threading
    import time
    from datetime import datetime

    from deploybench.lease import Holder, LeaseStore

    store, holder = LeaseStore(None), Holder("someone-else__manual_1", dag_id="deploybench_run", pid=4242)
    cluster = lab.inv.name  # the lease is the inventory's
    got = store.try_acquire(cluster, holder, ttl_s=300)
    assert not hasattr(got, "holder"), f"the lab's lease was not free: {got}"
    try:
        dr = dag.test(run_conf=_conf(lab, lease_on_busy="fail", load_duration_s=3))
        assert dr.state == "failed"
        states = {ti.task_id: ti.state for ti in dr.get_task_instances()}
        assert states["lease.acquire"] == "failed" and states["preflight.nodes_and_links"] == "upstream_failed"
        rec = json.loads((paths.run_dir(_key(dr)) / "stages" / "lease.json").read_text())
        assert "someone-else__manual_1" in rec["error"] and "4242" in rec["error"], rec["error"]
        assert not (paths.run_dir(_key(dr)) / "stages" / "preflight.json").exists()

        released: list[float] = []

        def let_go() -> None:
            released.append(time.time())
            store.release(cluster, holder.run_key)

        timer = threading.Timer(6.0, let_go)
        timer.start()
        dr = dag.test(run_conf=_conf(lab, lease_on_busy="wait", lease_wait_s=120, load_duration_s=3))
        timer.join()
        assert dr.state == "success"
        rec = json.loads((paths.run_dir(_key(dr)) / "stages" / "lease.json").read_text())
        assert rec["status"] == "success" and rec["result"]["released"] is True
        pre = json.loads((paths.run_dir(_key(dr)) / "stages" / "preflight.json").read_text())
        # preflight started only after the other holder let go
        assert datetime.fromisoformat(pre["started_at"]).timestamp() >= released[0], (pre["started_at"], released)
        assert store.status(cluster).free
    finally:
        store.release(cluster, holder.run_key)
