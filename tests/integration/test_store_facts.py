"""Revision 0002 against a real PostgreSQL: upgrade from 0001, identities and series, stage facts,
server metrics by COPY, the exclusion flag, and a store killed half-way then retried."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from alembic import command
from sqlalchemy import create_engine, func, select, text

from deploybench.store import StoreError, db, load_run, write_run
from deploybench.store.models import (
    CapacityStep,
    Cluster,
    FanoutNode,
    PreflightLink,
    RequestSample,
    RolloutStep,
    Run,
    Series,
    ServerMetric,
)
from deploybench.store.query import UnknownRuns, set_excluded
from tests.support import store_fixtures as fx

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(120)]


def _count(dsn: str, model, key: str) -> int:
    with db.open_store(dsn).connect() as conn:
        return conn.execute(select(func.count()).select_from(model).where(model.run_key == key)).scalar_one()


def test_upgrade_from_0001_keeps_old_runs():
    test_dsn, _ = fx.make_database()
    try:
        engine = create_engine(test_dsn)
        cfg = db._alembic_config()
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0001")
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO runs (run_key, dag_id, status, started_at, fingerprint, inventory, "
                              "node_count) VALUES ('old/1', 'd', 'success', now(), 'fp', 'lab', 2)"))
        engine.dispose()
        assert db.migrate(test_dsn) == db.head_revision()
        stored = load_run(test_dsn, "old/1")
        assert stored is not None and stored.series_id is None and stored.excluded is False
        assert stored.run.trigger is None
    finally:
        fx.drop_database(test_dsn)


def test_identities_are_shared_and_series_line_up(dsn):
    rng = np.random.default_rng(7)
    a, b, c = (f"deploybench_run/ident_{i}" for i in "abc")
    cfg, other = fx.config(), fx.config(max_num_seqs=16)
    for key, conf in ((a, cfg), (b, cfg), (c, other)):
        frame = fx.samples(100, 300, rng)
        write_run(dsn, fx.run_record(key, conf), [], fx.phase_from(frame, 20), frame, facts=fx.facts(conf))
    runs = {k: load_run(dsn, k) for k in (a, b, c)}
    assert runs[a].series_id == runs[b].series_id != runs[c].series_id
    assert runs[a].series_fingerprint == fx.facts(cfg).identity.fingerprint
    assert fx.facts(cfg).identity.differences(fx.facts(other).identity) == ["serving"]
    with db.open_store(dsn).connect() as conn:
        assert conn.execute(select(func.count()).select_from(Cluster)).scalar_one() == 1  # one cluster row, shared
        assert conn.execute(select(func.count()).select_from(Series)).scalar_one() == 2
    # the fault knob of the simulated engine does not start a new series
    assert fx.facts(fx.config(slowdown=1.1)).identity.fingerprint == fx.facts(cfg).identity.fingerprint


def test_facts_round_trip_and_a_rewrite_replaces_them(dsn):
    rng = np.random.default_rng(8)
    key = "deploybench_run/facts_1"
    frame = fx.samples(200, 250, rng)
    metrics = pd.DataFrame({"ts": [fx.T0 + timedelta(seconds=i) for i in range(10)] * 2,
                            "node": ["n1"] * 10 + ["n2"] * 10, "metric": "vllm:num_requests_running",
                            "labels": [{"model_name": "m"}] * 20, "value": np.arange(20.0), "phase": "sustained"})
    facts = fx.facts(fx.config(), metrics, capacity=[(4, 4, 200, True), (8, 8, 400, True), (16, 11, 3000, False)])
    for _ in range(2):  # the second write replaces, never duplicates
        res = write_run(dsn, fx.run_record(key, fx.config()), [], fx.phase_from(frame, 20), frame, facts=facts)
    assert res.replaced and res.facts["server_metrics"] == 20
    for model, n in ((PreflightLink, 2), (FanoutNode, 1), (RolloutStep, 2), (CapacityStep, 3), (ServerMetric, 20),
                     (RequestSample, 200)):
        assert _count(dsn, model, key) == n, model.__tablename__
    with db.open_store(dsn).connect() as conn:
        labels = conn.execute(select(ServerMetric.labels).where(ServerMetric.run_key == key)).scalars().first()
        trig = conn.execute(select(Run.trigger).where(Run.run_key == key)).scalar_one()
    assert labels == "model_name=m" and trig == "manual"


def test_exclusion_needs_a_reason_and_survives_a_rewrite(dsn):
    key = "deploybench_run/excl_1"
    write_run(dsn, fx.run_record(key, fx.config()), facts=fx.facts(fx.config()))
    with pytest.raises(StoreError, match="needs a reason"):
        set_excluded(dsn, key, True, "  ")
    with pytest.raises(UnknownRuns, match="no/such/run"):
        set_excluded(dsn, "no/such/run", True, "x")
    set_excluded(dsn, key, True, "n2 was throttling")
    write_run(dsn, fx.run_record(key, fx.config()), facts=fx.facts(fx.config()))  # a retried store task
    stored = load_run(dsn, key)
    assert stored.excluded and stored.exclude_reason == "n2 was throttling"


def test_bad_server_metrics_are_refused_before_writing(dsn):
    key = "deploybench_run/badmetrics"
    bad = pd.DataFrame({"ts": ["not a time"], "node": ["n1"], "metric": ["m"], "value": [1.0]})
    with pytest.raises(StoreError, match="no valid ts"):
        write_run(dsn, fx.run_record(key, fx.config()), facts=fx.facts(fx.config(), bad))
    assert load_run(dsn, key) is None


_WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    sys.path.insert(0, {root!r})  # a fresh interpreter: the checkout, for tests.support
    from tests.support import store_fixtures as fx
    from deploybench.store import write_run, writer
    rng = np.random.default_rng(1)
    frame = fx.samples(100_000, 300, rng)
    real = writer._copy_samples
    def slow_copy(conn, samples, run_key):
        n = real(conn, samples, run_key)          # every row sent, transaction still open
        print("COPIED", flush=True)
        time.sleep(60)                            # killed here
        return n
    writer._copy_samples = slow_copy
    write_run({dsn!r}, fx.run_record({key!r}, fx.config()), [], fx.phase_from(frame, 20), frame,
              facts=fx.facts(fx.config()))
""")


