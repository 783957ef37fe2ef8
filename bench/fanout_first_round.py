"""Fan-out on fresh labs: how often does a lab's FIRST chain fan-out need more than one round?

    sudo .venv/bin/python bench/fanout_first_round.py [--runs 20] [--name f1first] [--busy-threads 1]
                                                      [--late-node n04 --late-ms 500]

Each run brings a 6-node netns lab up (200 Mbit/s links, 16 MiB model), empties the targets,
runs one chain fan-out with FanoutSpec() defaults, and brings the lab down; it prints the rounds
and each node's attempts, and for a run that needed more than one round, the end of every
relay log on the nodes. Before the fix of issue 18's known bug (a relay started without its
token: sshd drops input that reaches a node after the command it was sent to has ended), about
1 suite run in 6 showed a retried first round on a busy machine; it needs load to show.
``--busy-threads`` runs Python threads that keep the controller's interpreter busy, as any
other work in the process that drives the fan-out does (1 is enough to make the old start
fail most rounds). ``--late-node``/``--late-ms`` hold back every input sent to one node over SSH by that long,
the way a busy controller does by a few milliseconds: with the old relay start, every round
then fails on that node; now the fan-out still takes one round. The code under test is the
one on sys.path: PYTHONPATH=<a checkout of an older commit>/include measures that commit.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import threading
import time

from fanout import wipe  # bench/fanout.py

MODEL = "sim-model"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--name", default="f1first", help="lab name (default %(default)s)")
    p.add_argument("--busy-threads", type=int, default=0, help="Python threads spinning in this process")
    p.add_argument("--late-node", default="", help="hold back every SSH input to this node")
    p.add_argument("--late-ms", type=float, default=500.0)
    a = p.parse_args()
    if os.geteuid() != 0:
        print("the netns lab needs root", file=sys.stderr)
        return 2
    os.environ.setdefault("DEPLOYBENCH_HOME", tempfile.mkdtemp(prefix="fanout-first-"))
    logging.basicConfig(level=logging.ERROR)
    from deploybench import fanout
    from deploybench.config import FanoutSpec
    from deploybench.errors import StageFailed
    from deploybench.lab import cluster
    from deploybench.lab.state import LabFiles
    from deploybench.transport import Cluster, SSHTransport

    if a.late_node:
        send_input = SSHTransport._send_input

        def late(self, chan, command, data, *args, **kwargs):
            if self.node.name == a.late_node:
                time.sleep(a.late_ms / 1000)
            return send_input(self, chan, command, data, *args, **kwargs)

        SSHTransport._send_input = late
    for _ in range(a.busy_threads):
        threading.Thread(target=lambda: [sum(range(10_000)) for _ in iter(int, 1)], daemon=True).start()
    retried = failed = 0
    for run in range(a.runs):
        inv = cluster.up(a.name, nodes=6, link_mbit=200, mode="netns", model_mb=16)
        try:
            wipe(LabFiles(a.name), inv.names[1:])
            t0 = time.monotonic()
            try:
                with Cluster(inv) as c:
                    res = fanout.run(c, inv.names, inv.names[0], MODEL, FanoutSpec(timeout_s=120))
                rounds, line = res.rounds, " ".join(f"{n.node}:{n.attempts}" for n in res.nodes[1:])
            except StageFailed as exc:
                failed += 1
                rounds, line = 0, f"FAILED {str(exc)[:300]}"
            print(f"run {run + 1}: {time.monotonic() - t0:.1f} s, rounds {rounds}, attempts {line}", flush=True)
            if rounds != 1:
                retried += rounds > 1
                with Cluster(inv) as c:
                    for n in inv.names:
                        logs = c[n].run(f"for f in {inv.run_root}/{n}/fanout/*.log; do [ -s $f ] && echo $f: "
                                        "$(tail -c 300 $f); done; true", timeout=30).stdout.splitlines()
                        for line in logs:  # a relay that ended well has '"error": null' last
                            if not line.endswith('"error": null}'):
                                print(f"  {n}: {line}", flush=True)
        finally:
            cluster.down(a.name)
    print(f"{a.runs} fresh-lab first fan-outs ({a.busy_threads} busy threads): {retried} needed more than one "
          f"round, {failed} failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
