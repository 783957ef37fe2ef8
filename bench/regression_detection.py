"""How often the regression benchmark's verdict is right, on real k6 runs against simulated engines.

Two sets of simulated engines run side by side on this machine: A at the reference speed and
B with ``--slowdown`` (the software of the bad date). For each repetition two series are measured
interleaved, run by run, so both see the same machine noise: a *steady* series (always A) and a
*changed* series (A, then B from run ``--change-at`` on). Each run is one short open-loop k6
phase, like the scheduled benchmark's sustained phase. Every run of both series is then judged
as the regression DAG judges it (``deploybench.analyse.judge``, replayed in logical-date order):

- changed series right: ``regression`` at the first slowed run and at no other run;
- steady series right: no ``regression`` at any run (``suspect`` counted apart).

Prints each series' P50 latencies and verdicts, then the rates. Usage:

    .venv/bin/python bench/regression_detection.py [--repeat 5] [--runs 8] [--slowdown 1.1] [--metric latency_p50_ms]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from deploybench.analyse.judge import JudgeParams, judge_values
from deploybench.config import SLO, LoadSpec
from deploybench.load import run_load
from deploybench.manifest import seed_model
from deploybench.sim.local import LocalEngines

METRICS = {"latency_p50_ms": "latency_p50_ms", "latency_p99_ms": "latency_p99_ms", "output_tps": "output_tps"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--change-at", type=int, default=None, help="first slowed run (default: runs // 2)")
    ap.add_argument("--slowdown", type=float, default=1.1)
    ap.add_argument("--rate", type=float, default=6.0)
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--metric", default="latency_p50_ms", choices=sorted(METRICS))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    change_at = args.runs // 2 if args.change_at is None else args.change_at
    spec = LoadSpec(rate=args.rate, duration_s=args.duration, warmup_s=1.0, prompt_tokens=64, output_tokens=16,
                    request_timeout_s=10)
    slo = SLO(p99_latency_ms=5000, max_error_rate=0.05)
    params = JudgeParams()
    right_changed = right_steady = suspects = 0
    noise: list[float] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="db-regression-bench-") as tmp:
        work = Path(tmp)
        seed_model(work / "model", total_mb=1)
        with LocalEngines(work / "model", work) as a, LocalEngines(work / "model", work) as b:
            fast = a.start(args.nodes, "--slowdown", "1.0")
            slow = b.start(args.nodes, "--slowdown", repr(args.slowdown))
            for rep in range(args.repeat):
                steady, changed = [], []
                for i in range(args.runs):
                    for series, eps in ((steady, fast), (changed, slow if i >= change_at else fast)):
                        res = run_load(eps, spec, slo, work / f"r{rep}-{i}-{len(series)}-{id(series)}",
                                       phase="sustained")
                        series.append(float(getattr(res, args.metric)))
                vs = [j.verdict for j in judge_values(args.metric, steady, params)]
                vc = [j.verdict for j in judge_values(args.metric, changed, params)]
                ok_c = vc[change_at] == "regression" and all(
                    v != "regression" for k, v in enumerate(vc) if k != change_at)
                ok_s = "regression" not in vs
                right_changed += ok_c
                right_steady += ok_s
                suspects += "suspect" in vs
                noise.append(float(np.std(steady, ddof=1) / np.mean(steady)))
                for name, vals, verdicts, ok in (("changed", changed, vc, ok_c), ("steady", steady, vs, ok_s)):
                    print(f"rep {rep} {name:<7} {'right' if ok else 'WRONG'}: {args.metric} "
                          f"{[round(v, 1) for v in vals]} -> {verdicts}", flush=True)
    n = args.repeat
    print(f"x{args.slowdown} slowdown from run {change_at} of {args.runs} ({args.nodes} engines, "
          f"{args.rate:g} req/s for {args.duration:g} s per run, metric {args.metric}, run-to-run noise "
          f"{np.median(noise):.1%} median):")
    print(f"  changed series flagged 'regression' exactly at the first slowed run: {right_changed}/{n} "
          f"({right_changed / n:.0%})")
    print(f"  steady series with no 'regression': {right_steady}/{n} ({right_steady / n:.0%}); "
          f"with a 'suspect': {suspects}/{n}")
    print(f"  {2 * n * args.runs} runs in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
