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
  fault (30 %) makes about 12 (fewer than 5, too few to say where errors come from, 3 times in 1,000);
- windows of 5/3 s: three over the phase, so the drift fault (every step 10 % longer per answered request, on
  every node: the same engine version leaks everywhere) shows as the last third serving about half the first's
  (``service_model.simulate`` of the same arrivals: 5.7 then 3.3 req/s a node);

and three faults that are not the engine's (``KINDS``), each standing for a rule that only unit tests had:

- ``client``: the run's k6 held to ``CLIENT_MAX_VUS`` VUs (``k6_max_vus``) for 24 req/s of 163-ms requests (about 4
  VUs busy): k6 drops iterations while the GPUs idle, ``client_limited`` on the cluster;
- ``slow_link``: the node's link shaped to ``SLOW_LINK_MBIT`` (the lab's HTB, ``lab.cluster.set_link``) under the
  inventory's nominal 500 (the run's threshold 30 %): preflight measures it low, blames the node and stops the run
  (policy abort), before any load; ``link_below_threshold`` names the node from preflight's own record, and the
  store stage and the report still run (findings over a run that stopped early are when a person needs them).

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
            "no_batching": "no_batching", "errors": "errors_one_node", "drift": "throughput_drift",
            "client": "client_limited", "slow_link": "link_below_threshold"}
# how a fault gets into the run: a sim fault on one node, or on every node (a finding of the whole cluster), a run
# knob, or the lab's link shaping
KINDS = {"throttle": "node", "leak": "node", "small_kv": "node", "no_batching": "node", "errors": "node",
         "drift": "cluster", "client": "params", "slow_link": "link"}
FAULTS = tuple(KINDS)
CLUSTER_RULES = ("client_limited", "throughput_drift")  # the rules that name the cluster, not a node
CLIENT_MAX_VUS = 2
SLOW_LINK_MBIT = 100  # 20 % of the lab's 500 Mbit/s nominal, under the run's 30 % threshold
FAST: dict[str, Any] = {
    "canary_nodes": 3, "iperf_seconds": 1, "link_threshold": 0.3, "load_rate": 24, "load_duration_s": 5,
    "warmup_s": 1, "output_tokens": 16, "prompt_tokens": 24, "gate_rate_per_node": 2, "gate_duration_s": 1,
    "gate_min_requests": 3, "ready_timeout_s": 30, "ttft_sample_rps": 0, "scrape_interval_s": 1,
    "max_num_seqs": 32, "sim_decode_base_ms": 10, "sim_decode_per_seq_ms": 0.2, "sim_prefill_per_token_ms": 0.005,
    "slo_p99_latency_ms": 30000, "slo_max_error_rate": 0.5, "request_timeout_s": 20, "window_s": 5 / 3,
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
    stopped: str | None = None  # the stage that stopped the run (its error), when one did

    @property
    def where(self) -> str | None:
        """The node the fault's rule must name: the faulty node, or None (the cluster) for a cluster rule."""
        return None if EXPECTED.get(self.fault or "") in CLUSTER_RULES else self.node

    @property
    def named(self) -> bool:
        """The fault's rule named the fault's node (or the cluster, for a cluster rule)."""
        want = EXPECTED.get(self.fault or "")
        return any(f.rule == want and f.node == self.where for f in self.findings)

    @property
    def false(self) -> list[Finding]:
        """Findings that name what is not faulty: anything in a clean run; another node, or the whole cluster, in a
        run with a node's fault (a faulty node may well trip more than one rule: those are not false); any other
        rule in a run with a cluster's fault."""
        if self.fault is None:
            return list(self.findings)
        if self.where is None:
            return [f for f in self.findings if f.rule != EXPECTED[self.fault]]
        return [f for f in self.findings if f.node != self.node]


def faulted_inventory(inventory: str | Path, fault: str | None, node: str | None, out: Path) -> Path:
    """A copy of ``inventory`` (a JSON file) with the sim ``fault`` on ``node`` and on no other node (on every node
    for a cluster's fault; on none for a fault that is not the engine's)."""
    data = json.loads(Path(inventory).read_text())
    names = [n["name"] for n in data["nodes"]]
    if fault is not None and node not in names:
        raise ValueError(f"node {node!r} is not in inventory {inventory} (its nodes: {', '.join(names)})")
    kind = KINDS.get(fault or "")
    for n in data["nodes"]:
        n.pop("sim_fault", None)
        if kind == "cluster" or (kind == "node" and n["name"] == node):
            n["sim_fault"] = fault
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    return out


def lab_run(run_key: str, inventory: str | Path, dsn: str, fault: str | None = None, node: str | None = None,
            params: dict[str, Any] | None = None, report: bool = False, lab: str | None = None) -> Outcome:
    """One whole run with ``fault`` on ``node`` (see the module doc); its findings as the store holds them. The
    faulted inventory is written beside the lab's (an inventory must be in the operator's folders). ``lab``: the
    lab's name, for ``slow_link`` (its link is shaped for the run, and restored after). A stage that stops the run
    (StageFailed: preflight's abort) stops it as in a DAG run: teardown, store and the report still run."""
    import time

    from deploybench import pipeline
    from deploybench.errors import StageFailed
    from deploybench.lab import cluster
    from deploybench.run import Run
    from deploybench.store import load_run

    t0 = time.monotonic()
    kind = KINDS.get(fault or "")
    if kind == "link" and (lab is None or node is None):
        raise ValueError(f"fault {fault!r} shapes a node's link in the lab: pass lab= and node=")
    inv = faulted_inventory(inventory, fault, node, Path(inventory).with_name(f"inventory-{fault or 'clean'}.json"))
    conf = {**FAST, **({"k6_max_vus": CLIENT_MAX_VUS} if kind == "params" else {}), **(params or {}),
            "inventory": str(inv)}
    stopped = None
    pipeline.validate(run_key, conf)
    pipeline.acquire_lease(run_key, dsn=dsn)
    try:
        if kind == "link":
            cluster.set_link(str(lab), str(node), mbit=SLOW_LINK_MBIT)
        with pipeline.lease_heartbeat(run_key, dsn, interrupt=False):
            for stage in ("preflight", "fanout", "rollout"):
                pipeline.run_stage(stage, run_key)
            pipeline.run_stage("load", run_key, phase="sustained")
    except StageFailed as exc:
        stopped = str(exc)[:300]
        log.info("run %s stopped: %s", run_key, stopped)
    finally:
        if kind == "link":
            cluster.set_link(str(lab), str(node))  # the nominal rate again
        pipeline.run_stage("teardown", run_key)
        pipeline.release_lease(run_key, dsn)
    pipeline.run_stage("store", run_key, dsn=dsn)
    path = pipeline.report(run_key, dsn)["path"] if report else None
    stored = load_run(dsn, run_key)
    found = [Finding(**f.model_dump()) for f in stored.findings] if stored is not None else []
    recs = Run.open(run_key).stages()
    out = Outcome(run_key, fault, node, found, round(time.monotonic() - t0, 1),
                  {s: round(r.seconds or 0.0, 1) for s, r in recs.items()}, path, stopped)
    log.info("run %s (%s on %s): %d findings in %.1f s: %s", run_key, fault or "clean", node or "-", len(found),
             out.seconds, "; ".join(f.line() for f in found) or "none")
    return out
