"""The diagnosis benchmark: each simulated fault on one node of a small netns lab, and clean runs, side by side.

Every run is a whole short run (tests/support/fault_runs.py, lab_run: preflight, fan-out, rollout, the sustained
phase, teardown, store) with one fault of ``fault_runs.FAULTS`` (a different node each time, in turn), or none:
the simulated engine's faults on one node (deploybench.sim.faults), the drift fault on every node (a rule of the
cluster), k6 held to too few VUs (client), one node's link shaped under its nominal speed (slow_link: preflight
stops that run; its finding comes from preflight's record). Prints, per run, every rule that fired and on which
node, whether the fault's own rule named the faulty node (the cluster, for a cluster's rule), and the false
findings (anything in a clean run; another node or the cluster in a node's fault; another rule in a cluster's).
Needs root (network namespaces) and sshd. Usage:

    .venv/bin/python bench/diagnosis.py [--nodes 3] [--clean 3] [--repeat 1]

Uses a throwaway database on $DEPLOYBENCH_DSN or the embedded PostgreSQL, and a lab of its own; both are removed
at the end. The last line is the score:
``diagnosis: <k> of <n> faults named on the right node, <f> false findings in <c> clean runs``.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.support
from deploybench import paths  # noqa: E402
from deploybench.analyse.findings import RULE_IDS  # noqa: E402
from deploybench.lab import cluster  # noqa: E402
from tests.support import fault_runs  # noqa: E402
from tests.support import store_fixtures as fx  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--clean", type=int, default=3, help="clean runs (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=1, help="times each fault is run (default %(default)s)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    lab = "dx" + secrets.token_hex(4)
    dsn, _ = fx.make_database()
    t0 = time.monotonic()
    outcomes: list[fault_runs.Outcome] = []
    try:
        inv = cluster.up(lab, nodes=args.nodes, link_mbit=500, mode="netns", model_mb=2)
        nodes = [n.name for n in inv.nodes]
        inventory = str(paths.lab_dir(lab) / "inventory.json")
        plan: list[tuple[str | None, str | None]] = [(None, None)] * args.clean
        plan += [(f, nodes[(i + r) % len(nodes)]) for r in range(args.repeat)
                 for i, f in enumerate(fault_runs.FAULTS)]
        for i, (fault, node) in enumerate(plan):
            out = fault_runs.lab_run(f"deploybench_run/{lab}_{i:02d}", inventory, dsn, fault, node,
                                     params={"canary_nodes": len(nodes)}, lab=lab)
            outcomes.append(out)
            fired = ", ".join(f"{f.rule}@{f.node or 'cluster'}" for f in out.findings) or "none"
            verdict = ("clean" if fault is None else
                       f"{fault_runs.EXPECTED[fault]} on {out.where or 'cluster'}: "
                       f"{'NAMED' if out.named else 'MISSED'}")
            stages = " ".join(f"{k} {v:g}" for k, v in out.stages.items() if k in ("preflight", "fanout", "rollout",
                                                                                   "load", "teardown", "store"))
            stopped = f"; stopped at {out.stopped.split(':')[0]}" if out.stopped else ""
            print(f"run {i:2d} {fault or 'clean':<11} node {node or '-':<6} {verdict:<45} fired: {fired}; "
                  f"false: {len(out.false)}  ({out.seconds:.0f} s: {stages}{stopped})", flush=True)
    finally:
        cluster.down(lab)
        fx.drop_database(dsn)
    faulty = [o for o in outcomes if o.fault is not None]
    clean = [o for o in outcomes if o.fault is None]
    print()
    print(f"{'rule':<22} {'fired on (run fault@node -> node)':<60}")
    for rule in RULE_IDS:
        hits = [f"{o.fault or 'clean'}@{o.node or '-'} -> {f.node or 'cluster'}" for o in outcomes
                for f in o.findings if f.rule == rule]
        print(f"{rule:<22} {', '.join(hits) or '-'}")
    false_faulty = sum(len(o.false) for o in faulty)
    print(f"\nfalse findings in faulty runs (another node or the cluster): {false_faulty}; "
          f"{len(outcomes)} runs in {time.monotonic() - t0:.0f} s")
    k = sum(o.named for o in faulty)
    f = sum(len(o.false) for o in clean)
    print(f"diagnosis: {k} of {len(faulty)} faults named on the right node, {f} false findings in {len(clean)} "
          "clean runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
