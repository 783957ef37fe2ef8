"""Preflight: prove the nodes and the links between them are fit before anything is deployed.

``run`` checks every node in parallel (``checks``), tests the links with iperf3 in rounds of
disjoint pairs (``links``), and decides under the run's policy which nodes go on
(``policy``). The decision and its reasons are part of the result; under ``abort`` (or when
``exclude`` leaves too little) it raises StageFailed carrying the result, so what was
measured is stored anyway.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from deploybench.config import PreflightSpec
from deploybench.errors import StageFailed
from deploybench.inventory import Inventory, Node
from deploybench.preflight.checks import NODE_BINARIES, Wanted, consistency, gather, judge_node
from deploybench.preflight.links import (
    IPERF_PORT,
    link_pairs,
    parse_iperf3,
    preflight_dir,
    run_rounds,
    schedule_rounds,
    sweep_script,
    test_address,
    test_link,
)
from deploybench.preflight.model import (
    CheckItem,
    Direction,
    LinkTest,
    NodeCheck,
    PreflightResult,
    node_errors,
)
from deploybench.preflight.policy import blame, decide, describe_link, matrix, node_summary, worst_links
from deploybench.transport import Cluster, UnsafeFolder

__all__ = [
    "IPERF_PORT", "CheckItem", "Direction", "LinkTest", "NodeCheck", "PreflightResult", "Wanted", "blame",
    "describe_link", "link_pairs", "matrix", "parse_iperf3", "run", "schedule_rounds", "test_link", "worst_links",
]

log = logging.getLogger(__name__)

def run(
    cluster: Cluster,
    names: list[str],
    spec: PreflightSpec,
    source: str | None = None,
    required_bytes: int = 0,
    *,
    model_name: str | None = None,
    engine_port: int | None = None,
    engine_binary: str | None = None,
) -> PreflightResult:
    """Check every node, test the links, decide which nodes go on. Raises StageFailed when the run must stop.

    ``model_name``: the model under each node's model root (its size at the source sizes the
    free-space check, unless ``required_bytes`` gives it); ``engine_port``: must be free on
    every node; ``engine_binary``: must be installed on every node (e.g. vllm).
    """
    t0 = time.monotonic()
    inv: Inventory = cluster.inventory
    nodes = [inv.node(n) for n in names]
    binaries = NODE_BINARIES + ("timeout",) + ((engine_binary,) if engine_binary else ())

    def wanted(node_name: str) -> Wanted:
        return Wanted(inv.model_root_of(node_name), model_name, engine_port, binaries, source, required_bytes,
                      nic_address=test_address(inv.node(node_name), spec.network))

    def one(n: Node) -> NodeCheck:
        try:
            cluster.run_dir(n.name)  # the run root must be the deploy user's own before anything is put there
        except UnsafeFolder:
            raise
        except node_errors():
            pass  # an unreachable node: gather says so, and the policy decides
        return gather(cluster, n, wanted(n.name), preflight_dir(inv, n.name))

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(nodes)))) as pool:
        checks = list(pool.map(one, nodes))
    by_name = {c.node: c for c in checks}
    model_bytes = required_bytes or (int(by_name[source].facts.get("model_bytes") or 0)
                                     if source in by_name and model_name else 0)
    for node, check in zip(nodes, checks):
        if check.reachable:
            judge_node(check, node, spec, wanted(node.name), model_bytes)
    findings = consistency(checks, spec)
    for c in checks:
        (log.info if c.ok else log.warning)("node %s: %s%s", c.node, c.status,
                                            "" if c.ok else " - " + "; ".join(c.reasons))

    # Links among every node that can run iperf3, so the matrix shows all there is to see.
    testable = [n for n in names if by_name[n].can_run_iperf3()]
    pairs = link_pairs(testable, spec.link_mode, source if source in testable else None)
    rounds = schedule_rounds(pairs)
    try:
        links = run_rounds(cluster, rounds, spec)
    finally:
        _sweep(cluster, [inv.node(n) for n in testable])
    _rdma_rounds(cluster, rounds, links, spec, {c.node: c.facts for c in checks})

    excluded = blame(names, checks, links, source)
    healthy, decision, abort = decide(names, excluded, links, spec, source)
    result = PreflightResult(
        checks, links, healthy, excluded, decision, round(time.monotonic() - t0, 3),
        policy=spec.policy.value, link_mode=spec.link_mode.value, threshold=spec.link_threshold, rounds=len(rounds),
        findings=findings, worst_links=worst_links(links), matrix=matrix(links),
    )
    log.info("preflight: nodes %s; %d links in %d rounds; %s", node_summary(checks), len(links), len(rounds), decision)
    if abort:
        raise StageFailed(f"preflight: {decision}", result.to_dict())
    return result


def _rdma_rounds(cluster: Cluster, rounds: list[list[tuple[str, str]]], links: list[LinkTest], spec: PreflightSpec,
                 facts: dict[str, dict[str, Any]]) -> None:
    """The RDMA test of each link (deploybench.preflight.rdma), round by round (disjoint pairs at once): its
    record on the LinkTest; a failed RDMA test fails the link, saying so; a pair without devices is skipped."""
    from deploybench.preflight import rdma

    inv = cluster.inventory
    by_pair = {(lt.src, lt.dst): lt for lt in links}
    for rnd in rounds:
        todo = []
        for a, b in rnd:
            lt = by_pair.get((a, b))
            if lt is None:
                continue
            ports, record = rdma.plan(spec, inv.node(a), inv.node(b), facts)
            if ports is None:
                lt.rdma = record
            else:
                todo.append((lt, ports))

        def one(item: tuple[LinkTest, tuple[dict[str, Any], dict[str, Any]]]) -> None:
            lt, ports = item
            src, dst = inv.node(lt.src), inv.node(lt.dst)
            lt.rdma = rdma.test_pair(cluster, src, dst, ports, spec, test_address(dst, spec.network),
                                     preflight_dir(inv, dst.name))
            if lt.rdma.status in ("fail", "error"):
                lt.ok = False
                lt.problems.append(f"RDMA {lt.rdma.status}: {lt.rdma.reason}")

        if todo:
            with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
                list(pool.map(one, todo))


def _sweep(cluster: Cluster, nodes: list[Node]) -> None:
    """Belt and braces after the rounds: no iperf3 server of this stage survives it."""
    def one(node: Node) -> None:
        try:
            res = cluster[node].run(sweep_script(preflight_dir(cluster.inventory, node.name)), timeout=20)
            if "swept=" in res.stdout:
                log.warning("node %s: stopped iperf3 servers left running: %s", node.name, res.stdout.strip())
        except node_errors() as exc:
            log.warning("node %s: could not sweep iperf3 servers: %s", node.name, exc)

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(nodes)))) as pool:
        list(pool.map(one, nodes))
