"""Preflight: prove the nodes and the links between them are fit before anything is deployed.

Node checks run on every node in parallel; link tests run iperf3 between node pairs,
scheduled in rounds of disjoint pairs so no node is in two tests at once, and compare
each link with the nominal speed of its slower end. The decision (which nodes stay)
follows the run's policy and is part of the result.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from deploybench.config import LinkMode, Policy, PreflightSpec
from deploybench.errors import DeploybenchError, StageFailed
from deploybench.inventory import Inventory, Node
from deploybench.transport import Cluster, spawn_script, stop_script

log = logging.getLogger(__name__)

REQUIRED_BINARIES = ("iperf3", "rsync", "sha256sum")
IPERF_PORT = 5201


@dataclass
class NodeCheck:
    node: str
    ok: bool
    reasons: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)


@dataclass
class LinkTest:
    src: str
    dst: str
    round: int
    nominal_mbit: float
    mbit: float | None = None
    ratio: float | None = None
    retransmits: int | None = None
    rtt_ms: float | None = None
    ok: bool = False
    error: str | None = None


@dataclass
class PreflightResult:
    nodes: list[NodeCheck]
    links: list[LinkTest]
    healthy: list[str]
    excluded: dict[str, str]
    decision: str
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


# -- pure parts ------------------------------------------------------------------------------
def link_pairs(names: list[str], mode: LinkMode, source: str | None = None) -> list[tuple[str, str]]:
    """The directed links to test: ring (each node to the next), star (source to each), mesh (every pair)."""
    n = len(names)
    if n < 2:
        return []
    if mode is LinkMode.RING:
        if n == 2:
            return [(names[0], names[1]), (names[1], names[0])]
        return [(names[i], names[(i + 1) % n]) for i in range(n)]
    if mode is LinkMode.STAR:
        src = source or names[0]
        return [(src, d) for d in names if d != src]
    return [(names[i], names[j]) for i in range(n) for j in range(i + 1, n)]


def schedule_rounds(pairs: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Group links into rounds in which no node takes part in two tests (greedy edge colouring).

    For a full mesh of N nodes (N even) the circle method gives the optimum, N-1 rounds;
    greedy colouring is used for the other shapes.
    """
    nodes = sorted({x for p in pairs for x in p})
    if len(pairs) == len(nodes) * (len(nodes) - 1) // 2 and len(nodes) % 2 == 0 and len(nodes) > 2:
        return _circle_rounds(pairs, nodes)
    rounds: list[list[tuple[str, str]]] = []
    busy: list[set[str]] = []
    for a, b in pairs:
        for i, used in enumerate(busy):
            if a not in used and b not in used:
                rounds[i].append((a, b))
                used.update((a, b))
                break
        else:
            rounds.append([(a, b)])
            busy.append({a, b})
    return rounds


