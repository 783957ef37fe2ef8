"""``deploybench lab up|down|status``: build, remove and inspect the embedded lab cluster."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from deploybench.lab.cluster import DEFAULT_LINK_MBIT, DEFAULT_MODEL_MB

    lab = subparsers.add_parser("lab", help="the embedded lab cluster (network namespaces or loopback)")
    sub = lab.add_subparsers(dest="lab_command", required=True)

    def named(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--name", default="demo", help="lab name: 1-12 lowercase letters/digits (default: demo)")
        return p

    p = named(sub.add_parser("up", help="build the lab (or report it if it is already running)"))
    p.add_argument("--nodes", type=int, default=16, help="number of nodes (default: 16)")
    p.add_argument("--loadgens", type=int, default=0,
                   help="load-generator machines (g01, g02, ...: own namespace and sshd, serving nothing) that split "
                        "each load phase by k6 execution segments (default: 0, the controller alone)")
    p.add_argument("--link-mbit", type=float, default=None,
                   help="nominal link speed of every node, Mbit/s (default: what this host carries when preflight "
                        f"tests the links, measured by a short iperf3 at up, at most {DEFAULT_LINK_MBIT:g})")
    p.add_argument("--mode", choices=["netns", "loopback", "auto"], default="auto",
                   help="netns (root: namespaces, sshd, tc), loopback (127.x addresses), auto (netns when root)")
    p.add_argument("--model-mb", type=float, default=DEFAULT_MODEL_MB,
                   help=f"size of the synthetic model seeded on the first node (default: {DEFAULT_MODEL_MB:g})")
    p.add_argument("--model-name", default=None, help="model folder name (default: the run config's model name)")
    p.set_defaults(func=_up)

    p = named(sub.add_parser("down", help="remove the lab: processes, namespaces, links, folders"))
    p.add_argument("--purge", action="store_true", help="also delete the lab's SSH user and host keys")
    p.set_defaults(func=_down)

    p = named(sub.add_parser("status", help="list the nodes and whether each answers"))
    p.set_defaults(func=_status)


def _up(args: argparse.Namespace) -> int:
    from deploybench.lab import cluster

    cluster.up(args.name, nodes=args.nodes, loadgens=args.loadgens, link_mbit=args.link_mbit, mode=args.mode,
               model_mb=args.model_mb, model_name=args.model_name)
    return _status(args)


def _down(args: argparse.Namespace) -> int:
    from deploybench.lab import cluster

    cluster.down(args.name, purge=args.purge)
    print(f"lab {args.name}: down")
    return 0


def _status(args: argparse.Namespace) -> int:
    import logging

    from deploybench.lab import cluster

    logging.getLogger("paramiko").setLevel(logging.WARNING)

    st = cluster.status(args.name)
    print(f"lab {st.name}: {st.mode.value} mode, subnet {st.subnet}, links {st.link_mbit:g} Mbit/s")
    if st.link_note:
        print(f"link speed measured at up: {st.link_note}")
    print(f"inventory: {st.inventory}")
    print(f"prometheus: {st.prometheus} (node exporters on every node's port 9100)" if st.prometheus
          else "prometheus: none (the lab runs without Prometheus; netns mode with the prometheus and "
               "prometheus-node-exporter packages starts one)")
    for n in st.nodes:
        mark = "ok  " if n.ok else "DOWN"
        print(f"  {n.name:5} {n.address:15} {mark} {'' if n.ok else n.detail}")
    up_count = sum(n.ok for n in st.nodes)
    print(f"{up_count}/{len(st.nodes)} nodes answer")
    return 0 if st.healthy else 1
