"""From a run's folder to the results store: records built from the stage records, written in
one transaction (the run, its identities and series, every stage and its facts, the load
phases per node, capacity-search steps, server metrics and the raw samples).

Called by the store stage whatever failed before, so a failed run is stored with the
results measured up to its failure and the reason it stopped.

Load-stage shapes read here (LoadResult dumps, see deploybench.load): a single phase (the
foundation's ``{"phase": ..., "nodes": [...], "samples_path": ...}``), or several under
``"phases"`` — a dict ``{name: {"status", "result": LoadResult, "analysis", "series"}}`` (the
load stage's three phases) or a list of LoadResults; the capacity search under ``"capacity"``
(or ``"capacity_search"``, or the probe phase's ``"analysis"``) as ``{"capacity_rps", "steps":
[{"step", "rate" | "offered_rps", "achieved_rps", "latency_p99_ms", "ttft_p99_ms",
"error_rate", "dropped_iterations", "passed" | "slo_ok", ...}]}``; server metrics as paths of
NDJSON/CSV files (ts, node, metric, value[, phase, labels]) under ``"series"`` or a phase's
``"metrics_path"``, or inline rows under ``"server_metrics"``. What is absent is skipped.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploybench.report import run_status

if TYPE_CHECKING:
    from deploybench.pipeline import Run

log = logging.getLogger(__name__)

# stages whose records go into stage_results (store and report describe the storing itself)
STORED_STAGES = ("validate", "lease", "preflight", "fanout", "rollout", "load", "teardown")
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


def load_phases(load: dict[str, Any]) -> list[dict[str, Any]]:
    """The LoadResult dumps of a load stage result: ``phases`` if present, else the result itself."""
    raw = load.get("phases") or []
    if isinstance(raw, dict):  # {name: {"status", "result", "analysis", "series"}}
        raw = [(v or {}).get("result") for v in raw.values()]
    phases = [p for p in raw if isinstance(p, dict) and p.get("phase")]
    if phases:
        return phases
    return [load] if load.get("phase") else []


def capacity_steps(load: dict[str, Any]) -> list[Any]:
    from deploybench.store.facts import CapacityStepRow

    search = load.get("capacity") or load.get("capacity_search")
    if not (isinstance(search, dict) and search.get("steps")) and isinstance(load.get("phases"), dict):
        search = ((load["phases"].get("probe") or {}).get("analysis")) or search
    steps = (search or {}).get("steps") if isinstance(search, dict) else search
    steps = list({s.get("step", i): s for i, s in enumerate(steps or []) if isinstance(s, dict)}.values())
    out = []
    known = ("achieved_rps", "latency_p99_ms", "ttft_p99_ms", "error_rate", "dropped_iterations")
    for i, s in enumerate(steps or []):
        offered = s.get("offered_rps", s.get("rate"))
        if offered is None:
            continue
        ok = s.get("slo_ok", s.get("passed", s.get("ok", False)))
        detail = {k: v for k, v in s.items() if k not in (*known, "offered_rps", "rate", "slo_ok", "passed", "ok",
                                                         "step")}
        out.append(CapacityStepRow(step=int(s.get("step", i)), offered_rps=float(offered), slo_ok=bool(ok),
                                   detail=detail, **{k: s.get(k) for k in known}))
    return out


def _server_metrics(load: dict[str, Any]) -> Any:
    import pandas as pd

    from deploybench.store.writer_facts import prepare_metrics

    sources: list[Any] = []
    if load.get("server_metrics"):
        sources.append(pd.DataFrame(load["server_metrics"]))
    paths = list(load.get("series") or [])
    if not paths:
        paths = [p.get("metrics_path") for p in load_phases(load)]
    frames = [prepare_metrics(s) for s in sources]
    for path in dict.fromkeys(p for p in paths if p):
        if not Path(path).is_file():
            log.warning("server metrics file %s is missing; the run is stored without it", path)
            continue
        frames.append(prepare_metrics(path))
    return pd.concat(frames, ignore_index=True) if frames else None


def samples_source(load: dict[str, Any]) -> Any:
    paths = load_sample_paths(load)
    if len(paths) <= 1:
        return paths[0] if paths else None
    import pandas as pd

    from deploybench.store.writer import read_samples

    return pd.concat([read_samples(p) for p in paths], ignore_index=True)


def run_facts(run: Run, recs: dict[str, dict[str, Any]]) -> Any:
    """Identities and the facts of every stage, from the stage records."""
    from deploybench.store.facts import (
        FanoutNodeRow,
        PreflightLinkRow,
        PreflightNodeRow,
        RolloutStepRow,
        RunFacts,
    )
    from deploybench.store.identity import identity_of

    def result(stage: str) -> dict[str, Any]:
        return (recs.get(stage) or {}).get("result") or {}

    def unique(rows: list[dict[str, Any]] | None, *key: str) -> list[dict[str, Any]]:
        """The last row per key: a stage that retried an item lists it twice; the store keeps one."""
        return list({tuple(r.get(k) for k in key): r for r in rows or [] if isinstance(r, dict)}.values())

    pf, fo, ro, ld = result("preflight"), result("fanout"), result("rollout"), result("load")
    identity = identity_of(run.cfg.model_dump(mode="json"), run.nodes, run.inventory.model_dump(mode="json"), fo, ro)
    return RunFacts(
        identity=identity,
        preflight_nodes=[PreflightNodeRow(node=n["node"], ok=n["ok"], reasons=n.get("reasons") or [],
                                          facts=n.get("facts") or {}) for n in unique(pf.get("nodes"), "node")],
        preflight_links=[PreflightLinkRow(**{k: lt.get(k) for k in PreflightLinkRow.model_fields if k in lt})
                         for lt in unique(pf.get("links"), "src", "dst", "round")],
        fanout_nodes=[FanoutNodeRow(node=c["node"], status=c["status"], bytes=c.get("bytes") or 0,
                                    seconds=c.get("seconds") or 0.0, verified=bool(c.get("verified")),
                                    started_s=c.get("started_at") or 0.0, error=c.get("error"))
                      for c in unique(fo.get("nodes"), "node")],
        rollout_steps=[RolloutStepRow(**{k: s[k] for k in RolloutStepRow.model_fields if k in s})
                       for s in unique(ro.get("steps"), "step")],
        capacity_steps=capacity_steps(ld) if ld else [],
        server_metrics=_server_metrics(ld) if ld else None,
    )


def load_sample_paths(load: dict[str, Any]) -> list[str]:
    """Every samples file of the load stage: each phase's, and each step's of the capacity search."""
    found = [p.get("samples_path") for p in load_phases(load)]
    raw = load.get("phases")
    for ph in raw.values() if isinstance(raw, dict) else []:
        found += [s.get("samples_path") for s in ((ph or {}).get("analysis") or {}).get("steps") or []]
    return list(dict.fromkeys(p for p in found if p))


def store_run(run: Run, dsn: str | None = None) -> dict[str, int]:
    from deploybench.store import RunRecord, StageRecord, write_run

    recs = run.stage_records()
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
    phases = [rec for p in load_phases(load) for rec in phase_records(p)] if load else []
    samples = samples_source(load) if load else None
    res = write_run(dsn, record, stages, phases, samples, facts=run_facts(run, recs))
    log.info("stored run %s: %d stages, %d phases, %d samples (replaced: %s)", run.key, res.stages, res.phases,
             res.samples, res.replaced)
    return {"stages": res.stages, "phases": res.phases, "samples": res.samples, "replaced": int(res.replaced),
            **{k: v for k, v in (res.facts or {}).items() if v}}