def test_a_store_killed_half_way_leaves_nothing_and_the_retry_stores_it_whole(dsn, tmp_path):
    key = "deploybench_run/killed_1"
    script = tmp_path / "writer.py"
    script.write_text(_WRITER.format(root=str(Path(__file__).resolve().parents[2]), dsn=dsn, key=key))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "COPIED", line
        proc.kill()  # SIGKILL: no rollback from the client, PostgreSQL must drop the open transaction itself
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 20
    while _count(dsn, RequestSample, key) or load_run(dsn, key) is not None:
        assert time.monotonic() < deadline, "the killed writer's rows became visible"
        time.sleep(0.2)
    rng = np.random.default_rng(1)
    frame = fx.samples(100_000, 300, rng)
    res = write_run(dsn, fx.run_record(key, fx.config()), [], fx.phase_from(frame, 20), frame,
                    facts=fx.facts(fx.config()))
    assert not res.replaced and res.samples == 100_000
    assert _count(dsn, RequestSample, key) == 100_000 and _count(dsn, RolloutStep, key) == 2


def test_node_windows_are_upserted_per_window_node_figure_and_source(dsn):
    from deploybench.store.facts import NodeWindowRow

    key = "deploybench_run/windows_1"
    frame = fx.samples(50, 250, np.random.default_rng(3))

    def rows(util: float) -> list[NodeWindowRow]:
        return [NodeWindowRow(phase="probe", step=s, node=n, metric="gpu_util_pct", source=src, unit="%",
                              mean=util + s, max=util + s + 5, samples=6)
                for s in (1, 2) for n in ("n1", "n2") for src in ("prometheus", "scrape")] + [
            NodeWindowRow(phase="sustained", node="n1", metric="gpu_power_w", source="prometheus", unit="W",
                          reason="prometheus at http://p:9090 did not answer")]

    for util in (10.0, 30.0):  # the second write replaces each figure, never adds a second
        base = fx.facts(fx.config())
        facts = base.model_copy(update={"node_windows": rows(util)})
        res = write_run(dsn, fx.run_record(key, fx.config()), [], fx.phase_from(frame, 20), frame, facts=facts)
        assert res.facts["node_windows"] == 9
    stored = load_run(dsn, key)
    assert stored is not None and len(stored.node_windows) == 9
    got = {(w.phase, w.step, w.node, w.source): w for w in stored.node_windows if w.metric == "gpu_util_pct"}
    assert got[("probe", 2, "n2", "scrape")].mean == 32.0 and got[("probe", 2, "n2", "scrape")].max == 37.0
    (absent,) = [w for w in stored.node_windows if w.metric == "gpu_power_w"]
    assert absent.mean is None and absent.max is None and absent.samples == 0 and "did not answer" in absent.reason
