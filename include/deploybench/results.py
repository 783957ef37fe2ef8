"""From a run's folder to the results store: records built from the stage records, written in
one transaction (the run, every stage, the load phases per node and the raw samples).

Called by the store stage whatever failed before, so a failed run is stored with the
results measured up to its failure and the reason it stopped.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from deploybench.report import run_status

if TYPE_CHECKING:
    from deploybench.pipeline import Run

log = logging.getLogger(__name__)

# stages whose records go into stage_results (store and report describe the storing itself)
STORED_STAGES = ("validate", "preflight", "fanout", "rollout", "load", "teardown")


def _when(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None


def phase_records(load: dict[str, Any]) -> list[Any]:
    """One PhaseRecord for the whole cluster ('*') and one per node, from a LoadResult dump."""
    from deploybench.store import PhaseRecord

    started = load["started_at"]
    common = {"phase": load["phase"], "duration_s": load["duration_s"], "started_at": started}
    keys = ("achieved_rps", "output_tps", "requests", "errors", "error_rate", "latency_p50_ms", "latency_p90_ms",
            "latency_p99_ms", "latency_p999_ms", "ttft_p50_ms", "ttft_p99_ms")
    out = [PhaseRecord(node="*", offered_rps=load["offered_rps"], dropped_iterations=load["dropped_iterations"],
                       **common, **{k: load.get(k) for k in keys})]
    per_node_offered = load["offered_rps"] / max(1, len(load.get("nodes") or []))
    for n in load.get("nodes") or []:
        out.append(PhaseRecord(node=n["node"], offered_rps=per_node_offered, **common, **{k: n.get(k) for k in keys}))
    return out


def store_run(run: "Run", dsn: str | None = None) -> dict[str, int]:
    from deploybench.store import RunRecord, StageRecord, write_run

    recs = run.stage_records()
    record = RunRecord.from_config(
        run.key,
        run.cfg,
        dag_id=run.meta.get("dag_id") or "cli",
        airflow_run_id=run.meta.get("airflow_run_id"),
        status=run_status(recs),
        started_at=_when(run.meta.get("started_at")) or datetime.now(timezone.utc),
        finished_at=datetime.now(timezone.utc),
        node_count=len(run.nodes),
    )
    stages = [
        StageRecord(
            stage=s,
            status=r["status"] if r["status"] in ("success", "failed") else "failed",
            started_at=_when(r.get("started_at")),
            seconds=r.get("seconds"),
            summary={"summary": r.get("summary", ""), "result": r.get("result")},
            error=r.get("error"),
        )
        for s, r in recs.items()
        if s in STORED_STAGES
    ]
    load = (recs.get("load") or {}).get("result") or None
    phases = phase_records(load) if load else []
    samples = load.get("samples_path") if load else None
    res = write_run(dsn, record, stages, phases, samples)
    log.info("stored run %s: %d stages, %d phases, %d samples (replaced: %s)", run.key, res.stages, res.phases,
             res.samples, res.replaced)
    return {"stages": res.stages, "phases": res.phases, "samples": res.samples, "replaced": int(res.replaced)}
