"""The runbook's troubleshooting table as rules (deploybench.analyse.findings), on typed results: each rule fires
on its symptom and names the node, stays silent on a clean phase, and never fires on absent data."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from deploybench.analyse import findings as fd
from deploybench.load.results import GpuFigures, LoadResult, NodeFigures, SloVerdict, WindowFigures
from deploybench.preflight.model import LinkTest, PreflightResult

T0 = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
NODES = ("n1", "n2", "n3")


def _figs(requests: int = 100, errors: int = 0, rps: float = 5.0, p99: float | None = 400.0, **kw) -> dict:
    return {"requests": requests, "errors": errors, "error_rate": errors / requests if requests else 0.0,
            "errors_by_kind": {"http_500": errors} if errors else {}, "achieved_rps": rps, "output_tps": rps * 8,
            "latency_p50_ms": None if p99 is None else p99 / 2, "latency_p90_ms": p99, "latency_p99_ms": p99,
            "latency_p999_ms": p99, **kw}


def _engine(**kw) -> dict:
    """A node's engine figures as NodeFigures holds them (scrape.with_engine_signals)."""
    return {"running_max": 4.0, "waiting_mean": 0.0, "kv_usage_mean": 0.1, "preemptions": 0.0,
            "resident_memory_growth_bytes": 0.0, **kw}


def result(nodes: dict | None = None, engine: dict | None = None, gpu: dict | None = None, windows=(),
           **kw) -> LoadResult:
    """A clean sustained phase over three nodes (20 s at 15 req/s), with ``nodes``/``engine``/``gpu`` overrides."""
    nodes = {n: {**_figs(**(nodes or {}).get(n, {})), **_engine(**(engine or {}).get(n, {}))} for n in NODES}
    gpus = {n: GpuFigures(source="dcgm", gpus=1, samples=6, util_mean_pct=40.0, sm_clock_mhz_mean=2000.0,
                          sm_clock_mhz_min=2000.0, throttle_reasons=0).model_copy(update=(gpu or {}).get(n, {}))
            for n in NODES}
    base = dict(_figs(requests=300, rps=15.0), phase="sustained", offered_rps=15.0, duration_s=20.0, warmup_s=1.0,
                started_at=T0, warmup_excluded=0, dropped_iterations=0, slo_ok=True,
                slo=SloVerdict(passed=True, reasons=[]),
                nodes=[NodeFigures(node=n, **f) for n, f in nodes.items()], samples_path="s", warmup_samples_path=None,
                summary_path="k", k6_exit_code=0, k6_thresholds_crossed=[], k6_cpu_s=2.0, vus_pre=4, vus_max=16,
                tags={}, notes=[], gpu=gpus, gpu_util_pct=40.0, lag_p99_ms=3.0, windows=list(windows))
    return LoadResult(**{**base, **kw})


def fired(res: LoadResult, preflight=None) -> list[tuple[str, str | None]]:
    return [(f.rule, f.node) for f in fd.findings_of({"sustained": res}, preflight)]


def test_a_clean_phase_has_no_finding():
    assert fired(result()) == []


def test_no_batching_fires_when_one_request_runs_while_others_wait_and_names_the_node():
    res = result(engine={"n2": {"running_max": 1.0, "waiting_mean": 3.2}})
    got = fd.findings_of({"sustained": res})
    assert [(f.rule, f.node) for f in got] == [("no_batching", "n2")]
    f = got[0]
    assert f.observed == 1.0 and f.expected == fd.NO_BATCH_MAX_RUNNING and f.phase == "sustained"
    assert f.window_start == T0 and f.window_end == T0 + timedelta(seconds=20) and "3.2 waited" in f.evidence
    # one at a time with nobody waiting is light load, not a batching problem
    assert fired(result(engine={"n2": {"running_max": 1.0, "waiting_mean": 0.1}})) == []
    # Triton: inferences about equal to executions
    assert fired(result(engine={"n1": {"batch_mean": 1.01, "inferences": 400.0}})) == [("no_batching", "n1")]
    assert fired(result(engine={"n1": {"batch_mean": 3.5, "inferences": 400.0}})) == []
    assert fired(result(engine={"n1": {"batch_mean": 1.0, "inferences": 5.0}})) == []  # too few to call


