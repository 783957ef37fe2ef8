"""DSN resolution, URL normalisation and the embedded server's stale-state checks: no database needed."""

from __future__ import annotations

import os

import pytest

from deploybench.store import StoreError, db, embedded
from deploybench.store.models import VERSION_TABLE, Base


@pytest.fixture()
def fake_embedded(monkeypatch):
    calls = []

    def ensure_running(*a, **kw):
        calls.append(1)
        return "postgresql+psycopg://postgres@/deploybench?host=/x"

    monkeypatch.setattr(embedded, "ensure_running", ensure_running)
    return calls


def test_explicit_dsn_wins_over_env(monkeypatch, fake_embedded):
    monkeypatch.setenv(db.ENV_DSN, "postgresql://env@h/envdb")
    r = db.resolve_dsn("postgresql://arg@h/argdb")
    assert (r.source, r.dsn) == ("argument", "postgresql+psycopg://arg@h/argdb")
    assert not fake_embedded


def test_env_dsn_wins_over_embedded(monkeypatch, fake_embedded):
    monkeypatch.setenv(db.ENV_DSN, "postgres://u:secret@h:5433/envdb")
    r = db.resolve_dsn()
    assert (r.source, r.dsn) == ("env", "postgresql+psycopg://u:secret@h:5433/envdb")
    assert not fake_embedded


def test_embedded_is_the_last_resort(monkeypatch, fake_embedded):
    monkeypatch.delenv(db.ENV_DSN, raising=False)
    r = db.resolve_dsn()
    assert r.source == "embedded" and fake_embedded == [1]
    monkeypatch.setenv(db.ENV_DSN, "  ")  # blank counts as unset
    assert db.resolve_dsn().source == "embedded"


def test_no_embedded_start_when_told_not_to(monkeypatch, fake_embedded):
    monkeypatch.delenv(db.ENV_DSN, raising=False)
    with pytest.raises(StoreError, match="no results DSN"):
        db.resolve_dsn(start_embedded=False)
    assert not fake_embedded


@pytest.mark.parametrize("dsn, message", [
    ("sqlite:///x.db", "needs PostgreSQL"),
    ("not a url", "is not a database URL"),
    ("postgresql://u@h", "names no database"),
])
def test_bad_dsns_are_refused(dsn, message):
    with pytest.raises(StoreError, match=message):
        db.normalize_dsn(dsn)


def test_passwords_are_masked_in_messages():
    assert "secret" not in db.redact("postgresql://u:secret@h/db")
    with pytest.raises(StoreError) as info:
        db.normalize_dsn("mysql://u:secret@h/db")
    assert "secret" not in str(info.value)


def test_migrations_are_packaged_and_head_is_known():
    assert (db.MIGRATIONS_DIR / "env.py").is_file()
    assert db.head_revision() == "0013_run_files"
    assert {"runs", "stage_results", "load_phases", "request_samples", "series", "clusters", "software",
            "model_artifacts", "serving_configs", "workloads", "preflight_nodes", "preflight_links", "fanout_nodes",
            "rollout_steps", "capacity_steps", "server_metrics", "comparisons", "change_points",
            "verdicts", "cluster_leases", "lease_events", "lease_waiters", "node_windows",
            "findings", "run_files"} == set(Base.metadata.tables)
    assert VERSION_TABLE != "alembic_version"  # never collide with another project's alembic in a shared DB


def test_stale_postmaster_pid_is_not_taken_for_a_server(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPLOYBENCH_HOME", str(tmp_path))
    pgdata = embedded.data_dir()
    pgdata.mkdir(parents=True)
    # a live process that is not postgres (PID reuse after a crash): this test process
    (pgdata / "postmaster.pid").write_text(f"{os.getpid()}\n{pgdata}\n0\n5432\n{pgdata}\n\n0 0\nready\n")
    assert embedded._read_pidfile(pgdata)[0] == os.getpid()
    assert not embedded._is_our_postmaster(os.getpid(), pgdata)
    assert embedded.running_dsn() is None
    (pgdata / "postmaster.pid").write_text("garbage")  # half-written
    assert embedded._read_pidfile(pgdata) == (0, None, 5432)
    embedded._remove_stale(pgdata, 0)
    assert not (pgdata / "postmaster.pid").exists()
    assert embedded.stop() is False  # nothing running: a no-op
