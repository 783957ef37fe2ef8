"""From a run's folder to the results store: records built from the stage records, written in
one transaction (the run, its identities and series, every stage and its facts, the load
phases per node, capacity-search steps, server metrics and the raw samples).

Called by the store stage whatever failed before, so a failed run is stored with the
results measured up to its failure and the reason it stopped.

The load stage is read in the one shape it is written (deploybench.records.LoadStageResult): every
phase's LoadResult under ``phases``, the capacity search's steps under ``capacity.steps``, the scraped
/metrics and GPU series under ``series``. A record that does not match is refused (RecordError names
the stage, the field and the run folder), never skipped.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploybench.run import STORED_STAGES, run_status

if TYPE_CHECKING:
    from deploybench.load.results import LoadResult
    from deploybench.records import LoadStageResult, StageRecord
    from deploybench.run import Run

log = logging.getLogger(__name__)

_TRIGGERS = ("manual", "scheduled", "backfill", "asset_triggered", "dataset_triggered", "matrix")  # matrix: a cell


def _when(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None


def trigger_of(meta: dict[str, Any]) -> str:
    """manual / scheduled / backfill / asset_triggered from an Airflow run id's prefix; cli without one."""
    if meta.get("trigger"):
        return str(meta["trigger"])
    run_id = meta.get("airflow_run_id") or ""
    if not run_id:
        return "cli"
    prefix = run_id.split("__", 1)[0]
    return prefix if prefix in _TRIGGERS else "api"


_FIGURES = ("achieved_rps", "output_tps", "requests", "errors", "error_rate", "latency_p50_ms", "latency_p90_ms",
            "latency_p99_ms", "latency_p999_ms", "ttft_p50_ms", "ttft_p99_ms")


def spike_columns(analysis: dict[str, Any] | None) -> dict[str, Any]:
    """The spike phase's figures the cluster row keeps (migration 0012_spike), from its analysis; {} for others."""
    if not analysis or "recovery_reason" not in analysis:
        return {}
    up = analysis.get("scale_up") or {}
    return {"spike_recovery_s": analysis.get("recovery_s"),
            "spike_recovery_reason": str(analysis.get("recovery_reason") or "")[:2000] or None,
            "scale_up_serving_s": up.get("all_serving_s"), "scale_up_slo_s": up.get("slo_again_s"),
            "scale_up": bool(up)}


def phase_records(load: LoadResult, analysis: dict[str, Any] | None = None) -> list[Any]:
    """One PhaseRecord for the whole cluster ('*') and one per node, from a phase's LoadResult (and, for the spike
    phase, its analysis: ``spike_columns``)."""
    from deploybench.store import PhaseRecord

    common = {"phase": load.phase, "duration_s": load.duration_s, "started_at": load.started_at}
    engine = load.engine or {}
    out = [PhaseRecord(node="*", offered_rps=load.offered_rps, dropped_iterations=load.dropped_iterations,
                       prefix_hit_rate=_hit_rate(list(engine.values())),
                       energy_per_output_token_j=load.energy_per_output_token_j,
                       energy_per_request_j=load.energy_per_request_j,
                       cost_per_million_output_tokens=load.cost_per_million_output_tokens,
                       cost_currency=load.cost_currency, **spike_columns(analysis),
                       **common, **{k: getattr(load, k) for k in _FIGURES})]
    per_node_offered = load.offered_rps / max(1, len(load.nodes))
    for n in load.nodes:
        out.append(PhaseRecord(node=n.node, offered_rps=per_node_offered, **common,
                               prefix_hit_rate=_hit_rate([engine[n.node]] if n.node in engine else []),
                               **{k: getattr(n, k) for k in _FIGURES}))
    return out