def _circle_rounds(pairs: list[tuple[str, str]], nodes: list[str]) -> list[list[tuple[str, str]]]:
    wanted = {frozenset(p): p for p in pairs}
    order = list(nodes)
    n = len(order)
    rounds = []
    for _ in range(n - 1):
        rnd = []
        for i in range(n // 2):
            key = frozenset((order[i], order[n - 1 - i]))
            rnd.append(wanted[key])
        rounds.append(rnd)
        order = [order[0], order[-1], *order[1:-1]]
    return rounds


def parse_iperf3(text: str) -> dict:
    """Throughput (Mbit/s), retransmits and mean RTT (ms) from ``iperf3 -J`` output."""
    data = json.loads(text)
    if "error" in data and not data.get("end"):
        raise DeploybenchError(f"iperf3: {data['error']}")
    end = data["end"]
    received = end.get("sum_received") or end.get("sum") or {}
    sent = end.get("sum_sent") or {}
    rtts = [s["sender"].get("mean_rtt") for s in end.get("streams", []) if s.get("sender", {}).get("mean_rtt")]
    return {
        "mbit": received.get("bits_per_second", 0.0) / 1e6,
        "retransmits": sent.get("retransmits"),
        "rtt_ms": (sum(rtts) / len(rtts) / 1000.0) if rtts else None,
    }


def blame(names: list[str], checks: list[NodeCheck], links: list[LinkTest]) -> dict[str, str]:
    """Nodes to exclude and why: a failed node check, or most of a node's links failed."""
    bad: dict[str, str] = {c.node: "; ".join(c.reasons) for c in checks if not c.ok}
    for name in names:
        if name in bad:
            continue
        mine = [lt for lt in links if name in (lt.src, lt.dst) and lt.src not in bad and lt.dst not in bad]
        failed = [lt for lt in mine if not lt.ok]
        if mine and len(failed) * 2 > len(mine):
            bad[name] = "; ".join(describe_link(lt) for lt in failed)
    return bad


def describe_link(lt: LinkTest) -> str:
    if lt.error:
        return f"link {lt.src} -> {lt.dst}: {lt.error}"
    return (
        f"link {lt.src} -> {lt.dst}: iperf3 reached {lt.mbit:.0f} Mbit/s, {lt.ratio:.0%} of the nominal "
        f"{lt.nominal_mbit:.0f} Mbit/s"
    )


# -- the stage -------------------------------------------------------------------------------
def check_node(cluster: Cluster, node: Node, required_bytes: int = 0) -> NodeCheck:
    """Reachability (with the pinned host key), required binaries, free space at the model root."""
    inv = cluster.inventory
    root = inv.model_root_of(node)
    script = (
        f"mkdir -p {shlex.quote(root)} && "
        f"echo kernel=$(uname -r); echo cpus=$(nproc); "
        f"echo free_bytes=$(df -PB1 {shlex.quote(root)} | awk 'NR==2{{print $4}}'); "
        + "".join(f"echo bin_{b}=$(command -v {b} || echo missing); " for b in REQUIRED_BINARIES)
    )
    try:
        res = cluster[node].run(script, timeout=30)
    except DeploybenchError as exc:
        return NodeCheck(node.name, False, [str(exc)])
    if not res.ok:
        return NodeCheck(node.name, False, [f"node {node.name}: check failed (rc {res.rc}): {res.stderr.strip()[-300:]}"])
    facts = dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)
    reasons = [
        f"node {node.name}: {b} is not installed (needed by preflight/fanout)"
        for b in REQUIRED_BINARIES
        if facts.get(f"bin_{b}") == "missing"
    ]
    free = int(facts.get("free_bytes") or 0)
    if required_bytes and free < required_bytes:
        reasons.append(
            f"node {node.name}: {free / 2**30:.1f} GiB free at {root}, the model needs {required_bytes / 2**30:.1f} GiB"
        )
    return NodeCheck(node.name, not reasons, reasons, facts)


