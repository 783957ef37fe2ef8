"""Selecting runs and reading their figures, for comparison, history and reports.

One run's figures for comparison are its cluster-wide load phases (node ``'*'``) and,
when the probe phase ran, its capacity; the per-request samples back the significance
tests. Every selector takes the same ``target`` as ``write_run``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pandas as pd
from sqlalchemy import Engine, func, or_, select, update
from sqlalchemy.exc import SQLAlchemyError

from deploybench.store.db import open_store, redact
from deploybench.store.errors import StoreError
from deploybench.store.models import (
    CapacityStep,
    Cluster,
    LoadPhase,
    ModelArtifact,
    Run,
    Series,
    ServingConfig,
    Software,
    Workload,
)


class UnknownRuns(StoreError):
    """Run keys that are not in the store."""


class EmptySelection(StoreError):
    """A filter that matched no run."""


@dataclass(frozen=True)
class RunFilter:
    """Which runs: by key, or by model / inventory / time range / tags / series (all that are given)."""

    run_keys: tuple[str, ...] = ()
    model: str | None = None
    inventory: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    tags: dict[str, str] = field(default_factory=dict)
    series: str | None = None  # a series fingerprint, or a prefix of it (at least 8 characters)
    status: str | None = "success"
    include_excluded: bool = False

    def describe(self) -> str:
        parts = [f"{k}={v!r}" for k, v in self.__dict__.items() if v not in (None, (), {}, False)]
        return ", ".join(parts) or "no filter"


RUN_COLUMNS = ("run_key", "dag_id", "airflow_run_id", "status", "started_at", "finished_at", "inventory",
               "node_count", "tags", "trigger", "excluded", "exclude_reason", "series_id", "config", "logical_date")


def run_order():
    """Where a run stands in time: its Airflow logical date (a backfilled run stands for that date), else when
    it started (a CLI run). Series, history and pages order runs by this, never by the wall clock alone."""
    return func.coalesce(Run.logical_date, Run.started_at)


def _engine_query(engine: Engine, what: str, fn):
    try:
        with engine.connect() as conn:
            return fn(conn)
    except SQLAlchemyError as exc:
        raise StoreError(f"reading {what} from {redact(str(engine.url))} failed: {exc}") from exc


def select_runs(target: Engine | str | None, flt: RunFilter) -> pd.DataFrame:
    """One row per selected run (RUN_COLUMNS + series fingerprint, model, workload hash), oldest first by
    ``run_order`` (logical date, else start), with that time as column ``order_at``.

    Run keys that are not stored raise UnknownRuns naming them; a filter matching nothing
    raises EmptySelection naming the filter.
    """
    engine = open_store(target)
    cols = [getattr(Run, c) for c in RUN_COLUMNS]
    query = (
        select(*cols, run_order().label("order_at"), Series.fingerprint.label("series"),
               ModelArtifact.name.label("model"), Workload.hash.label("workload"), ServingConfig.attrs.label("serving"),
               Cluster.name.label("cluster"),
               Software.engine.label("engine"))
        .outerjoin(Series, Series.id == Run.series_id)
        .outerjoin(ModelArtifact, ModelArtifact.id == Series.model_id)
        .outerjoin(Workload, Workload.id == Series.workload_id)
        .outerjoin(ServingConfig, ServingConfig.id == Series.serving_id)
        .outerjoin(Cluster, Cluster.id == Series.cluster_id)
        .outerjoin(Software, Software.id == Series.software_id)
    )
    if flt.run_keys:
        query = query.where(Run.run_key.in_(flt.run_keys))
    else:
        if flt.status:
            query = query.where(Run.status == flt.status)
        if not flt.include_excluded:
            query = query.where(Run.excluded.is_(False))
        if flt.model:
            query = query.where(ModelArtifact.name == flt.model)
        if flt.inventory:  # the inventory's name or its path
            query = query.where(or_(Cluster.name == flt.inventory, Run.inventory == flt.inventory))
        if flt.since:
            query = query.where(Run.started_at >= flt.since)
        if flt.until:
            query = query.where(Run.started_at < flt.until)
        if flt.tags:
            query = query.where(Run.tags.contains(flt.tags))
        if flt.series:  # a literal prefix: '%', '_' (and the escape character) match only themselves
            query = query.where(Series.fingerprint.startswith(flt.series, autoescape=True))
    query = query.order_by(run_order(), Run.run_key)
    frame = _engine_query(engine, "runs", lambda c: pd.DataFrame(c.execute(query).mappings().all()))
    if flt.run_keys:
        missing = [k for k in flt.run_keys if frame.empty or k not in set(frame["run_key"])]
        if missing:
            raise UnknownRuns(f"unknown run id(s): {', '.join(missing)}; "
                              "list stored runs with `deploybench store runs`")
        frame = frame.set_index("run_key").loc[list(dict.fromkeys(flt.run_keys))].reset_index()
    elif frame.empty:
        raise EmptySelection(f"no stored run matches {flt.describe()}; widen the filter or list runs with "
                             f"`deploybench store runs`")
    return frame


def phase_figures(target: Engine | str | None, run_keys: list[str]) -> pd.DataFrame:
    """Cluster-wide load-phase aggregates (node '*') of these runs, one row per run and phase."""
    engine = open_store(target)
    query = select(LoadPhase).where(LoadPhase.run_key.in_(run_keys), LoadPhase.node == "*")
    return _engine_query(engine, "load phases", lambda c: pd.read_sql(query, c))


def node_figures(target: Engine | str | None, run_key: str) -> pd.DataFrame:
    engine = open_store(target)
    query = select(LoadPhase).where(LoadPhase.run_key == run_key, LoadPhase.node != "*").order_by(LoadPhase.node)
    return _engine_query(engine, "per-node figures", lambda c: pd.read_sql(query, c))


def capacity_figures(target: Engine | str | None, run_keys: list[str]) -> pd.DataFrame:
    """Capacity-search steps of these runs (empty when no probe phase was stored)."""
    engine = open_store(target)
    query = select(CapacityStep).where(CapacityStep.run_key.in_(run_keys)).order_by(CapacityStep.run_key,
                                                                                    CapacityStep.step)
    return _engine_query(engine, "capacity steps", lambda c: pd.read_sql(query, c))


def table(target: Engine | str | None, model: Any, run_key: str) -> pd.DataFrame:
    """All rows of one fact table (PreflightLink, FanoutNode, RolloutStep, ...) for a run."""
    engine = open_store(target)
    query = select(model).where(model.run_key == run_key).order_by(model.id)
    return _engine_query(engine, model.__tablename__, lambda c: pd.read_sql(query, c))


def set_excluded(target: Engine | str | None, run_key: str, excluded: bool, reason: str | None = None) -> None:
    """Flag a run as excluded from analysis (with the reason), or include it again."""
    if excluded and not (reason or "").strip():
        raise StoreError(f"excluding run {run_key!r} needs a reason (e.g. 'node n03 was throttling')")
    engine = open_store(target)
    try:
        with engine.begin() as conn:
            n = conn.execute(update(Run).where(Run.run_key == run_key)
                             .values(excluded=excluded, exclude_reason=reason if excluded else None)).rowcount
    except SQLAlchemyError as exc:
        raise StoreError(f"flagging run {run_key!r} failed: {exc}") from exc
    if n == 0:
        raise UnknownRuns(f"unknown run id: {run_key}; list stored runs with `deploybench store runs`")


def series_of(target: Engine | str | None, run_key: str) -> tuple[int, str]:
    """(series id, fingerprint) of a stored run; StoreError if it has no series."""
    engine = open_store(target)
    query = select(Run.series_id, Series.fingerprint).outerjoin(Series, Series.id == Run.series_id).where(
        Run.run_key == run_key)
    row = _engine_query(engine, f"run {run_key!r}", lambda c: c.execute(query).first())
    if row is None:
        raise UnknownRuns(f"unknown run id: {run_key}; list stored runs with `deploybench store runs`")
    if row[0] is None:
        raise StoreError(f"run {run_key!r} has no series (stored without identities); store it again to add them")
    return int(row[0]), str(row[1])
