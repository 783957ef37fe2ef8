"""Fan-out benchmark: T_p2p, chain, tree and star on one 16-node lab, printed as ratios to T_p2p.

    sudo .venv/bin/python bench/fanout.py [--nodes 16] [--link-mbit 100] [--model-mb 128] [--skip-tree] [--skip-star]
    sudo .venv/bin/python bench/fanout.py --nodes 48 --model-mb 32 --link-mbit 25 --skip-tree --skip-star

The links are the bottleneck on purpose. Every node's link is shaped to ``--link-mbit`` in
both directions; the chain moves ``nodes x link`` bytes per second through relays that each
hash and write what passes, all on this machine. At 100 Mbit/s and 16 nodes that is 16 x
12.5 MB/s = 200 MB/s of hashing + writing + veth traffic in total, a fraction of 2 cores
(sha256 alone runs at several hundred MB/s per core); at the lab's default 500 Mbit/s it
would be 1 GB/s and the CPUs, not the links, would set the pace. 128 MB makes one copy
about 11 s, long enough that per-round set-up (SSH, starting relays) is small beside it,
and keeps the star run (15 copies through one uplink) near three minutes.

T_p2p is the same tool (the chain relay, with its inline hashing and publishing) from the
source to one node. Each strategy starts from empty targets; before the first, the relay is
installed on every node (as it is on any run after a node's first). ``stage`` is the whole
fan-out call (manifest, inspection, rounds, verification, publishing); ``transfer`` is the
first byte to the last node's finish. ``cpu`` is how busy the machine's cores were during the
run (all processes, so other people's work shows there too). Ratios are measured side by
side in one run; absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time

from deploybench import fanout
from deploybench.config import FanoutSpec
from deploybench.fanout.relay_control import Relays
from deploybench.lab import cluster
from deploybench.lab.state import LabFiles
from deploybench.transport import Cluster

MODEL = "sim-model"


def cpu_ticks() -> tuple[int, int]:
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


def wipe(files: LabFiles, nodes: list[str]) -> None:
    for n in nodes:
        for child in files.models(n).iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()


def measure(c: Cluster, files: LabFiles, names: list[str], strategy: str, parallel: int) -> dict:
    wipe(files, names[1:])
    busy0, total0 = cpu_ticks()
    t0 = time.monotonic()
    res = fanout.run(c, names, names[0], MODEL, FanoutSpec(strategy=strategy, parallel=parallel))
    stage = time.monotonic() - t0
    busy1, total1 = cpu_ticks()
    targets = [n for n in res.nodes if n.node != names[0]]
    assert all(n.verified for n in targets), [n.error for n in targets if not n.verified]
    transfer = max(n.started_at + n.seconds for n in targets) - min(n.started_at for n in targets)
    return {"stage": stage, "transfer": transfer, "cpu": (busy1 - busy0) / max(1, total1 - total0),
            "nodes": len(targets), "bytes": res.bytes_moved}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="f4bench", help="lab name (default %(default)s)")
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--link-mbit", type=float, default=100.0)
    p.add_argument("--model-mb", type=float, default=128.0)
    p.add_argument("--skip-star", action="store_true", help="star takes ~15 copies' time")
    p.add_argument("--skip-tree", action="store_true", help="tree takes log2(nodes) copies' time")
    p.add_argument("--keep", action="store_true",
                   help="leave the lab up (its Prometheus stays stopped unless --with-prometheus)")
    p.add_argument("--with-prometheus", action="store_true",
                   help="leave the lab's Prometheus scraping its nodes during the runs (stopped by default)")
    a = p.parse_args()
    # BENCH_LOG=DEBUG: every step's log line, stamped with milliseconds since the start
    logging.basicConfig(level=getattr(logging, os.environ.get("BENCH_LOG", "WARNING").upper()),
                        format="%(relativeCreated)d %(name)s %(message)s")
    if os.geteuid() != 0:
        print("the netns lab needs root", file=sys.stderr)
        return 2
    inv = cluster.up(a.name, nodes=a.nodes, link_mbit=a.link_mbit, mode="netns", model_mb=a.model_mb)
    files = LabFiles(a.name)
    rows = []
    try:
        if not a.with_prometheus:
            # The lab's Prometheus stands for the team's, which runs on its own machine: here it shares the 2 cores
            # with every node, and its scrapes of 48 node exporters kept 9-11 % of them busy (an idle 48-node lab;
            # under 0.1 % without it). The fan-out does not read it; the exporters go on, idle.
            cluster.stop_prometheus(a.name)
        with Cluster(inv) as c:
            # Warm, as any run after a node's first is: the source's hash cache, SSH sessions, and this
            # relay version on every node (it is sent once per version, then found there).
            fanout.run(c, inv.names[:2], inv.names[0], MODEL, FanoutSpec())
            relays = Relays(c, MODEL, FanoutSpec())
            for name in inv.names:
                relays.install(name)
            plan = [("T_p2p", inv.names[:2], "chain"), ("chain", inv.names, "chain")]
            plan += [] if a.skip_tree else [("tree", inv.names, "tree")]
            plan += [] if a.skip_star else [("star", inv.names, "star")]
            for label, names, strategy in plan:
                r = measure(c, files, names, strategy, parallel=len(names) - 1)
                rows.append((label, strategy, r))
                print(f"  {label}: {r['stage']:.1f} s", file=sys.stderr, flush=True)
    finally:
        if not a.keep:
            cluster.down(a.name)
    base = rows[0][2]
    if not (base["stage"] > 0 and base["transfer"] > 0):
        print(f"T_p2p run gave no timing: {base}", file=sys.stderr)
        return 1
    mb = a.model_mb
    print(f"\nfan-out of a {mb:g} MiB model, {a.nodes}-node netns lab, links {a.link_mbit:g} Mbit/s "
          f"(one copy's wire time {mb * 2**20 * 8 / 1e6 / a.link_mbit:.1f} s), {os.cpu_count()} cores")
    print(f"{'run':8} {'strategy':8} {'targets':>7} {'stage s':>8} {'x T_p2p':>8} {'transfer s':>10} "
          f"{'x T_p2p':>8} {'cpu busy':>8}")
    for label, strategy, r in rows:
        print(f"{label:8} {strategy:8} {r['nodes']:>7} {r['stage']:>8.1f} {r['stage'] / base['stage']:>8.2f} "
              f"{r['transfer']:>10.1f} {r['transfer'] / base['transfer']:>8.2f} {r['cpu']:>8.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