def _hit_rate(figs: list[dict[str, Any]]) -> float | None:
    """Hit tokens over queried tokens of the engines' prefix caches (their counters' increases over the phase);
    None when an engine did not count them (a partial sum would speak for the others) or nothing was queried."""
    pairs = [(f.get("prefix_hits"), f.get("prefix_queries")) for f in figs]
    if not pairs or any(not isinstance(h, int | float) or not isinstance(q, int | float) for h, q in pairs):
        return None
    hits, total = sum(float(h or 0) for h, _ in pairs), sum(float(q or 0) for _, q in pairs)
    return min(1.0, max(0.0, hits / total)) if total > 0 else None


_STEP_FIGURES = ("achieved_rps", "latency_p99_ms", "ttft_p99_ms", "error_rate", "dropped_iterations")


def capacity_steps(load: LoadStageResult) -> list[Any]:
    """The capacity search's steps (the last of each step number: a retried step is listed twice)."""
    from deploybench.store.facts import CapacityStepRow

    steps = list({s.step: s for s in load.capacity.steps}.values())
    return [CapacityStepRow(step=s.step, offered_rps=s.rate, slo_ok=s.passed,
                            detail=s.model_dump(mode="json", exclude={*_STEP_FIGURES, "rate", "passed", "step"}),
                            **{k: getattr(s, k) for k in _STEP_FIGURES})
            for s in steps]


def node_windows(load: LoadStageResult) -> list[Any]:
    """Every phase's (and probe step's) per node figures, with their source."""
    from deploybench.store.facts import NodeWindowRow

    rows = {}
    for name, ph in load.phases.items():
        for step, figs in ph.node_windows.items():
            for w in figs:
                rows[(name, step, w.node, w.metric, w.source)] = NodeWindowRow(phase=name, step=step,
                                                                               **w.model_dump())
    return list(rows.values())


def _server_metrics(load: LoadStageResult) -> Any:
    import pandas as pd

    from deploybench.store.writer_facts import prepare_metrics

    frames = []
    for path in dict.fromkeys(load.series):
        if not Path(path).is_file():
            log.warning("server metrics file %s is missing; the run is stored without it", path)
            continue
        frames.append(prepare_metrics(path))
    return pd.concat(frames, ignore_index=True) if frames else None


def samples_source(load: LoadStageResult) -> Any:
    """The samples of every phase and capacity-search step: one file's path, or their rows together."""
    paths = load.sample_paths()
    if len(paths) <= 1:
        return paths[0] if paths else None
    import pandas as pd

    from deploybench.store.writer import read_samples

    return pd.concat([read_samples(p) for p in paths], ignore_index=True)


