"""Reading runs back: small helpers for the report, the CLI and the tests.

They take the same ``target`` as ``write_run`` (Engine, DSN, or None for the default)
and return the records the writer took, so what goes in can be compared with what
comes out.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from sqlalchemy import Engine, func, select
from sqlalchemy.exc import SQLAlchemyError

from deploybench.store.db import open_store, redact
from deploybench.store.errors import StoreError
from deploybench.store.facts import FindingRow, NodeWindowRow
from deploybench.store.models import Finding, LoadPhase, NodeWindow, RequestSample, Run, Series, StageResult
from deploybench.store.rows import SAMPLE_COLUMNS, PhaseRecord, RunRecord, StageRow, StoredRun

_RUN_FIELDS = tuple(RunRecord.model_fields)
_STAGE_FIELDS = tuple(StageRow.model_fields)
_PHASE_FIELDS = tuple(PhaseRecord.model_fields)
_FINDING_FIELDS = tuple(FindingRow.model_fields)


def _cols(model: Any, names: tuple[str, ...]) -> list[Any]:
    return [getattr(model, n) for n in names]


def _run(rowmap: Any) -> RunRecord:
    return RunRecord(**{k: rowmap[k] for k in _RUN_FIELDS})


def _fail(engine: Engine, what: str, exc: Exception) -> StoreError:
    return StoreError(f"reading {what} from {redact(str(engine.url))} failed: {exc}")


def load_run(target: Engine | str | None, run_key: str) -> StoredRun | None:
    """The run with its stages (in stage-name order of writing) and phases, or None if it is not stored."""
    engine = open_store(target)
    try:
        with engine.connect() as conn:
            row = conn.execute(
                select(*_cols(Run, _RUN_FIELDS), Run.created_at, Run.updated_at, Run.series_id, Run.excluded,
                       Run.exclude_reason, Series.fingerprint.label("series_fingerprint"))
                .outerjoin(Series, Series.id == Run.series_id).where(Run.run_key == run_key)
            ).mappings().first()
            if row is None:
                return None
            stages = conn.execute(
                select(*_cols(StageResult, _STAGE_FIELDS)).where(StageResult.run_key == run_key)
                .order_by(StageResult.id)
            ).mappings().all()
            phases = conn.execute(
                select(*_cols(LoadPhase, _PHASE_FIELDS)).where(LoadPhase.run_key == run_key)
                .order_by(LoadPhase.id)
            ).mappings().all()
            n = conn.execute(
                select(func.count()).select_from(RequestSample).where(RequestSample.run_key == run_key)
            ).scalar_one()
            windows = conn.execute(
                select(*_cols(NodeWindow, tuple(NodeWindowRow.model_fields))).where(NodeWindow.run_key == run_key)
                .order_by(NodeWindow.phase, NodeWindow.step, NodeWindow.node, NodeWindow.metric, NodeWindow.source)
            ).mappings().all()
            found = conn.execute(
                select(*_cols(Finding, _FINDING_FIELDS)).where(Finding.run_key == run_key).order_by(Finding.id)
            ).mappings().all()
    except SQLAlchemyError as exc:
        raise _fail(engine, f"run {run_key!r}", exc) from exc
    return StoredRun(
        run=_run(row),
        stages=[StageRow(**dict(s)) for s in stages],
        phases=[PhaseRecord(**dict(p)) for p in phases],
        sample_count=n,
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        series_id=row["series_id"],
        series_fingerprint=row["series_fingerprint"],
        excluded=row["excluded"],
        exclude_reason=row["exclude_reason"],
        node_windows=[NodeWindowRow(**dict(w)) for w in windows],
        findings=[FindingRow(**dict(f)) for f in found],
    )


def count_samples(target: Engine | str | None, run_key: str, phase: str | None = None) -> int:
    """How many raw samples the run has (in one phase, if given)."""
    engine = open_store(target)
    query = select(func.count()).select_from(RequestSample).where(RequestSample.run_key == run_key)
    if phase is not None:
        query = query.where(RequestSample.phase == phase)
    try:
        with engine.connect() as conn:
            return int(conn.execute(query).scalar_one())
    except SQLAlchemyError as exc:
        raise _fail(engine, f"sample count of run {run_key!r}", exc) from exc


def latest_runs(target: Engine | str | None, limit: int = 20) -> list[RunRecord]:
    """The most recently started runs, newest first."""
    engine = open_store(target)
    query = select(*_cols(Run, _RUN_FIELDS)).order_by(Run.started_at.desc(), Run.run_key).limit(limit)
    try:
        with engine.connect() as conn:
            return [_run(r) for r in conn.execute(query).mappings()]
    except SQLAlchemyError as exc:
        raise _fail(engine, "the latest runs", exc) from exc


def load_samples(target: Engine | str | None, run_key: str, phase: str | None = None) -> pd.DataFrame:
    """The raw samples of a run (one phase, if given) in the writer's column layout, ordered by ts."""
    engine = open_store(target)
    query = select(*_cols(RequestSample, SAMPLE_COLUMNS)).where(RequestSample.run_key == run_key)
    if phase is not None:
        query = query.where(RequestSample.phase == phase)
    try:
        with engine.connect() as conn:
            rows = conn.execute(query.order_by(RequestSample.ts, RequestSample.id)).all()
    except SQLAlchemyError as exc:
        raise _fail(engine, f"samples of run {run_key!r}", exc) from exc
    frame = pd.DataFrame(rows, columns=list(SAMPLE_COLUMNS))
    frame["ts"] = pd.to_datetime(frame["ts"], utc=True)
    return frame
