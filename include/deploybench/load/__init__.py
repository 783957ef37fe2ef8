"""The load stage: open-model load with k6, in three phases. Open loop: requests start at the offered rate
whatever the server does, so a slow server cannot slow the client down and hide its own latency.

* ``runner.run_load`` — one k6 run (a phase, or one step of the search) with the TTFT sampler and the
  /metrics scraper beside it; the building block the others use, and what the rollout's canary gate calls.
* ``probe.search`` — the capacity: a scout ramp, then constant steps around its throughput estimate
  (or the earlier doubling then bisection), each constant step judged by the SLO, achieved ÷ offered
  and dropped iterations.
* ``gpu`` — each node's GPU utilisation and memory beside every k6 run (DCGM gauges, or nvidia-smi over
  the run's transport; absent when neither answers), and the SLO's optional utilisation objective.
* ``sustained.run`` — a fraction of the probed capacity (without the probe: the load rate as typed) held
  for the configured time; per-window figures, drift.
* ``overload.run`` — a ramp past the capacity, then recovery at half of it; where each objective broke,
  errors by kind, recovery time.
* ``phases.run_phases`` — the three in order, as the pipeline's load stage runs them.
"""

from typing import TYPE_CHECKING, Any

from deploybench.load.results import (
    Endpoint,
    EndpointNotReady,
    Figures,
    LoadError,
    LoadResult,
    NodeFigures,
    SloVerdict,
    WindowFigures,
)

if TYPE_CHECKING:
    from deploybench.load.runner import build_env, find_k6, k6_command, k6_timeout_s, run_load, size_vus
    from deploybench.load.samples import (
        SAMPLE_COLUMNS,
        SAMPLE_METRIC,
        load_samples,
        read_k6_json,
        save_samples,
    )
    from deploybench.load.stats import figures, node_figures, slo_verdict, thresholds_crossed, window_figures

# The modules behind these names import pandas: loaded when a name is first used, so that what only reads a
# result (the records, the stage registry a DAG file builds its tasks from) does not pay for it.
_LAZY = {**dict.fromkeys(("build_env", "find_k6", "k6_command", "k6_timeout_s", "run_load", "size_vus"), "runner"),
         **dict.fromkeys(("SAMPLE_COLUMNS", "SAMPLE_METRIC", "load_samples", "read_k6_json", "save_samples"),
                         "samples"),
         **dict.fromkeys(("figures", "node_figures", "slo_verdict", "thresholds_crossed", "window_figures"), "stats")}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


__all__ = [
    "Endpoint", "EndpointNotReady", "Figures", "LoadError", "LoadResult", "NodeFigures", "SAMPLE_COLUMNS",
    "SAMPLE_METRIC", "SloVerdict", "WindowFigures", "build_env", "figures", "find_k6", "k6_command",
    "k6_timeout_s", "load_samples", "node_figures", "read_k6_json", "run_load", "save_samples", "size_vus",
    "slo_verdict", "thresholds_crossed", "window_figures",
]
