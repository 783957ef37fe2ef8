"""Two matrix cells on one rollout, on a real netns lab, stage by stage (``deploybench.pipeline``), no Airflow.

- cell A (``deployment.keep_for`` B) deploys, measures, leaves its engines running and hands the lease
  to B by name; cell B (``deployment.adopt`` A, another load rate) takes the lease at once, adopts the
  engines - its preflight, fanout and rollout records say "reused from run A (age N s)" and it serves
  from A's endpoints - measures, then stops A's engines and releases the lease clean. In the store both
  cells name A's run as their rollout.
- adopted records are hostile input: a record kept for another run, one naming a forged owner, one
  whose preflight is older than max_reuse_s, and a pid file planted to name an unrelated process are
  refused with their reason (the cell then deploys on its own), and the unrelated process is left alone.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from deploybench import http, paths, pipeline
from deploybench.lab import cluster as lab_cluster
from deploybench.lease import LeaseStore
from deploybench.matrix import deployment, planned
from deploybench.run import LOAD_PHASES, Run
from tests.support import lab_names

pytestmark = [
    pytest.mark.integration, pytest.mark.time_limit(300), pytest.mark.netns,
]

LAB = lab_names.unique("lm3")
FAST = {"nodes": 2, "canary_nodes": 1, "iperf_seconds": 1, "link_threshold": 0.3, "load_duration_s": 3,
        "warmup_s": 1, "output_tokens": 8, "prompt_tokens": 32, "gate_rate_per_node": 2, "gate_duration_s": 3,
        "gate_min_requests": 5, "ready_timeout_s": 30, "ttft_sample_rps": 0, "scrape_interval_s": 0}


@pytest.fixture(scope="module")
def inventory():
    lab_cluster.up(LAB, nodes=2, link_mbit=500, mode="netns", model_mb=2)
    try:
        yield str(paths.lab_dir(LAB) / "inventory.json")
    finally:
        lab_cluster.down(LAB)


def _validate_cell(key: str, conf: dict) -> None:
    """Validate ``key`` as a matrix cell with ``conf``: its matrix's plan lists it so (what the matrix's plan task
    writes; validate refuses a cell's run id or a deployment section that no plan made). These tests hand-write
    deployment sections to attack adoption itself, behind that first check."""
    cell = planned.cell_of(key)
    assert cell is not None, key
    plan = planned.read(cell[0]) or {"matrix_key": cell[0], "cells": []}
    plan["cells"] = [c for c in plan["cells"] if c["run_key"] != key] + [
        {"cell_id": cell[1], "run_key": key, "action": "run", "conf": conf}]
    planned.save(plan)
    pipeline.validate(key, conf)


def _deploy_stages(key: str, dsn: str) -> list[dict]:
    pipeline.acquire_lease(key, dsn=dsn)
    with pipeline.lease_heartbeat(key, dsn, interrupt=False):
        for stage in ("preflight", "fanout"):
            pipeline.run_stage(stage, key)
        return list(pipeline.run_stage("rollout", key).endpoints)


def _finish(key: str, endpoints: list[dict], dsn: str) -> None:
    with pipeline.lease_heartbeat(key, dsn, interrupt=False):
        for phase in LOAD_PHASES:
            pipeline.run_stage("load", key, phase=phase)
    pipeline.run_stage("teardown", key)
    pipeline.release_lease(key, dsn)
    pipeline.run_stage("store", key, dsn=dsn)


def _answering(endpoints: list[dict]) -> list[bool]:
    return [http.is_up(e["url"] + "/health", timeout=2) for e in endpoints]


def test_two_cells_share_one_rollout_and_the_last_stops_it(inventory, dsn):
    from deploybench.matrix.result import outcome

    a, b = "deploybench_run__matrix__lm3__c01", "deploybench_run__matrix__lm3__c02"
    base = {**FAST, "inventory": inventory}
    _validate_cell(a, {**base, "load_rate": 2, "deployment": {"keep_for": b}})
    _validate_cell(b, {**base, "load_rate": 4, "deployment": {"adopt": a}})
    eps_a = _deploy_stages(a, dsn)
    _finish(a, eps_a, dsn)
    run_a = Run.open(a)
    assert run_a.result("teardown")["kept"]["kept_for"] == b
    assert all(_answering(eps_a)), "A's engines were kept running for B"
    lease = LeaseStore(dsn).status(run_a.inventory.name)
    assert lease.holder == b and [(p["run_key"], p["kept_by"]) for p in lease.kept] == [(a, b)]

    eps_b = _deploy_stages(b, dsn)  # the lease is B's already: no wait, and A's engines are not cleaned up
    assert eps_b == eps_a
    run_b = Run.open(b)
    for stage in ("preflight", "fanout", "rollout"):
        rec = run_b.stage(stage)
        assert rec is not None and rec.status == "success" and rec.summary.startswith(f"reused from run {a} (age "), rec
        assert rec.result["reused"]["from"] == a and rec.result["reused"]["age_s"] < 900
    assert run_b.result("fanout")["manifest_digest"] == \
        run_a.result("fanout")["manifest_digest"]
    assert "nodes" not in run_b.result("preflight")  # the per-node facts stay with A
    _finish(b, eps_b, dsn)
    assert (ld := run_b.stage("load")) is not None and ld.status == "success"
    assert not any(_answering(eps_a)), "the last cell stops the shared engines"
    info = LeaseStore(dsn).status(run_a.inventory.name)
    assert info.free and info.pending_cleanup == []
    # the store says both cells ran on A's rollout, and both are in the same series (same deployment, other load)
    plan = {"cells": [{"cell_id": "c01", "label": "load_rate=2", "action": "run", "run_key": a, "deployment": "d1",
                       "reason": ""},
                      {"cell_id": "c02", "label": "load_rate=4", "action": "run", "run_key": b, "deployment": "d1",
                       "reason": ""}]}
    assert [(r["status"], r["rollout_run"]) for r in outcome(dsn, plan)] == [("success", a), ("success", a)]
    # the matrix's cleanup finds nothing left to do
    assert deployment.cleanup([a, b], dsn) == []


def _kept(inventory: str, dsn: str, key: str, taker: str) -> list[dict]:
    """A cell that deployed and kept its engines for ``taker`` (lease handed over)."""
    _validate_cell(key, {**FAST, "inventory": inventory, "load_rate": 2, "deployment": {"keep_for": taker}})
    eps = _deploy_stages(key, dsn)
    _finish(key, eps, dsn)
    assert Run.open(key).result("teardown")["kept"]["kept"]
    return eps


def test_hostile_or_stale_records_are_not_adopted(inventory, dsn):
    giver, taker, other = ("deploybench_run__matrix__lm3h__c01", "deploybench_run__matrix__lm3h__c02",
                           "deploybench_run__matrix__lm3h__c09")
    eps = _kept(inventory, dsn, giver, taker)
    record = paths.run_dir(giver) / deployment.KEPT
    good = json.loads(record.read_text())
    base = {**FAST, "inventory": inventory, "load_rate": 4}

    def verdict(key: str, **spec) -> dict:
        _validate_cell(key, {**base, "deployment": {"adopt": giver, **spec}})
        return deployment.adopt(Run.open(key))

    # kept for another run: refused, and the engines (not ours to judge) are left running
    got = verdict(other)
    assert not got["adopted"] and f"is for run {taker!r}, not this one" in got["why"] and got["stopped"] is None
    assert all(_answering(eps))
    # a forged owner (a path) in the record: refused before anything is read or stopped
    record.write_text(json.dumps({**good, "owner": "../../etc"}))
    got = verdict(taker)
    assert not got["adopted"] and "names no valid owner" in got["why"] and got["stopped"] is None
    # a planted pid file: the engine's pid file now names an unrelated process -> not the owner's engine
    record.write_text(json.dumps(good))
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        from deploybench.rollout.ssh import SSHDeployer
        from deploybench.transport import Cluster

        owner = Run.open(giver)
        with Cluster(owner.inventory, None, run_key=giver) as cl:
            pid_path = SSHDeployer(cl, owner.cfg)._paths(owner.inventory.node(owner.nodes[0]))[0]
            cl[owner.nodes[0]].run(["cp", pid_path, pid_path + ".saved"], timeout=15).check()
            cl[owner.nodes[0]].run(["sh", "-c", f"echo {sleeper.pid} > {pid_path}"], timeout=15).check()
            got = verdict(taker, max_reuse_s=900)
            cl[owner.nodes[0]].run(["mv", pid_path + ".saved", pid_path], timeout=15).check()
        assert not got["adopted"] and "does not name a live process running the owner's command" in got["why"]
        assert sleeper.poll() is None, "the unrelated process is left alone"
    finally:
        sleeper.kill()
    # the taker stopped the engines of the sound record it refused, so it can deploy on its own - but not the
    # one whose pid file named another process: that engine is left for a person (or the true pid file) to stop
    assert json.loads(record.read_text())["adopted_by"] == taker
    assert _answering(eps) == [True, False]
    assert deployment.stop(giver, owner.nodes) == {n: "stopped" for n in owner.nodes}  # the real pid file is back
    assert not any(_answering(eps))
    # stale: a fresh kept deployment, adopted with max_reuse_s=0
    giver2, taker2 = "deploybench_run__matrix__lm3s__c01", "deploybench_run__matrix__lm3s__c02"
    LeaseStore(dsn).release(Run.open(giver).inventory.name, taker)
    eps2 = _kept(inventory, dsn, giver2, taker2)
    _validate_cell(taker2, {**base, "deployment": {"adopt": giver2, "max_reuse_s": 0}})
    got = deployment.adopt(Run.open(taker2))
    assert not got["adopted"] and "past deployment.max_reuse_s=0" in got["why"]
    assert not any(_answering(eps2))
    LeaseStore(dsn).release(Run.open(giver2).inventory.name, taker2)


def test_the_matrix_cleanup_stops_engines_nobody_took_over(inventory, dsn):
    giver, taker = "deploybench_run__matrix__lm3c__c01", "deploybench_run__matrix__lm3c__c02"
    eps = _kept(inventory, dsn, giver, taker)
    cluster = Run.open(giver).inventory.name
    # the taker failed before adopting and let the lease go: the kept engines are nobody's now
    assert LeaseStore(dsn).release(cluster, taker)
    assert all(_answering(eps)) and LeaseStore(dsn).status(cluster).free
    done = deployment.cleanup([giver, taker], dsn)
    assert [(d["owner"], d["released"]) for d in done] == [(giver, True)]
    assert set(done[0]["stopped"].values()) == {"stopped"}
    assert not any(_answering(eps))
    info = LeaseStore(dsn).status(cluster)
    assert info.free and info.pending_cleanup == []
    assert deployment.cleanup([giver, taker], dsn) == []  # idempotent
