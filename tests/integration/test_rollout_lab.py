"""Rollout on a real 16-node netns lab (ssh backend): sshd per node, the simulated engine, the real k6 gate.

Covers: a full 2 -> 4 -> 8 -> 16 scale-out with a gate at every step; a canary whose gate fails;
and the faults of issue 5 - an engine that exits at start-up on a canary node (corrupt model),
a node unreachable at step k, an engine that dies after it was ready, an engine not ready before
the deadline. Each must be attributed to its node with the log tail, undone by policy, stored in
the stage record, and leave no engine process or open port behind.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from deploybench import http, paths, pipeline
from deploybench.errors import StageFailed
from deploybench.lab.state import LabFiles
from deploybench.run import Run
from tests.support import lab_names

pytestmark = [
    pytest.mark.integration, pytest.mark.time_limit(150), pytest.mark.netns,
]

LAB = lab_names.unique("lxr5")
PORT = 8000


@pytest.fixture(scope="module")
def lab():
    """16 nodes, each holding its own copy of the model (copied host-side: this test is not about fan-out)."""
    from deploybench.lab import cluster

    inv = cluster.up(LAB, nodes=16, link_mbit=1000, mode="netns", model_mb=2)
    files = LabFiles(LAB)
    src = files.models(inv.nodes[0].name) / "sim-model"
    for n in inv.nodes[1:]:
        dst = files.models(n.name) / "sim-model"
        if not dst.exists():
            shutil.copytree(src, dst)
    try:
        yield inv
    finally:
        cluster.down(LAB)


def _validate(key: str, lab, **extra) -> list[str]:
    conf = {"inventory": str(paths.lab_dir(LAB) / "inventory.json"), "gate_rate_per_node": 2,
            "gate_duration_s": 3, "gate_min_requests": 5, "warmup_s": 0, "output_tokens": 8,
            "prompt_tokens": 32, "ready_timeout_s": 30, **extra}
    return pipeline.validate(key, conf)["nodes"]


def _engine_pids(lab) -> list[str]:
    """Engine processes of this lab anywhere on the machine (netns nodes share the host's pid namespace)."""
    out = []
    for n in lab.nodes:
        r = subprocess.run(["pgrep", "-f", f"deploybench.sim.engine --host {n.address} "], capture_output=True,
                           text=True)
        out += r.stdout.split()
    return out


def _serving(lab) -> list[str]:
    return [n.name for n in lab.nodes if http.is_up(f"http://{n.address}:{PORT}/health", timeout=1)]


def _assert_nothing_running(lab) -> None:
    assert _serving(lab) == [], "an engine port still answers"
    assert _engine_pids(lab) == [], "an engine process is still running"


def _fail(key: str, nodes: list[str]) -> dict:
    with pytest.raises(StageFailed):
        pipeline.run_stage("rollout", key)
    rec = Run.open(key).stage("rollout")
    assert rec is not None and rec.status == "failed"
    return rec.model_dump()


def _teardown(key: str, lab) -> None:
    pipeline.run_stage("teardown", key)
    _assert_nothing_running(lab)


def test_full_scale_out_2_4_8_16_with_a_gate_at_every_step(lab):
    key = "r5-full"
    nodes = _validate(key, lab, canary_nodes=2)
    assert len(nodes) == 16
    eps = pipeline.run_stage("rollout", key).endpoints
    res = Run.open(key).result("rollout")
    assert res["plan"] == [2, 4, 8, 16]
    assert [s["nodes"] for s in res["steps"]] == [2, 4, 8, 16]
    assert [n for s in res["steps"] for n in s["added"]] == nodes  # each node added exactly once, in order
    for s in res["steps"]:
        assert set(s["ready_s"]) == set(s["added"]) and all(v > 0 for v in s["ready_s"].values())
        assert set(s["smoke"].values()) == {"ok"}
        g = s["gate"]
        assert g["passed"] and g["slo_ok"] and g["errors"] == 0
        assert g["requests"] >= 5 and g["rate"] == 2 * s["nodes"]
    assert sorted(e["node"] for e in eps) == sorted(nodes)
    assert sorted(_serving(lab)) == sorted(nodes)
    _teardown(key, lab)


def test_canary_gate_failure_tears_down_and_stores_the_reason(lab):
    key = "r5-gatefail"
    nodes = _validate(key, lab, nodes=4, canary_nodes=2, slo_p99_latency_ms=20)  # a sim answer takes > 100 ms
    rec = _fail(key, nodes)
    res = rec["result"]
    assert "canary gate failed" in rec["error"] and "P99 latency" in rec["error"]
    assert res["failure"]["step"] == 0 and res["failure"]["action"] == "torn down"
    assert len(res["steps"]) == 1 and res["steps"][0]["status"] == "failed"
    assert res["steps"][0]["gate"]["requests"] >= 5 and not res["steps"][0]["gate"]["slo_ok"]
    _assert_nothing_running(lab)


def test_corrupt_model_on_a_canary_node_is_attributed_with_its_log(lab):
    key = "r5-corrupt"
    nodes = _validate(key, lab, nodes=4, canary_nodes=2)
    victim = nodes[1]
    model = LabFiles(LAB).models(victim) / "sim-model"
    target = sorted(p for p in model.rglob("*") if p.is_file() and "manifest" not in p.name)[0]
    with open(target, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
    try:
        rec = _fail(key, nodes)
    finally:
        with open(target, "r+b") as f:
            f.seek(0)
            f.write(b)
    fail = rec["result"]["failure"]
    assert [c["node"] for c in fail["nodes"]] == [victim]
    assert "exited before it was ready" in fail["nodes"][0]["reason"]
    assert "manifest" in fail["nodes"][0]["log_tail"]  # the engine's own words, read back from the node
    assert victim in rec["error"] and fail["action"] == "torn down"
    _assert_nothing_running(lab)


def test_never_ready_before_the_deadline(lab):
    key = "r5-slow"
    nodes = _validate(key, lab, nodes=2, canary_nodes=1, ready_timeout_s=0.05, gate_rate_per_node=5)
    rec = _fail(key, nodes)
    fail = rec["result"]["failure"]
    assert fail["nodes"][0]["node"] == nodes[0] and "not ready" in fail["nodes"][0]["reason"]
    assert "0.05 s" in rec["error"]
    _assert_nothing_running(lab)


def test_engine_dying_after_ready_rolls_back_to_the_last_good_step(lab):
    """Step 1 (4 nodes): one new engine is killed once ready; the gate sees errors, the node is named,
    the rollout returns to the canary's 2 engines (policy rollback), and teardown stops them."""
    from deploybench import rollout
    from deploybench.rollout import gate as gates
    from deploybench.rollout.ssh import SSHDeployer

    key = "r5-crash"
    nodes = _validate(key, lab, nodes=4, canary_nodes=2, on_step_failure="rollback")
    run = Run.open(key)
    victim = nodes[3]
    with run.cluster() as cluster:  # the run's own pid files (per run key), as pipeline.teardown finds them
        dep = SSHDeployer(cluster, run.cfg)

        def gate(eps, step):
            if step == 1:
                pid, _ = dep._paths(run.inventory.node(victim))
                cluster[victim].run(f"kill -KILL $(head -n 1 {pid})", timeout=10)
            return gates.gate_load(eps, run.cfg, dep.profile, run.dir / "rollout", step)

        with pytest.raises(StageFailed) as err:
            rollout.plan.execute(dep, nodes, run.cfg, run.dir / "rollout", gate=gate)
        res = err.value.result
        assert res["failure"]["step"] == 1 and [c["node"] for c in res["failure"]["nodes"]] == [victim]
        assert "exited after it was ready" in res["failure"]["nodes"][0]["reason"]
        assert res["failure"]["action"] == "rolled back to step 0 (2 nodes)"
        assert [s["status"] for s in res["steps"]] == ["ok", "failed"]
        assert sorted(_serving(lab)) == sorted(nodes[:2])
        assert sorted(e["node"] for e in res["endpoints"]) == sorted(nodes[:2])
    _teardown(key, lab)


def test_node_unreachable_at_step_2(lab):
    """A node of step 2 is down (killed: no sshd, link down): step 2 fails on it; policy teardown stops all."""
    from deploybench.lab import cluster

    key = "r5-unreach"
    nodes = _validate(key, lab, nodes=8, canary_nodes=2, on_step_failure="teardown")
    victim = nodes[5]
    cluster.kill_node(LAB, victim)
    try:
        rec = _fail(key, nodes)
    finally:
        cluster.start_node(LAB, victim)
    fail = rec["result"]["failure"]
    assert fail["step"] == 2 and [c["node"] for c in fail["nodes"]] == [victim]
    assert "unreachable" in fail["nodes"][0]["reason"] or "could not start" in fail["nodes"][0]["reason"]
    assert fail["action"].startswith("torn down")
    assert [s["status"] for s in rec["result"]["steps"]] == ["ok", "ok", "failed"]
    _teardown(key, lab)