def run_facts(run: Run, load: LoadStageResult | None, findings: list[Any] | None = None) -> Any:
    """Identities and the facts of every stage, from the typed stage results (deploybench.records): a stage
    skipped (external backend) or reused (a matrix cell on an earlier cell's deployment) has no facts of its
    own here; its identity fields (the model, the engine) still count."""
    from dataclasses import asdict

    from deploybench.fanout.result import FanoutResult
    from deploybench.preflight.checks import fabric_identity
    from deploybench.preflight.model import PreflightResult
    from deploybench.records import ReusedPreflight, SkippedExternal
    from deploybench.rollout.base import RolloutResult
    from deploybench.store.facts import (
        FanoutNodeRow,
        FindingRow,
        PreflightLinkRow,
        PreflightNodeRow,
        RolloutStepRow,
        RunFacts,
    )
    from deploybench.store.identity import identity_of

    def unique(items: list[Any], *key: str) -> list[Any]:
        """The last item per key: a stage that retried an item lists it twice; the store keeps one."""
        return list({tuple(getattr(i, k) for k in key): i for i in items}.values())

    pf, fo, ro = run.preflight_result(), run.fanout_result(), run.rollout_result()
    model = {} if fo is None or isinstance(fo, SkippedExternal) else {
        "model": fo.model, "manifest_digest": fo.manifest_digest, "total_bytes": fo.total_bytes, "files": fo.files}
    engine = {} if ro is None else {
        "profile": ro.profile, "endpoints": ro.endpoints, "image": getattr(ro, "image", None),
        "version": getattr(ro, "version", None)}
    fabric = ({n.node: fabric_identity(n.facts) for n in pf.nodes} if isinstance(pf, PreflightResult)
              else pf.fabric if isinstance(pf, ReusedPreflight) else None)
    pf = pf if isinstance(pf, PreflightResult) else None
    identity = identity_of(run.cfg.model_dump(mode="json"), run.nodes, run.inventory.model_dump(mode="json"), model,
                           engine, fabric, run.traffic)
    fo = fo if isinstance(fo, FanoutResult) else None
    ro = ro if isinstance(ro, RolloutResult) else None
    return RunFacts(
        identity=identity,
        preflight_nodes=[PreflightNodeRow(node=n.node, ok=n.ok, reasons=n.reasons, facts=n.facts)
                         for n in unique(pf.nodes if pf else [], "node")],
        preflight_links=[PreflightLinkRow(**{k: v for k, v in asdict(lt).items() if k in PreflightLinkRow.model_fields})
                         for lt in unique(pf.links if pf else [], "src", "dst", "round")],
        fanout_nodes=[FanoutNodeRow(node=c.node, status=c.status, bytes=c.bytes, seconds=c.seconds,
                                    verified=c.verified, started_s=c.started_at, error=c.error)
                      for c in unique(fo.nodes if fo else [], "node")],
        rollout_steps=[RolloutStepRow(**{k: v for k, v in asdict(s).items() if k in RolloutStepRow.model_fields})
                       for s in unique(ro.steps if ro else [], "step")],
        capacity_steps=capacity_steps(load) if load else [],
        node_windows=node_windows(load) if load else [],
        findings=[FindingRow(**f.model_dump()) for f in findings or []],
        server_metrics=_server_metrics(load) if load else None,
    )


def store_run(run: Run, dsn: str | None = None, findings: list[Any] | None = None) -> dict[str, int]:
    """The run into the store in one transaction; ``findings`` (deploybench.analyse.findings, which the store stage
    computes: the analysis is a layer above the store) with it."""
    from deploybench.store import RunRecord, StageRow, write_run

    recs = run.stages()
    load = run.load_result()  # refused here, before anything is written, if it does not match the contract
    record = RunRecord.from_config(
        run.key,
        run.cfg,
        dag_id=run.meta.get("dag_id") or "cli",
        airflow_run_id=run.meta.get("airflow_run_id"),
        status=run_status(recs),
        started_at=_when(run.meta.get("started_at")) or datetime.now(UTC),
        finished_at=datetime.now(UTC),
        node_count=len(run.nodes),
        trigger=trigger_of(run.meta),
        logical_date=_when(run.meta.get("logical_date")),
    )
    stages = [_stage_row(StageRow, r) for s, r in recs.items() if s in STORED_STAGES]
    phases = [row for ph in load.phases.values() if ph.result is not None
              for row in phase_records(ph.result, ph.analysis)] if load else []
    samples = samples_source(load) if load else None
    res = write_run(dsn, record, stages, phases, samples, facts=run_facts(run, load, findings))
    log.info("stored run %s: %d stages, %d phases, %d samples (replaced: %s)", run.key, res.stages, res.phases,
             res.samples, res.replaced)
    return {"stages": res.stages, "phases": res.phases, "samples": res.samples, "replaced": int(res.replaced),
            **{k: v for k, v in (res.facts or {}).items() if v}}


def _stage_row(row: Any, r: StageRecord) -> Any:
    """The store's row of a stage record (a record still 'running' was cut short: stored as failed)."""
    return row(stage=r.stage, status=r.status if r.status in ("success", "failed") else "failed",
               started_at=_when(r.started_at), seconds=r.seconds,
               summary={"summary": r.summary, "result": r.result}, error=r.error)
