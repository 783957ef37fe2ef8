"""Findings: the runbook's troubleshooting table (docs: /work/shared/RUNBOOK.md) as rules over a run's typed results.

A finding says why a configuration reached the capacity it did, in the runbook's words, with its evidence: the
rule, the node (None: the whole cluster), the metric, the window (phase, step and time span), the numbers
(``observed`` against ``expected``, a threshold or what the other nodes did) and what to do. The rules read the
load phases' ``LoadResult`` (client figures per node, the engine's own /metrics figures, the GPU figures) and
preflight's ``PreflightResult``; nothing else. A rule never fires on absent data: a figure that was not measured
(None, or not a finite number: a record is a file, and what a node said is hostile) keeps it silent. The
engine's figures are read typed, from ``NodeFigures`` (``scrape.with_engine_signals``), the GPU's from
``GpuFigures``.

Only the phases in ``ANALYSED_PHASES`` are judged: sustained is the runbook's "load" mode, below the knee, where a
healthy cluster is stable; the probe and overload push past the knee on purpose, where queues, latency outliers
and errors are what they measure, not faults.

Rules (``RULES``; thresholds are the named constants below, each with why):

- ``no_batching``: requests do not batch: at most one request ran in every scrape while others waited (vLLM's
  running/waiting gauges), or Triton's inference count is close to its execution count (the runbook's check);
- ``client_limited``: the client could not offer the load (k6 dropped iterations, sent late, or its CPU was
  full) while the GPUs were under-used: the figures measure the client, not the server;
- ``kv_cache_saturated``: the engine preempted sequences, or its KV cache sat nearly full;
- ``gpu_throttled``: DCGM reported a slowdown reason (thermal, power), or the SM clock was well below the other
  nodes';
- ``slow_node``: one node's throughput or P99 is an outlier against the others (the median and the median absolute
  deviation; needs ``MIN_OUTLIER_NODES`` nodes);
- ``memory_drift`` / ``throughput_drift``: the resident memory grew with the requests answered (a leak), or the
  throughput fell from the start of the phase to its end;
- ``errors_one_node``: most of the errors come from one node;
- ``link_below_threshold``: preflight measured a link below its threshold of the nominal speed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, Field

from deploybench.load.results import LoadResult

# -- thresholds ------------------------------------------------------------------------------------------------
ANALYSED_PHASES = ("sustained",)
NO_BATCH_MAX_RUNNING = 1.0  # never more than one request running in a scrape: a batch of one
NO_BATCH_MIN_WAITING = 0.5  # ... while on average half a request or more waited: batching was possible
TRITON_BATCH_MAX = 1.05  # inferences / executions within 5 % of 1: the runbook's "about 1:1 means no batching"
TRITON_MIN_INFERENCES = 20  # fewer are not enough to call a ratio
DROPPED_MAX_SHARE = 0.01  # k6 dropped more than 1 % of the iterations it was to start: it ran out of VUs
LAG_P99_MAX_MS = 200.0  # P99 send lag past 200 ms: requests left well after they were due (a busy generator)
CLIENT_CPU_MAX_CORES = 0.9  # k6 used 90 % of a core or more: its event loop is the bottleneck
GPU_UNDERUSED_PCT = 80.0  # the runbook's GPU utilisation target (80-85 %): under it, the GPU could do more
PREEMPTIONS_MIN = 1  # a preemption throws away computed KV: any one shows a cache too small for the batch
KV_USAGE_HIGH = 0.95  # a cache 95 % full on average: the next longer batch preempts
# DCGM's slowdown reasons (NVIDIA/DCGM dcgmlib/dcgm_fields.h, DCGM_CLOCKS_THROTTLE_REASON_*): SW power cap 0x4,
# HW slowdown 0x8, SW thermal 0x20, HW thermal 0x40, HW power brake 0x80; idle (0x1), application clocks (0x2),
# sync boost (0x10) and display clocks (0x100) slow nothing down under load
THROTTLE_SLOWDOWN_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
SM_CLOCK_MIN_RATIO = 0.9  # an SM clock under 90 % of the fastest node's: below its clocks (the P-state check)
MIN_OUTLIER_NODES = 3  # the median of two is their mean: an outlier needs at least three to stand out from
OUTLIER_Z = 3.5  # Iglewicz and Hoaglin's cut-off for the modified z-score, 0.6745 (x - median) / MAD
MAD_FLOOR = 0.05  # the MAD is at least 5 % of the median: equal clean nodes must not make noise an outlier
OUTLIER_RPS_RATIO = 0.8  # and the node served under 80 % of the median throughput ...
OUTLIER_P99_RATIO = 2.0  # ... or its P99 is twice the median or more (a short phase's P99 moves by tens of %)
LEAK_MIN_BYTES = 16 << 20  # resident memory grew 16 MiB or more over the phase (allocator noise is a few MiB) ...
LEAK_MIN_BYTES_PER_REQUEST = 64 << 10  # ... and 64 KiB or more per answered request
DRIFT_MIN_WINDOWS = 3  # thirds of a phase: fewer windows cannot tell a trend from a bump
DRIFT_MAX_FALL = 0.2  # the last third served 20 % less than the first (the sustained phase's default threshold)
ERRORS_MIN = 5  # fewer errors are too few to say where they come from
ERRORS_MIN_SHARE = 0.6  # one node has 60 % or more of the errors ...
ERRORS_MIN_RATE = 0.01  # ... its error rate is 1 % or more (the runbook's alert) ...
ERRORS_OTHERS_RATIO = 3.0  # ... and 3 x the other nodes' or more


class Finding(BaseModel):
    """One rule that fired, with its evidence and what to do (see the module doc)."""

    rule: str
    node: str | None  # None: the whole cluster
    metric: str
    phase: str
    step: int = 0
    window_start: datetime | None = None
    window_end: datetime | None = None
    observed: float | None = None
    expected: float | None = None  # the threshold, or what the other nodes did
    evidence: str
    advice: str
    detail: dict[str, Any] = Field(default_factory=dict)

    def line(self) -> str:
        """One line for logs and text reports."""
        where = f"node {self.node}" if self.node else "cluster"
        return f"{self.rule} ({where}, {self.phase}): {self.evidence}; {self.advice}"


def _num(x: object) -> float | None:
    """A finite number, or None (absent): a record is a file, an engine's figure hostile input."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


