"""The load stage's records as the pipeline writes them (``from tests.support import load_records``): phase
outcome files in load.phases.run_phase's shape, assembled by load.phases.assemble, the one contract
deploybench.records types."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from deploybench.config import LoadSpec
from deploybench.load import phases
from deploybench.load.probe import CapacityResult, ProbeStep
from deploybench.load.results import LoadResult, NodeFigures, SloVerdict

T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)


def _figures(rate: float, p99: float, requests: int, errors: int) -> dict[str, Any]:
    return {"requests": requests, "errors": errors, "error_rate": errors / requests, "errors_by_kind":
            {"http_503": errors} if errors else {}, "achieved_rps": round(rate * 0.975, 3), "output_tps": rate * 8,
            "latency_p50_ms": p99 * 0.66, "latency_p90_ms": p99 * 0.8, "latency_p99_ms": p99,
            "latency_p999_ms": p99 * 1.1}


def load_result(phase: str, rate: float, samples: str, p99: float = 600.0, metrics: str | None = None) -> LoadResult:
    """A LoadResult as deploybench.load writes one: 15 s at ``rate`` over two nodes."""
    n = int(rate * 15)
    return LoadResult(**_figures(rate, p99, n, 10), phase=phase, offered_rps=rate, duration_s=15, warmup_s=1,
                      started_at=T0, warmup_excluded=3, dropped_iterations=0, slo_ok=True,
                      slo=SloVerdict(passed=True, reasons=[]),
                      nodes=[NodeFigures(node=x, **_figures(rate / 2, p99, n // 2, 5)) for x in ("n1", "n2")],
                      samples_path=samples, warmup_samples_path=None, summary_path="k6-summary.json", k6_exit_code=0,
                      k6_thresholds_crossed=[], k6_cpu_s=0.2, vus_pre=2, vus_max=8, tags={}, notes=[],
                      metrics_path=metrics)


def _step(n: int, rate: float, passed: bool, samples: str) -> ProbeStep:
    return ProbeStep(step=n, rate=rate, passed=passed, reasons=[] if passed else ["P99 4000 ms > 2000 ms"],
                     requests=int(rate * 4), achieved_rps=rate if passed else rate * 0.6,
                     achieved_ratio=1.0 if passed else 0.6, latency_p99_ms=300.0 if passed else 4000.0,
                     ttft_p99_ms=None, error_rate=0.0, errors_by_kind={}, dropped_iterations=0,
                     started_at=T0.isoformat(), duration_s=4.0, samples_path=samples, metrics_path=None)


def write_load_stage(out_dir: Path, samples: str, series: str | None = None) -> dict[str, Any]:
    """The load stage's result as the pipeline makes it: phase outcome files (load.phases.run_phase's shape: a
    probe that found 16 req/s, sustained, an overload that failed) assembled by load.phases.assemble."""
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [_step(1, 8, True, samples), _step(2, 16, True, samples), _step(3, 32, False, samples)]
    found = CapacityResult(capacity_rps=16, bracket=(16, 32), converged=True, reason="bracketed", steps=steps,
                           seconds=40.0)
    outcomes = {
        "probe": {"phase": "probe", "status": "success", "error": None, "analysis": found.model_dump(mode="json"),
                  "result": load_result("probe", 16, samples).model_dump(mode="json"), "series": []},
        "sustained": {"phase": "sustained", "status": "success", "error": None,
                      "result": load_result("sustained", 16, samples, metrics=series).model_dump(mode="json"),
                      "analysis": {"drifted": False, "reasons": [], "capacity_rps": 16, "capacity_source": "probe"},
                      "series": [series] if series else []},
        "overload": {"phase": "overload", "status": "failed", "result": None, "error": "LoadError: k6 crashed",
                     "analysis": None},
    }
    for name, outcome in outcomes.items():
        (out_dir / f"{name}.result.json").write_text(json.dumps(outcome))
    return json.loads(json.dumps(phases.assemble(out_dir, LoadSpec())))  # as the stage record holds it
