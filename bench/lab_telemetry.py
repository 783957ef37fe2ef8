"""What the netns lab's telemetry costs: ``lab up`` with and without the node exporters and Prometheus, and the
CPU they use while the lab idles, side by side in one run (needs root and Debian's prometheus and
prometheus-node-exporter).

    .venv/bin/python bench/lab_telemetry.py [--nodes 16] [--rounds 2] [--idle-s 10]

Each round builds the lab twice, once with the telemetry hidden (the lab then runs without Prometheus, as on a
machine without the packages) and once with it, and times ``up``; with it, the CPU seconds of every exporter and of
Prometheus over ``--idle-s`` of idling are read from /proc/<pid>/stat. Prints each time, their ratio, and the
telemetry's share of one core; absolute figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from deploybench.lab import cluster, netns
from deploybench.lab.state import LabFiles

NAME = "bchtel"


def cpu_s(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            continue
    return total / tick


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def up_s(nodes: int, telemetry: bool) -> float:
    real = shutil.which
    if not telemetry:
        cluster.shutil.which = lambda b, *a, **k: None if "prometheus" in b or b == "node_exporter" else real(b)
    try:
        t0 = time.monotonic()
        cluster.up(NAME, nodes=nodes, link_mbit=200, mode="netns", model_mb=1)
        return time.monotonic() - t0
    finally:
        cluster.shutil.which = real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=10.0)
    args = ap.parse_args()
    os.environ.setdefault("DEPLOYBENCH_HOME", tempfile.mkdtemp(prefix="bench-telemetry-"))
    times: dict[bool, list[float]] = {False: [], True: []}
    shares = []
    try:
        for _ in range(args.rounds):
            for telemetry in (False, True):
                cluster.down(NAME)
                times[telemetry].append(up_s(args.nodes, telemetry))
                if telemetry:
                    root = LabFiles(NAME).root
                    pids = netns.pids_mentioning(f"{root}/prometheus/") + [
                        p for p in netns.pids_mentioning(f"{root}/nodes/") if "exporter" in cmdline(p)]
                    c0 = cpu_s(pids)
                    time.sleep(args.idle_s)
                    shares.append((cpu_s(pids) - c0) / args.idle_s)
    finally:
        cluster.down(NAME)
    without, with_ = statistics.median(times[False]), statistics.median(times[True])
    print(f"lab up, {args.nodes} nodes, median of {args.rounds}: without telemetry {without:.2f} s, with it "
          f"{with_:.2f} s ({with_ / without:.2f}x)")
    print(f"telemetry idling: {statistics.median(shares):.1%} of one core ({args.nodes} node exporters and "
          f"Prometheus, 1 s scrapes, over {args.idle_s:g} s)")


if __name__ == "__main__":
    main()
