"""The run report: a readable summary for the terminal and one self-contained HTML file.

Both are built from the run's stage records, so a failed run gets a report too: it
shows which stage failed and why, beside everything measured before.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deploybench.pipeline import Run

ORDER = ("validate", "preflight", "fanout", "rollout", "load", "teardown", "store", "report")


def run_status(records: dict[str, dict]) -> str:
    """failed if any stage failed or a work stage never ran; else success."""
    if any(r.get("status") == "failed" for r in records.values()):
        return "failed"
    if not all(s in records for s in ("validate", "preflight", "fanout", "rollout", "load")):
        return "failed"
    return "success"


def summary_text(run: "Run") -> str:
    recs = run.stage_records()
    lines = [f"deploybench run {run.key}: {run_status(recs).upper()}",
             f"  config {run.cfg.fingerprint()[:12]}  nodes {len(run.nodes)}  engine {run.cfg.engine.profile.value}",
             "", f"  {'stage':<10} {'status':<8} {'seconds':>8}  what happened"]
    for s in ORDER:
        r = recs.get(s)
        if r is None:
            lines.append(f"  {s:<10} {'skipped':<8} {'':>8}")
            continue
        lines.append(f"  {s:<10} {r['status']:<8} {r.get('seconds', 0):>8.1f}  {r.get('summary', '')}")
    ld = (recs.get("load") or {}).get("result") or {}
    if ld:
        lines += ["", f"  load result, phase {ld.get('phase')} (warm-up of {ld.get('warmup_s', 0):g} s excluded; "
                  "end-to-end latency measured by k6 on the client):",
                  f"    requests/s     {ld.get('achieved_rps', 0):.2f} (offered {ld.get('offered_rps', 0):g}, "
                  f"{ld.get('requests', 0)} requests in {ld.get('duration_s', 0):g} s)",
                  f"    output tok/s   {ld.get('output_tps', 0):.1f}",
                  f"    latency P50    {_ms(ld.get('latency_p50_ms'))}",
                  f"    latency P99    {_ms(ld.get('latency_p99_ms'))}",
                  f"    error rate     {ld.get('error_rate', 0):.2%} {ld.get('errors_by_kind') or ''}",
                  f"    dropped        {ld.get('dropped_iterations', 0)} iterations",
                  "    SLO            " + ("met" if ld.get("slo_ok") else
                                            "NOT met: " + "; ".join((ld.get("slo") or {}).get("reasons") or []))]
    truth = sim_capacity(run)
    if truth:
        lines += [f"    ground truth   the simulated engine saturates at {truth[0]:.2f} req/s per node, "
                  f"{truth[0] * truth[1]:.1f} req/s for {truth[1]} nodes (closed form; SLO not considered)"]
    rep = (recs.get("report") or {}).get("result") or {}
    if rep.get("path"):
        lines += ["", f"  report: {rep['path']}"]
    return "\n".join(lines)


def sim_capacity(run: "Run") -> tuple[float, int] | None:
    """(saturation req/s per engine, engines) for the simulated engine, from its closed form."""
    if run.cfg.engine.profile.value != "sim":
        return None
    from deploybench.lab.service_model import ServiceParams, capacity

    endpoints = ((run.stage_record("rollout") or {}).get("result") or {}).get("endpoints") or []
    cap = capacity(ServiceParams.from_config(run.cfg.engine), run.cfg.load.prompt_tokens, run.cfg.load.output_tokens)
    return cap.requests_per_s, len(endpoints) or len(run.nodes)


def _ms(v) -> str:
    return "n/a" if v is None else f"{v:.0f} ms"


def _table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}"
    return "" if v is None else str(v)


def write_html(run: "Run") -> Path:
    recs = run.stage_records()
    status = run_status(recs)
    parts = [f"<h1>deploybench run <code>{html.escape(run.key)}</code></h1>",
             f"<p class='{status}'>Status: <b>{status}</b> &middot; {len(run.nodes)} nodes &middot; engine "
             f"{html.escape(run.cfg.engine.profile.value)} &middot; config {run.cfg.fingerprint()[:12]}</p>",
             "<h2>Stages</h2>",
             _table(["stage", "status", "seconds", "what happened"],
                    [[s, recs[s]["status"], recs[s].get("seconds"), recs[s].get("summary")] for s in ORDER if s in recs])]
    ld = (recs.get("load") or {}).get("result") or {}
    if ld:
        parts += [f"<h2>Load: {html.escape(str(ld.get('phase')))}</h2>", _table(
            ["offered req/s", "achieved req/s", "output tok/s", "P50 ms", "P90 ms", "P99 ms", "P99.9 ms", "errors",
             "dropped", "SLO"],
            [[ld.get("offered_rps"), ld.get("achieved_rps"), ld.get("output_tps"), ld.get("latency_p50_ms"),
              ld.get("latency_p90_ms"), ld.get("latency_p99_ms"), ld.get("latency_p999_ms"),
              f"{ld.get('error_rate', 0):.2%}", ld.get("dropped_iterations"),
              "met" if ld.get("slo_ok") else "not met: " + "; ".join((ld.get("slo") or {}).get("reasons") or [])]])]
        if ld.get("nodes"):
            parts += ["<h3>Per node</h3>", _table(
                ["node", "requests", "req/s", "output tok/s", "P50 ms", "P99 ms", "errors"],
                [[v["node"], v.get("requests"), v.get("achieved_rps"), v.get("output_tps"), v.get("latency_p50_ms"),
                  v.get("latency_p99_ms"), v.get("errors")] for v in ld["nodes"]])]
        if ld.get("notes"):
            parts += ["<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in ld["notes"]) + "</ul>"]
    pf = (recs.get("preflight") or {}).get("result") or {}
    if pf.get("links"):
        parts += ["<h2>Preflight links</h2>", f"<p>{html.escape(pf.get('decision', ''))}</p>", _table(
            ["from", "to", "Mbit/s", "nominal", "ratio", "retransmits", "RTT ms", "ok", "error"],
            [[lt["src"], lt["dst"], lt.get("mbit"), lt["nominal_mbit"], lt.get("ratio"), lt.get("retransmits"),
              lt.get("rtt_ms"), lt["ok"], lt.get("error")] for lt in pf["links"]])]
    fo = (recs.get("fanout") or {}).get("result") or {}
    if fo.get("nodes"):
        parts += ["<h2>Fan-out</h2>", _table(
            ["node", "status", "MiB", "seconds", "verified", "error"],
            [[c["node"], c["status"], c["bytes"] / 2**20, c["seconds"], c["verified"], c.get("error")]
             for c in fo["nodes"]])]
    ro = (recs.get("rollout") or {}).get("result") or {}
    if ro.get("steps"):
        parts += ["<h2>Rollout</h2>", _table(
            ["step", "nodes", "added", "slowest ready s", "seconds"],
            [[s["step"], s["nodes"], ", ".join(s["added"]), max(s["ready_s"].values() or [0]), s["seconds"]]
             for s in ro["steps"]])]
    errors = [(s, r["error"]) for s, r in recs.items() if r.get("error")]
    if errors:
        parts += ["<h2>Errors</h2>"] + [f"<h3>{html.escape(s)}</h3><pre>{html.escape(e)}</pre>" for s, e in errors]
    doc = (
        "<!doctype html><html><head><meta charset='utf-8'><title>deploybench "
        f"{html.escape(run.key)}</title><style>"
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin:.5em 0}"
        "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}td:first-child,th:first-child{text-align:left}"
        ".failed{color:#b00}.success{color:#070}pre{background:#f6f6f6;padding:.5em;white-space:pre-wrap}"
        "</style></head><body>" + "\n".join(parts) + "</body></html>"
    )
    path = run.dir / "report.html"
    path.write_text(doc)
    return path
