"""Load-stage accuracy: the probe's capacity against the simulated engine's closed form, side by side.

    python bench/load_accuracy.py [--step-s 3] [--tolerance 0.04] [--start-rps 1] [--only ramp|doubling]

For two engine configurations (1 and 2 nodes on 127.0.0.1) it runs the capacity search with an SLO too
loose to bind, so the truth is the saturation rate lambda_max x nodes (service_model.capacity), and
prints found / truth, whether that is within +-5 %, the steps used and the time spent: the earlier
search (doubling from ``--start-rps``, then bisection) and the current one (a scout ramp, then constant
steps around its estimate) side by side on the same engines. Then one light-load run prints the
client's and the engine's TTFT and the client's e2e against the configured service times. Prints the
machine's load average: on a shared 2-core machine k6's schedule lag (also printed) is the first suspect.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

from _engines import local_engines

from deploybench.config import SLO, EngineSpec, LoadSpec, SimKnobs
from deploybench.engines import profile as engine_profile
from deploybench.load import load_samples, phases, run_load
from deploybench.sim.service_model import ServiceParams, capacity

CONFIGS = {
    "batch 8, 1 node": (1, EngineSpec(max_num_seqs=8, sim=SimKnobs(decode_base_ms=4.0, decode_per_seq_ms=0.5,
                                                                   prefill_per_token_ms=0.02, queue_limit=32)), 32, 16),
    "batch 4, 2 nodes": (2, EngineSpec(max_num_seqs=4, sim=SimKnobs(decode_base_ms=4.0, decode_per_seq_ms=0.5,
                                                                 prefill_per_token_ms=0.02, queue_limit=32)), 64, 24),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-s", type=float, default=3.0)
    ap.add_argument("--tolerance", type=float, default=0.04)
    ap.add_argument("--start-rps", type=float, default=LoadSpec().probe_start_rps)
    ap.add_argument("--only", choices=["ramp", "doubling"], help="run one search only")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'config':<16} {'search':<9} {'truth':>7} {'found':>7} {'found/truth':>11} {'+-5 %':>5} {'bracket':>16} "
          f"{'steps':>5} {'seconds':>7} {'lag p99 at cap':>14}")
    for name, (nodes, engine, P, O) in CONFIGS.items():
        lam = capacity(ServiceParams.from_config(engine), P, O).requests_per_s * nodes
        b, q = engine.max_num_seqs, engine.sim.queue_limit
        slo = SLO(p99_latency_ms=4000 * (b + q) * nodes / lam)
        spec = LoadSpec(prompt_tokens=P, output_tokens=O, phases=["probe"], probe_start_rps=args.start_rps,
                        probe_max_rps=2000, probe_step_s=args.step_s, probe_warmup_s=1, probe_tolerance=args.tolerance,
                        probe_max_steps=20, request_timeout_s=10, ttft_sample_rps=1, scrape_interval_s=1)
        with local_engines(engine, nodes) as eps:
            for search in [args.only] if args.only else ["doubling", "ramp"]:
                with tempfile.TemporaryDirectory() as tmp:
                    t0 = time.monotonic()
                    out = phases.run_phase("probe", eps, spec, slo, Path(tmp), search=search)
                    secs = time.monotonic() - t0
                    an = out["analysis"]
                    lag = out["result"]["lag_p99_ms"] or 0.0  # of the capacity step
                cap = an["capacity_rps"] or 0.0
                lo, hi = an["bracket"]
                ok = "yes" if abs(cap / lam - 1) <= 0.05 else "NO"
                print(f"{name:<16} {search:<9} {lam:7.1f} {cap:7.1f} {cap / lam:11.3f} {ok:>5} "
                      f"{f'[{lo or 0:.1f}, {hi or 0:.1f}]':>16} {len(an['steps']):5d} {secs:7.1f} {lag:11.1f} ms")
                trail = " ".join(f"ramp {st['rate_from']:g}->{st['rate']:g}" if st["kind"] == "ramp"
                                 else f"{st['rate']:.1f}{'+' if st['passed'] else '-'}" for st in an["steps"])
                print(f"{'':<16} steps: {trail}")

    engine = EngineSpec(max_num_seqs=8, sim=SimKnobs(decode_base_ms=100.0, decode_per_seq_ms=0.0,
                                                     prefill_per_token_ms=0.25, queue_limit=8))
    P, O = 40, 2
    cap = capacity(ServiceParams.from_config(engine), P, O)
    spec = LoadSpec(rate=1.2, duration_s=10, warmup_s=1, prompt_tokens=P, output_tokens=O, ttft_sample_rps=0.5,
                    scrape_interval_s=1, request_timeout_s=10)
    with local_engines(engine, 1) as eps, tempfile.TemporaryDirectory() as tmp:
        res = run_load(eps, spec, SLO(), Path(tmp), phase="light", metrics=engine_profile("sim").metrics)
        df = load_samples(res.samples_path)
    ttft = statistics.median(df["ttft_ms"].dropna())
    e2e = statistics.median(df.loc[df["ttft_ms"].isna(), "latency_ms"])
    eng = res.engine["n1"]["ttft_mean_ms"]
    print("\nlight load (1.2 req/s, engine alone most of the time):")
    print(f"  TTFT  client median {ttft:7.2f} ms, engine mean {eng:7.2f} ms, configured {cap.single_ttft_ms:7.2f} ms "
          f"-> ratios {ttft / cap.single_ttft_ms:.3f} / {eng / cap.single_ttft_ms:.3f}")
    print(f"  e2e   client median {e2e:7.2f} ms, configured {cap.single_e2e_ms:7.2f} ms -> ratio "
          f"{e2e / cap.single_e2e_ms:.3f}")
    print(f"  ITL   client P50    {res.itl_p50_ms:7.2f} ms, configured {cap.single_itl_ms:7.2f} ms -> ratio "
          f"{res.itl_p50_ms / cap.single_itl_ms:.3f}")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
