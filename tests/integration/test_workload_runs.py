"""Every shipped workload through a whole run on a real netns lab, stage by stage (``deploybench.pipeline``).

One rollout serves them all, as a config matrix shares one (``deployment.keep_for``/``adopt``): the first cell
deploys, each next one validates its own conf (its workload), adopts the engines, runs the sustained phase, is
stored and reported, and hands them on; the last stops them. Per workload: the run succeeds, its plan is the
workload's, the store keeps the workload in its config and the engine's prefix-cache hit rate of the phase (0
exactly where no two requests share words; well above it for shared prefixes and conversations), and the report
names the workload.
"""

from __future__ import annotations

import json

import pytest

from deploybench import paths, pipeline, workloads
from deploybench.lab import cluster as lab_cluster
from deploybench.matrix import planned
from deploybench.run import LOAD_PHASES, Run
from tests.support import lab_names

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(420), pytest.mark.netns]

LAB = lab_names.unique("lw")
SHIPPED = ["synthetic", "chat-lognormal", "shared-prefix", "multi-turn", "bursty", "sharegpt-sample", "trace-sample"]
FAST = {"nodes": 2, "canary_nodes": 1, "iperf_seconds": 1, "link_threshold": 0.3, "load_rate": 8, "load_duration_s": 4,
        "warmup_s": 1, "output_tokens": 8, "prompt_tokens": 32, "gate_rate_per_node": 2, "gate_duration_s": 3,
        "gate_min_requests": 5, "ready_timeout_s": 30, "ttft_sample_rps": 0, "scrape_interval_s": 1,
        "max_num_seqs": 32, "sim_decode_base_ms": 2, "sim_decode_per_seq_ms": 0.1, "sim_prefill_per_token_ms": 0.005,
        "slo_p99_latency_ms": 10000}


@pytest.fixture(scope="module")
def inventory():
    lab_cluster.up(LAB, nodes=2, link_mbit=500, mode="netns", model_mb=2)
    try:
        yield str(paths.lab_dir(LAB) / "inventory.json")
    finally:
        lab_cluster.down(LAB)


def _plan_cells(keys: list[str], confs: list[dict]) -> None:
    """What a matrix's plan task writes: validate refuses a cell's run id or deployment section no plan made."""
    matrix = planned.cell_of(keys[0])
    assert matrix is not None
    planned.save({"matrix_key": matrix[0], "cells": [
        {"cell_id": planned.cell_of(k)[1], "run_key": k, "action": "run", "conf": c}  # type: ignore[index]
        for k, c in zip(keys, confs)]})


def test_every_shipped_workload_runs_through_a_whole_run(inventory, dsn):
    from deploybench.store import load_run

    assert set(SHIPPED) <= set(workloads.workloads())
    keys = [f"deploybench_run__matrix__lw__c{i:02d}" for i in range(1, len(SHIPPED) + 1)]
    confs = []
    for i, name in enumerate(SHIPPED):
        deployment = {**({"adopt": keys[i - 1]} if i else {}), **({"keep_for": keys[i + 1]} if i + 1 < len(keys)
                                                                  else {})}
        confs.append({**FAST, "inventory": inventory, "workload": name, "deployment": deployment,
                      "api": "chat" if name == "multi-turn" else "completions",
                      # multi-turn counts its rate in sessions: 2 conversations/s of 4 turns on average, 8 req/s
                      **({"load_rate": 2} if name == "multi-turn" else {})})
    _plan_cells(keys, confs)
    pipeline.validate(keys[0], confs[0])  # the others validate when their turn comes, as a matrix's cells do
    hit_rate = {}
    for i, (key, name, conf) in enumerate(zip(keys, SHIPPED, confs)):
        if i:
            pipeline.validate(key, conf)
        pipeline.acquire_lease(key, dsn=dsn)
        with pipeline.lease_heartbeat(key, dsn, interrupt=False):
            for stage in ("preflight", "fanout", "rollout"):
                pipeline.run_stage(stage, key)
            for phase in LOAD_PHASES:
                pipeline.run_stage("load", key, phase=phase)
        pipeline.run_stage("teardown", key)
        pipeline.release_lease(key, dsn)
        pipeline.run_stage("store", key, dsn=dsn)
        got = pipeline.report(key, dsn)

        run = Run.open(key)
        failed = {s: r.error for s, r in run.stages().items() if r.status == "failed"}
        assert not failed, (name, failed)
        plan = json.loads((run.dir / "load" / "sustained.plan.json").read_text())
        assert plan["workload"] == name
        stored = load_run(dsn, key)
        assert stored is not None and stored.run.config["load"]["workload"] == name
        cluster = next(p for p in stored.phases if p.node == "*" and p.phase == "sustained")
        assert cluster.requests > 0 and cluster.errors == 0, (name, cluster)
        hit_rate[name] = cluster.prefix_hit_rate
        with open(got["path"]) as fh:
            page = fh.read()
        assert f"workload {name}" in page
        ld = run.load_result()
        assert ld is not None
        if name == "multi-turn":  # the form's rate was conversations/s: the requests are its turns
            assert ld.capacity.rate_unit == "sessions"
            assert ld.capacity.requests_per_session == pytest.approx(4, abs=0.05)
            assert ld.capacity.capacity_sessions_per_s == 2
            assert ld.offered_rps == pytest.approx(2 * ld.capacity.requests_per_session, rel=0.3)  # a Poisson window
            assert "Rates in sessions" in page and "Capacity 2.00 sessions/s" in page
            assert "sessions/s" in run.stages()["validate"].summary
        else:
            assert ld.capacity.rate_unit == "requests" and ld.capacity.capacity_sessions_per_s is None
    # the sim caches prefixes: nothing repeats in synthetic traffic (each request its own words, and each run's
    # differ from the runs before it on the same engines), shared system prompts and conversations' earlier turns
    # do; every figure is the engines' own counters over the phase
    assert hit_rate["synthetic"] == 0.0 and hit_rate["chat-lognormal"] == 0.0 and hit_rate["bursty"] == 0.0
    assert hit_rate["shared-prefix"] > 0.3 and hit_rate["multi-turn"] > 0.3, hit_rate
    assert hit_rate["trace-sample"] is not None and hit_rate["trace-sample"] > 0.05, hit_rate