def test_client_limited_needs_a_client_sign_and_an_under_used_gpu():
    assert fired(result(dropped_iterations=30)) == [("client_limited", None)]
    assert fired(result(lag_p99_ms=450.0)) == [("client_limited", None)]
    assert fired(result(k6_cpu_s=19.0)) == [("client_limited", None)]
    assert fired(result(dropped_iterations=30, gpu_util_pct=92.0)) == []  # the GPUs were busy: the server's limit
    assert fired(result(dropped_iterations=30, gpu_util_pct=None)) == []  # GPU not measured: no finding
    assert fired(result(dropped_iterations=2, lag_p99_ms=50.0)) == []


def test_kv_cache_saturated_on_preemptions_or_a_full_cache():
    got = fd.findings_of({"sustained": result(engine={"n3": {"preemptions": 12.0, "kv_usage_mean": 0.97}})})
    assert [(f.rule, f.node, f.observed) for f in got] == [("kv_cache_saturated", "n3", 12.0)]
    assert "97% full" in got[0].evidence
    assert fired(result(engine={"n1": {"kv_usage_mean": 0.99}})) == [("kv_cache_saturated", "n1")]
    assert fired(result(engine={"n1": {"preemptions": None, "kv_usage_mean": None}})) == []


def test_gpu_throttled_on_a_slowdown_reason_or_a_clock_under_the_others():
    got = fd.findings_of({"sustained": result(gpu={"n2": {"throttle_reasons": 0x20, "sm_clock_mhz_mean": 1000.0}})})
    assert [(f.rule, f.node) for f in got] == [("gpu_throttled", "n2")] and "0x20" in got[0].evidence
    assert fired(result(gpu={"n2": {"throttle_reasons": 0x1}})) == []  # idle is no slowdown
    assert fired(result(gpu={"n1": {"throttle_reasons": None, "sm_clock_mhz_mean": 1400.0}})) == [
        ("gpu_throttled", "n1")]  # no reasons reported, but 70 % of the others' clock
    assert fired(result(gpu={"n1": {"sm_clock_mhz_mean": 1900.0}})) == []  # 95 %: within the nodes' spread


def test_slow_node_is_an_outlier_against_the_median_and_needs_three_nodes():
    slow = result(nodes={"n3": {"rps": 2.0, "p99": 2500.0}}, engine={}, gpu={})
    got = fd.findings_of({"sustained": slow})
    assert {(f.rule, f.node, f.metric) for f in got} == {("slow_node", "n3", "achieved requests/s"),
                                                          ("slow_node", "n3", "P99 latency ms")}
    # noise among clean nodes is no outlier, however small their spread (the MAD floor)
    assert fired(result(nodes={"n1": {"p99": 430.0}, "n3": {"p99": 380.0, "rps": 4.8}})) == []
    # two nodes: no median to stand out from
    two = result(nodes={"n3": {"rps": 2.0, "p99": 2500.0}})
    two = two.model_copy(update={"nodes": two.nodes[1:]})
    assert [r for r, _ in fired(two) if r == "slow_node"] == []
    # absent P99 (no request succeeded on a node) is not an outlier
    assert fired(result(nodes={"n3": {"p99": None}})) == []


def test_memory_drift_fires_on_growth_per_answered_request_and_throughput_drift_on_a_falling_phase():
    leak = result(engine={"n1": {"resident_memory_growth_bytes": 200.0 * 2**20}})  # 200 MiB over 100 answered
    got = fd.findings_of({"sustained": leak})
    assert [(f.rule, f.node) for f in got] == [("memory_drift", "n1")] and "2048 KiB per answered" in got[0].evidence
    assert fired(result(engine={"n1": {"resident_memory_growth_bytes": 4.0 * 2**20}})) == []  # allocator noise
    assert fired(result(engine={"n1": {"resident_memory_growth_bytes": None}})) == []
    def windows(rates):
        return [WindowFigures(**_figs(rps=r), start_s=5.0 * i, duration_s=5.0, offered_rps=15.0)
                for i, r in enumerate(rates)]
    assert fired(result(windows=windows([15, 15, 14, 10, 9, 9]))) == [("throughput_drift", None)]
    assert fired(result(windows=windows([15, 14.5, 15, 14.8, 15, 14.2]))) == []
    assert fired(result(windows=windows([15, 9]))) == []  # two windows: no trend


