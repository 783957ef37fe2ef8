"""The external backend: simulated engines started outside deploybench (plain processes on a loopback lab's
addresses), measured by the deploybench_run DAG through Airflow's dag.test().

Asserted: fan-out and rollout are recorded as skipped (external) and preflight as skipped by parameter; the
store's software identity says the service was not deployed by deploybench; the probe's capacity is the
simulated engines' closed-form capacity; sustained and probe figures and samples are stored; teardown left
the engines running (deploybench did not start them, so it does not stop them). An endpoint outside the
operator's allow-list, or on a node that is not the run's, is refused at validate time.
"""

from __future__ import annotations

import json

import pytest

from deploybench import http, paths
from deploybench.errors import ConfigError
from tests.support import lab_names

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(420)]  # a loopback lab: no root needed

LAB = lab_names.unique("lxext")
PORT = 8040  # the external_engines fixture (conftest.py) starts the engines on LAB's nodes at PORT
KNOBS = {"max_num_seqs": 4, "sim_decode_base_ms": 8, "sim_decode_per_seq_ms": 1, "sim_prefill_per_token_ms": 0.01}


def _conf(inv, urls: dict[str, str], **extra) -> dict:
    return {"inventory": str(paths.lab_dir(LAB) / "inventory.json"), "nodes": 2, "rollout_backend": "external",
            "external_endpoints": [f"{n}={u}" for n, u in urls.items()], "external_preflight": False,
            "prompt_tokens": 32, "output_tokens": 8, **KNOBS,
            "load_phases": ["probe", "sustained"], "probe_start_rps": 30, "probe_step_s": 2, "probe_tolerance": 0.3,
            "warmup_s": 1, "load_duration_s": 3, "window_s": 1.5, "slo_p99_latency_ms": 2000,
            "ttft_sample_rps": 1, "scrape_interval_s": 1, **extra}


def test_hostile_or_misplaced_endpoints_are_refused_before_anything_runs(external_engines, monkeypatch):
    from deploybench import pipeline

    inv, urls, _ = external_engines
    monkeypatch.setenv("DEPLOYBENCH_TARGET_URLS", " ".join(urls.values()))
    with pytest.raises(ConfigError, match=r"not in the operator.s allow-list"):
        pipeline.validate("lx-ext-bad1", _conf(inv, {**urls, inv.nodes[0].name: "http://127.0.0.1:9"}))
    with pytest.raises(ConfigError, match="is not one of this run's nodes"):
        pipeline.validate("lx-ext-bad2", _conf(inv, {"elsewhere": urls[inv.nodes[0].name]}, nodes=2))
    with pytest.raises(ConfigError, match="no user, query or fragment"):
        pipeline.validate("lx-ext-bad3", _conf(inv, {inv.nodes[0].name: urls[inv.nodes[0].name] + "?x=1"}))
    with pytest.raises(ConfigError, match="needs rollout.endpoints"):
        pipeline.validate("lx-ext-bad4", {**_conf(inv, urls), "external_endpoints": []})
    assert not (paths.run_dir("lx-ext-bad1") / "run.json").exists()


def test_external_engines_measured_through_the_dag(external_engines, dag_test_run, monkeypatch):

    from sqlalchemy import text

    from deploybench import params as form
    from deploybench.sim.service_model import ServiceParams, capacity
    from deploybench.store import count_samples, load_run
    from deploybench.store.db import open_store

    inv, urls, procs = external_engines
    monkeypatch.setenv("DEPLOYBENCH_TARGET_URLS", ",".join(urls.values()))
    conf = _conf(inv, urls)
    _, key, stages = dag_test_run(conf)

    for name in ("preflight", "fanout"):
        assert stages[name]["result"]["skipped"] == "external", stages[name]
        assert stages[name]["summary"].startswith("skipped (external backend")
    ro = stages["rollout"]["result"]
    assert ro["skipped"] == "external" and ro["steps"] == [] and ro["deployed_by"] == "not deployed by deploybench"
    assert sorted(e["url"] for e in ro["endpoints"]) == sorted(urls.values())

    # deploybench started nothing, so it stopped nothing: the engines still serve
    assert all(p.poll() is None for p in procs)
    assert all(http.is_up(u + "/health") for u in urls.values())

    cfg = form.to_config(conf)
    truth = capacity(ServiceParams.from_config(cfg.engine), 32, 8).requests_per_s * 2
    res = stages["load"]["result"]
    cap = res["capacity"]["capacity_rps"]
    assert 0.6 * truth <= cap <= 1.1 * truth, (cap, truth)
    assert res["phase"] == "sustained" and res["offered_rps"] == pytest.approx(0.8 * cap)

    stored = load_run(None, key)
    assert stored.run.status == "success"
    assert {p.phase for p in stored.phases if p.node == "*"} == {"probe", "sustained"}
    assert {p.node for p in stored.phases if p.node != "*"} == {n.name for n in inv.nodes}
    for phase in ("probe", "sustained"):
        assert count_samples(None, key, phase) > 0
    assert {s.stage: s.status for s in stored.stages}["rollout"] == "success"
    with open_store(None).connect() as conn:
        engine, version = conn.execute(text(
            "SELECT sw.engine, sw.version FROM runs r JOIN series se ON se.id = r.series_id "
            "JOIN software sw ON sw.id = se.software_id WHERE r.run_key = :k"), {"k": key}).one()
    assert engine == "sim" and version == "external (not deployed by deploybench)"


def test_preflight_runs_when_the_nodes_are_reachable_and_leaves_the_engines_port_alone(external_engines, monkeypatch):
    """external_preflight on (the default): the nodes are checked as usual, but the port the external
    engines hold is not one deploybench must find free (it would for engines it starts itself)."""
    from deploybench import pipeline, stages
    from deploybench.run import Run

    inv, urls, procs = external_engines
    monkeypatch.setenv("DEPLOYBENCH_TARGET_URLS", " ".join(urls.values()))
    key = "lx-ext-preflight"
    pipeline.validate(key, _conf(inv, urls, external_preflight=True, iperf_seconds=1, link_threshold=0.3,
                                 port=PORT))
    healthy = pipeline.run_stage("preflight", key).healthy
    rec = json.loads((paths.run_dir(key) / "stages" / "preflight.json").read_text())
    assert rec["status"] == "success" and "skipped" not in rec["result"]
    assert sorted(healthy) == sorted(urls) and [n["node"] for n in rec["result"]["nodes"]] != []
    assert pipeline.run_stage("fanout", key).skipped == "external"  # the engines hold their model
    assert stages.verified_nodes(Run.open(key)) == healthy
    assert all(p.poll() is None for p in procs)
