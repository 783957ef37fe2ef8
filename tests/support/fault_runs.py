"""Short whole runs on a lab with one simulated fault on one node: does the right finding name the right node?

Each run goes through the pipeline as a DAG run does (validate, lease, preflight, fan-out, rollout, the sustained
phase, teardown, store), on a copy of the lab's inventory that puts ``fault`` (deploybench.sim.faults) on
``node`` (``Node.sim_fault``: the operator's inventory, never the form), and returns the findings the store
holds for it. ``FAST`` keeps a run short: a small model, 1-second link tests, one rollout step (every node of a
3-node lab; pass ``canary_nodes`` for another size) with a 1-second gate, a 5-second phase; and makes every
fault visible in that time (``EXPECTED`` names the rule that must name the node):

- the engines decode a step in ``10 + 0.2 x running`` ms and answer 16 tokens, so alone a request takes
  16 x 10.2 = 163 ms: a node without batching serves at most 6.1 requests/s, under the 8 each node is offered,
  and its queue grows; a throttled one (half clock) takes twice as long; a clean one has room to spare (B = 32);
- prompts of about 24 tokens hold 2 KV blocks when admitted and 3 at their end: the small KV cache's 5 blocks
  take two together, which outgrow it (preemptions) and slow it under the offered rate;
- about 40 requests per node in the phase: the leak (2 MiB each) grows the memory by tens of MiB, the errors
  fault (30 %) makes about 12 (fewer than 5, too few to say where errors come from, 3 times in 1,000).

Used by tests/integration/test_findings_lab.py and bench/diagnosis.py (``from tests.support import fault_runs``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploybench.analyse.findings import Finding

log = logging.getLogger(__name__)

EXPECTED = {"throttle": "gpu_throttled", "leak": "memory_drift", "small_kv": "kv_cache_saturated",
            "no_batching": "no_batching", "errors": "errors_one_node"}
FAST: dict[str, Any] = {
    "canary_nodes": 3, "iperf_seconds": 1, "link_threshold": 0.3, "load_rate": 24, "load_duration_s": 5,
    "warmup_s": 1, "output_tokens": 16, "prompt_tokens": 24, "gate_rate_per_node": 2, "gate_duration_s": 1,
    "gate_min_requests": 3, "ready_timeout_s": 30, "ttft_sample_rps": 0, "scrape_interval_s": 1,
    "max_num_seqs": 32, "sim_decode_base_ms": 10, "sim_decode_per_seq_ms": 0.2, "sim_prefill_per_token_ms": 0.005,
    "slo_p99_latency_ms": 30000, "slo_max_error_rate": 0.5, "request_timeout_s": 20,
}


@dataclass
class Outcome:
    """One run: the fault and its node (None: a clean run), the findings, and how they score."""

    run_key: str
    fault: str | None
    node: str | None
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)  # stage -> seconds, as its record says
    report: str | None = None  # the HTML report's path, when asked for

    @property
    def named(self) -> bool:
        """The fault's rule named the fault's node."""
        want = EXPECTED.get(self.fault or "")
        return any(f.rule == want and f.node == self.node for f in self.findings)

    @property
    def false(self) -> list[Finding]:
        """Findings that name what is not faulty: anything in a clean run; another node, or the whole cluster, in a
        run with a fault (a faulty node may well trip more than one rule: those are not false)."""
        return [f for f in self.findings if self.fault is None or f.node != self.node]


def faulted_inventory(inventory: str | Path, fault: str | None, node: str | None, out: Path) -> Path:
    """A copy of ``inventory`` (a JSON file) with ``fault`` on ``node`` and on no other node."""
    data = json.loads(Path(inventory).read_text())
    names = [n["name"] for n in data["nodes"]]
    if fault is not None and node not in names:
        raise ValueError(f"node {node!r} is not in inventory {inventory} (its nodes: {', '.join(names)})")
    for n in data["nodes"]:
        n.pop("sim_fault", None)
        if fault is not None and n["name"] == node:
            n["sim_fault"] = fault
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    return out


def lab_run(run_key: str, inventory: str | Path, dsn: str, fault: str | None = None, node: str | None = None,
            params: dict[str, Any] | None = None, report: bool = False) -> Outcome:
    """One whole run with ``fault`` on ``node`` (see the module doc); its findings as the store holds them. The
    faulted inventory is written beside the lab's (an inventory must be in the operator's folders)."""
    import time

    from deploybench import pipeline
    from deploybench.run import Run
    from deploybench.store import load_run

    t0 = time.monotonic()
    inv = faulted_inventory(inventory, fault, node, Path(inventory).with_name(f"inventory-{fault or 'clean'}.json"))
    conf = {**FAST, **(params or {}), "inventory": str(inv)}
    pipeline.validate(run_key, conf)
    pipeline.acquire_lease(run_key, dsn=dsn)
    try:
        with pipeline.lease_heartbeat(run_key, dsn, interrupt=False):
            for stage in ("preflight", "fanout", "rollout"):
                pipeline.run_stage(stage, run_key)
            pipeline.run_stage("load", run_key, phase="sustained")
    finally:
        pipeline.run_stage("teardown", run_key)
        pipeline.release_lease(run_key, dsn)
    pipeline.run_stage("store", run_key, dsn=dsn)
    path = pipeline.report(run_key, dsn)["path"] if report else None
    stored = load_run(dsn, run_key)
    found = [Finding(**f.model_dump()) for f in stored.findings] if stored is not None else []
    recs = Run.open(run_key).stages()
    out = Outcome(run_key, fault, node, found, round(time.monotonic() - t0, 1),
                  {s: round(r.seconds or 0.0, 1) for s, r in recs.items()}, path)
    log.info("run %s (%s on %s): %d findings in %.1f s: %s", run_key, fault or "clean", node or "-", len(found),
             out.seconds, "; ".join(f.line() for f in found) or "none")
    return out
