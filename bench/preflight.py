"""Preflight benchmark: a full iperf3 mesh in rounds of disjoint pairs against the same pairs one by one.

    python bench/preflight.py [--nodes 16] [--seconds 2] [--link-mbit 100] [--lab pfbench] [--keep]

Both schedules test the same N(N-1)/2 pairs with the same test duration (the stage's
default, iperf3 -t 2 --bidir) and the same iperf3 servers (one per node, started once) on
the same lab, side by side in one run, SSH sessions opened before either; the ratio of
their wall times is printed (expected: about N(N-1)/2 / (N-1) = N/2, i.e. >= 7x for 16
nodes, less the per-test overhead that both pay).

Then the fabric check (issue 33) on the same lab: every TCP flow of the iperf3 ports capped at a quarter of
the link (the lab's per-flow HTB classes: one stream cannot fill the link, as one stream on one core cannot
fill 100-400 GbE), a ring tested with one stream and with the chosen streams (--streams), side by side. The
last line gives the worst link's reading of each: one stream should stay below 0.9 of nominal, the chosen
streams reach 0.9 or more.
Needs root (netns lab). Uses its own lab, removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

from deploybench.config import LinkMode, PreflightSpec
from deploybench.lab import cluster
from deploybench.preflight import link_pairs, schedule_rounds
from deploybench.preflight.links import run_rounds
from deploybench.transport import Cluster


def measure(c: Cluster, rounds: list, spec: PreflightSpec, concurrent: bool) -> tuple[float, list]:
    t0 = time.monotonic()
    links = run_rounds(c, rounds, spec, concurrent=concurrent)
    return time.monotonic() - t0, links


def describe(label: str, seconds: float, rounds: list, links: list) -> str:
    mbit = [d.mbit for lt in links for d in lt.directions]
    failed = sum(1 for lt in links if lt.error)
    med = statistics.median(mbit) if mbit else float("nan")
    low = min(mbit) if mbit else float("nan")
    return (f"{label:<22} {len(links):4d} tests in {len(rounds):3d} rounds: {seconds:7.1f} s wall, "
            f"per direction median {med:5.0f} Mbit/s, min {low:5.0f} Mbit/s, {failed} errors")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=PreflightSpec().iperf_seconds,
                    help="iperf3 test duration, the same for both schedules (default: the stage's, %(default)g)")
    ap.add_argument("--link-mbit", type=float, default=100.0,
                    help="lab link speed; low enough that 8 concurrent tests do not saturate a 2-core machine's "
                         "CPU, which would measure the CPU, not the schedule")
    ap.add_argument("--streams", type=int, default=8, help="the fabric check's parallel streams (iperf3 -P)")
    ap.add_argument("--lab", default="pfbench")
    ap.add_argument("--keep", action="store_true", help="leave the lab running")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if os.geteuid() != 0:
        print("bench/preflight.py needs root (netns lab)", file=sys.stderr)
        return 2

    inv = cluster.up(args.lab, nodes=args.nodes, link_mbit=args.link_mbit, mode="netns", model_mb=1)
    spec = PreflightSpec(link_mode=LinkMode.MESH, iperf_seconds=args.seconds, link_threshold=0.5)
    pairs = link_pairs(inv.names, LinkMode.MESH)
    in_rounds = schedule_rounds(pairs)
    one_by_one = [[p] for p in pairs]
    print(f"lab {args.lab}: {args.nodes} nodes at {args.link_mbit:g} Mbit/s, {len(pairs)} pairs, "
          f"iperf3 -t {args.seconds:g} --bidir; load average before: {os.getloadavg()[0]:.2f}", flush=True)
    try:
        with Cluster(inv) as c:
            for name in inv.names:  # open every SSH session first: neither schedule pays for it
                c[name].run("true", timeout=30).check()
            t_rounds, l_rounds = measure(c, in_rounds, spec, concurrent=True)
            print(describe("mesh in rounds", t_rounds, in_rounds, l_rounds), flush=True)
            t_seq, l_seq = measure(c, one_by_one, spec, concurrent=False)
            print(describe("sequential pairs", t_seq, one_by_one, l_seq), flush=True)
            fabric = fabric_check(args, inv, c)
    finally:
        if not args.keep:
            cluster.down(args.lab)
    ideal = len(one_by_one) / len(in_rounds)
    print(f"ratio sequential / rounds: {t_seq / t_rounds:.1f}x (ideal {ideal:.1f}x = {len(one_by_one)} tests / "
          f"{len(in_rounds)} rounds); per-test wall: rounds {t_rounds / len(in_rounds):.2f} s, "
          f"sequential {t_seq / len(one_by_one):.2f} s; load average after: {os.getloadavg()[0]:.2f}")
    print(fabric)
    return 0


def fabric_check(args: argparse.Namespace, inv, c: Cluster) -> str:
    """One stream against the chosen streams on a ring whose every flow is capped at a quarter of the link."""
    cap = args.link_mbit / 4
    for name in inv.names:
        cluster.set_link(args.lab, name, flow_cap_mbit=cap)
    ring = schedule_rounds(link_pairs(inv.names, LinkMode.RING))
    worst = {}
    for streams in (1, args.streams):
        spec = PreflightSpec(link_mode=LinkMode.RING, iperf_seconds=args.seconds, omit_s=1, link_threshold=0.9,
                             streams=streams)
        seconds, links = measure(c, ring, spec, concurrent=True)
        ratios = [lt.ratio for lt in links if lt.ratio is not None]
        worst[streams] = min(ratios) if ratios else float("nan")
        print(f"fabric, flows capped at {cap:g} Mbit/s: {streams} stream(s): {len(links)} links in {seconds:.1f} s, "
              f"worst {worst[streams]:.2f} of nominal, median {statistics.median(ratios):.2f}, "
              f"{sum(1 for lt in links if lt.ok)} passed", flush=True)
    return (f"fabric: one stream {worst[1]:.2f} of nominal, {args.streams} streams {worst[args.streams]:.2f} "
            "of nominal")


if __name__ == "__main__":
    sys.exit(main())
