"""``deploybench lease status|break CLUSTER``: who holds a cluster, and the operator's way out."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("lease", help="the cluster lease: who holds a cluster, break a dead run's lease")
    lsub = p.add_subparsers(dest="lease_command", required=True)
    s = lsub.add_parser("status", help="who holds a cluster's lease (run, DAG, host, pid, age) and which runs wait "
                                       "for it, in their order; or of every cluster")
    s.add_argument("cluster", nargs="?", default=None, help="the inventory's name (default: every cluster)")
    s.add_argument("--events", type=int, default=5, help="show this many recent lease events (0: none)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--dsn", default=None, help="results database (default: DEPLOYBENCH_DSN or the embedded one)")
    s.set_defaults(func=cmd_status)
    b = lsub.add_parser("break", help="free a cluster's lease whoever holds it; the holder stops at its next "
                                      "heartbeat, the next run cleans up after it")
    b.add_argument("cluster", help="the inventory's name")
    b.add_argument("--dsn", default=None, help="results database (default: DEPLOYBENCH_DSN or the embedded one)")
    b.set_defaults(func=cmd_break)


def cmd_status(args: argparse.Namespace) -> int:
    from deploybench.lease import LeaseStore

    store = LeaseStore(args.dsn)
    infos = [i for i in [store.status(args.cluster)] if i] if args.cluster else store.all()
    if args.json:
        print(json.dumps([i.to_dict() for i in infos], default=str, indent=1))
        return 0
    if not infos:
        print(f"cluster {args.cluster!r} was never leased" if args.cluster else "no cluster was ever leased")
        return 0
    for info in infos:
        print(info.describe())
        for n, w in enumerate(info.waiting, 1):
            print(f"  waiting {n}: run {w['run_key']} (DAG {w['dag_id']}) since {w['since']:%Y-%m-%d %H:%M:%S}")
        for p in info.pending_cleanup:
            print(f"  pending cleanup: run {p.get('run_key')} ({p.get('reason')}, host {p.get('host')}, "
                  f"pid {p.get('pid')})")
        for e in store.events(info.cluster, limit=args.events) if args.events else []:
            extra = e["detail"].get("by") or e["detail"].get("host") or ""
            print(f"  {e['at']:%Y-%m-%d %H:%M:%S} {e['event']:<10} {e['run_key'] or ''} {extra}".rstrip())
    return 0


def cmd_break(args: argparse.Namespace) -> int:
    from deploybench.lease import LeaseStore

    was = LeaseStore(args.dsn).break_lease(args.cluster)
    if was is None:
        print(f"cluster {args.cluster!r} is not leased; nothing to break")
        return 0
    print(f"broke the lease: {was.describe()}")
    print(f"run {was.holder!r} stops at its next heartbeat (if it still runs); the next run on {args.cluster!r} "
          "cleans up what it left on the nodes")
    return 0

