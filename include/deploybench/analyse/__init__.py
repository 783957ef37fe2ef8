"""Analysis of stored runs: figures per run, comparison across configurations, history per series.

- ``figures``  — one row of figures per run (capacity, goodput, P99 TTFT and end-to-end, output
  tokens/s, error rate) from the store;
- ``compare``  — configurations x figures, the best configuration meeting the SLO, changes against
  a baseline with a rank test on the per-request samples, the throughput-latency Pareto front;
- ``history``  — change points per series (ruptures' PELT, confirmed by a Welch t-test from
  scipy), written back with method and parameters, and a verdict for the newest run;
- ``pareto``   — the front itself (pure);
- ``findings`` — the runbook's troubleshooting table as rules over one run's typed results (pure).

Nothing here imports Airflow; statistics come from scipy and ruptures, not from this package.
"""

from deploybench.errors import DeploybenchError


class AnalysisError(DeploybenchError):
    """A comparison or history request that cannot be answered as asked (mixed workloads, a foreign baseline)."""
