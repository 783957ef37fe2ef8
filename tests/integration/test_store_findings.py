"""Findings in the results store (migration 0010): written with the run, read back whole, replaced by a re-run."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest

from deploybench.store import load_run, write_run
from deploybench.store.facts import FindingRow
from tests.support import store_fixtures as fx

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(120)]


def _finding(rule: str, node: str | None, observed: float) -> FindingRow:
    return FindingRow(rule=rule, node=node, metric="m", phase="sustained", window_start=fx.T0,
                      window_end=fx.T0 + timedelta(seconds=20), observed=observed, expected=0.0,
                      evidence=f"{rule} on {node}", advice="do something", detail={"reasons": 32})


def test_findings_round_trip_and_a_rewrite_replaces_them(dsn):
    key = "deploybench_run/findings_1"
    frame = fx.samples(50, 250, np.random.default_rng(3))
    cfg = fx.config()
    first = [_finding("gpu_throttled", "n2", 32.0), _finding("throughput_drift", None, 9.5)]
    write_run(dsn, fx.run_record(key, cfg), [], fx.phase_from(frame, 20), frame,
              facts=fx.facts(cfg).model_copy(update={"findings": first}))
    stored = load_run(dsn, key)
    assert stored is not None and stored.findings == first  # every field back as written, the cluster's node None
    again = [_finding("kv_cache_saturated", "n3", 12.0)]
    res = write_run(dsn, fx.run_record(key, cfg), [], fx.phase_from(frame, 20), frame,
                    facts=fx.facts(cfg).model_copy(update={"findings": again}))
    assert res.replaced and res.facts is not None and res.facts["findings"] == 1
    stored = load_run(dsn, key)
    assert stored is not None and stored.findings == again  # replaced, not appended
    write_run(dsn, fx.run_record(key, cfg), [], fx.phase_from(frame, 20), frame, facts=fx.facts(cfg))
    stored = load_run(dsn, key)
    assert stored is not None and stored.findings == []  # a clean re-run leaves none
