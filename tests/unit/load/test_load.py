"""Unit tests of deploybench.load: sizing, environment, figures, SLO verdict, k6 output parsing.

The fixture tests/unit/fixtures/load/k6-out.json.gz (and its --summary-export) was written by the
real k6 v1.1.0 running k6/run.js against a stub OpenAI server on 127.0.0.1: 3 nodes (n1 clean, n2
with injected HTTP 500s, n3 hanging past the 0.5 s request timeout), 6 req/s for 1 s warm-up + 3 s,
maxVUs 1 so that the hangs also drop iterations.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from deploybench import load
from deploybench.config import SLO, LoadSpec
from deploybench.errors import ConfigError
from deploybench.load import (
    Endpoint,
    Figures,
    build_env,
    figures,
    k6_command,
    load_samples,
    node_figures,
    read_k6_json,
    save_samples,
    size_vus,
    slo_verdict,
    thresholds_crossed,
)
from deploybench.load import samples as samples_mod

FIXTURES = Path(__file__).parent / "fixtures"
EPS = [Endpoint("n1", "http://127.0.0.1:8001", "m"), Endpoint("n2", "http://127.0.0.1:8002", "m")]


# -- sizing and environment -------------------------------------------------------------------------
def test_vus_sized_from_rate_and_slo_p99():
    # 20 req/s x 2 s = 40 in flight; x1.5 preallocated, x4 at most
    assert size_vus(20, LoadSpec(), SLO(p99_latency_ms=2000)) == (60, 160)
    assert size_vus(10, LoadSpec(), SLO(p99_latency_ms=500)) == (8, 20)


def test_vus_never_below_the_minimum_and_capped_by_max_vus():
    assert size_vus(0.1, LoadSpec(), SLO(p99_latency_ms=100)) == (2, 2)
    assert size_vus(20, LoadSpec(max_vus=10), SLO(p99_latency_ms=2000)) == (10, 10)
    assert size_vus(1, LoadSpec(max_vus=50), SLO(p99_latency_ms=1000)) == (2, 50)


def test_env_carries_the_load_shape_and_the_slo():
    spec = LoadSpec(rate=8, duration_s=30, warmup_s=5, prompt_tokens=100, output_tokens=16, stream=True)
    env = build_env(EPS, spec, SLO(p99_latency_ms=1500, max_error_rate=0.02), phase="probe",
                    rate=12.5, duration_s=6, tags={"run_key": "r1"})
    assert json.loads(env["DB_ENDPOINTS"]) == [
        {"node": "n1", "url": "http://127.0.0.1:8001", "model": "m"},
        {"node": "n2", "url": "http://127.0.0.1:8002", "model": "m"},
    ]
    assert float(env["DB_RATE"]) == 12.5 and float(env["DB_DURATION_S"]) == 6.0  # overrides win over spec
    assert float(env["DB_WARMUP_S"]) == 5.0
    assert (env["DB_PRE_VUS"], env["DB_MAX_VUS"]) == ("29", "75")  # 12.5 x 1.5 s = 18.75 in flight
    assert env["DB_PHASE"] == "probe" and json.loads(env["DB_TAGS"]) == {"run_key": "r1"}
    assert env["DB_API"] == "completions" and env["DB_STREAM"] == "true"
    assert env["DB_PROMPT_TOKENS"] == "100" and env["DB_OUTPUT_TOKENS"] == "16"
    assert float(env["DB_SLO_P99_MS"]) == 1500 and float(env["DB_SLO_MAX_ERROR_RATE"]) == 0.02
    assert all(isinstance(v, str) for v in env.values())


def test_env_api_override_for_triton():
    env = build_env(EPS, LoadSpec(), SLO(), phase="p", rate=1, duration_s=1, api="triton")
    assert env["DB_API"] == "triton"


@pytest.mark.parametrize(
    ("endpoints", "tags", "words"),
    [
        ([], None, "at least one endpoint"),
        ([EPS[0], EPS[0]], None, "unique"),
        (EPS, {"node": "x"}, "node"),
    ],
)
def test_env_refuses_bad_input(endpoints, tags, words):
    with pytest.raises(ConfigError, match=words):
        build_env(endpoints, LoadSpec(), SLO(), phase="p", rate=1, duration_s=1, tags=tags)


def test_command_is_an_argument_list_with_the_api_port_off(tmp_path):
    cmd = k6_command("/bin/k6", Path("/k6/run.js"), tmp_path / "o.json.gz", tmp_path / "s.json")
    i = cmd.index("--address")
    assert cmd[i + 1] == ""
    assert f"json={tmp_path / 'o.json.gz'}" in cmd and cmd[-1] == "/k6/run.js"


# -- figures on a synthetic DataFrame with known answers --------------------------------------------
def _frame(rows: list[dict]) -> pd.DataFrame:
    base = {"ts": 0, "phase": "sustained", "node": "n1", "status": 200, "error_kind": None,
            "latency_ms": 1.0, "ttft_ms": None, "prompt_tokens": 10, "output_tokens": 4, "warmup": False}
    df = pd.DataFrame([{**base, **r} for r in rows], columns=[*load.SAMPLE_COLUMNS, "warmup"])
    return samples_mod._typed(df, ts_unit="ms")


@pytest.fixture
def synthetic() -> pd.DataFrame:
    rows = [{"ts": i, "latency_ms": float(i), "node": "n1" if i % 2 else "n2"} for i in range(1, 101)]
    rows += [{"ts": 200 + i, "status": 500, "error_kind": "http_500", "latency_ms": 5.0, "output_tokens": 0,
              "node": "n2"} for i in range(8)]
    rows += [{"ts": 300 + i, "status": 0, "error_kind": "timeout", "latency_ms": 30000.0, "output_tokens": 0,
              "node": "n1"} for i in range(2)]
    # the warm-up: slow and failing, and it must not show anywhere
    rows += [{"ts": -100 + i, "latency_ms": 99999.0, "warmup": True} for i in range(20)]
    rows += [{"ts": -50, "status": 503, "error_kind": "http_503", "warmup": True}]
    return _frame(rows)


def test_percentiles_and_rates_known_answers(synthetic):
    fig = figures(synthetic, duration_s=10)
    assert fig.requests == 110 and fig.errors == 10
    assert fig.error_rate == pytest.approx(10 / 110)
    assert fig.errors_by_kind == {"http_500": 8, "timeout": 2}
    # successful latencies are 1..100 ms; linear interpolation
    assert (fig.latency_p50_ms, fig.latency_p90_ms, fig.latency_p99_ms, fig.latency_p999_ms) == \
        (50.5, 90.1, 99.01, 99.901)
    assert fig.sent_rps == pytest.approx(11.0)
    # answered within the 10 s window: 100 successes and 8 fast 500s; the 30 s timeouts answer after it
    assert fig.achieved_rps == pytest.approx(10.8)
    assert fig.goodput_rps == pytest.approx(10.0) and fig.goodput_ratio == pytest.approx(100 / 108)
    assert fig.output_tps == pytest.approx(100 * 4 / 10)


def test_warmup_rows_are_excluded(synthetic):
    fig = figures(synthetic, duration_s=10)
    assert "http_503" not in fig.errors_by_kind
    assert fig.latency_p999_ms < 100
    only_warmup = figures(synthetic[synthetic["warmup"]], duration_s=10)
    assert only_warmup.requests == 0 and only_warmup.latency_p99_ms is None


def test_per_node_figures_add_up(synthetic):
    per = {f.node: f for f in node_figures(synthetic, 10, ["n1", "n2", "n3"])}
    assert per["n1"].requests == 52 and per["n1"].errors_by_kind == {"timeout": 2}
    assert per["n2"].requests == 58 and per["n2"].errors_by_kind == {"http_500": 8}
    assert per["n3"].requests == 0 and per["n3"].latency_p50_ms is None
    assert per["n1"].latency_p50_ms == 50.0  # odd latencies 1..99: between 49 and 51
    assert sum(f.requests for f in per.values()) == 110


# -- SLO verdict ------------------------------------------------------------------------------------
def _fig(**kw) -> Figures:
    base = dict(requests=100, errors=0, error_rate=0.0, errors_by_kind={}, achieved_rps=10.0, output_tps=1.0,
                latency_p50_ms=100.0, latency_p90_ms=200.0, latency_p99_ms=500.0, latency_p999_ms=900.0)
    return Figures(**{**base, **kw})


def test_slo_passes_within_limits():
    v = slo_verdict(_fig(), SLO(p99_latency_ms=2000, max_error_rate=0.01))
    assert v.passed and v.reasons == []


def test_slo_fails_on_p99_and_names_it():
    v = slo_verdict(_fig(latency_p99_ms=2500.0), SLO(p99_latency_ms=2000))
    assert not v.passed and len(v.reasons) == 1 and "P99 latency 2500 ms" in v.reasons[0]


def test_slo_fails_on_error_rate_and_names_it():
    v = slo_verdict(_fig(errors=20, error_rate=0.2, errors_by_kind={"http_500": 20}), SLO(max_error_rate=0.01))
    assert not v.passed and len(v.reasons) == 1
    assert "error rate 20.00%" in v.reasons[0] and "http_500: 20" in v.reasons[0]


def test_slo_edge_cases():
    assert not slo_verdict(_fig(requests=0, latency_p99_ms=None), SLO()).passed
    assert "no request succeeded" in slo_verdict(
        _fig(errors=100, error_rate=1.0, latency_p99_ms=None), SLO(max_error_rate=1.0)).reasons[0]
    assert slo_verdict(_fig(error_rate=0.01, errors=1), SLO(max_error_rate=0.01)).passed  # at the limit
    assert "under the SLO's 20.00 req/s" in slo_verdict(_fig(), SLO(min_rps=20)).reasons[0]


# -- the real k6 output fixture ---------------------------------------------------------------------
def test_fixture_parses_into_samples():
    df, dropped = read_k6_json(FIXTURES / "k6-out.json.gz")
    assert list(df.columns) == [*load.SAMPLE_COLUMNS, *samples_mod.EXTRA_COLUMNS, "iteration"]
    assert df["iteration"].isna().all()  # k6 output of before the iteration index was recorded (issue 31)
    assert len(df) == 19 and int(df["warmup"].sum()) == 6
    assert str(df["ts"].dt.tz) == "UTC" and df["ts"].is_monotonic_increasing
    assert set(df["phase"]) == {"sustained"} and df["ttft_ms"].isna().all()
    # round-robin by iteration over the 3 nodes
    assert list(df["node"][:6]) == ["n1", "n2", "n3", "n1", "n2", "n3"]
    timeouts = df[df["error_kind"] == "timeout"]
    assert len(timeouts) == 2 and set(timeouts["node"]) == {"n3"} and (timeouts["status"] == 0).all()
    assert (timeouts["latency_ms"] >= 500).all() and (timeouts["output_tokens"] == 0).all()
    ok = df[df["error_kind"].isna()]
    assert (ok["output_tokens"] == 8).all() and ok["prompt_tokens"].between(10, 30).all()
    assert len(dropped) == 6


def test_fixture_figures_and_thresholds():
    df, _ = read_k6_json(FIXTURES / "k6-out.json.gz")
    fig = figures(df, duration_s=3)
    # 13 measured requests, the last started by k6 exactly at the window's end: not in [start, start + 3 s)
    assert (fig.requests, fig.errors) == (12, 3)
    assert fig.errors_by_kind == {"http_500": 1, "timeout": 2}
    assert fig.output_tps == pytest.approx(9 * 8 / 3)
    assert 50 < fig.latency_p50_ms < fig.latency_p99_ms < 100  # the two 502 ms timeouts are errors, not latencies
    summary = json.loads((FIXTURES / "k6-summary.json").read_text())
    assert thresholds_crossed(summary) == ["db_request_failed{window:measure}: rate<=0.01"]
    assert not slo_verdict(fig, SLO()).passed


def test_samples_round_trip_as_csv_gz(tmp_path, monkeypatch, synthetic):
    monkeypatch.setattr(samples_mod, "_parquet_available", lambda: False)
    frame = synthetic[load.SAMPLE_COLUMNS]
    path = save_samples(frame, tmp_path, "sustained.samples")
    assert path.name == "sustained.samples.csv.gz"
    back = load_samples(path)
    assert list(back.columns) == load.SAMPLE_COLUMNS
    pd.testing.assert_frame_equal(back, frame, check_dtype=False, check_index_type=False)
    assert back["error_kind"].isna().sum() == frame["error_kind"].isna().sum()
    assert str(back["ts"].dt.tz) == "UTC" and back["status"].dtype == "int64"
    assert math.isnan(back["ttft_ms"].iloc[0])


def test_samples_fit_the_results_store():
    from deploybench.store import SAMPLE_COLUMNS as STORE_COLUMNS
    from deploybench.store import writer as store

    assert tuple(load.SAMPLE_COLUMNS) == tuple(STORE_COLUMNS)
    df, _ = read_k6_json(FIXTURES / "k6-out.json.gz")
    prepared = store.prepare_samples(df.loc[~df["warmup"], load.SAMPLE_COLUMNS])
    assert len(prepared) == 13