class _Phase:
    """What every rule needs of one phase: its result and its window."""

    def __init__(self, name: str, res: LoadResult) -> None:
        self.name, self.res = name, res
        self.start = res.started_at
        self.end = res.started_at + timedelta(seconds=res.duration_s) if _num(res.duration_s) is not None else None

    def finding(self, rule: str, node: str | None, metric: str, observed: float | None, expected: float | None,
                evidence: str, advice: str, **detail: Any) -> Finding:
        return Finding(rule=rule, node=node, metric=metric, phase=self.name, step=self.res.step,
                       window_start=self.start, window_end=self.end, observed=observed, expected=expected,
                       evidence=evidence, advice=advice, detail=detail)


def no_batching(ph: _Phase) -> Iterable[Finding]:
    for n in ph.res.nodes:
        running, waiting = _num(n.running_max), _num(n.waiting_mean)
        if running is not None and waiting is not None and running <= NO_BATCH_MAX_RUNNING \
                and waiting >= NO_BATCH_MIN_WAITING:
            yield ph.finding(
                "no_batching", n.node, "running requests", running, NO_BATCH_MAX_RUNNING,
                f"at most {running:g} request ran at a time while {waiting:.1f} waited on average (the engine's "
                "/metrics over the window)",
                "the engine serves one request per step: check its batch settings (vLLM --max-num-seqs, Triton "
                "max_batch_size and dynamic_batching), and that requests can be batched (same model, compatible "
                "parameters)", waiting_mean=waiting)
            continue
        batch, inferences = _num(n.batch_mean), _num(n.inferences)
        if batch is not None and inferences is not None and inferences >= TRITON_MIN_INFERENCES \
                and batch <= TRITON_BATCH_MAX:
            yield ph.finding(
                "no_batching", n.node, "nv_inference_count / nv_inference_exec_count", batch, TRITON_BATCH_MAX,
                f"Triton ran {inferences:.0f} inferences in about as many executions (mean batch {batch:.2f})",
                "raise max_batch_size and set dynamic_batching (preferred_batch_size, max_queue_delay_microseconds) "
                "in config.pbtxt", inferences=inferences)