def test_link(cluster: Cluster, src: Node, dst: Node, rnd: int, seconds: float, threshold: float) -> LinkTest:
    """One iperf3 test src -> dst; the server on dst is started for it and always stopped."""
    inv = cluster.inventory
    nominal = min(src.link_mbit, dst.link_mbit)
    lt = LinkTest(src.name, dst.name, rnd, nominal)
    pid = f"{inv.run_root}/{dst.name}/iperf3-{src.name}.pid"
    try:
        started = False
        for port in (IPERF_PORT, IPERF_PORT + 1, IPERF_PORT + 2):
            srv = ["iperf3", "-s", "-1", "-B", dst.data_address, "-p", str(port)]
            cluster[dst].run(spawn_script(srv, f"{inv.run_root}/{dst.name}/iperf3-{src.name}.log", pid), timeout=15)
            client = ["iperf3", "-c", dst.data_address, "-B", src.data_address, "-p", str(port),
                      "-t", f"{seconds:g}", "-J", "--connect-timeout", "3000"]
            res = None
            for _ in range(20):  # the server needs a moment to listen
                res = cluster[src].run(client, timeout=seconds + 20)
                if res.ok or "unable to connect" not in (res.stdout + res.stderr):
                    break
                time.sleep(0.1)
            if res is not None and res.ok:
                started = True
                break
            if "in use" not in (res.stdout + res.stderr if res else ""):
                break
            cluster[dst].run(stop_script(pid, 1), timeout=10)
        if not started:
            out = (res.stdout + res.stderr) if res else ""
            try:
                lt.error = f"iperf3 failed: {json.loads(res.stdout).get('error')}" if res else "iperf3 did not run"
            except (ValueError, AttributeError):
                lt.error = f"iperf3 failed (rc {res.rc if res else '?'}): {out.strip()[-200:]}"
            return lt
        figures = parse_iperf3(res.stdout)
        lt.mbit, lt.retransmits, lt.rtt_ms = figures["mbit"], figures["retransmits"], figures["rtt_ms"]
        lt.ratio = lt.mbit / nominal
        lt.ok = lt.ratio >= threshold
    except DeploybenchError as exc:
        lt.error = str(exc)
    finally:
        try:
            cluster[dst].run(stop_script(pid, 1), timeout=10)
        except DeploybenchError as exc:
            log.warning("node %s: could not stop iperf3 server: %s", dst.name, exc)
    return lt


def run(
    cluster: Cluster, names: list[str], spec: PreflightSpec, source: str | None = None, required_bytes: int = 0
) -> PreflightResult:
    """Check every node, test the links, decide which nodes go on. Raises StageFailed under ``abort``."""
    t0 = time.monotonic()
    inv: Inventory = cluster.inventory
    nodes = [inv.node(n) for n in names]
    with ThreadPoolExecutor(max_workers=min(16, len(nodes))) as pool:
        checks = list(pool.map(lambda n: check_node(cluster, n, required_bytes), nodes))
    reachable = [c.node for c in checks if c.ok]
    for c in checks:
        log.info("node %s: %s", c.node, "ok" if c.ok else "; ".join(c.reasons))

    links: list[LinkTest] = []
    pairs = [p for p in link_pairs(names, spec.link_mode, source) if p[0] in reachable and p[1] in reachable]
    for i, rnd in enumerate(schedule_rounds(pairs)):
        with ThreadPoolExecutor(max_workers=max(1, len(rnd))) as pool:
            done = list(pool.map(
                lambda p: test_link(cluster, inv.node(p[0]), inv.node(p[1]), i, spec.iperf_seconds, spec.link_threshold),
                rnd,
            ))
        for lt in done:
            log.info("round %d: %s", i, describe_link(lt) if (lt.error or not lt.ok) else
                     f"link {lt.src} -> {lt.dst}: {lt.mbit:.0f} Mbit/s ({lt.ratio:.0%})")
        links.extend(done)

    excluded = blame(names, checks, links)
    healthy = [n for n in names if n not in excluded]
    seconds = time.monotonic() - t0
    if not excluded:
        decision = f"all {len(names)} nodes passed ({len(links)} links at >= {spec.link_threshold:.0%} of nominal)"
    elif spec.policy is Policy.ABORT:
        reasons = "\n  ".join(f"{n}: {why}" for n, why in excluded.items())
        decision = f"abort: {len(excluded)} of {len(names)} nodes failed preflight:\n  {reasons}"
    elif len(healthy) < spec.min_nodes or (source and source in excluded):
        why = "the fan-out source failed" if source in excluded else f"only {len(healthy)} healthy, min_nodes={spec.min_nodes}"
        decision = f"abort: {why}; excluded: " + "; ".join(f"{n} ({w})" for n, w in excluded.items())
    else:
        decision = f"exclude {', '.join(excluded)}; continuing with {len(healthy)} nodes"
    result = PreflightResult(checks, links, healthy, excluded, decision, seconds)
    if decision.startswith("abort"):
        raise StageFailed(f"preflight: {decision}", result.to_dict())
    return result