def test_errors_one_node_when_most_errors_come_from_it():
    res = result(nodes={"n2": {"errors": 20, "requests": 100}, "n1": {"errors": 1}})
    got = fd.findings_of({"sustained": res})
    assert [(f.rule, f.node) for f in got] == [("errors_one_node", "n2")] and "20 of the 21 errors" in got[0].evidence
    assert fired(result(nodes={n: {"errors": 4} for n in NODES})) == []  # spread evenly: not one node's
    assert fired(result(nodes={"n2": {"errors": 3}})) == []  # too few errors to say


def test_links_below_threshold_from_preflight():
    links = [LinkTest(src="n1", dst="n2", round=0, nominal_mbit=1000, mbit=412, ratio=0.412, ok=False,
                      threshold=0.9),
             LinkTest(src="n2", dst="n3", round=0, nominal_mbit=1000, mbit=950, ratio=0.95, ok=True, threshold=0.9),
             LinkTest(src="n3", dst="n1", round=0, nominal_mbit=1000, ok=False, error="iperf3 failed")]
    pf = PreflightResult(nodes=[], links=links, healthy=[], excluded={}, decision="", seconds=1.0)
    got = fd.findings_of({}, pf)
    assert [(f.rule, f.node, f.detail["dst"]) for f in got] == [("link_below_threshold", "n1", "n2")]
    assert "41% of the nominal 1000 Mbit/s (threshold 90%)" in got[0].evidence
    # the end preflight blamed is named, whichever end sent: a slow n2 shows on n1 -> n2 and n2 -> n3 alike
    links[1] = LinkTest(src="n2", dst="n3", round=0, nominal_mbit=1000, mbit=300, ratio=0.3, ok=False,
                        threshold=0.9)
    pf = PreflightResult(nodes=[], links=links, healthy=["n1", "n3"], excluded={"n2": "2 of 2 links failed"},
                         decision="", seconds=1.0)
    got = fd.findings_of({}, pf)
    assert [(f.node, f.detail["src"], f.detail["dst"]) for f in got] == [("n2", "n1", "n2"), ("n2", "n2", "n3")]
    assert "preflight blamed n2" in got[0].evidence and "preflight blamed" not in fd.findings_of({}, PreflightResult(
        nodes=[], links=links[:1], healthy=[], excluded={}, decision="", seconds=1.0))[0].evidence
    both = PreflightResult(nodes=[], links=links[:1], healthy=[], excluded={"n1": "x", "n2": "x"}, decision="",
                           seconds=1.0)
    assert [f.node for f in fd.findings_of({}, both)] == ["n1"]  # cannot tell: the sender, as before


def test_only_the_sustained_phase_is_judged_and_hostile_figures_are_absent():
    over = result(engine={"n2": {"running_max": 1.0, "waiting_mean": 9.0}})
    assert fd.findings_of({"overload": over, "probe": over}) == []
    for bad in (float("nan"), float("inf")):
        assert fired(result(engine={"n1": {"preemptions": bad, "kv_usage_mean": bad}})) == [], bad
    # what an engine's page said reaches NodeFigures as a finite number, or not at all
    from deploybench.load.scrape import with_engine_signals

    nodes = with_engine_signals(result().nodes, {"n1": {"preemptions": "12", "kv_usage_mean": True,
                                                        "waiting_mean": float("nan"), "running_max": 1}})
    n1 = nodes[0]
    assert (n1.preemptions, n1.kv_usage_mean, n1.waiting_mean, n1.running_max) == (None, None, None, 1.0)
    assert nodes[1].preemptions is None  # n2: its engine said nothing: absent, not the 0 it had


@pytest.mark.parametrize("rule", fd.RULE_IDS)
def test_every_rule_id_is_produced_by_some_rule(rule):
    import inspect

    assert f'"{rule}"' in inspect.getsource(fd)