def client_limited(ph: _Phase) -> Iterable[Finding]:
    r = ph.res
    util = _num(r.gpu_util_pct)
    if util is None or util >= GPU_UNDERUSED_PCT:
        return
    due = r.requests + r.dropped_iterations
    signs: list[tuple[str, float, float, str]] = []
    if due > 0 and r.dropped_iterations / due > DROPPED_MAX_SHARE:
        signs.append(("k6 dropped iterations", r.dropped_iterations / due, DROPPED_MAX_SHARE,
                      f"k6 dropped {r.dropped_iterations} of {due} iterations ({r.dropped_iterations / due:.1%})"))
    lag = _num(r.lag_p99_ms)
    if lag is not None and lag > LAG_P99_MAX_MS:
        signs.append(("send lag P99 ms", lag, LAG_P99_MAX_MS, f"requests left {lag:.0f} ms late (P99)"))
    # k6's CPU over its whole run (warm-up included), per k6 process: several load generators each have their own
    # cores, so the busiest one's counts (k6_cpu_s sums them); a generator that did not report its CPU says nothing
    wall = (_num(r.duration_s) or 0.0) + (_num(r.warmup_s) or 0.0)
    gen_cpu = [c for g in r.generators if (c := _num(g.k6_cpu_s)) is not None]
    cpu = max(gen_cpu) if r.generators else _num(r.k6_cpu_s)
    if r.generators and len(gen_cpu) < len(r.generators):
        cpu = None
    if cpu is not None and wall and cpu / wall >= CLIENT_CPU_MAX_CORES:
        signs.append(("k6 CPU cores", cpu / wall, CLIENT_CPU_MAX_CORES, f"k6 used {cpu / wall:.2f} CPU cores"
                      + (" (the busiest load generator)" if r.generators else "")))
    if signs:
        metric, observed, limit, _ = signs[0]
        yield ph.finding(
            "client_limited", None, metric, round(observed, 4), limit,
            "; ".join(s[3] for s in signs) + f", while the GPUs were {util:.0f} % busy (under {GPU_UNDERUSED_PCT:g} %)",
            "the client, not the server, was the limit: give k6 more VUs (maxVUs about rate x P99), more CPU or "
            "more generators, then run again before judging the server", gpu_util_pct=util)


def kv_cache_saturated(ph: _Phase) -> Iterable[Finding]:
    for n in ph.res.nodes:
        node = n.node
        pre, usage = _num(n.preemptions), _num(n.kv_usage_mean)
        advice = ("the KV cache is too small for the batch: raise --gpu-memory-utilization, lower --max-num-seqs or "
                  "--max-model-len, or spread the model over more GPUs (tensor parallelism)")
        if pre is not None and pre >= PREEMPTIONS_MIN:
            yield ph.finding("kv_cache_saturated", node, "vllm:num_preemptions", pre, 0.0,
                             f"{pre:.0f} sequences preempted in the window" +
                             (f", KV cache {usage:.0%} full on average" if usage is not None else ""), advice)
        elif usage is not None and usage >= KV_USAGE_HIGH:
            yield ph.finding("kv_cache_saturated", node, "vllm:kv_cache_usage_perc", usage, KV_USAGE_HIGH,
                             f"the KV cache was {usage:.0%} full on average", advice)


def gpu_throttled(ph: _Phase) -> Iterable[Finding]:
    gpus = ph.res.gpu or {}
    clocks = {n: c for n, g in gpus.items() if (c := _num(g.sm_clock_mhz_mean)) is not None}
    fastest = max(clocks.values(), default=None)
    for node in sorted(gpus):
        g = gpus[node]
        reasons = g.throttle_reasons
        clock = clocks.get(node)
        said = f", SM clock {clock:.0f} MHz" if clock is not None else ""
        advice = ("the GPU ran under its clocks: check its temperature and cooling, power capping and the P-state "
                  "(nvidia-smi -q -d PERFORMANCE,CLOCK); rerun once it is cool")
        if isinstance(reasons, int) and not isinstance(reasons, bool) and reasons & THROTTLE_SLOWDOWN_MASK:
            yield ph.finding("gpu_throttled", node, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
                             float(reasons & THROTTLE_SLOWDOWN_MASK), 0.0,
                             f"DCGM reported clock slowdown reasons {reasons:#x}{said}", advice, reasons=reasons)
        elif clock is not None and fastest and len(clocks) >= 2 and clock < SM_CLOCK_MIN_RATIO * fastest:
            yield ph.finding("gpu_throttled", node, "DCGM_FI_DEV_SM_CLOCK", clock, fastest,
                             f"SM clock {clock:.0f} MHz, {clock / fastest:.0%} of the fastest node's {fastest:.0f} MHz",
                             advice)


