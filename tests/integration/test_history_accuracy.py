"""History's accuracy with real k6 runs against the simulated engine on 127.0.0.1.

A series whose engines are slowed down by 10 % from its fifth run on must be flagged at that
run (a regression in latency), and nothing else; a series of the same length without a change
must not be flagged. bench/history_accuracy.py repeats both and prints the detections.
"""

from __future__ import annotations

import pytest
from sqlalchemy import select

from deploybench.analyse.history import analyse_series
from deploybench.analyse.simseries import run_series
from deploybench.store import db
from deploybench.store.models import ChangePoint, Verdict
from deploybench.store.query import set_excluded

# 16 k6 runs of ~2.5 s plus engine starts; the bound is generous for a loaded 2-core machine
pytestmark = [pytest.mark.integration, pytest.mark.quiet, pytest.mark.time_limit(240)]
RUNS, CHANGE_AT = 8, 4


def test_a_ten_percent_slowdown_is_flagged_where_it_starts_and_a_steady_series_is_not(dsn, tmp_path):
    changed = run_series(dsn, "acc-change", RUNS, tmp_path / "a", change_at=CHANGE_AT, slowdown=1.1, duration_s=2.0)
    steady = run_series(dsn, "acc-steady", RUNS, tmp_path / "b", duration_s=2.0)

    hist = analyse_series(dsn, changed[-1])
    assert set(hist.flagged()) == {changed[CHANGE_AT]}, hist.changes
    latency = [c for c in hist.changes if c.metric.startswith("latency")]
    assert latency and all(c.direction == "regression" and c.magnitude > 0.05 for c in latency)
    assert hist.verdicts["latency_p50_ms"]["verdict"] == "regression"
    assert hist.verdicts["latency_p50_ms"]["p_value"] < hist.params.alpha

    flat = analyse_series(dsn, steady[-1])
    assert flat.changes == [], flat.changes
    assert all(v["verdict"] == "no change" for v in flat.verdicts.values())

    # written back with method and parameters; an excluded run is left out of the next analysis
    with db.open_store(dsn).connect() as conn:
        stored = conn.execute(select(ChangePoint.run_key, ChangePoint.method, ChangePoint.params)
                              .where(ChangePoint.series_id == hist.series_id)).all()
        verdict = conn.execute(select(Verdict.verdict).where(Verdict.run_key == changed[-1],
                                                             Verdict.metric == "latency_p50_ms")).scalar_one()
    assert {r.run_key for r in stored} == {changed[CHANGE_AT]} and stored[0].params["min_size"] == hist.params.min_size
    assert verdict == "regression"
    set_excluded(dsn, changed[0], True, "warm-up run of the test")
    again = analyse_series(dsn, changed[-1])
    assert changed[0] not in set(again.runs["run_key"]) and len(again.runs) == RUNS - 1
