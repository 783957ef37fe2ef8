"""The DAG's load group on a real 2-node lab: probe -> sustained -> overload, stored in PostgreSQL.

dag.test() runs every task for real (sshd, iperf3, rsync, the simulated engine started over SSH, k6 and
the TTFT sampler against the nodes' addresses, /metrics scraped); the engines are configured fast
(about 40 req/s per node) so the capacity search takes a few short steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploybench import paths
from deploybench.sim.service_model import ServiceParams, capacity

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.netns]

DAGS = Path(__file__).resolve().parents[2] / "dags"


@pytest.fixture(scope="module")
def lab(netns_lab):
    """A 2-node lab (the fixtures' Lab: name, inv, files) in the session's home, where dag.test()'s Airflow
    and the embedded PostgreSQL live."""
    return netns_lab("ldag", nodes=2, link_mbit=200, model_mb=4, own_home=False)


def test_three_phases_run_and_are_stored(lab, airflow_db):
    from airflow.dag_processing.dagbag import DagBag

    from deploybench import params as form
    from deploybench.store import count_samples, load_run
    from deploybench.store.models import CapacityStep, ServerMetric
    from deploybench.store.query import table

    dag = DagBag(dag_folder=str(DAGS)).dags["deploybench_run"]
    conf = {
        "inventory": str(lab.files.inventory), "nodes": 2, "canary_nodes": 1, "iperf_seconds": 1,
        "link_threshold": 0.5, "prompt_tokens": 32, "output_tokens": 8, "max_num_seqs": 4,
        "sim_decode_base_ms": 8, "sim_decode_per_seq_ms": 1, "sim_prefill_per_token_ms": 0.01,
        "load_phases": ["probe", "sustained", "overload"], "probe_start_rps": 30, "probe_step_s": 2,
        "probe_tolerance": 0.3, "warmup_s": 1, "load_duration_s": 3, "window_s": 1.5, "overload_ramp_s": 3,
        "recovery_s": 2, "slo_p99_latency_ms": 2000, "ttft_sample_rps": 1, "scrape_interval_s": 1,
    }
    dr = dag.test(run_conf=conf)
    key = paths.dag_run_key("deploybench_run", dr.run_id)
    rec = json.loads((paths.run_dir(key) / "stages" / "load.json").read_text())
    assert dr.state == "success", rec.get("error")

    res = rec["result"]
    cfg = form.to_config(conf)
    truth = capacity(ServiceParams.from_config(cfg.engine), 32, 8).requests_per_s * 2
    cap = res["capacity"]["capacity_rps"]
    assert set(res["phases"]) == {"probe", "sustained", "overload"}
    assert 0.6 * truth <= cap <= 1.1 * truth, (cap, truth)  # a coarse search here: accuracy has its own tests
    assert res["phase"] == "sustained" and res["offered_rps"] == pytest.approx(0.8 * cap)  # the headline
    assert res["phases"]["overload"]["analysis"]["capacity_source"] == "probe"

    stored = load_run(None, key)
    cluster = {p.phase for p in stored.phases if p.node == "*"}
    assert cluster == {"probe", "sustained", "overload"}
    assert {p.node for p in stored.phases if p.node != "*"} == {n.name for n in lab.inv.nodes}
    steps = len(res["capacity"]["steps"])
    assert len(table(None, CapacityStep, key)) == steps
    assert len(table(None, ServerMetric, key)) > 0
    for phase in ("probe", "sustained", "overload"):
        assert count_samples(None, key, phase) > 0
