"""The results store against a real PostgreSQL.

The server is DEPLOYBENCH_DSN's if set, else the embedded one (started if needed).
The tests work in a throwaway database (tests/support/fixtures.py's ``dsn``) dropped at the end,
so the user's results are never touched.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import numpy as np
import pandas as pd
import psycopg
import pytest
from sqlalchemy import text

from deploybench import cli
from deploybench.store import (
    PhaseRecord,
    RunRecord,
    StageRow,
    StoreError,
    count_samples,
    db,
    latest_runs,
    load_run,
    load_samples,
    migrate,
    write_run,
    writer,
)
from deploybench.store.models import VERSION_TABLE, Base

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(90)]  # a lock never released, a server that never answers

T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)




def make_run(key: str, **kw) -> RunRecord:
    fields = dict(run_key=key, dag_id="deploybench_run", airflow_run_id=key.split("/")[-1], status="success",
                  started_at=T0, finished_at=T0 + timedelta(minutes=3), config={"load": {"rate": 8.0}},
                  fingerprint="fp-" + key[-4:], inventory="lab", node_count=4, tags={"suite": "it"})
    return RunRecord(**{**fields, **kw})


def make_phases(rps: float) -> list[PhaseRecord]:
    base = dict(offered_rps=rps, achieved_rps=rps * 0.98, output_tps=rps * 60, requests=1000, errors=10,
                error_rate=0.01, dropped_iterations=2, latency_p50_ms=200, latency_p90_ms=400, latency_p99_ms=900,
                latency_p999_ms=1200, duration_s=30, started_at=T0)
    return [PhaseRecord(phase="sustained", **base),
            PhaseRecord(phase="sustained", node="n01", ttft_p50_ms=20, ttft_p99_ms=80, **base)]


def make_samples(n: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    status = np.where(rng.random(n) < 0.01, 503, 200)
    return pd.DataFrame({
        "ts": pd.date_range(T0, periods=n, freq="3ms", tz="UTC"),
        "phase": np.where(np.arange(n) < n // 2, "probe", "sustained"),
        "node": [f"n0{i % 4 + 1}" for i in range(n)],
        "status": status,
        "error_kind": np.where(status == 503, "http_503", None),
        "latency_ms": rng.gamma(2.0, 100.0, n),
        "ttft_ms": np.where(rng.random(n) < 0.5, rng.gamma(2.0, 10.0, n), np.nan),
        "prompt_tokens": rng.integers(50, 500, n),
        "output_tokens": rng.integers(1, 128, n),
    })


STAGES = [StageRow(stage="preflight", status="success", started_at=T0, seconds=2.5, summary={"nodes": 4}),
          StageRow(stage="load", status="success", started_at=T0, seconds=60.0, summary={"rps": 8.0})]


def test_migrate_twice_is_a_no_op(dsn):
    assert migrate(dsn) == db.head_revision()
    assert migrate(dsn) == db.head_revision()
    with db.get_engine(dsn).connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {VERSION_TABLE}")).scalar_one() == 1


def test_models_and_migrations_agree(dsn):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    migrate(dsn)
    with db.get_engine(dsn).connect() as conn:
        context = MigrationContext.configure(conn, opts={
            "version_table": VERSION_TABLE, "compare_type": True, "compare_server_default": True,
        })
        assert compare_metadata(context, Base.metadata) == []


def test_write_then_read_back(dsn):
    key = f"deploybench_run/manual__{uuid.uuid4().hex[:8]}"
    frame = make_samples(10_000)
    result = write_run(dsn, make_run(key), STAGES, make_phases(8.0), frame)
    assert (result.replaced, result.stages, result.phases, result.samples) == (False, 2, 2, 10_000)

    stored = load_run(dsn, key)
    assert stored.run == make_run(key)
    assert stored.stages == STAGES
    assert stored.phases == make_phases(8.0)
    assert stored.sample_count == 10_000
    assert count_samples(dsn, key, phase="probe") == 5_000

    back = load_samples(dsn, key)
    assert back["ts"].tolist() == frame["ts"].tolist()
    assert np.array_equal(back["latency_ms"].to_numpy(), frame["latency_ms"].to_numpy())  # binary COPY: exact
    assert back["ttft_ms"].isna().sum() == frame["ttft_ms"].isna().sum()
    assert (back["error_kind"] == "http_503").sum() == (frame["status"] == 503).sum()
    assert back["error_kind"].isna().sum() == (frame["status"] == 200).sum()
    assert load_run(dsn, "no/such-run") is None


def test_writing_again_replaces_without_duplicates(dsn):
    key = f"deploybench_run/retry__{uuid.uuid4().hex[:8]}"
    write_run(dsn, make_run(key), STAGES, make_phases(8.0), make_samples(3_000))
    first = load_run(dsn, key)

    again = write_run(dsn, make_run(key, status="failed", node_count=2), STAGES[:1], make_phases(16.0),
                      make_samples(1_000, seed=1))
    assert again.replaced
    stored = load_run(dsn, key)
    assert (stored.run.status, stored.run.node_count) == ("failed", 2)
    assert [s.stage for s in stored.stages] == ["preflight"]
    assert [(p.phase, p.node, p.offered_rps) for p in stored.phases] == [("sustained", "*", 16.0),
                                                                          ("sustained", "n01", 16.0)]
    assert stored.sample_count == 1_000
    assert stored.created_at == first.created_at and stored.updated_at > first.updated_at
    assert sum(r.run_key == key for r in latest_runs(dsn, 1000)) == 1


def test_invalid_samples_leave_the_stored_run_untouched(dsn):
    key = f"deploybench_run/bad__{uuid.uuid4().hex[:8]}"
    write_run(dsn, make_run(key), STAGES, make_phases(8.0), make_samples(2_000))
    bad = make_samples(2_000).astype({"latency_ms": object})
    bad.loc[1_500, "latency_ms"] = "n/a"
    with pytest.raises(StoreError, match="latency_ms"):
        write_run(dsn, make_run(key, status="failed"), [], [], bad)
    stored = load_run(dsn, key)
    assert (stored.run.status, len(stored.stages), stored.sample_count) == ("success", 2, 2_000)


def test_failure_half_way_through_copy_rolls_back(dsn, monkeypatch):
    """A row the database refuses after the run row was upserted and the children deleted."""
    key = f"deploybench_run/half__{uuid.uuid4().hex[:8]}"
    write_run(dsn, make_run(key), STAGES, make_phases(8.0), make_samples(2_000))

    frame = make_samples(20_000, seed=2)
    prepared = writer.prepare_samples(frame)
    prepared["latency_ms"] = prepared["latency_ms"].astype(object)
    prepared.loc[15_000, "latency_ms"] = "n/a"  # a bad row that got past validation: refused inside COPY
    monkeypatch.setattr(writer, "prepare_samples", lambda _: prepared)
    monkeypatch.setattr(writer, "COPY_CHUNK_ROWS", 5_000)  # rows before the bad one are already sent

    with pytest.raises(StoreError, match="rolled back"):
        write_run(dsn, make_run(key, status="failed"), STAGES[:1], make_phases(99.0), frame)
    stored = load_run(dsn, key)
    assert stored.run.status == "success"
    assert len(stored.stages) == 2 and stored.phases == make_phases(8.0)
    assert stored.sample_count == 2_000


def test_samples_go_in_with_copy(dsn, monkeypatch):
    statements = []
    real_copy = psycopg.Cursor.copy
    real_executemany = psycopg.Cursor.executemany

    def spy_copy(self, statement, *a, **kw):
        statements.append(("copy", str(statement)))
        return real_copy(self, statement, *a, **kw)

    def spy_executemany(self, query, *a, **kw):
        statements.append(("executemany", str(query)))
        return real_executemany(self, query, *a, **kw)

    monkeypatch.setattr(psycopg.Cursor, "copy", spy_copy)
    monkeypatch.setattr(psycopg.Cursor, "executemany", spy_executemany)
    key = f"deploybench_run/copy__{uuid.uuid4().hex[:8]}"
    write_run(dsn, make_run(key), STAGES, make_phases(8.0), make_samples(5_000))

    copies = [s for kind, s in statements if kind == "copy"]
    assert len(copies) == 1 and copies[0].startswith("COPY request_samples")
    assert not any("request_samples" in s for kind, s in statements if kind == "executemany")
    assert count_samples(dsn, key) == 5_000


def test_samples_from_a_file_and_a_run_without_samples(dsn, tmp_path):
    key = f"deploybench_run/file__{uuid.uuid4().hex[:8]}"
    make_samples(500).to_csv(tmp_path / "samples.csv.gz", index=False)
    assert write_run(dsn, make_run(key), STAGES, [], tmp_path / "samples.csv.gz").samples == 500
    assert count_samples(dsn, key) == 500
    assert write_run(dsn, make_run(key), [], [], None).samples == 0
    assert count_samples(dsn, key) == 0


def test_duplicate_stage_is_refused_before_writing(dsn):
    key = f"deploybench_run/dup__{uuid.uuid4().hex[:8]}"
    with pytest.raises(StoreError, match="appears twice"):
        write_run(dsn, make_run(key), STAGES + STAGES[:1], [], None)
    assert load_run(dsn, key) is None


def test_cli_lists_runs(dsn, capsys):
    key = f"deploybench_run/cli__{uuid.uuid4().hex[:8]}"
    write_run(dsn, make_run(key, started_at=datetime.now(UTC), finished_at=None), [], [], None)
    assert cli.main(["store", "--dsn", dsn, "runs", "-n", "5"]) == 0
    out = capsys.readouterr().out
    assert key in out and "RUN KEY" in out
    assert cli.main(["store", "--dsn", dsn, "migrate"]) == 0
    assert f"revision {db.head_revision()}" in capsys.readouterr().out
