"""From checks and links to a decision: which nodes are at fault, who goes on, and the words for it.

Pure functions over the measured results, so every rule is unit-tested without a cluster.
"""

from __future__ import annotations

from collections import Counter

from deploybench.config import Policy, PreflightSpec
from deploybench.preflight.model import LinkTest, NodeCheck


def describe_link(lt: LinkTest) -> str:
    """One sentence naming both nodes and the measured figures, e.g.
    "link n07 -> n08: iperf3 reached 412 Mbit/s, 41% of the nominal 1000 Mbit/s (threshold 90%)"."""
    if lt.error:
        return f"link {lt.src} -> {lt.dst}: {lt.error}"
    thr = f" (threshold {lt.threshold:.0%})" if lt.threshold is not None else ""
    streams = f" with {lt.streams} streams" if lt.streams and lt.streams > 1 else ""
    text = (f"link {lt.src} -> {lt.dst}: iperf3 reached {lt.mbit:.0f} Mbit/s{streams}, {lt.ratio:.0%} of the nominal "
            f"{lt.nominal_mbit:.0f} Mbit/s{thr}")
    if len(lt.directions) > 1:
        text += " [" + ", ".join(f"{d.src} -> {d.dst} {d.mbit:.0f} Mbit/s" for d in lt.directions) + "]"
    if lt.first_ratio is not None:
        text += f"; tested twice, the first test read {lt.first_ratio:.0%}"
    if lt.problems:
        text += "; " + "; ".join(lt.problems)
    return text


def blame(
    names: list[str], checks: list[NodeCheck], links: list[LinkTest], source: str | None = None
) -> dict[str, str]:
    """Nodes to exclude and why.

    1. a node whose own checks failed;
    2. a node most of whose tested links failed (a slow NIC or cable shows on all its links);
    3. a failed link whose two ends are both still in: the end with the larger share of failed
       links goes; on a tie both go (the test cannot tell which end is at fault), except the
       fan-out source when the other end can take the blame.
    """
    bad: dict[str, str] = {c.node: "; ".join(c.reasons) for c in checks if not c.ok}

    def judged(name: str) -> tuple[list[LinkTest], list[LinkTest]]:
        mine = [lt for lt in links if name in (lt.src, lt.dst) and lt.src not in bad and lt.dst not in bad]
        return mine, [lt for lt in mine if not lt.ok]

    majority = {}
    for name in names:
        if name in bad:
            continue
        mine, failed = judged(name)
        if mine and len(failed) * 2 > len(mine):
            majority[name] = "; ".join(describe_link(lt) for lt in failed)
    bad.update(majority)
    for lt in links:
        if lt.ok or lt.src in bad or lt.dst in bad:
            continue
        share = {n: len(judged(n)[1]) / max(1, len(judged(n)[0])) for n in (lt.src, lt.dst)}
        top = max(share.values())
        ends = [n for n in (lt.src, lt.dst) if share[n] == top]
        if len(ends) == 2 and source in ends:
            ends.remove(source)
        for n in ends:
            bad[n] = describe_link(lt) + ("" if len(ends) == 1 else " (cannot tell which end is at fault)")
    return {n: bad[n] for n in names if n in bad}


def decide(names: list[str], excluded: dict[str, str], links: list[LinkTest], spec: PreflightSpec,
           source: str | None) -> tuple[list[str], str, bool]:
    """(healthy nodes, the decision in words, abort?) under the run's policy."""
    healthy = [n for n in names if n not in excluded]
    if not excluded:
        return healthy, (f"all {len(names)} nodes passed ({len(links)} links at >= {spec.link_threshold:.0%} "
                         "of nominal" + (f", RTT <= {spec.max_rtt_ms:g} ms" if spec.ping_count else "") + ")"), False
    if spec.policy is Policy.ABORT:
        reasons = "\n  ".join(f"{n}: {why}" for n, why in excluded.items())
        return healthy, (f"abort (policy abort): {len(excluded)} of {len(names)} nodes failed preflight:\n  {reasons}"
                         "\n  fix them, or set preflight_policy=exclude to go on without them"), True
    listed = "; ".join(f"{n} ({why})" for n, why in excluded.items())
    if source and source in excluded:
        return healthy, (f"abort (policy exclude): the fan-out source {source} failed preflight; excluded: {listed}; "
                         "fix it or choose another source_node"), True
    if len(healthy) < spec.min_nodes:
        return healthy, (f"abort (policy exclude): only {len(healthy)} healthy nodes left, min_nodes={spec.min_nodes}; "
                         f"excluded: {listed}"), True
    return healthy, (f"exclude {', '.join(excluded)}; continuing with {len(healthy)} of {len(names)} nodes: "
                     f"{listed}"), False


def matrix(links: list[LinkTest]) -> dict[str, dict[str, float]]:
    """src -> dst -> fraction of nominal, one cell per measured direction (the report's heat map)."""
    out: dict[str, dict[str, float]] = {}
    for lt in links:
        for d in lt.directions:
            out.setdefault(d.src, {})[d.dst] = d.ratio
    return out


def worst_links(links: list[LinkTest], k: int = 5) -> list[str]:
    """The ``k`` weakest directions (and every failed test), worst first, in words."""
    errors = [describe_link(lt) for lt in links if lt.error]
    dirs = sorted(((d, lt) for lt in links for d in lt.directions), key=lambda x: x[0].ratio)
    shown = [f"{d.src} -> {d.dst}: {d.mbit:.0f} Mbit/s, {d.ratio:.0%} of {lt.nominal_mbit:.0f} Mbit/s"
             + (f", {d.retransmits} retransmits" if d.retransmits else "") for d, lt in dirs[:k]]
    return errors + shown


def node_summary(checks: list[NodeCheck]) -> str:
    counts = Counter(c.status for c in checks)
    return ", ".join(f"{counts[s]} {s}" for s in ("pass", "warn", "fail") if counts[s])
