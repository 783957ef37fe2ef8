"""The stages as objects (deploybench.stages) and their typed records (deploybench.records): the registry is the
run's stage list, every record shape a stage writes reads back typed (its own result, skipped by the external
backend, reused from a kept deployment), a record that does not match is refused naming the field, and no
module outside the backends' registry compares backend names."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest

from deploybench import rollout, stages
from deploybench.config import RolloutBackend, RunConfig
from deploybench.fanout.result import FanoutResult, NodeCopy
from deploybench.preflight.model import CheckItem, LinkTest, NodeCheck, PreflightResult
from deploybench.records import (
    ExternalRollout,
    KeptEngines,
    LeaseResult,
    RecordError,
    ReportResult,
    ReusedFanout,
    ReusedPreflight,
    ReusedRollout,
    SkippedExternal,
    StageRecord,
    StoppedEngines,
    StoreResult,
    ValidateResult,
    stage_result,
)
from deploybench.rollout.base import RolloutResult, StepResult
from deploybench.run import LEASED_STAGES, STAGES

LIB = Path(__file__).resolve().parents[2] / "include" / "deploybench"


def _rec(stage: str, result: object) -> StageRecord:
    return StageRecord(stage=stage, status="success", started_at="2026-12-06T00:00:00+00:00", result=result)


def test_the_registry_is_the_runs_stage_list_in_order():
    assert list(stages.REGISTRY) == [s for s in STAGES if s != "lease"]  # the lease is the pipeline's own
    assert [s for s in stages.REGISTRY if stages.REGISTRY[s].leased] == list(LEASED_STAGES)
    for name, stage in stages.REGISTRY.items():
        assert stage.name == name and stage.result is not None, name


def test_each_stage_result_reads_back_as_the_type_the_stage_built():
    pf = PreflightResult([NodeCheck("n1", True, checks=[CheckItem("ssh", "pass")])],
                         [LinkTest("n1", "n2", 0, 1000.0, mbit=950.0, ratio=0.95, ok=True)], ["n1"], {}, "ok", 1.5)
    fo = FanoutResult("m", "d" * 64, 10, [{"path": "w.bin", "size": 10, "sha256": "s"}], "n1", "chain",
                      [NodeCopy("n1", "source", verified=True), NodeCopy("n2", "copied", bytes=10, seconds=1.0,
                                                                         verified=True)])
    ro = RolloutResult("sim", [StepResult(1, 1, ["n1"], {"n1": 0.5}, {"n1": "ok"}, 2.0)],
                       [{"node": "n1", "url": "http://10.0.0.1:8000", "model": "m"}], 3.0, "ssh", [1])
    for stage, res in (("preflight", pf), ("fanout", fo), ("rollout", ro)):
        on_disk = json.loads(json.dumps(stages.dump(res)))  # as the record file holds it
        assert stage_result(_rec(stage, on_disk), "/runs/x") == res, stage
    assert "verified_nodes" in stages.dump(fo) and stages.dump(fo)["nodes"][1]["mbit_s"] == 0.0  # derived, on disk


@pytest.mark.parametrize("stage, result, kind", [
    ("preflight", {"skipped": "external", "deployed_by": "not deployed by deploybench", "nodes": []}, SkippedExternal),
    ("fanout", {"skipped": "external", "deployed_by": "not deployed by deploybench", "nodes": []}, SkippedExternal),
    ("preflight", {"healthy": ["n1"], "reused": {"from": "r1", "via": "r1", "age_s": 3.0, "max_reuse_s": 900}},
     ReusedPreflight),
    ("fanout", {"model": "m", "manifest_digest": "d", "total_bytes": 1, "files": [], "verified_nodes": ["n1"],
                "strategy": "chain", "reused": {"from": "r1", "via": "r1", "age_s": 3.0, "max_reuse_s": 900}},
     ReusedFanout),
    ("rollout", {"profile": "sim", "backend": "ssh", "endpoints": [{"node": "n1", "url": "u", "model": "m"}],
                 "reused": {"from": "r1", "via": "r1", "age_s": None, "max_reuse_s": 900}}, ReusedRollout),
    ("rollout", {"profile": "sim", "backend": "external", "skipped": "external", "deployed_by": "x", "version": "v",
                 "steps": [], "plan": [], "endpoints": [], "ready_s": {}, "failure": None, "seconds": 0.1},
     ExternalRollout),
])
def test_the_shapes_of_work_not_done_here_read_back_typed(stage, result, kind):
    got = stage_result(_rec(stage, result), "/runs/x")
    assert isinstance(got, kind)
    if kind in (ReusedPreflight, ReusedFanout, ReusedRollout):
        assert got.reused.from_ == "r1" and stages.dump(got)["reused"]["from"] == "r1"  # written back as read


KEPT = {"kept": True, "kept_by": "r1", "kept_for": "r2", "owner": "r1", "cluster": "lab", "nodes": ["n1", "n2"],
        "deployment": "f" * 16, "kept_at": "2026-12-06T00:00:00+00:00", "preflight_at": "t", "fanout_at": "t",
        "deployed_at": None}


@pytest.mark.parametrize("stage, result, kind", [
    ("validate", {"nodes": ["n1", "n2"], "fingerprint": "be2cf0df196a"}, ValidateResult),
    ("lease", {"cluster": "lab", "spec": {"ttl_s": 900.0}, "waited_s": 0.4, "taken_over": None, "cleaned": [],
               "acquired_at": "t", "released_at": "t", "released": True, "leftovers": False}, LeaseResult),
    ("lease", {"cluster": "lab", "spec": {}, "holder": {"run_key": "other"}}, LeaseResult),  # refused: who held it
    ("lease", {"cluster": "lab", "spec": {}, "waited_s": 0.0, "taken_over": None, "cleaned": [], "acquired_at": "t",
               "released_at": "t", "released": False, "handed_over_to": "r2", "leftovers": False}, LeaseResult),
    ("teardown", {"n1": "stopped", "n2": "error: pid 7 still running"}, StoppedEngines),
    ("teardown", {"kept": KEPT}, KeptEngines),
    ("store", {"stages": 7, "phases": 3, "samples": 10, "replaced": 0, "fanout_nodes": 2}, StoreResult),
    ("report", {"path": "/runs/x/report.html", "verdicts": None, "verdict_line": ""}, ReportResult),
])
def test_the_other_stages_records_read_back_typed_and_write_back_as_they_were(stage, result, kind):
    """validate, the lease, teardown, store and report: typed too; the file on disk is the same as before."""
    got = stage_result(_rec(stage, result), "/runs/x")
    assert isinstance(got, kind)
    assert got.model_dump(mode="json", exclude_unset=True) == result  # the same record, read and written again
    if kind is StoppedEngines:
        assert got.errors() == {"n2": "error: pid 7 still running"}
    with pytest.raises(RecordError, match=rf"'{stage}' stage record"):
        stage_result(_rec(stage, {**result, "nodes": "n1"} if stage != "teardown" else {"kept": {**KEPT, "nodes": 2}}),
                     "/runs/x")


def test_a_record_that_does_not_match_is_refused_naming_the_field():
    pf = stages.dump(PreflightResult([], [], ["n1"], {}, "ok", 1.0))
    with pytest.raises(RecordError, match=r"'preflight' stage record .* field result.healthy_nodes"):
        stage_result(_rec("preflight", {**pf, "healthy_nodes": ["n1"]}), "/runs/x")
    with pytest.raises(RecordError, match=r"field result.links.0.ratio"):
        stage_result(_rec("preflight", {**pf, "links": [{**asdict(LinkTest("a", "b", 0, 1.0)), "ratio": "fast"}]}),
                     "/runs/x")
    with pytest.raises(RecordError, match="field result.reused.from"):
        stage_result(_rec("rollout", {"endpoints": [], "reused": {"via": "x"}}), "/runs/x")


def test_what_differs_between_backends_is_a_capability_not_a_name_compared():
    """Every backend is one registered Deployer class with its capabilities; no module outside the registry (and
    the config that declares the names) compares a backend's name."""
    caps = {b: rollout.capabilities(RunConfig(inventory="x", rollout={"backend": b.value,  # type: ignore[arg-type]
                                                                      **({"endpoints": ["n1=http://h:1"]} if
                                                                         b is RolloutBackend.EXTERNAL else {})}))
            for b in RolloutBackend}
    assert set(caps) == set(rollout.BACKENDS)
    assert [b.value for b, c in caps.items() if c.shares_deployments] == ["ssh"]
    assert [b.value for b, c in caps.items() if not c.deploys] == ["external"]
    assert [b.value for b, c in caps.items() if c.needs_kube] == ["kubernetes"]
    compared = re.compile(r"backend\.value\s*[!=]=|backend\s+is\s+(not\s+)?RolloutBackend\.|\.backend\s*==\s*\"")
    found = [f"{p.relative_to(LIB)}:{i}" for p in LIB.rglob("*.py") if p.name != "config.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if compared.search(line)]
    assert found == [], f"backend names compared outside deploybench.rollout.BACKENDS: {found}"


def test_the_next_stage_reads_its_nodes_from_the_records(tmp_path):
    """Fan-out deploys onto the nodes preflight kept and rollout onto those fan-out verified, read from their
    records; a fan-out that verified fewer nodes than preflight kept never hands the others to the rollout."""
    from deploybench.run import Run, save_record

    run = Run("deploybench_run__x", tmp_path, RunConfig(inventory="lab"), None, ["n1", "n2", "n3"], {})  # type: ignore[arg-type]
    assert stages.healthy_nodes(run) == stages.verified_nodes(run) == ["n1", "n2", "n3"]  # nothing ran yet
    save_record(tmp_path, _rec("preflight", stages.dump(PreflightResult([], [], ["n1", "n3"], {"n2": "no ssh"},
                                                                        "exclude", 1.0))))
    assert stages.healthy_nodes(run) == stages.verified_nodes(run) == ["n1", "n3"]
    fo = FanoutResult("m", "d", 1, [], "n1", "chain", [NodeCopy("n1", "source", verified=True),
                                                         NodeCopy("n3", "failed", verified=False)])
    save_record(tmp_path, _rec("fanout", stages.dump(fo)))
    assert stages.verified_nodes(run) == ["n1"]
    save_record(tmp_path, _rec("fanout", stages.dump(FanoutResult("m", "d", 1, [], "n1", "chain", []))))
    assert stages.verified_nodes(run) == []  # not the healthy ones: none holds this run's verified copy
