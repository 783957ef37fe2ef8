"""Comparison across configurations on a real PostgreSQL, from stored runs with per-request samples."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import select

from deploybench import cli
from deploybench.analyse import AnalysisError
from deploybench.analyse.compare import compare
from deploybench.analyse.history import analyse_series
from deploybench.store import db, write_run
from deploybench.store.models import Comparison as ComparisonRow
from deploybench.store.query import EmptySelection, RunFilter, UnknownRuns
from tests.support import store_fixtures as fx

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(120)]

# (key suffix, max_num_seqs, prompt tokens, median latency ms, capacity steps (offered, achieved, p99, ok))
CONFIGS = {
    "seq8": (8, 32, 400.0, [(4, 4, 500, True), (8, 8, 800, True), (16, 12, 2600, False)]),
    "seq16": (16, 32, 480.0, [(4, 4, 600, True), (8, 8, 900, True), (16, 16, 1500, True), (32, 20, 5000, False)]),
    "seq4": (4, 32, 900.0, [(4, 4, 1200, True), (8, 6, 3000, False)]),
    "seq8b": (8, 32, 400.0, []),  # a repetition of seq8
    "longprompt": (8, 512, 700.0, []),  # another workload
}


@pytest.fixture(scope="module")
def stored(dsn):
    rng = np.random.default_rng(42)
    keys = {}
    for i, (name, (seqs, prompt, lat, cap)) in enumerate(CONFIGS.items()):
        cfg = fx.config(max_num_seqs=seqs, prompt_tokens=prompt)
        key = f"deploybench_run/manual__{name}"
        frame = fx.samples(400, lat, rng, start=fx.T0 + timedelta(hours=i))
        write_run(dsn, fx.run_record(key, cfg, fx.T0 + timedelta(hours=i)), [], fx.phase_from(frame, 20), frame,
                  facts=fx.facts(cfg, capacity=cap))
        keys[name] = key
    return dsn, keys


def test_table_best_and_pareto(stored):
    dsn, k = stored
    cmp = compare(dsn, RunFilter(run_keys=(k["seq8"], k["seq16"], k["seq4"])))
    t = cmp.table.set_index("run_key")
    assert t.loc[k["seq16"], "capacity_rps"] == 16 and t.loc[k["seq8"], "capacity_rps"] == 8
    assert t.loc[k["seq4"], "capacity_rps"] == 4
    assert t["slo_met"].all()
    (group,) = cmp.groups
    assert cmp.best[group] == k["seq16"]  # highest capacity meeting the SLO
    # seq4 has lower capacity and higher P99 than seq8: dominated; seq8 (lower P99) and seq16 (more capacity) not
    assert set(cmp.pareto[group]) == {k["seq8"], k["seq16"]}
    assert 0 < t.loc[k["seq8"], "goodput_rps"] <= t.loc[k["seq8"], "achieved_rps"] * 1.05
    with db.open_store(dsn).connect() as conn:
        row = conn.execute(select(ComparisonRow.run_keys, ComparisonRow.params, ComparisonRow.result)
                           .where(ComparisonRow.id == cmp.id)).one()
    assert row.run_keys == [k["seq8"], k["seq16"], k["seq4"]] and row.params["alpha"] == 0.05
    assert row.result["best"] == {group: k["seq16"]}


def test_changes_against_a_baseline_come_with_a_rank_test(stored):
    dsn, k = stored
    cmp = compare(dsn, RunFilter(run_keys=(k["seq8"], k["seq16"], k["seq8b"])), baseline=k["seq8"])
    ch = cmp.changes.set_index(["run_key", "figure"])
    slower = ch.loc[(k["seq16"], "latency_p99_ms")]
    assert slower["direction"] == "worse" and slower["significant"] and slower["p_value"] < 1e-6
    same = ch.loc[(k["seq8b"], "latency_p50_ms")]  # the same distribution: no significant change
    assert not same["significant"] and same["p_value"] > 0.05
    assert slower["change"] == pytest.approx(slower["value"] / slower["baseline"] - 1) and slower["change"] > 0.1
    assert pd.isna(ch.loc[(k["seq16"], "capacity_rps"), "p_value"])  # one number per run: no test


def test_other_workloads_are_separated_and_refused_as_baseline(stored):
    dsn, k = stored
    cmp = compare(dsn, RunFilter(run_keys=(k["seq8"], k["seq16"], k["longprompt"])))
    assert len(cmp.groups) == 2
    assert [k["longprompt"]] in list(cmp.groups.values())
    with pytest.raises(AnalysisError, match="another workload"):
        compare(dsn, RunFilter(run_keys=(k["longprompt"], k["seq8"])), baseline=k["longprompt"])


def test_bad_selections_name_what_is_wrong(stored):
    dsn, k = stored
    with pytest.raises(UnknownRuns, match="nope/1.*nope/2"):
        compare(dsn, RunFilter(run_keys=(k["seq8"], "nope/1", "nope/2")))
    with pytest.raises(EmptySelection, match="model='no-such-model'"):
        compare(dsn, RunFilter(model="no-such-model"))
    with pytest.raises(UnknownRuns, match="baseline 'nope/3'"):
        compare(dsn, RunFilter(run_keys=(k["seq8"],)), baseline="nope/3")
    with pytest.raises(AnalysisError, match="same series"):
        analyse_series(dsn, k["seq8"], baseline=k["seq16"], save=False)


def test_filters_pick_runs(stored):
    dsn, k = stored
    got = compare(dsn, RunFilter(model="sim-model", since=fx.T0 + timedelta(minutes=30),
                                 until=fx.T0 + timedelta(hours=2, minutes=30), tags={"suite": "i7"}), save=False)
    assert got.run_keys() == [k["seq16"], k["seq4"]]


def test_cli_compare_prints_and_writes_a_report(stored, capsys, tmp_path):
    dsn, k = stored
    html = tmp_path / "cmp.html"
    assert cli.main(["compare", "--dsn", dsn, k["seq8"], k["seq16"], "--baseline", k["seq8"], "--html",
                     str(html)]) == 0
    out = capsys.readouterr().out
    assert "best meeting the SLO: " + k["seq16"] in out and "(significant)" in out
    assert html.is_file() and "<svg" in html.read_text() and "Pareto front" in html.read_text()
    assert cli.main(["compare", "--dsn", dsn, "nope/9"]) == 2
    assert "unknown run id(s): nope/9" in capsys.readouterr().err
