"""``deploybench store ...``: migrate, show the DSN, list runs, stop the embedded server."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("store", help="the results database (PostgreSQL)")
    parser.add_argument("--dsn", help="results database URL (default: $DEPLOYBENCH_DSN, else the embedded server)")
    sub = parser.add_subparsers(dest="store_command", required=True)

    sub.add_parser("migrate", help="upgrade the schema to the newest migration").set_defaults(func=_migrate)
    sub.add_parser(
        "dsn", help="print the resolved DSN, starting the embedded PostgreSQL if needed"
    ).set_defaults(func=_dsn)
    runs = sub.add_parser("runs", help="a table of recent runs")
    runs.add_argument("-n", "--limit", type=int, default=20)
    runs.set_defaults(func=_runs)
    sub.add_parser("stop", help="stop the embedded PostgreSQL (data is kept)").set_defaults(func=_stop)
    exclude = sub.add_parser("exclude", help="leave a run out of comparisons and history (with a reason)")
    exclude.add_argument("run_key")
    exclude.add_argument("--reason", required=True, help="why, e.g. 'n03 was thermally throttling'")
    exclude.set_defaults(func=_exclude, excluded=True)
    include = sub.add_parser("include", help="take an excluded run back into the analysis")
    include.add_argument("run_key")
    include.set_defaults(func=_exclude, excluded=False, reason=None)
    prune = sub.add_parser("prune-run-files", help="drop the run-folder files (samples) of runs finished long ago "
                                                   "from the results database; run.json and report.html stay")
    prune.add_argument("--older-than", type=float, required=True, metavar="DAYS",
                       help="runs whose last file was pushed more than DAYS days ago")
    prune.set_defaults(func=_prune)


def _prune(args: argparse.Namespace) -> int:
    from deploybench.store.db import resolve_dsn
    from deploybench.store.run_files import prune

    got = prune(resolve_dsn(args.dsn).dsn, args.older_than)
    sys.stdout.write(f"dropped {got['files']} file(s) ({got['bytes']:,} bytes) of {got['runs']} run(s) last pushed "
                     f"more than {args.older_than:g} days ago\n")
    return 0


def _exclude(args: argparse.Namespace) -> int:
    from deploybench.store.query import set_excluded

    set_excluded(args.dsn, args.run_key, args.excluded, args.reason)
    state = f"excluded ({args.reason})" if args.excluded else "included again"
    sys.stdout.write(f"run {args.run_key} {state}\n")
    return 0


def _migrate(args: argparse.Namespace) -> int:
    from deploybench.store.db import get_engine, migrate, redact, resolve_dsn

    resolved = resolve_dsn(args.dsn)
    revision = migrate(get_engine(resolved.dsn))
    sys.stdout.write(f"{redact(resolved.dsn)} ({resolved.source}) at revision {revision}\n")
    return 0


def _dsn(args: argparse.Namespace) -> int:
    from deploybench.store.db import resolve_dsn

    sys.stdout.write(resolve_dsn(args.dsn).dsn + "\n")
    return 0


def _runs(args: argparse.Namespace) -> int:
    from deploybench.store.reader import latest_runs

    rows = [("RUN KEY", "STATUS", "STARTED (UTC)", "SECONDS", "NODES", "INVENTORY", "FINGERPRINT")]
    for run in latest_runs(args.dsn, args.limit):
        seconds = f"{(run.finished_at - run.started_at).total_seconds():.0f}" if run.finished_at else "-"
        started = run.started_at.astimezone(UTC)
        rows.append((
            run.run_key, run.status, started.strftime("%Y-%m-%d %H:%M:%S"), seconds,
            str(run.node_count), run.inventory, run.fingerprint[:12],
        ))
    if len(rows) == 1:
        sys.stdout.write("no runs stored yet\n")
        return 0
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")
    return 0


def _stop(args: argparse.Namespace) -> int:
    from deploybench.store import embedded

    stopped = embedded.stop()
    sys.stdout.write(f"embedded PostgreSQL {'stopped' if stopped else 'was not running'} ({embedded.data_dir()})\n")
    return 0
