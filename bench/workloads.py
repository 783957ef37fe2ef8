"""Workloads side by side: how well k6 keeps each arrival process's schedule, and what the traffic changes.

    python bench/workloads.py [--seconds 5] [--rates 50,500,2000] [--skip-engine]

1. Send lag and fit. Against HAProxy answering a canned completion from its own memory (`http-request return`: the
   server costs next to nothing, so the client is what is measured), each arrival process (constant, poisson,
   gamma with gaps' CV 3) at each rate: the send lag P50/P99 (a request's actual send time minus the time its
   schedule had it due: k6's even spacing, or the plan's send time) and goodness of fit. The fit of what was
   *sent*: a chi-square test of the number of requests sent per window (of max(20 ms, 10 / rate): k6 stamps sends
   in whole ms, too coarse for the gaps themselves at 2,000 req/s) against Poisson's law; Poisson must pass it,
   constant and gamma must fail it. Beside it, the schedule's own law (the plan's gaps against exponential or
   gamma).
2. Prefix hit rate. The shared-prefix workload against the simulated engine: the hit rate the engine counted
   (vllm:prefix_cache_hits / queries over the phase) against the closed form of the plan (every shared prefix's
   whole 16-token blocks hit, the rest computed).
3. Capacity under Poisson against constant arrivals: the probe phase on the same simulated engine with the same
   lengths; Poisson's bursts queue, so its capacity at the same P99 is lower.

Last line: ``workloads: send lag P99 <ms> ms at <top rate> req/s; prefix hit rate <measured> vs <truth>; poisson fit
p=<p>``. Aims (issue 27): send lag P99 <= 5 ms at 2,000 req/s; hit rate within 3 % of the truth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from deploybench import workloads
from deploybench.config import SLO, LoadSpec
from deploybench.load import Endpoint, load_samples, read_k6_json, run_load

CANNED = ('{"id":"cmpl-bench","object":"text_completion","model":"m","choices":[{"index":0,"text":" ok",'
          '"finish_reason":"length"}],"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}')
PROCESSES = {
    "constant": '[arrival]\nprocess = "constant"\n',
    "poisson": '[arrival]\nprocess = "poisson"\n',
    "gamma": '[arrival]\nprocess = "gamma"\ncv = 3.0\n',
}
LENGTHS = '[input]\ndist = "fixed"\nvalue = 8\n[output]\ndist = "fixed"\nvalue = 1\n'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def haproxy(folder: Path, host: str = "127.0.0.1") -> Iterator[str]:
    """HAProxy on ``host`` (127.0.0.1; bench/loadgen_scale.py: a netns lab's bridge address) answering every POST
    /v1/completions with CANNED and anything else with 200."""
    exe = shutil.which("haproxy") or "/usr/sbin/haproxy"
    port = free_port()
    cfg = folder / "haproxy.cfg"
    cfg.write_text(f"""global
    maxconn 4000
defaults
    mode http
    timeout client 30s
    timeout connect 5s
    timeout server 30s
frontend canned
    bind {host}:{port}
    http-request return status 200 content-type application/json string '{CANNED}' if {{ path_beg /v1/completions }}
    http-request return status 200 content-type application/json string '{{"status":"ok"}}'
""")
    proc = subprocess.Popen([exe, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
                break
            if proc.poll() is not None:
                raise RuntimeError(f"haproxy exited: {proc.stderr.read().decode(errors='replace')[-800:]}")
            time.sleep(0.05)
        yield f"http://{host}:{port}"
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        if proc.poll() is None:
            proc.kill()


def poisson_counts_p(sent_s: np.ndarray, rate: float) -> float:
    """p-value of the numbers of sends in windows of max(20 ms, 10 / rate) against Poisson's law for that window
    (chi-square; counts grouped so that each group expects at least 5 windows). Windows of 20 ms at least: k6
    stamps sends in whole ms and a send lags its due time by a ms or two, which at 2,000 req/s moves requests
    between 5 ms windows often enough to show."""
    w = max(0.02, 10.0 / rate)
    t = sent_s - sent_s.min()
    n_win = int(t.max() // w)
    if n_win < 20:
        return float("nan")
    counts = np.bincount((t[t < n_win * w] // w).astype(int), minlength=n_win)
    law = stats.poisson(rate * w)
    # groups of consecutive counts, each expecting >= 5 windows (the tails folded into the end groups)
    edges, lo, top = [], 0, int(law.ppf(1 - 1e-9)) + 1
    while lo <= top:
        hi = lo
        while hi < top and (law.cdf(hi) - law.cdf(lo - 1)) * n_win < 5:
            hi += 1
        edges.append((lo, hi))
        lo = hi + 1
    seen = [np.sum((counts >= a) & (counts <= b)) for a, b in edges]
    seen[-1] += np.sum(counts > edges[-1][1])
    probs = [law.cdf(b) - law.cdf(a - 1) for a, b in edges]
    probs[-1] += law.sf(edges[-1][1])
    expected = np.array(probs) * n_win
    return float(stats.chisquare(seen, expected * (sum(seen) / expected.sum())).pvalue)


def schedule_p(plan: dict, process: str, rate: float) -> float | None:
    """p-value of the plan's own gaps against their law (None for constant: k6 spaces those itself)."""
    due = np.array([r[0] for r in plan["requests"]]) / 1000.0
    if process == "constant" or len(due) < 50:
        return None
    gaps = np.diff(due)
    if process == "poisson":
        return float(stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue)
    law = stats.gamma(1 / 9, 0, 9 / rate)
    edges = np.concatenate([[0.0], law.ppf(np.linspace(0.3, 0.95, 14)), [np.inf]])
    counts, _ = np.histogram(gaps, edges)
    return float(stats.chisquare(counts, np.diff(law.cdf(edges)) * len(gaps)).pvalue)


def lag_table(rates: list[float], seconds: float, folder: Path) -> dict[tuple[str, float], dict]:
    out = {}
    slo = SLO(p99_latency_ms=50)  # VUs sized for 50 ms answers; HAProxy answers in well under 1 ms
    with haproxy(folder) as url:
        ep = [Endpoint(node="haproxy", url=url, model="m")]
        print(f"{'process':>9} {'rate':>6} {'sent/plan':>9} {'lag p50':>8} {'lag p99':>8} {'dropped':>7} "
              f"{'poisson counts p':>16} {'schedule p':>10} {'k6 CPU/req':>10}")
        for rate in rates:
            for process in PROCESSES:
                spec = LoadSpec(workload=f"bench-{process}", rate=rate, duration_s=seconds, warmup_s=1,
                                ttft_sample_rps=0, scrape_interval_s=0, request_timeout_s=5)
                run_dir = folder / f"{process}-{rate:g}"
                res = run_load(ep, spec, slo, run_dir, phase="bench")
                df = load_samples(res.samples_path)
                plan = json.loads((run_dir / "bench.plan.json").read_text())
                planned = len(plan["requests"]) if plan["timed"] else rate * (1 + seconds)
                k6, _ = read_k6_json(run_dir / "bench.k6.json.gz")
                measured = k6[k6["ts"] >= pd.Timestamp(res.started_at)]  # the warm-up second left out
                lag = measured["lag_ms"].to_numpy()
                sent = (df["ts"] - df["ts"].min()).dt.total_seconds().to_numpy()
                row = {"lag_p50": float(np.nanpercentile(lag, 50)), "lag_p99": float(np.nanpercentile(lag, 99)),
                       "sent": (res.requests + res.warmup_excluded) / planned, "dropped": res.dropped_iterations,
                       "counts_p": poisson_counts_p(sent, rate), "schedule_p": schedule_p(plan, process, rate),
                       "cpu_ms": 1000 * res.k6_cpu_s / max(1, res.requests + res.warmup_excluded)}
                out[(process, rate)] = row
                sp = "-" if row["schedule_p"] is None else f"{row['schedule_p']:.3g}"
                print(f"{process:>9} {rate:6.0f} {row['sent']:9.3f} {row['lag_p50']:6.2f}ms {row['lag_p99']:6.2f}ms "
                      f"{row['dropped']:7d} {row['counts_p']:16.3g} {sp:>10} {row['cpu_ms']:8.3f}ms")
    return out


def engine_part(folder: Path, seconds: float) -> tuple[float | None, float | None, dict[str, float]]:
    """(measured hit rate, closed-form hit rate, {process: probed capacity}) on the simulated engine."""
    from _engines import local_engines

    from deploybench.config import EngineSpec, SimKnobs
    from deploybench.engines import profile
    from deploybench.load import phases

    engine = EngineSpec(max_num_seqs=8, sim=SimKnobs(decode_base_ms=10, decode_per_seq_ms=1,
                                                      prefill_per_token_ms=0.2))
    metrics = profile("sim").metrics
    slo = SLO(p99_latency_ms=2000)
    with local_engines(engine, 1) as eps:
        eps = [Endpoint.of({"node": e.node, "url": e.url, "model": e.model}, f"{e.url}/metrics") for e in eps]
        spec = LoadSpec(workload="shared-prefix", rate=8, duration_s=max(10.0, 4 * seconds), warmup_s=0,
                        output_tokens=16, ttft_sample_rps=0, scrape_interval_s=1, request_timeout_s=30)
        before = _counters(eps[0])
        run_load(eps, spec, slo, folder / "prefix", phase="prefix", metrics=metrics)
        after = _counters(eps[0])
        measured = (after[0] - before[0]) / max(1.0, after[1] - before[1])
        doc = json.loads((folder / "prefix" / "prefix.plan.json").read_text())
        truth = _closed_form(doc)
        caps = {}
        for process in ("constant", "poisson"):
            spec = LoadSpec(workload=f"bench-{process}-sim", rate=8, phases=["probe"], probe_start_rps=2,
                            probe_max_rps=200, probe_step_s=max(6.0, seconds), ttft_sample_rps=0,
                            output_tokens=32, request_timeout_s=30)
            out = phases.run_phase("probe", eps, spec, slo, folder / f"probe-{process}", metrics=metrics)
            caps[process] = float((out.get("analysis") or {}).get("capacity_rps") or 0.0)
    return measured, truth, caps


def _counters(ep: Endpoint) -> tuple[float, float]:
    """The engine's (prefix cache hits, queries) counters, in tokens."""
    from deploybench.load.scrape import get_page, parse_metrics

    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    got = {n: v for n, _, v in parse_metrics(get_page(f"{ep.url}/metrics", 2.0), names)}
    return got[names[0]], got[names[1]]


def _closed_form(doc: dict) -> float:
    """The plan file's closed-form hit rate on a fresh engine (deploybench.workloads.Plan.expected_prefix_hits,
    less each group's first request, which computes its prefix)."""
    rows = doc["requests"]
    plan = workloads.Plan(doc["workload"], doc["seed"], doc["prefixes"], doc["prefix_tokens"],
                          [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows])
    hits, queries = plan.expected_prefix_hits()
    first = len({g for g in plan.group if g >= 0}) * (plan.prefix_tokens // 16 * 16)
    return (hits - first) / queries


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--rates", default="50,500,2000")
    ap.add_argument("--skip-engine", action="store_true", help="only the send lag (no simulated engine)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rates = [float(r) for r in args.rates.split(",")]
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="db-bench-wl-") as tmp:
        folder = Path(tmp)
        wl = folder / "workloads"
        wl.mkdir()
        for process, arrival in PROCESSES.items():
            (wl / f"bench-{process}.toml").write_text(f'name = "bench-{process}"\n{arrival}{LENGTHS}')
            (wl / f"bench-{process}-sim.toml").write_text(
                f'name = "bench-{process}-sim"\n{arrival}[input]\ndist = "fixed"\nvalue = 64\n')
        os.environ[workloads.WORKLOAD_ENV] = str(wl)
        table = lag_table(rates, args.seconds, folder)
        measured = truth = None
        caps: dict[str, float] = {}
        if not args.skip_engine:
            measured, truth, caps = engine_part(folder, args.seconds)
            print(f"\nshared-prefix hit rate: measured {measured if measured is None else f'{measured:.4f}'}, "
                  f"closed form {truth:.4f}")
            print(f"probed capacity, same engine and lengths: constant {caps.get('constant', 0):.2f} req/s, "
                  f"poisson {caps.get('poisson', 0):.2f} req/s "
                  f"(ratio {caps.get('poisson', 0) / max(1e-9, caps.get('constant', 0)):.3f})")
    top = max(rates)
    lag99 = max(table[(p, top)]["lag_p99"] for p in PROCESSES)
    fit = table[("poisson", top)]["counts_p"]
    hit = "absent" if measured is None else f"{measured:.4f}"
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    print(f"workloads: send lag P99 {lag99:.2f} ms at {top:.0f} req/s; prefix hit rate {hit} vs "
          f"{'-' if truth is None else f'{truth:.4f}'}; poisson fit p={fit:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