def _outliers(values: Mapping[str, float]) -> dict[str, tuple[float, float]]:
    """Node -> (modified z-score, median) of the nodes more than OUTLIER_Z from the median (MAD floored)."""
    if len(values) < MIN_OUTLIER_NODES:
        return {}
    med = statistics.median(values.values())
    mad = max(statistics.median(abs(v - med) for v in values.values()), MAD_FLOOR * abs(med))
    if mad <= 0:
        return {}
    return {n: (z, med) for n, v in values.items() if abs(z := 0.6745 * (v - med) / mad) >= OUTLIER_Z}


def slow_node(ph: _Phase) -> Iterable[Finding]:
    nodes = ph.res.nodes
    rps = {n.node: v for n in nodes if (v := _num(n.achieved_rps)) is not None}
    p99 = {n.node: v for n in nodes if (v := _num(n.latency_p99_ms)) is not None}
    advice = ("compare the node with the others: the same hardware, driver and clocks (nvidia-smi), its disk "
              "(iostat) and how the load balancer spreads requests")
    for node, (z, med) in sorted(_outliers(rps).items()):
        if rps[node] < OUTLIER_RPS_RATIO * med:
            yield ph.finding("slow_node", node, "achieved requests/s", rps[node], med,
                             f"served {rps[node]:.2f} requests/s against a median of {med:.2f} over {len(rps)} "
                             f"nodes (modified z {z:.1f})", advice, z=round(z, 2))
    for node, (z, med) in sorted(_outliers(p99).items()):
        if p99[node] >= OUTLIER_P99_RATIO * med:
            yield ph.finding("slow_node", node, "P99 latency ms", p99[node], med,
                             f"P99 latency {p99[node]:.0f} ms against a median of {med:.0f} ms over {len(p99)} "
                             f"nodes (modified z {z:.1f})", advice, z=round(z, 2))


def drift(ph: _Phase) -> Iterable[Finding]:
    r = ph.res
    answered = {n.node: (_num(n.achieved_rps) or 0.0) * (_num(r.duration_s) or 0.0) for n in r.nodes}
    for node_figs in r.nodes:
        node = node_figs.node
        growth = _num(node_figs.resident_memory_growth_bytes)
        n = answered.get(node) or 0.0
        if growth is None or n < 1 or growth < LEAK_MIN_BYTES or growth / n < LEAK_MIN_BYTES_PER_REQUEST:
            continue
        yield ph.finding("memory_drift", node, "process_resident_memory_bytes", growth, float(LEAK_MIN_BYTES),
                         f"resident memory grew {growth / 2**20:.1f} MiB over the phase, {growth / n / 1024:.0f} KiB "
                         f"per answered request ({n:.0f} answered)",
                         "memory grows with the requests served (a leak): it ends in an out-of-memory restart; "
                         "check the engine's version for a known leak, watch it over a longer run, restart it "
                         "periodically meanwhile", bytes_per_request=round(growth / n, 1))
    windows = r.windows
    if len(windows) >= DRIFT_MIN_WINDOWS:
        k = max(1, len(windows) // 3)
        first = [w for w in windows[:k]]
        last = [w for w in windows[-k:]]
        a = statistics.fmean(w.achieved_rps for w in first)
        b = statistics.fmean(w.achieved_rps for w in last)
        offered_a = statistics.fmean(w.offered_rps for w in first)
        offered_b = statistics.fmean(w.offered_rps for w in last)
        if a > 0 and offered_a > 0 and offered_b > 0:
            fall = 1 - (b / offered_b) / (a / offered_a)  # against what each part offered
            if fall > DRIFT_MAX_FALL:
                yield ph.finding("throughput_drift", None, "achieved requests/s", round(b, 3), round(a, 3),
                                 f"throughput fell {fall:.0%} from the first third of the phase ({a:.2f} req/s) to "
                                 f"the last ({b:.2f} req/s)",
                                 "throughput falls during the run: look for a leak (memory per node), cache "
                                 "pollution or thermal throttling (GPU temperature and clocks)", fall=round(fall, 4))


def errors_one_node(ph: _Phase) -> Iterable[Finding]:
    nodes = [n for n in ph.res.nodes if n.requests > 0]
    total = sum(n.errors for n in nodes)
    if len(nodes) < 2 or total < ERRORS_MIN:
        return
    for n in nodes:
        others_req = sum(o.requests for o in nodes if o is not n)
        others_rate = sum(o.errors for o in nodes if o is not n) / others_req if others_req else 0.0
        rate = n.errors / n.requests
        if (n.errors / total >= ERRORS_MIN_SHARE and rate >= ERRORS_MIN_RATE
                and rate >= ERRORS_OTHERS_RATIO * others_rate):
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(n.errors_by_kind.items())) or "no kinds recorded"
            yield ph.finding("errors_one_node", n.node, "error rate", round(rate, 4), round(others_rate, 4),
                             f"{n.errors} of the {total} errors ({n.errors / total:.0%}) came from this node: its "
                             f"error rate {rate:.1%} against {others_rate:.1%} on the others ({kinds})",
                             "look at this node's engine log for out-of-memory errors and restarts, and its queue "
                             "(429: full); take it out of the pool until it is fixed", share=round(n.errors / total, 4))


