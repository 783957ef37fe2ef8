"""The load stage against the simulated engine: real k6, real HTTP, 127.0.0.1 only.

Two engine processes on two ports are two "nodes" (the ``local_engines`` fixture of conftest.py). Each
test bounds its own time: the engines must answer /health within LocalEngines' start timeout, and
run_load bounds k6 by warm-up + duration + margin.
"""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import pytest

from deploybench.config import SLO, LoadSpec
from deploybench.load import Endpoint, EndpointNotReady, load_samples, run_load
from deploybench.sim.local import MODEL, free_port

pytestmark = [pytest.mark.integration, pytest.mark.quiet]

def test_sustained_phase_on_two_nodes(local_engines, tmp_path):
    eps = local_engines.start(2)
    spec = LoadSpec(rate=10, duration_s=6, warmup_s=2, prompt_tokens=32, output_tokens=8, request_timeout_s=10)
    res = run_load(eps, spec, SLO(p99_latency_ms=2000, max_error_rate=0.01), tmp_path / "out",
                   tags={"run_key": "it-sustained"})

    assert res.k6_exit_code == 0 and res.slo_ok and res.slo.passed, res.slo.reasons
    assert res.requests == pytest.approx(10 * 6, abs=3)  # k6 starts one iteration at each boundary
    assert res.achieved_rps == pytest.approx(10, rel=0.1)
    assert res.errors == 0 and res.error_rate == 0 and res.dropped_iterations == 0
    assert res.warmup_excluded == pytest.approx(10 * 2, abs=2)
    per = {n.node: n for n in res.nodes}
    assert set(per) == {"n1", "n2"} and abs(per["n1"].requests - per["n2"].requests) <= 1
    assert res.output_tps == pytest.approx(res.requests * 8 / 6)
    assert 0 < res.latency_p50_ms <= res.latency_p90_ms <= res.latency_p99_ms <= res.latency_p999_ms < 2000

    df = load_samples(res.samples_path)
    assert len(df) == res.requests and df["ts"].min() >= pd.Timestamp(res.started_at)
    assert len(load_samples(res.warmup_samples_path)) == res.warmup_excluded
    assert (df["output_tokens"] == 8).all() and df["error_kind"].isna().all()
    assert df["prompt_tokens"].between(16, 48).all() and df["prompt_tokens"].nunique() > 5
    assert set(df["phase"]) == {"sustained"} and set(df["node"]) == {"n1", "n2"}
    assert Path(res.summary_path).is_file()


def test_injected_errors_fail_the_slo_on_error_rate(local_engines, tmp_path):
    eps = local_engines.start(2, "--error-rate", "0.2")
    spec = LoadSpec(rate=10, duration_s=8, warmup_s=1, prompt_tokens=16, output_tokens=4, request_timeout_s=10)
    res = run_load(eps, spec, SLO(p99_latency_ms=2000, max_error_rate=0.01), tmp_path / "out")

    assert res.k6_exit_code == 99  # the error-rate threshold crossed: a result, not a crash
    assert res.error_rate == pytest.approx(0.2, abs=0.1)
    assert set(res.errors_by_kind) == {"http_500"}
    assert not res.slo_ok and len(res.slo.reasons) == 1 and "error rate" in res.slo.reasons[0]
    assert any("db_request_failed" in t for t in res.k6_thresholds_crossed)
    assert sum(n.errors for n in res.nodes) == res.errors


def test_streamed_chat_counts_tokens_from_the_sse_body(local_engines, tmp_path):
    eps = local_engines.start(1)
    spec = LoadSpec(rate=5, duration_s=2, warmup_s=0, prompt_tokens=16, output_tokens=6, api="chat",
                    stream=True, request_timeout_s=10)
    res = run_load(eps, spec, SLO(), tmp_path / "out", phase="stream")
    assert res.errors == 0 and res.requests == pytest.approx(10, abs=2)
    assert (load_samples(res.samples_path)["output_tokens"] == 6).all()


def test_an_endpoint_that_is_not_up_fails_fast(local_engines, tmp_path):
    eps = local_engines.start(1) + [Endpoint("n9", f"http://127.0.0.1:{free_port()}", MODEL)]
    t0 = time.monotonic()
    with pytest.raises(EndpointNotReady, match="node n9"):
        run_load(eps, LoadSpec(rate=5, duration_s=30, warmup_s=0), SLO(), tmp_path / "out")
    assert time.monotonic() - t0 < 15
