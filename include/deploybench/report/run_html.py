"""The run report's sections: stages, load figures and plots, findings, preflight, fan-out, rollout, errors.

Read from the run folder only (stage records, samples and metric files the stages wrote).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import pandas as pd

from deploybench.analyse.findings import ANALYSED_PHASES, run_findings
from deploybench.engines import profile_name
from deploybench.fanout.result import FanoutResult
from deploybench.preflight.model import PreflightResult
from deploybench.report import node_windows, plots
from deploybench.report.findings_html import findings_section
from deploybench.report.html import (
    document,
    esc,
    figure,
    fmt_change,
    fmt_money,
    fmt_p,
    fmt_pct,
    fmt_util,
    table,
)
from deploybench.rollout.base import RolloutResult
from deploybench.run import STAGES, run_status

if TYPE_CHECKING:
    from deploybench.analyse.history import History
    from deploybench.records import LoadStageResult
    from deploybench.run import Run

log = logging.getLogger(__name__)


def _samples(load: LoadStageResult) -> pd.DataFrame:
    from deploybench.store.ingest import samples_source as sample_source
    from deploybench.store.writer import read_samples

    src = sample_source(load)
    if src is None:
        return pd.DataFrame()
    try:
        return read_samples(src)
    except Exception as exc:  # noqa: BLE001 - a report must render even when a samples file is unreadable
        log.warning("report: samples unreadable (%s); plots over time are left out", exc)
        return pd.DataFrame()


def _gpu_row(phase: dict[str, Any], node: dict[str, Any]) -> list[Any]:
    """phase, node, req/s beside the node's GPU figures (``LoadResult.gpu``); 'absent' where not measured."""
    g = (phase.get("gpu") or {}).get(node["node"]) or {}
    mem = g.get("mem_used_mib_mean")
    watts = g.get("power_mean_w")
    return [phase.get("phase"), node["node"], node.get("achieved_rps"), fmt_util(g.get("util_mean_pct")),
            "absent" if mem is None else mem, "absent" if watts is None else watts,
            g.get("source") or f"absent: {g.get('reason') or 'not sampled'}"]


# The engine's figures by role (deploybench.load.scrape.engine_figures), in this order; a column shows when a node's
# profile maps its role, a cell says "absent" where the engine's page lacked it.
ENGINE_COLUMNS = (("ttft_p99_ms", "TTFT P99 ms"), ("itl_mean_ms", "ITL mean ms"), ("e2e_p99_ms", "E2E P99 ms"),
                  ("queue_mean_ms", "queue mean ms"), ("compute_mean_ms", "compute mean ms"),
                  ("batch_mean", "batch (mean)"), ("running_max", "running max"), ("waiting_max", "waiting max"),
                  ("kv_usage_max", "KV cache use max"), ("prefix_hit_rate", "prefix hit rate"),
                  ("preemptions", "preemptions"))


