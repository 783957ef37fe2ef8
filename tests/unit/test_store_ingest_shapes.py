"""What the store task reads from a load stage result: one phase, or the three phases with the
capacity search and the scraped /metrics series (the shapes deploybench.load writes)."""

from __future__ import annotations

import gzip
import json

import pandas as pd
import pytest

from deploybench.store import StoreError
from deploybench.store.ingest import capacity_steps, load_phases, samples_source, trigger_of
from deploybench.store.writer_facts import prepare_metrics


def _phase(name: str, path: str) -> dict:
    return {"phase": name, "samples_path": path, "offered_rps": 8}


def test_single_phase_and_three_phases():
    assert [p["phase"] for p in load_phases(_phase("sustained", "s.csv"))] == ["sustained"]
    three = {"phase": "sustained", "phases": {
        "probe": {"status": "success", "result": _phase("probe", "p.csv"),
                  "analysis": {"capacity_rps": 16, "steps": [
                      {"step": 0, "rate": 8, "passed": True, "achieved_rps": 8.0, "latency_p99_ms": 300,
                       "error_rate": 0, "dropped_iterations": 0, "reasons": []},
                      {"step": 1, "rate": 32, "passed": False, "achieved_rps": 20.0, "latency_p99_ms": 4000,
                       "reasons": ["P99 4000 ms > 2000 ms"]}]}},
        "sustained": {"status": "success", "result": _phase("sustained", "s.csv")},
        "overload": {"status": "failed", "result": None, "error": "k6 crashed"}}}
    assert [p["phase"] for p in load_phases(three)] == ["probe", "sustained"]
    steps = capacity_steps(three)
    assert [(s.step, s.offered_rps, s.slo_ok) for s in steps] == [(0, 8.0, True), (1, 32.0, False)]
    assert steps[1].detail["reasons"] == ["P99 4000 ms > 2000 ms"]
    three["capacity"] = {"capacity_rps": 8, "steps": [{"rate": 4, "passed": True}]}  # the assembled copy wins
    assert [s.offered_rps for s in capacity_steps(three)] == [4.0]
    assert samples_source(_phase("sustained", "s.csv")) == "s.csv"


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
