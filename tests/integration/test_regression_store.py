"""The regression verdict against a real results store: runs stored out of date order (a backfill after
later scheduled runs) are judged where their logical date puts them, the verdict is written back, and a
failing verdict carries the message."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from sqlalchemy import select

from deploybench import regression
from deploybench.store import write_run
from deploybench.store.models import Verdict
from tests.support import store_fixtures as fx

pytestmark = pytest.mark.integration

DAY0 = datetime(2026, 3, 1, tzinfo=UTC)


@pytest.fixture
def dsn(fresh_dsn):
    """Each test judges its own history: a database of its own."""
    return fresh_dsn


@pytest.fixture()
def bench(tmp_path):
    (tmp_path / f"nightly{regression.SUFFIX}").write_text(json.dumps({
        "name": "nightly", "params": {"inventory": "demo"}, "metrics": ["latency_p50_ms"],
        "notify": [{"kind": "smtp", "to": ["perf@example.com"]}]}))
    return regression.by_name("nightly", tmp_path)


def _store(dsn, bench, day: int, latency: float, stored_at: datetime, tags: dict | None = None,
           name: str = "nightly") -> str:
    rng = np.random.default_rng(day)
    cfg = fx.config()
    key = f"deploybench_regression__{name}__backfill__{day}"
    frame = fx.samples(400, latency, rng, start=stored_at)
    frame["latency_ms"] = latency * (1 + 0.002 * rng.standard_normal(len(frame)))  # a tight median
    record = fx.run_record(key, cfg, started=stored_at, logical_date=DAY0 + timedelta(days=day)).model_copy(
        update={"tags": tags or {"benchmark": "nightly", "benchmark_rev": bench.revision}})
    write_run(dsn, record, [], fx.phase_from(frame, 20.0), frame, facts=fx.facts(cfg))
    return key


def test_a_backfilled_run_is_judged_against_the_dates_before_it_not_the_runs_stored_before_it(dsn, bench):
    now = datetime(2026, 12, 3, tzinfo=UTC)
    # stored first (scheduled, recent dates, already slow), then the backfill of March
    late = [_store(dsn, bench, 200 + i, 330.0, now + timedelta(minutes=i)) for i in range(3)]
    keys = [_store(dsn, bench, d, 300.0 if d < 4 else 330.0, now + timedelta(hours=1, minutes=d)) for d in range(6)]
    _store(dsn, bench, 3, 500.0, now, tags={"benchmark": "other", "benchmark_rev": "x"}, name="other")

    ok = regression.judge_run(bench, keys[3], dsn, "http://af")
    assert ok["verdict"] == "no change" and ok["metrics"]["latency_p50_ms"]["against"] == keys[:3]

    with pytest.raises(regression.RegressionFound) as found:
        regression.judge_run(bench, keys[4], dsn, "http://af")
    v = found.value.verdict["metrics"]["latency_p50_ms"]
    assert v["verdict"] == "regression" and v["against"] == keys[:4] and late[0] not in v["against"]
    assert v["magnitude"] == pytest.approx(0.10, abs=0.01) and v["p_value"] < 0.01
    assert "latency_p50_ms +10.0%" in found.value.subject and "http://af/deploybench/runs/" in found.value.text
    assert regression.read_verdict(keys[4])["verdict"] == "regression"

    # the next date, already at the new level: nothing new
    assert regression.judge_run(bench, keys[5], dsn)["verdict"] == "no change"
    with fx.db.open_store(dsn).connect() as conn:
        rows = dict(
            conn.execute(
                select(Verdict.run_key, Verdict.verdict).where(Verdict.method == "deploybench-judge")
            ).all()
        )
    assert rows == {keys[3]: "no change", keys[4]: "regression", keys[5]: "no change"}


def test_a_suspect_fails_only_when_the_benchmark_says_so(dsn, bench, tmp_path):
    keys = [_store(dsn, bench, d, v, datetime(2026, 12, 3, tzinfo=UTC) + timedelta(minutes=d))
            for d, v in enumerate([300, 306, 294, 303, 297, 316])]
    got = regression.judge_run(bench, keys[-1], dsn)
    assert got["verdict"] == "suspect", got
    strict = bench.model_copy(update={"fail_on_suspect": True})
    with pytest.raises(regression.RegressionFound, match="suspect in benchmark nightly"):
        regression.judge_run(strict, keys[-1], dsn)


def test_the_first_run_of_a_benchmark_is_judged_too_few_runs(dsn, bench):
    key = _store(dsn, bench, 0, 300.0, datetime(2026, 12, 3, tzinfo=UTC), tags={"benchmark": "renamed"})
    got = regression.judge_run(bench, key, dsn)  # no run of this benchmark revision in the store, not even it
    assert got["verdict"] == "no change" and "too few runs" in got["metrics"]["latency_p50_ms"]["how"]