def _engine_rows(phases: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """(headers, rows) of the engine's own view: each phase and node, the figures its profile's roles give."""
    figs = [(p.get("phase"), node, f) for p in phases for node, f in sorted((p.get("engine") or {}).items())]
    cols = [(k, h) for k, h in ENGINE_COLUMNS if any(k in f for _, _, f in figs)]
    if not cols:
        return [], []
    rows = [[phase, node, *("absent" if f.get(k) is None else round(f[k], 3) if isinstance(f[k], float) else f[k]
                            for k, _ in cols)] for phase, node, f in figs]
    return ["phase", "node", *(h for _, h in cols)], rows


def _load_sections(ld: LoadStageResult, slo_ms: float) -> list[str]:
    from deploybench.store.ingest import capacity_steps

    phases = [p.model_dump(mode="json") for p in ld.ran()]
    parts = ["<h2>Load</h2>", table(
        ["phase", "offered req/s", "achieved req/s", "GPU util %", "output tok/s", "J per output token",
         "J per request", "cost per 1M output tokens", "P50 ms",
         "P90 ms", "P99 ms", "P99.9 ms", "TTFT P99 ms", "errors", "dropped", "SLO"],
        [[p.get("phase"), p.get("offered_rps"), p.get("achieved_rps"), fmt_util(p.get("gpu_util_pct")),
          p.get("output_tps"), "absent" if p.get("energy_per_output_token_j") is None
          else f"{p['energy_per_output_token_j']:.4g}",
          "absent" if p.get("energy_per_request_j") is None else f"{p['energy_per_request_j']:.4g}",
          fmt_money(p.get("cost_per_million_output_tokens"), p.get("cost_currency")), p.get("latency_p50_ms"),
          p.get("latency_p90_ms"), p.get("latency_p99_ms"), p.get("latency_p999_ms"),
          "absent" if p.get("ttft_p99_ms") is None else f"{p['ttft_p99_ms']} (n={p.get('ttft_samples')})",
          fmt_pct(p.get("error_rate", 0)), p.get("dropped_iterations"),
          "met" if p.get("slo_ok") else "not met: " + "; ".join((p.get("slo") or {}).get("reasons") or [])]
         for p in phases])]
    samples = _samples(ld)
    steps = [s.model_dump() for s in capacity_steps(ld)]
    cap = ld.capacity.capacity_rps
    parts.append("<h3>Throughput and latency</h3>")
    curve = [(s["achieved_rps"], s["latency_p99_ms"]) for s in steps
             if s.get("achieved_rps") is not None and s.get("latency_p99_ms") is not None]
    if not curve:
        curve = [(p["achieved_rps"], p["latency_p99_ms"]) for p in phases if p.get("latency_p99_ms") is not None]
    parts.append(figure(plots.throughput_latency({"this configuration": curve}, "Throughput vs P99 latency", slo_ms),
                        "throughput-latency curve (capacity-search steps, else the phases)"))
    per = ld.capacity.requests_per_session
    if ld.capacity.rate_unit == "sessions" and per:
        sess = ld.capacity.capacity_sessions_per_s
        parts.append(f"<p>Rates in sessions: this workload's conversations have {per:.2f} turns on average, and the "
                     f"run's rates count conversations started per second (requests/s are turns). Capacity "
                     + (f"{sess:.2f} sessions/s ({ld.capacity.capacity_rps:.2f} req/s)." if sess is not None
                        else "not found.")
                     + " Offered and achieved by phase, in sessions/s: "
                     + "; ".join(f"{p.get('phase')} {p.get('offered_rps', 0) / per:.3g} offered, "
                                 f"{p.get('achieved_rps', 0) / per:.3g} achieved" for p in phases) + ".</p>")
    parts.append("<h3>Capacity search</h3>")
    parts.append(figure(plots.capacity_steps(steps, cap), "capacity-search steps (green: SLO held)"))
    probe_steps = [s.model_dump(mode="json") for s in ld.phases["probe"].probe_steps()] if "probe" in ld.phases else []
    if probe_steps:
        parts.append(table(["step", "kind", "offered req/s", "achieved req/s", "GPU util %", "passed", "why"],
                           [[s.get("step"), s.get("kind", "constant"),
                             (f"{s['rate_from']:g} -> {s['rate']:g}" if s.get("rate_from") is not None
                              else s.get("rate")),
                             s.get("achieved_rps"), fmt_util(s.get("gpu_util_pct")), s.get("passed"),
                             "; ".join(s.get("reasons") or [])] for s in probe_steps]))
    for name, title in (("sustained", "Sustained phase over time"), ("overload", "Overload ramp and recovery")):
        parts.append(f"<h3>{esc(title)}</h3>")
        sub = samples[samples["phase"] == name] if not samples.empty else samples
        if name == "sustained" and sub.empty and not samples.empty and len(phases) == 1:
            sub = samples  # the foundation's single phase
        parts.append(figure(plots.over_time(sub, title, slo_ms), title.lower()))
    sp = ld.phases.get("spike")
    if sp is not None and sp.analysis:
        from deploybench.report.spike import facts

        parts.append("<h3>Spike and recovery</h3>")
        sub = samples[samples["phase"] == "spike"] if not samples.empty else samples
        parts.append(figure(plots.over_time(sub, "Spike and recovery", slo_ms), "spike and recovery"))
        parts.append(table(["", "spike phase"], [[k, v] for k, v in facts(sp.analysis)]))
    nodes = next((p.get("nodes") for p in phases if p.get("phase") == "sustained"), None) or (
        phases[0].get("nodes") if phases else None) or []
    if nodes:
        parts += ["<h3>Per node</h3>", figure(plots.per_node_bars(nodes), "requests/s and P99 latency per node"),
                  table(["node", "requests", "req/s", "GPU util %", "GPU mem MiB", "output tok/s", "P50 ms",
                         "P99 ms", "errors"],
                        [[v["node"], v.get("requests"), v.get("achieved_rps"), fmt_util(v.get("gpu_util_pct")),
                          "absent" if v.get("gpu_mem_used_mib") is None else v["gpu_mem_used_mib"],
                          v.get("output_tps"), v.get("latency_p50_ms"), v.get("latency_p99_ms"), v.get("errors")]
                         for v in nodes])]
    length_rows = [[p.get("phase"), what, side, (p["lengths"][what].get(side) or {}).get("n"),
                    *[(p["lengths"][what].get(side) or {}).get(k) for k in ("mean", "p50", "p90", "p99", "max")]]
                   for p in phases if p.get("lengths") for what in ("prompt", "output") for side in ("asked", "served")]
    if length_rows:
        parts += ["<h3>Lengths asked and served (tokens)</h3>",
                  "<p>Asked: what the workload's plan asked for (a conversation's later turn: the conversation so "
                  "far). Served: the measured requests' prompt and answer lengths (the engine's usage where it sent "
                  "one), failed requests' answers left out.</p>",
                  table(["phase", "what", "", "requests", "mean", "P50", "P90", "P99", "max"], length_rows)]
        served = samples[samples["phase"] == "sustained"] if not samples.empty else samples
        if not served.empty:
            parts.append(figure(plots.lengths(served), "prompt and answer lengths of the sustained phase's requests"))
    turn_rows = [[p.get("phase"), t["turn"] + 1, t["requests"], t["errors"], t.get("prompt_tokens_mean"),
                  t.get("latency_p50_ms"), t.get("latency_p99_ms"),
                  f"{t['ttft_p99_ms']} (n={t['ttft_samples']})" if t.get("ttft_p99_ms") is not None else "absent"]
                 for p in phases for t in p.get("turns") or []]
    if turn_rows:
        parts += ["<h3>Conversations, by turn</h3>",
                  "<p>Each turn is sent with the conversation so far: its prompt grows, and a prefix cache serves "
                  "what the turns before it computed. TTFT is the streaming sampler's, which sends whole "
                  "conversations as k6 does (n: its turns of that index).</p>",
                  table(["phase", "turn", "requests", "errors", "prompt tokens (mean)", "P50 ms", "P99 ms",
                         "TTFT P99 ms"], turn_rows)]
    heads, rows = _engine_rows(phases)
    if rows:
        parts += ["<h3>The engine's own view (its metrics), every phase</h3>", table(heads, rows)]
    gpu_rows = [_gpu_row(p, v) for p in phases for v in p.get("nodes") or []]
    if gpu_rows:
        parts += ["<h3>GPU utilisation per node, every phase</h3>",
                  table(["phase", "node", "req/s", "GPU util %", "GPU mem MiB", "GPU power W", "source"], gpu_rows)]
    gen_rows = [[p.get("phase"), g["name"], g.get("segment"), g.get("requests"), g.get("rps"),
                 "absent" if g.get("lag_p50_ms") is None else g["lag_p50_ms"],
                 "absent" if g.get("lag_p99_ms") is None else g["lag_p99_ms"], g.get("dropped_iterations"),
                 "absent" if g.get("clock_offset_ms") is None else g["clock_offset_ms"]]
                for p in phases for g in p.get("generators") or []]
    if gen_rows:
        parts += ["<h3>Load generators, every phase</h3>",
                  "<p>Each phase was split across the inventory's load generators by k6 execution segments: one "
                  "schedule, each request sent once, all started at one barrier. What each one sent in the measured "
                  "window, its send lag against the schedule and its clock's offset to the controller's (measured "
                  "before the phase).</p>",
                  table(["phase", "generator", "segment", "requests", "req/s", "send lag P50 ms", "send lag P99 ms",
                         "dropped", "clock offset ms"], gen_rows)]
    notes = [n for p in phases for n in p.get("notes") or []]
    if notes:
        parts.append("<ul>" + "".join(f"<li>{esc(n)}</li>" for n in dict.fromkeys(notes)) + "</ul>")
    return parts


def history_section(hist: History, heading: str = "History of this series", scope: str = "") -> list[str]:
    """The verdict on the newest run and the change points (the run report and the history page); ``scope``
    says which runs are counted when it is not every run of the series."""
    parts = [f"<h2>{esc(heading)}</h2>",
             f"<p>Series <code>{esc(hist.fingerprint[:12])}</code>: {len(hist.runs)} runs (excluded and failed runs "
             f"left out{'; ' + esc(scope) if scope else ''}); method {esc(hist.params)}.</p>",
             table(["metric", "verdict on the newest run", "magnitude", "p-value", "against"],
                   [[m, v["verdict"], fmt_change(v["magnitude"]), fmt_p(v["p_value"]), v["against"]]
                    for m, v in hist.verdicts.items()],
                   [v["verdict"] for v in hist.verdicts.values()])]
    if hist.changes:
        parts.append(table(["metric", "change point at run", "direction", "before", "after", "magnitude", "p-value"],
                           [[c.metric, c.run_key, c.direction, c.mean_before, c.mean_after,
                             fmt_change(c.magnitude), fmt_p(c.p_value)] for c in hist.changes]))
    else:
        parts.append("<p>No change point in this series.</p>")
    return parts


def _history_scope(run: Run) -> str:
    """Which runs the report's history counts (``report.history_for``): said on every DAG run's report, so
    it tells nothing about whether the series has runs of other DAGs."""
    from deploybench.store.access import RunReaders

    dag_id = run.meta.get("dag_id") or "cli"  # as store.ingest stores it
    if RunReaders(dag_id, run.meta.get("airflow_run_id")).may_read_all_dags():
        return ""
    return (f"only runs of DAG {dag_id}, which everyone who may read this report may read; the results pages' "
            f"history of the series shows every run you may read")


def render(run: Run, history: History | None = None) -> str:
    recs = run.stages()
    status = run_status(recs)
    parts = [f"<h1>deploybench run <code>{esc(run.key)}</code></h1>",
             f"<p class='{status}'>Status: <b>{status}</b> &middot; {len(run.nodes)} nodes &middot; engine "
             f"{esc(profile_name(run.cfg.engine))} &middot; workload {esc(run.cfg.load.workload)} &middot; config "
             f"{run.cfg.fingerprint()[:12]}</p>",
             "<h2>Stages</h2>",
             table(["stage", "status", "seconds", "what happened"],
                   [[s, recs[s].status, recs[s].seconds, recs[s].summary]
                    for s in STAGES if s in recs])]
    ld = run.load_result()
    if ld is not None:
        parts += _load_sections(ld, run.cfg.slo.p99_latency_ms)
        parts += node_windows.section(node_windows.of_load(ld.phases))
    judged = ld is not None and any(p in ld.phases and ld.phases[p].result is not None for p in ANALYSED_PHASES)
    parts.append(findings_section(run_findings(run), analysed=judged))
    if history is not None:
        parts += history_section(history, scope=_history_scope(run))
    pf = run.preflight_result()
    if isinstance(pf, PreflightResult) and pf.links:
        parts += ["<h2>Preflight links</h2>", f"<p>{esc(pf.decision)}</p>",
                  figure(plots.bandwidth_matrix([asdict(lt) for lt in pf.links]), "preflight bandwidth matrix"),
                  table(["from", "to", "Mbit/s", "nominal", "ratio", "streams", "retransmits", "RTT ms (loaded)",
                         "ping RTT ms", "jitter ms", "RDMA", "ok", "problems, notes, error"],
                        [[lt.src, lt.dst, lt.mbit, lt.nominal_mbit, lt.ratio, lt.streams, lt.retransmits, lt.rtt_ms,
                          lt.latency_ms, lt.jitter_ms, _rdma_cell(lt.rdma), lt.ok,
                          "; ".join([*lt.problems, *lt.notes, *([lt.error] if lt.error else [])]) or None]
                         for lt in pf.links])]
    fo = run.fanout_result()
    if isinstance(fo, FanoutResult) and fo.nodes:
        parts += ["<h2>Fan-out</h2>", figure(plots.fanout_timeline([asdict(c) for c in fo.nodes]), "fan-out timeline"),
                  table(["node", "status", "MiB", "seconds", "verified", "error"],
                        [[c.node, c.status, c.bytes / 2**20, c.seconds, c.verified, c.error] for c in fo.nodes])]
    ro = run.rollout_result()
    if isinstance(ro, RolloutResult) and ro.steps:
        parts += ["<h2>Rollout</h2>", table(
            ["step", "nodes", "added", "slowest ready s", "seconds"],
            [[s.step, s.nodes, ", ".join(s.added), max(s.ready_s.values() or [0]), s.seconds] for s in ro.steps])]
    errors = [(s, r.error) for s, r in recs.items() if r.error]
    if errors:
        parts += ["<h2>Errors</h2>"] + [f"<h3>{esc(s)}</h3><pre>{esc(e)}</pre>" for s, e in errors]
    return document(f"deploybench {run.key}", parts)


def _rdma_cell(rec: object) -> str | None:
    """A link's RDMA test in a table cell: the verdict and Gbit/s, or why it was skipped."""
    if rec is None:
        return None
    status, gbit, reason = getattr(rec, "status", ""), getattr(rec, "gbit", None), getattr(rec, "reason", "")
    return f"{status} {gbit:g} Gbit/s" if gbit is not None else f"{status}: {reason}"[:160]
