"""Record and sample validation of the results store: no database needed."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from deploybench.config import RunConfig
from deploybench.store import SAMPLE_COLUMNS, PhaseRecord, RunRecord, StageRow, StoreError
from deploybench.store.writer import prepare_samples, read_samples

T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)


def run(**kw) -> RunRecord:
    fields = dict(run_key="deploybench_run/manual__1", dag_id="deploybench_run", status="success",
                  started_at=T0, fingerprint="abc", inventory="lab", node_count=4)
    return RunRecord(**{**fields, **kw})


def phase(**kw) -> PhaseRecord:
    fields = dict(phase="sustained", offered_rps=20, achieved_rps=19.5, output_tps=1200, requests=600, errors=6,
                  error_rate=0.01, latency_p50_ms=300, latency_p90_ms=600, latency_p99_ms=900,
                  latency_p999_ms=1500, duration_s=30, started_at=T0)
    return PhaseRecord(**{**fields, **kw})


def samples(n: int = 5) -> pd.DataFrame:
    return pd.DataFrame({
        "ts": pd.date_range(T0, periods=n, freq="10ms", tz="UTC"),
        "phase": "sustained", "node": "n01", "status": 200, "error_kind": None,
        "latency_ms": np.linspace(100, 200, n), "ttft_ms": np.nan, "prompt_tokens": 200, "output_tokens": 64,
    })


def test_run_record_valid_and_frozen():
    r = run(finished_at=T0 + timedelta(minutes=5), tags={"team": "infra"})
    assert r.node_count == 4 and r.tags == {"team": "infra"}
    with pytest.raises(ValidationError):
        r.status = "failed"


@pytest.mark.parametrize("bad", [
    {"status": "done"},
    {"started_at": datetime(2026, 12, 2, 10, 0)},  # naive: refused
    {"finished_at": T0 - timedelta(seconds=1)},
    {"run_key": ""},
    {"node_count": -1},
    {"inventroy": "typo"},
])
def test_run_record_refuses(bad):
    with pytest.raises(ValidationError):
        run(**bad)


def test_run_record_from_config_takes_fingerprint_and_tags():
    config = RunConfig.parse({"inventory": "lab", "nodes": 2, "tags": {"t": "1"}})
    r = RunRecord.from_config("k", config, dag_id="d", status="running", started_at=T0)
    assert r.fingerprint == config.fingerprint()
    assert (r.inventory, r.node_count, r.tags) == ("lab", 2, {"t": "1"})
    assert r.config["load"]["rate"] == config.load.rate


def test_phase_record_defaults_to_cluster_and_checks_coherence():
    assert phase().node == "*"
    with pytest.raises(ValidationError, match="errors=700 is more than requests=600"):
        phase(errors=700, error_rate=1.0)
    with pytest.raises(ValidationError, match="must not decrease"):
        phase(latency_p99_ms=100)
    with pytest.raises(ValidationError, match="does not match"):
        phase(error_rate=0.5)
    with pytest.raises(ValidationError):
        phase(ttft_p50_ms=50, ttft_p99_ms=10)
    with pytest.raises(ValidationError):
        phase(achieved_rps=float("nan"))


def test_stage_record():
    assert StageRow(stage="preflight", status="success", seconds=1.5).summary == {}
    with pytest.raises(ValidationError):
        StageRow(stage="preflight", status="ok")
    with pytest.raises(ValidationError):
        StageRow(stage="preflight", status="success", seconds=-1)


def test_prepare_samples_coerces_types():
    out = prepare_samples(samples().assign(status="200", error_kind=["", "timeout", None, "", ""]))
    assert list(out.columns) == list(SAMPLE_COLUMNS)
    assert out["status"].dtype == "int64"
    assert out["error_kind"].isna().tolist() == [True, False, True, True, True]
    assert str(out["ts"].dt.tz) == "UTC"


@pytest.mark.parametrize("change, message", [
    (lambda f: f.drop(columns="latency_ms"), "missing columns \\['latency_ms'\\]"),
    (lambda f: f.assign(extra=1), "unknown columns \\['extra'\\]"),
    (lambda f: f.assign(ts=f["ts"].dt.tz_localize(None)), "naive timestamps"),
    (lambda f: f.assign(latency_ms=[1.0, 2.0, "abc", 4.0, 5.0]), "latency_ms; first at row 2 \\(value 'abc'\\)"),
    (lambda f: f.assign(latency_ms=[1.0, -2.0, 3.0, 4.0, 5.0]), "negative or infinite value in column latency_ms"),
    (lambda f: f.assign(status=[200, 200, 200, None, 200]), "no value in column status; first at row 3"),
    (lambda f: f.assign(prompt_tokens=[1, 2, 3, 4, 2**31]), "outside 0..2147483647"),
    (lambda f: f.assign(output_tokens=1.5), "fractional value"),
    (lambda f: f.assign(node=""), "empty string in column node"),
])
def test_prepare_samples_refuses_bad_rows(change, message):
    with pytest.raises(StoreError, match=message):
        prepare_samples(change(samples()))


def test_read_samples_from_csv_and_jsonl(tmp_path):
    frame = samples()
    frame.to_csv(tmp_path / "s.csv.gz", index=False)
    frame.to_json(tmp_path / "s.jsonl", orient="records", lines=True, date_format="iso")
    for name in ("s.csv.gz", "s.jsonl"):
        out = prepare_samples(read_samples(tmp_path / name))
        assert out["ts"].tolist() == frame["ts"].tolist()
        assert np.allclose(out["latency_ms"], frame["latency_ms"])
    with pytest.raises(StoreError, match="unknown format"):
        (tmp_path / "s.txt").write_text("x")
        read_samples(tmp_path / "s.txt")
    with pytest.raises(StoreError, match="does not exist"):
        read_samples(tmp_path / "nope.csv")
