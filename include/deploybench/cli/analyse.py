"""``deploybench compare`` and ``deploybench history``: the analysis from the command line."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path


def parse_when(text: str) -> datetime:
    """An ISO date/time, UTC when it has no offset (the CLI's --since/--until and the comparison page's)."""
    try:
        value = datetime.fromisoformat(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not an ISO date/time, e.g. 2026-12-01 or 2026-12-01T08:00") \
            from exc
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def parse_tag(text: str) -> tuple[str, str]:
    """KEY=VALUE (the CLI's --tag and the comparison page's tag=)."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"tag {text!r} is not KEY=VALUE")
    k, v = text.split("=", 1)
    return k, v


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("compare", help="compare stored runs: figures, best config, changes, Pareto front")
    p.add_argument("runs", nargs="*", metavar="RUN_KEY", help="run keys to compare (default: select by filter)")
    p.add_argument("--dsn", help="results database URL (default: $DEPLOYBENCH_DSN, else the embedded server)")
    p.add_argument("--model", help="only runs of this model name")
    p.add_argument("--inventory", help="only runs on this inventory (cluster)")
    p.add_argument("--since", type=parse_when, help="only runs started at or after (ISO date/time, UTC if no offset)")
    p.add_argument("--until", type=parse_when, help="only runs started before")
    p.add_argument("--tag", type=parse_tag, action="append", default=[], metavar="KEY=VALUE", help="only runs with tag")
    p.add_argument("--series", help="only runs of this series fingerprint (a prefix of 8+ characters is enough)")
    p.add_argument("--include-excluded", action="store_true", help="also runs flagged as excluded")
    p.add_argument("--baseline", metavar="RUN_KEY", help="report each figure's change against this run")
    p.add_argument("--alpha", type=float, default=0.05, help="significance level of the rank tests (default 0.05)")
    p.add_argument("--html", type=Path, help="write the comparison report to this file")
    p.set_defaults(func=_compare)

    h = subparsers.add_parser("history", help="change points of a run's series and a verdict on its newest run")
    h.add_argument("run", metavar="RUN_KEY", help="any run of the series")
    h.add_argument("--dsn")
    h.add_argument("--baseline", metavar="RUN_KEY", help="judge the newest run against this run of the same series")
    h.set_defaults(func=_history)


def _compare(args: argparse.Namespace) -> int:
    import pandas as pd

    from deploybench.analyse import AnalysisError
    from deploybench.analyse.compare import compare, curves
    from deploybench.report.compare_html import config_label, write_comparison_html
    from deploybench.store.query import RunFilter

    if args.runs and any((args.model, args.inventory, args.since, args.until, args.tag, args.series)):
        raise AnalysisError(f"give run keys ({' '.join(args.runs)}) or filters (--model, --inventory, --since, "
                            "--until, --tag, --series), not both")
    flt = RunFilter(run_keys=tuple(args.runs), model=args.model, inventory=args.inventory, since=args.since,
                    until=args.until, tags=dict(args.tag), series=args.series,
                    include_excluded=args.include_excluded)
    cmp = compare(args.dsn, flt, args.baseline, alpha=args.alpha)
    out = sys.stdout
    cols = ("capacity_rps", "goodput_rps", "achieved_rps", "output_tps", "latency_p99_ms", "ttft_p99_ms",
            "error_rate")
    heads = ("capacity", "goodput", "req/s", "tok/s", "P99 ms", "TTFT P99", "errors")
    for n, (group, keys) in enumerate(cmp.groups.items(), start=1):
        out.write(f"workload group {n} ({group[:12]}): {len(keys)} run(s)\n")
        sub = cmp.table[cmp.table["run_key"].isin(keys)]
        rows: list[tuple[object, ...]] = [("configuration", *heads, "SLO", "pareto")]
        for _, r in sub.iterrows():
            rows.append((config_label(r), *[_f(r[c], pct=c == "error_rate") for c in cols],
                         "met" if r["slo_met"] else "NOT met", "*" if r["pareto"] else ""))
        _print_table(rows)
        best = cmp.best.get(group)
        out.write(f"  best meeting the SLO: {best or 'none'}\n\n")
    if cmp.baseline and not cmp.changes.empty:
        out.write(f"change against baseline {cmp.baseline} (rank test, alpha {args.alpha}):\n")
        rows = [("run", "figure", "baseline", "value", "change", "p-value", "verdict")]
        for _, c in cmp.changes.iterrows():
            verdict = (f"{c['direction']} (significant)" if c["significant"] and c["direction"] != "same" else
                       "no significant change" if not pd.isna(c["p_value"]) else "no test (one value per run)")
            rows.append((c["run_key"], c["figure"], _f(c["baseline"]), _f(c["value"]),
                         "-" if pd.isna(c["change"]) else f"{c['change']:+.1%}",
                         "n/a" if pd.isna(c["p_value"]) else f"{c['p_value']:.3g}", verdict))
        _print_table(rows)
    if args.html:
        path = write_comparison_html(cmp, args.html, curves(args.dsn, cmp.run_keys()))
        out.write(f"report: {path}\n")
    out.write(f"comparison #{cmp.id} stored\n")
    return 0


def _history(args: argparse.Namespace) -> int:
    from deploybench.analyse.history import analyse_series

    hist = analyse_series(args.dsn, args.run, baseline=args.baseline)
    out = sys.stdout
    out.write(f"series {hist.fingerprint[:12]}: {len(hist.runs)} runs (excluded and failed runs left out), "
              f"method {hist.params}\n")
    for c in hist.changes:
        out.write(f"  change point in {c.metric} at {c.run_key}: {c.direction} {c.magnitude:+.1%} "
                  f"({c.mean_before:.4g} -> {c.mean_after:.4g}, p={c.p_value:.3g})\n")
    if not hist.changes:
        out.write("  no change point\n")
    out.write(f"newest run {hist.newest}:\n")
    for metric, v in hist.verdicts.items():
        p = "n/a" if v["p_value"] is None else f"{v['p_value']:.3g}"
        out.write(f"  {metric:<16} {v['verdict']:<12} {v['magnitude']:+.1%} p={p} (against {v['against']})\n")
    return 0


def _f(v: float | None, pct: bool = False) -> str:
    if v is None or v != v:
        return "-"
    return f"{v:.2%}" if pct else f"{v:,.2f}"


def _print_table(rows: list[tuple[object, ...]]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        sys.stdout.write("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")
