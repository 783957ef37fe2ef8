"""The hand-over of a run folder through the results database (deploybench.store.run_files), against a local copy.

    .venv/bin/python bench/run_files.py [--samples-mb 8 32 128] [--records 12]

What a distributed executor adds to each task of a run: a pull of the run's folder before its work and a push of
what it wrote after. For a folder like a run's (one record per stage, a few KB each, and the load stage's samples
CSV of the given size) it times, side by side in this process: the push of the whole folder (the load task's),
the pull of it onto an empty disk (the next task on another worker), the pull when nothing changed (every later
task: a listing, no content), and a plain ``shutil.copytree`` of the same folder (the shared-disk baseline).
Ratios against the copy are printed per size. Uses a throwaway database on $DEPLOYBENCH_DSN or the embedded
PostgreSQL; the machine's other load is measured with it, so compare the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.support
from deploybench.store import run_files  # noqa: E402
from tests.support import store_fixtures as fx  # noqa: E402


def _folder(root: Path, samples_mb: int, records: int) -> Path:
    folder = root / "runs" / "bench-run"
    (folder / "stages").mkdir(parents=True)
    (folder / "run.json").write_text('{"run_key": "bench-run"}' + " " * 4000)
    for i in range(records):
        (folder / "stages" / f"stage{i:02d}.json").write_bytes(os.urandom(3000).hex().encode())
    line = b"2026-12-06T10:00:00.000000+00:00,sustained,n01,200,,312.25,41.5,512,128\n"
    (folder / "load").mkdir()
    with open(folder / "load" / "samples.csv", "wb") as f:
        f.write(line * (samples_mb * 2**20 // len(line)))
    return folder


def _timed(fn, *args) -> float:
    t = time.monotonic()
    fn(*args)
    return time.monotonic() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples-mb", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--records", type=int, default=12)
    args = ap.parse_args()
    dsn, _ = fx.make_database()
    try:
        with tempfile.TemporaryDirectory(prefix="db-bench-rf-warm-") as warm:
            run_files.pull("bench-warm-up", dsn, Path(warm))  # the migrations and the pool, before any timing
        print(f"{'samples':>8} {'copy s':>8} {'push s':>8} {'pull s':>8} {'re-pull s':>9} "
              f"{'push/copy':>9} {'pull/copy':>9}")
        for mb in args.samples_mb:
            with tempfile.TemporaryDirectory(prefix="db-bench-rf-") as tmp:
                home_a, home_b, home_c = Path(tmp) / "a", Path(tmp) / "b", Path(tmp) / "c"
                folder = _folder(home_a, mb, args.records)
                key = f"bench-run-{mb}"
                copy_s = _timed(shutil.copytree, folder, home_c / "copy")
                push_s = _timed(run_files.push, key, dsn, {}, folder)
                target = home_b / "runs" / "bench-run"
                target.mkdir(parents=True)
                pull_s = _timed(run_files.pull, key, dsn, target)
                again_s = _timed(run_files.pull, key, dsn, target)
                print(f"{mb:>6}MB {copy_s:>8.3f} {push_s:>8.3f} {pull_s:>8.3f} {again_s:>9.3f} "
                      f"{push_s / copy_s:>8.1f}x {pull_s / copy_s:>8.1f}x")
        print(f"run_files: a {args.samples_mb[-1]} MB run folder pushed in {push_s:.2f} s and pulled in "
              f"{pull_s:.2f} s ({push_s / copy_s:.0f}x and {pull_s / copy_s:.0f}x a local copy); an unchanged folder "
              f"re-pulled in {again_s * 1000:.0f} ms")
    finally:
        fx.drop_database(dsn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
