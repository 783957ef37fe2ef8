"""The test suite's wall time against the CPU it needs: `make test`'s two parts, measured on this machine.

    sudo .venv/bin/python bench/suite.py [--workers 4,6] [--no-quiet]

Runs the parallel part (``pytest -n W -m "not quiet"``) once for each worker count, side by side in
one run, then the quiet part (``-m quiet``, alone) once, exactly as `make test` does, and reads the
machine's CPU time (user + system + interrupts, all processes, /proc/stat) around each. Prints per
part: wall time, CPU seconds, how busy the cores were, and the floor that CPU sets on the wall time
(CPU seconds / cores: no scheduling of these tests can finish sooner on this machine); then the
whole suite's wall time at the best worker count against the issue's 6-minute target. Run it on an
otherwise idle machine: /proc/stat counts every process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 6 * 60


def busy_cpu_s() -> float:
    """CPU seconds spent by the whole machine since boot, idle and iowait excluded."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def measure(label: str, argv: list[str]) -> dict:
    env = dict(os.environ)  # as the Makefile: the virtualenv's bin first on PATH
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    cpu0, t0 = busy_cpu_s(), time.monotonic()
    res = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    wall, cpu = time.monotonic() - t0, busy_cpu_s() - cpu0
    last = (res.stdout.strip().splitlines() or ["(no output)"])[-1]
    cores = os.cpu_count() or 1
    row = {"label": label, "wall": wall, "cpu": cpu, "busy": cpu / (wall * cores), "floor": cpu / cores,
           "rc": res.returncode, "summary": last}
    print(f"{label:<22} {wall:7.0f} s wall {cpu:7.0f} CPU-s  cores {row['busy']:4.0%} busy  "
          f"floor {row['floor']:5.0f} s  rc={res.returncode}  {last}", flush=True)
    if res.returncode:
        print("\n".join(res.stdout.splitlines()[-40:]), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="6", help="comma-separated worker counts for the parallel part")
    ap.add_argument("--no-quiet", action="store_true", help="skip the quiet part")
    args = ap.parse_args()
    py = sys.executable
    print(f"{os.cpu_count()} cores; make test = the parallel part, then the quiet part alone", flush=True)
    counts = [w.strip() for w in args.workers.split(",")]
    parallel = [measure(f"parallel, {w} workers", [py, "-m", "pytest", "-q", "-n", w, "-m", "not quiet", "tests"])
                for w in counts]
    best = min(parallel, key=lambda r: r["wall"])
    for r in parallel:
        print(f"  {r['label']}: {r['wall'] / best['wall']:.2f}x the fastest")
    if args.no_quiet:
        return max(r["rc"] for r in parallel)
    quiet = measure("quiet, alone", [py, "-m", "pytest", "-q", "-m", "quiet", "tests"])
    wall, cpu = best["wall"] + quiet["wall"], best["cpu"] + quiet["cpu"]
    cores = os.cpu_count() or 1
    print(f"suite ({best['label']} + quiet): {wall:.0f} s wall = {wall / TARGET_S:.2f}x the {TARGET_S} s target; "
          f"{cpu:.0f} CPU-s, so no schedule on {cores} cores finishes under {cpu / cores:.0f} s "
          f"({cpu / cores / TARGET_S:.2f}x the target)")
    return max(r["rc"] for r in [*parallel, quiet])


if __name__ == "__main__":
    sys.exit(main())
