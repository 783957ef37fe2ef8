"""History's accuracy, repeated: series of real k6 runs against the simulated engine.

For each repetition: one series with a slowdown switched on half-way, one without. Prints
where change points were found and the verdict on the newest run. Usage:

    .venv/bin/python bench/history_accuracy.py [--repeat 3] [--runs 8] [--slowdown 1.1]

Uses a throwaway database on $DEPLOYBENCH_DSN or the embedded PostgreSQL; dropped at the end.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.support
from deploybench.analyse.history import analyse_series  # noqa: E402
from deploybench.analyse.simseries import run_series  # noqa: E402
from tests.support import store_fixtures as fx  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--slowdown", type=float, default=1.1)
    ap.add_argument("--duration", type=float, default=2.0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dsn, _ = fx.make_database()
    change_at = args.runs // 2
    hits = clean = 0
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(args.repeat):
                for kind, at in (("change", change_at), ("steady", None)):
                    keys = run_series(dsn, f"bench-{kind}-{rep}", args.runs, Path(tmp) / f"{kind}{rep}",
                                      change_at=at, slowdown=args.slowdown, duration_s=args.duration)
                    h = analyse_series(dsn, keys[-1])
                    flagged = sorted({keys.index(k) for k in h.flagged()})
                    p50 = h.runs["latency_p50_ms"].round(1).tolist()
                    v = h.verdicts["latency_p50_ms"]
                    p = v["p_value"] if v["p_value"] is None else round(v["p_value"], 5)
                    print(
                        f"rep {rep} {kind:<6} change at {at}: flagged run(s) {flagged}; newest run "
                        f"{v['verdict']} {v['magnitude']:+.1%} p={p}; "
                        f"P50 ms {p50}",
                        flush=True,
                    )
                    if kind == "change":
                        hits += flagged == [at]
                    else:
                        clean += flagged == []
    finally:
        fx.drop_database(dsn)
    print(f"slowdown x{args.slowdown} flagged exactly at its start: {hits}/{args.repeat}; "
          f"steady series with no flag: {clean}/{args.repeat}; {time.monotonic() - t0:.0f} s")
    return 0 if hits == clean == args.repeat else 1


if __name__ == "__main__":
    sys.exit(main())
