"""The load phases against simulated engines on 127.0.0.1: sustained with windows and drift, overload
with its break points and recovery, one load-balanced URL, and an endpoint that dies mid-phase.

Engines from conftest's local_engines (small decode times, so every phase is a few seconds).
"""

from __future__ import annotations

import json

import pytest

from deploybench.config import SLO, EngineSpec, LoadSpec, SimKnobs
from deploybench.engines import profile as engine_profile
from deploybench.inventory import Price
from deploybench.load import Endpoint, load_samples, phases
from deploybench.load.scrape import read_series
from deploybench.sim.service_model import ServiceParams, capacity

pytestmark = [pytest.mark.integration, pytest.mark.quiet]



@pytest.fixture
def engines(local_engines):
    """start(engine, n, *extra_args) -> [Endpoint], each call naming its engines n1..n<n>."""
    return lambda engine, n, *extra: local_engines.start(n, *extra, engine=engine)


# 8 x (8 / 4 + 1) + 0.01 x 32 ms = 24.3 ms per request: about 41 req/s per node
ENGINE = EngineSpec(max_num_seqs=4, sim=SimKnobs(decode_base_ms=8.0, decode_per_seq_ms=1.0,
                                                 prefill_per_token_ms=0.01, queue_limit=64))
WORK = dict(prompt_tokens=32, output_tokens=8, request_timeout_s=5, ttft_sample_rps=2, scrape_interval_s=0.5)


def test_sustained_then_overload_on_two_nodes(engines, tmp_path):
    eps = engines(ENGINE, 2)
    cap = capacity(ServiceParams.from_config(ENGINE), 32, 8).requests_per_s * 2
    # the probe did not run: sustained offers load.rate as typed (half the capacity), and overload works from it:
    # its ramp to 4 x it ends at twice the capacity, its recovery at a quarter of the capacity
    spec = LoadSpec(rate=round(cap / 2, 2), phases=["sustained", "overload"], duration_s=6, warmup_s=1, window_s=2,
                    overload_factor=4.0, overload_ramp_s=6, recovery_s=4, drift_threshold=1.0, **WORK)
    slo = SLO(p99_latency_ms=400, max_error_rate=0.01, p99_ttft_ms=400)
    out_dir = tmp_path / "load"
    sim = engine_profile("sim").metrics  # the engine's own figures: the names its profile maps
    sus = phases.run_phase("sustained", eps, spec, slo, out_dir, tags={"run": "t"}, metrics=sim)
    over = phases.run_phase("overload", eps, spec, slo, out_dir, tags={"run": "t"}, metrics=sim)

    res, drift = sus["result"], sus["analysis"]
    assert res["slo_ok"], res["slo"]
    assert res["offered_rps"] == pytest.approx(spec.rate) and drift["capacity_source"] == "config"
    # P99 of 160 requests moves a lot on a shared machine; throughput must hold (drift's logic: unit tests)
    assert len(res["windows"]) == 3 and not drift["drifted"] and abs(drift["achieved_change"]) < 0.1, drift
    assert drift["achieved_rps"] == [res["windows"][0]["achieved_rps"], res["windows"][-1]["achieved_rps"]]
    assert res["ttft_samples"] >= 8 and res["ttft_p99_ms"] is not None and res["itl_p50_ms"] is not None
    assert res["goodput_rps"] == pytest.approx(res["achieved_rps"], rel=0.02)
    assert res["lag_p99_ms"] is not None and res["lag_p99_ms"] < 100
    for node in ("n1", "n2"):  # the engine's own view, from /metrics
        eng = res["engine"][node]
        assert eng["scrapes"] >= 8 and eng["ttft_count"] > 0 and eng["e2e_mean_ms"] > 0
    series = read_series(res["metrics_path"])
    assert {p["node"] for p in series} == {"n1", "n2"} and {p["phase"] for p in series} == {"sustained"}
    assert any(p["metric"] == "vllm:num_requests_running" for p in series)

    ov, an = over["result"], over["analysis"]
    assert [round(t, 2) for t, _ in ov["stages"]] == [round(4 * spec.rate, 2), round(spec.rate / 2, 2),
                                                     round(spec.rate / 2, 2)]
    broke = an["broke_at"]
    assert broke["achieved_ratio"] is not None, an
    if not an["client_limited_windows"]:
        # the engine falls behind near or past its capacity (on a busy 2-core machine the sim's own CPU
        # shortage takes some off its closed form), not at the start of the ramp (0.5 x)
        assert 0.75 * cap <= broke["achieved_ratio"]["rate"] <= 2 * cap + 1, an
    else:  # k6 itself fell behind (a busy 2-core machine): the phase must say so with its schedule lag
        assert ov["lag_p99_ms"] > 50, an
    assert an["recovered"] and an["recovery_s"] is not None and an["recovery_s"] <= spec.recovery_s
    assert sum(an["errors_by_kind_ramp"].values()) + sum(an["errors_by_kind_recovery"].values()) == ov["errors"]

    data = phases.assemble(out_dir, spec)
    assert data["phase"] == "sustained" and set(data["phases"]) == {"sustained", "overload"}
    assert data["capacity"] == {"capacity_rps": spec.rate, "source": "config"} and len(data["series"]) == 2
    assert "overload: broke at" in phases.summary(data)