RULES: dict[str, Callable[[_Phase], Iterable[Finding]]] = {
    "no_batching": no_batching, "client_limited": client_limited, "kv_cache_saturated": kv_cache_saturated,
    "gpu_throttled": gpu_throttled, "slow_node": slow_node, "drift": drift, "errors_one_node": errors_one_node,
}
RULE_IDS = ("no_batching", "client_limited", "kv_cache_saturated", "gpu_throttled", "slow_node", "memory_drift",
            "throughput_drift", "errors_one_node", "link_below_threshold")


def link_findings(preflight: Any) -> list[Finding]:
    """Preflight's links below their threshold (a PreflightResult; anything else, or none: no finding), one per
    link. The node named is the end preflight blamed (``excluded``: a node most of whose links failed, or the end
    with the larger share of failed links), so a slow node's links all name it, whichever end iperf3 sent from;
    where preflight blamed neither end, or both (it cannot tell), the sending end, with the other in ``detail``."""
    links = getattr(preflight, "links", None) or []
    excluded = getattr(preflight, "excluded", None)
    blamed = set(excluded) if isinstance(excluded, Mapping) else set()
    out = []
    for lt in links:
        ratio, threshold = _num(getattr(lt, "ratio", None)), _num(getattr(lt, "threshold", None))
        threshold = threshold if threshold is not None else _num(getattr(preflight, "threshold", None))
        if ratio is None or threshold is None or ratio >= threshold:
            continue
        mbit, nominal = _num(lt.mbit), _num(lt.nominal_mbit)
        ends = [n for n in (lt.src, lt.dst) if n in blamed]
        node = ends[0] if len(ends) == 1 else lt.src
        why = f"; preflight blamed {node}, the end with the larger share of failed links" if len(ends) == 1 else ""
        out.append(Finding(
            rule="link_below_threshold", node=node, metric="iperf3 Mbit/s / nominal", phase="preflight",
            step=int(lt.round), observed=ratio, expected=threshold,
            evidence=(f"link {lt.src} -> {lt.dst} reached {mbit or 0:.0f} Mbit/s, {ratio:.0%} of the nominal "
                      f"{nominal or 0:.0f} Mbit/s (threshold {threshold:.0%}){why}"),
            advice="check the link's cables, NIC and switch port, its MTU and the negotiated speed (ethtool); "
                   "a slow link slows the model copy and any traffic between the nodes",
            detail={"src": lt.src, "dst": lt.dst, "mbit": mbit, "nominal_mbit": nominal}))
    return out


def findings_of(phases: Mapping[str, LoadResult | None], preflight: Any = None) -> list[Finding]:
    """Every finding of a run: the rules over each analysed phase's result, and preflight's slow links."""
    out = link_findings(preflight)
    for name in ANALYSED_PHASES:
        res = phases.get(name)
        if res is None:
            continue
        ph = _Phase(name, res)
        for rule in RULES.values():
            out.extend(rule(ph))
    return out


def run_findings(run: Any) -> list[Finding]:
    """The findings of a run folder (deploybench.run.Run): its load phases' results and preflight's."""
    load = run.load_result()
    phases = {name: ph.result for name, ph in load.phases.items()} if load is not None else {}
    return findings_of(phases, run.preflight_result())
