"""Ingest benchmark: raw samples into the results store, bulk COPY against row-by-row INSERTs.

    .venv/bin/python bench/ingest.py [--rows 1000000] [--row-by-row 20000] [--executemany 100000]

The bulk path is the store's own (``write_run``: binary COPY in the run's transaction, the
run's other facts beside it). Row-by-row is one INSERT statement per sample, in one
transaction; executemany is psycopg 3's batched form of the same INSERT. The slow paths run
on fewer rows (their rate does not depend on the table size here) and rows/s are compared;
all three run one after the other in this process, so the ratio is measured side by side.
Uses a throwaway database on $DEPLOYBENCH_DSN or the embedded PostgreSQL.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.support
from deploybench.store import write_run  # noqa: E402
from deploybench.store.db import open_store  # noqa: E402
from deploybench.store.rows import SAMPLE_COLUMNS  # noqa: E402
from deploybench.store.writer import prepare_samples  # noqa: E402
from tests.support import store_fixtures as fx  # noqa: E402

INSERT = (f"INSERT INTO request_samples (run_key, {', '.join(SAMPLE_COLUMNS)}) "
          f"VALUES (%s, {', '.join(['%s'] * len(SAMPLE_COLUMNS))})")


def _rows(frame, key):
    ts = list(frame["ts"].dt.to_pydatetime())
    cols = [frame[c].astype(object).where(frame[c].notna(), None).tolist() for c in SAMPLE_COLUMNS[1:]]
    return [(key, t, *rest) for t, *rest in zip(ts, *cols)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--row-by-row", type=int, default=20_000)
    ap.add_argument("--executemany", type=int, default=100_000)
    args = ap.parse_args()
    dsn, _ = fx.make_database()
    try:
        rng = np.random.default_rng(0)
        frame = fx.samples(args.rows, 300.0, rng, errors=args.rows // 100)
        engine = open_store(dsn)
        cfg = fx.config()
        # warm the connection pool and the migration check
        write_run(dsn, fx.run_record("bench/warm", cfg), [], [], frame.head(1000))

        t = time.monotonic()
        res = write_run(dsn, fx.run_record("bench/copy", cfg), [], fx.phase_from(frame.head(10_000), 20), frame,
                        facts=fx.facts(cfg))
        copy_s = time.monotonic() - t
        assert res.samples == args.rows

        results = {"COPY (write_run, whole run)": (args.rows, copy_s)}
        prepared = prepare_samples(frame)
        for name, n, many in (("executemany INSERT", args.executemany, True),
                              ("row-by-row INSERT", args.row_by_row, False)):
            rows = _rows(prepared.head(n), f"bench/{'many' if many else 'rows'}")
            write_run(dsn, fx.run_record(rows[0][0], cfg))
            t = time.monotonic()
            with engine.begin() as conn:
                cur = conn.connection.driver_connection.cursor()
                if many:
                    cur.executemany(INSERT, rows)
                else:
                    for r in rows:
                        cur.execute(INSERT, r)
            results[name] = (n, time.monotonic() - t)
    finally:
        fx.drop_database(dsn)

    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
          "(shared: absolute rates are noisy, the ratios are measured side by side)")
    copy_rate = results["COPY (write_run, whole run)"][0] / results["COPY (write_run, whole run)"][1]
    for name, (n, secs) in results.items():
        rate = n / secs
        print(f"{name:<30} {n:>9,} rows in {secs:7.2f} s = {rate:>10,.0f} rows/s   COPY is {copy_rate / rate:5.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