def test_one_load_balanced_url(engines, tmp_path):
    eps = engines(ENGINE, 1)
    spec = LoadSpec(rate=10, duration_s=3, warmup_s=1, target_url=eps[0].url, **WORK)
    # the cost is the serving node's (n1, behind the URL), not the load balancer's (the inventory has no "lb")
    out = phases.run_phase("sustained", eps, spec, SLO(), tmp_path / "load",
                           prices={"n1": Price(per_node_hour=2.0, currency="EUR")})
    res = out["result"]
    assert [n["node"] for n in res["nodes"]] == [phases.LB_NODE] and res["errors"] == 0
    assert set(load_samples(res["samples_path"])["node"]) == {phases.LB_NODE}
    assert set(res["engine"]) == {"n1"}  # the nodes behind the URL are scraped by name
    tokens = res["output_tps"] * res["duration_s"]
    assert tokens > 0 and res["cost_currency"] == "EUR" and res["cost_per_hour"] == 2.0
    assert res["cost_per_million_output_tokens"] == pytest.approx(2.0 * res["duration_s"] / 3600 / tokens * 1e6,
                                                                  rel=1e-5)


def test_an_endpoint_that_dies_mid_phase_is_attributed_to_its_node(engines, tmp_path):
    eps = engines(ENGINE, 1) + engines(ENGINE, 1, "--crash-after", "20")
    eps[1] = Endpoint("n2", eps[1].url, eps[1].model)
    spec = LoadSpec(rate=16, duration_s=5, warmup_s=1, **WORK)
    out = phases.run_phase("sustained", eps, spec, SLO(max_error_rate=0.01), tmp_path / "load")
    res = out["result"]
    assert out["status"] == "success" and res["k6_exit_code"] == 99  # the SLO verdict, not a crash
    per = {n["node"]: n for n in res["nodes"]}
    assert per["n1"]["errors"] == 0 and per["n2"]["errors"] > 10
    # a refused or reset connection, or k6's generic network error 1000 (an engine dying mid-response:
    # unexpected EOF) - never an HTTP status or a bad response
    assert all(k.startswith(("connection_", "network")) for k in per["n2"]["errors_by_kind"]), per["n2"]
    assert not res["slo_ok"] and any("error rate" in r for r in res["slo"]["reasons"])
    assert res["engine"]["n2"]["scrape_errors"] > 0 and res["engine"]["n1"]["scrape_errors"] == 0
    assert json.loads((tmp_path / "load" / "sustained.result.json").read_text())["status"] == "success"
