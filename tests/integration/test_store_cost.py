"""The cost per million output tokens through the results store on a real PostgreSQL (migration 0008_cost): written
and read back, absent stays absent, an older migration's database upgrades, and a comparison of configurations
answers "which is cheapest at our latency target"."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import text

from deploybench.analyse.compare import compare
from deploybench.report.compare_html import render
from deploybench.store import db, load_run, migrate, write_run
from deploybench.store.query import RunFilter
from tests.support import store_fixtures as fx

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(120)]


def _store(dsn: str, name: str, hour: int, latency_ms: float, price: tuple[float, str] | None,
           max_num_seqs: int) -> str:
    """A run of the fixtures' workload with its cluster row priced at ``price`` (cost per 1M tokens, currency)."""
    cfg = fx.config(max_num_seqs=max_num_seqs)
    key = f"deploybench_run/manual__cost_{name}"
    frame = fx.samples(400, latency_ms, np.random.default_rng(hour), start=fx.T0 + timedelta(hours=hour))
    phases = [p.model_copy(update={"cost_per_million_output_tokens": price[0], "cost_currency": price[1]})
              if price else p for p in fx.phase_from(frame, 20)]
    write_run(dsn, fx.run_record(key, cfg, fx.T0 + timedelta(hours=hour)), [], phases, frame, facts=fx.facts(cfg))
    return key


def test_the_cost_and_its_currency_round_trip_and_absent_stays_absent(dsn):
    priced = _store(dsn, "rt", 1, 400.0, (4.166667, "USD"), 8)
    unpriced = _store(dsn, "none", 2, 400.0, None, 8)
    got = load_run(dsn, priced)
    (phase,) = got.phases
    assert phase.cost_per_million_output_tokens == pytest.approx(4.166667) and phase.cost_currency == "USD"
    (bare,) = load_run(dsn, unpriced).phases
    assert bare.cost_per_million_output_tokens is None and bare.cost_currency is None
    with db.get_engine(dsn).connect() as conn:  # NULL in the table, not 0
        stored = conn.execute(text("SELECT cost_per_million_output_tokens IS NULL, cost_currency IS NULL FROM "
                                   "load_phases WHERE run_key = :k"), {"k": unpriced}).one()
    assert tuple(stored) == (True, True)


def test_a_database_at_0007_upgrades_to_0008_cost_keeping_its_rows(fresh_dsn):
    from alembic import command

    from deploybench.store.db import _alembic_config

    engine = db.get_engine(fresh_dsn)
    cfg = _alembic_config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0007")
    with engine.connect() as conn:
        cols = {r[0] for r in conn.execute(text("SELECT column_name FROM information_schema.columns WHERE "
                                                "table_name = 'load_phases'"))}
    assert "energy_per_output_token_j" in cols and "cost_currency" not in cols
    assert migrate(fresh_dsn) == db.head_revision()  # through 0008_cost and every later one
    with engine.connect() as conn:
        cols = {r[0] for r in conn.execute(text("SELECT column_name FROM information_schema.columns WHERE "
                                                "table_name = 'load_phases'"))}
    assert {"cost_per_million_output_tokens", "cost_currency"} <= cols


def test_a_comparison_names_the_cheapest_configuration_meeting_the_slo(dsn):
    # P99 target 2000 ms (the fixtures' SLO); latencies are log-normal around the median given
    keys = {"fast_dear": _store(dsn, "fast_dear", 3, 300.0, (9.0, "USD"), 16),
            "slow_cheap": _store(dsn, "slow_cheap", 4, 500.0, (3.0, "USD"), 8),
            "too_slow": _store(dsn, "too_slow", 5, 2600.0, (1.0, "USD"), 4),  # cheapest, misses the SLO
            "dominated": _store(dsn, "dominated", 6, 600.0, (5.0, "USD"), 12),  # dearer and slower than slow_cheap
            "unpriced": _store(dsn, "unpriced", 7, 250.0, None, 32)}
    cmp = compare(dsn, RunFilter(run_keys=tuple(keys.values())), save=False)
    (group,) = cmp.groups
    t = cmp.table.set_index("run_key")
    assert t.loc[keys["slow_cheap"], "cost_per_million_output_tokens"] == 3.0
    assert t.loc[keys["slow_cheap"], "cost_currency"] == "USD"
    assert pd.isna(t.loc[keys["unpriced"], "cost_currency"])  # absent, not 0
    assert pd.isna(t.loc[keys["unpriced"], "cost_per_million_output_tokens"])
    assert not t.loc[keys["too_slow"], "slo_met"]
    assert cmp.cost_pareto[group] == [keys["too_slow"], keys["slow_cheap"], keys["fast_dear"]]
    assert cmp.cheapest[group] == {"USD": keys["slow_cheap"]}
    html = render(cmp)
    assert "Cheapest configuration meeting the SLO (P99 within 2000 ms)" in html and "3 USD per million" in html
    assert "<th>cost per 1M output tokens</th>" in html and "<td>9 USD</td>" in html


def test_the_energy_per_request_round_trips_beside_the_energy_per_token_and_absent_stays_null(dsn):
    """Migration 0011: the GPUs' energy per request answered is stored with the phase (the cluster row) and read back;
    a phase whose power was not measured keeps NULL, never 0."""
    cfg = fx.config(max_num_seqs=8)
    frame = fx.samples(200, 300.0, np.random.default_rng(7), start=fx.T0 + timedelta(hours=9))
    measured = [p.model_copy(update={"energy_per_output_token_j": 0.2875, "energy_per_request_j": 18.4})
                for p in fx.phase_from(frame, 10)]
    key = "deploybench_run/manual__energy_rt"
    write_run(dsn, fx.run_record(key, cfg, fx.T0 + timedelta(hours=9)), [], measured, frame, facts=fx.facts(cfg))
    (phase,) = load_run(dsn, key).phases
    assert (phase.energy_per_output_token_j, phase.energy_per_request_j) == (0.2875, 18.4)
    bare_key = "deploybench_run/manual__energy_none"
    write_run(dsn, fx.run_record(bare_key, cfg, fx.T0 + timedelta(hours=10)), [], fx.phase_from(frame, 10), frame,
              facts=fx.facts(cfg))
    with db.get_engine(dsn).connect() as conn:
        stored = conn.execute(text("SELECT energy_per_request_j IS NULL FROM load_phases WHERE run_key = :k"),
                              {"k": bare_key}).scalar_one()
    assert stored is True
