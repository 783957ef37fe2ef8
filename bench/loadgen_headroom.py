"""Load-generator headroom: the highest arrival rate this machine's k6 sustains with under 1 % dropped.

    python bench/loadgen_headroom.py [--start 100] [--max 20000] [--seconds 3]

Against a trivial local endpoint (the simulated engine with a 1-token answer and a 4096-slot batch in
microseconds, so the server is never the limit), k6 runs open-model steps at doubling rates, then
bisects between the last good and the first bad one. A rate is sustained when fewer than 1 % of its
iterations are dropped and k6 sent at least 99 % of the offered requests. Printed per step, side by
side: sent / offered, answered / offered, dropped %, k6's schedule lag P99 and its CPU per request.
Above the printed rate, the load generator, not the cluster, is what a run measures.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path

from _engines import local_engines

from deploybench.config import SLO, EngineSpec, LoadSpec, SimKnobs
from deploybench.load import run_load

TRIVIAL = EngineSpec(max_num_seqs=4096, sim=SimKnobs(decode_base_ms=0.01, decode_per_seq_ms=0.0,
                                                      prefill_per_token_ms=0.0, queue_limit=4096))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=float, default=100)
    ap.add_argument("--max", type=float, default=20000)
    ap.add_argument("--seconds", type=float, default=3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    spec = LoadSpec(prompt_tokens=8, output_tokens=1, warmup_s=1, duration_s=args.seconds, ttft_sample_rps=0,
                    scrape_interval_s=0, request_timeout_s=5)
    slo = SLO(p99_latency_ms=50)  # VUs sized for 50 ms answers: the trivial server answers in about 1 ms
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'offered':>9} {'sent/off':>8} {'answ/off':>8} {'dropped':>8} {'lag p99':>9} {'k6 CPU/req':>10}  verdict")
    good, bad, rate = None, None, args.start
    with local_engines(TRIVIAL, 1) as eps, tempfile.TemporaryDirectory() as tmp:
        for _ in range(12):
            res = run_load(eps, spec, slo, Path(tmp), phase="headroom", rate=rate)
            offered = rate * res.duration_s
            dropped = res.dropped_iterations / offered
            ok = dropped < 0.01 and res.sent_rps >= 0.99 * rate
            cpu_per_req = 1000 * res.k6_cpu_s / max(1, res.requests + res.warmup_excluded)
            print(f"{rate:9.0f} {res.sent_rps / rate:8.3f} {res.achieved_rps / rate:8.3f} {dropped:8.2%} "
                  f"{res.lag_p99_ms or 0:7.1f}ms {cpu_per_req:8.3f}ms  {'sustained' if ok else 'NOT sustained'}")
            if ok:
                good = rate if good is None else max(good, rate)
            else:
                bad = rate if bad is None else min(bad, rate)
            if bad is None:
                if rate >= args.max:
                    break
                rate = min(rate * 2, args.max)
            elif good is None:
                rate /= 2
            elif (bad - good) / bad <= 0.1:
                break
            else:
                rate = (good + bad) / 2
    print(f"\nhighest rate sustained with < 1 % dropped: {good or 0:.0f} req/s"
          + (f" (first failing: {bad:.0f})" if bad else f" (every rate up to {args.max:.0f} held)"))
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
