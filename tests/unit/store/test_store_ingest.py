"""The one contract between the load stage and its readers (deploybench.records): the load stage's result
as deploybench.load.phases assembles it from the phase files is what the store's ingest reads; a record
that does not match is refused, naming the stage, the field and the run folder. Also the stage records'
keys on disk, and the trigger read from an Airflow run id."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from deploybench.config import RunConfig
from deploybench.load import phases
from deploybench.records import LoadStageResult, RecordError, StageRecord
from deploybench.run import STAGES, STORED_STAGES, Run, read_record, recording, save_record
from deploybench.store import StoreError
from deploybench.store.ingest import capacity_steps, phase_records, samples_source, store_run, trigger_of
from deploybench.store.writer_facts import prepare_metrics
from tests.support.load_records import T0, write_load_stage


def _record(result: Any) -> StageRecord:
    return StageRecord(stage="load", status="success", started_at=T0.isoformat(), summary="", result=result)


def test_the_load_stage_as_assembled_is_what_ingest_reads(tmp_path):
    data = write_load_stage(tmp_path / "load", "s.csv")
    got = LoadStageResult.of(_record(data), tmp_path)
    assert [r.phase for r in got.ran()] == ["probe", "sustained"]  # the failed overload has no result
    assert got.headline() is not None and got.headline().phase == "sustained"
    steps = capacity_steps(got)
    assert [(s.step, s.offered_rps, s.slo_ok) for s in steps] == [(1, 8.0, True), (2, 16.0, True), (3, 32.0, False)]
    assert steps[2].latency_p99_ms == 4000.0 and steps[2].detail["reasons"] == ["P99 4000 ms > 2000 ms"]
    assert "rate" not in steps[0].detail and steps[0].detail["duration_s"] == 4.0
    rows = phase_records(got.ran()[1])
    assert [(r.node, r.offered_rps, r.requests) for r in rows] == [("*", 16.0, 240), ("n1", 8.0, 120),
                                                                    ("n2", 8.0, 120)]
    assert rows[0].started_at == T0 and rows[0].latency_p99_ms == 600.0
    assert samples_source(got) == "s.csv"  # every phase and step wrote the same file here: read once


def test_a_retried_capacity_step_is_stored_once_and_every_samples_file_is_read(tmp_path):
    data = write_load_stage(tmp_path / "load", "s.csv")
    data["capacity"]["steps"].append({**data["capacity"]["steps"][2], "rate": 30.0})  # step 3 again
    data["phases"]["probe"]["analysis"]["steps"][0]["samples_path"] = "step1.csv"
    got = LoadStageResult.of(_record(data), tmp_path)
    assert [(s.step, s.offered_rps) for s in capacity_steps(got)] == [(1, 8.0), (2, 16.0), (3, 30.0)]
    assert got.sample_paths() == ["s.csv", "step1.csv"]


@pytest.mark.parametrize("spoil,field", [
    (lambda d: d["capacity"]["steps"][0].pop("rate"), "result.capacity.steps.0.rate"),
    (lambda d: d["capacity"]["steps"][1].update(passed="maybe"), "result.capacity.steps.1.passed"),
    (lambda d: d.update(phases=list(d["phases"].values())), "result.phases"),
    (lambda d: d.pop("capacity"), "result.capacity"),
    (lambda d: d["phases"]["sustained"]["result"].pop("offered_rps"), "result.phases.sustained.result.offered_rps"),
    (lambda d: d["phases"]["probe"]["analysis"]["steps"][2].pop("passed"),
     "result.phases.probe.analysis.steps.2.passed"),
    (lambda d: d.pop("slo_ok"), "result.slo_ok"),  # the headline LoadResult's own fields
])
def test_a_load_record_off_the_contract_is_refused_naming_stage_field_and_folder(tmp_path, spoil, field):
    data = write_load_stage(tmp_path / "load", "s.csv")
    LoadStageResult.of(_record(copy.deepcopy(data)), tmp_path)  # unspoilt: read
    spoil(data)
    with pytest.raises(RecordError) as err:
        LoadStageResult.of(_record(data), tmp_path)
    text = str(err.value)
    assert f"run folder {tmp_path}" in text and "'load' stage record" in text and f"field {field}:" in text, text


def _run(tmp_path: Path) -> Run:
    return Run("deploybench_run/r1", tmp_path, RunConfig(inventory="lab"), None, ["n1", "n2"], {})  # type: ignore[arg-type]


def test_the_store_refuses_a_malformed_load_record_before_it_connects(tmp_path):
    run = _run(tmp_path)
    save_record(tmp_path, StageRecord(stage="validate", status="success", started_at=T0.isoformat()))
    data = write_load_stage(tmp_path / "load", "s.csv")
    data["capacity"]["steps"][0]["offered_rps"] = data["capacity"]["steps"][0].pop("rate")  # an alias of old
    save_record(tmp_path, _record(data))
    # a DSN nobody listens on: reaching it would raise a StoreError, not the RecordError
    with pytest.raises(RecordError, match=r"field result\.capacity\.steps\.0\.rate: Field required"):
        store_run(run, "postgresql+psycopg://nobody@127.0.0.1:9/none")


def test_stage_records_keep_their_keys_on_disk_and_a_bad_one_is_refused(tmp_path):
    with recording(tmp_path, "fanout") as rec:
        rec.result, rec.summary = {"nodes": []}, "nothing to copy"
    with pytest.raises(ValueError), recording(tmp_path, "rollout"):
        raise ValueError("no endpoint")
    ok = json.loads((tmp_path / "stages" / "fanout.json").read_text())
    assert set(ok) == {"stage", "status", "started_at", "finished_at", "seconds", "summary", "result"}
    assert ok["status"] == "success" and ok["result"] == {"nodes": []}
    failed = read_record(tmp_path, "rollout")
    assert failed is not None and failed.status == "failed" and failed.error == "ValueError: no endpoint"
    assert failed.summary == "ValueError: no endpoint" and failed.result is None
    assert list(_run(tmp_path).stages()) == ["fanout", "rollout"]
    (tmp_path / "stages" / "teardown.json").write_text(json.dumps({**ok, "stage": "teardown", "status": "done"}))
    with pytest.raises(RecordError, match=rf"run folder {tmp_path}: the 'teardown' stage record .*field status"):
        read_record(tmp_path, "teardown")


def test_the_stage_list_is_declared_once():
    assert STAGES.index("lease") < STAGES.index("preflight") < STAGES.index("load") < STAGES.index("store")
    assert STAGES[:STAGES.index("store")] == STORED_STAGES
    assert phases.ORDER == ("probe", "sustained", "spike", "overload")


def test_scraped_series_file_is_read_as_written(tmp_path):
    path = tmp_path / "sustained.metrics.jsonl.gz"
    points = [{"ts": "2026-01-01T00:00:01.250000+00:00", "node": "n01", "phase": "sustained", "step": 0,
               "metric": "vllm:num_requests_running", "labels": {"model_name": "m", "a": "1"}, "value": 3.0},
              {"ts": "2026-01-01T00:00:02.250000+00:00", "node": "n01", "phase": "sustained", "step": 0,
               "metric": "up", "labels": {}, "value": 0.0}]
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join(json.dumps(p) for p in points) + "\n")
    frame = prepare_metrics(path)
    assert list(frame["labels"]) == ["a=1,model_name=m", ""]
    assert list(frame["value"]) == [3.0, 0.0] and str(frame["ts"].dt.tz) == "UTC"
    with pytest.raises(StoreError, match="missing columns \\['metric'\\]"):
        prepare_metrics(pd.DataFrame({"ts": [1.0], "node": ["n"], "value": [1.0]}))


@pytest.mark.parametrize("meta,expected", [
    ({"airflow_run_id": "manual__2026-12-02T10:00:00"}, "manual"),
    ({"airflow_run_id": "scheduled__2026-12-02T00:00:00"}, "scheduled"),
    ({"airflow_run_id": "backfill__2026-12-01"}, "backfill"),
    ({"airflow_run_id": "matrix__manual__2026-12-02T10:00:00__c01"}, "matrix"),
    ({"airflow_run_id": "my-own-id"}, "api"),
    ({}, "cli"),
])
def test_trigger_from_the_airflow_run_id(meta, expected):
    assert trigger_of(meta) == expected


def test_every_probe_steps_and_phases_node_windows_become_rows_with_their_step():
    from deploybench.report.node_windows import of_load
    from deploybench.store.ingest import node_windows

    def fig(node: str, src: str, mean: float | None) -> dict:
        return {"node": node, "metric": "cpu_busy_pct", "source": src, "unit": "%", "mean": mean, "max": mean,
                "samples": 5 if mean is not None else 0, "reason": None if mean is not None else "absent: why"}

    load = LoadStageResult.model_validate({
        "phases": {"probe": {"phase": "probe", "status": "success",
                             "node_windows": {"1": [fig("n1", "prometheus", 10.0)],
                                              "2": [fig("n1", "prometheus", 20.0), fig("n2", "prometheus", None)]}},
                   "sustained": {"phase": "sustained", "status": "failed", "error": "x",
                                 "node_windows": {"0": [fig("n1", "scrape", 5.0)]}}},
        "capacity": {"capacity_rps": None, "reason": "x"}, "series": []})
    rows = node_windows(load)
    assert sorted((r.phase, r.step, r.node, r.source, r.mean) for r in rows) == [
        ("probe", 1, "n1", "prometheus", 10.0), ("probe", 2, "n1", "prometheus", 20.0),
        ("probe", 2, "n2", "prometheus", None), ("sustained", 0, "n1", "scrape", 5.0)]
    assert sorted((r["phase"], r["step"], r["node"]) for r in of_load(load.phases)) == [
        ("probe", 1, "n1"), ("probe", 2, "n1"), ("probe", 2, "n2"), ("sustained", 0, "n1")]
