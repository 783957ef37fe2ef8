"""The part of ``write_run`` that stores identities, the series and the stage facts.

Runs inside the writer's transaction (``conn`` is its SQLAlchemy connection): identity
rows are upserted on their hash and their ids returned either way, the series is upserted
on its fingerprint, and the run's fact rows are deleted and inserted again, like its
stages. Server metrics go in with binary COPY, like the request samples.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import psycopg
from sqlalchemy import Connection, delete, insert, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from deploybench.store.errors import StoreError
from deploybench.store.facts import METRIC_COLUMNS, RunFacts
from deploybench.store.identity import RunIdentity
from deploybench.store.models import (
    CapacityStep,
    Cluster,
    FanoutNode,
    Finding,
    ModelArtifact,
    NodeWindow,
    PreflightLink,
    PreflightNode,
    RolloutStep,
    Run,
    Series,
    ServerMetric,
    ServingConfig,
    Software,
    Workload,
)

FACT_MODELS = (PreflightNode, PreflightLink, FanoutNode, RolloutStep, CapacityStep, NodeWindow, ServerMetric,
               Finding)
_IDENTITY_MODELS: dict[str, type[Cluster | Software | ModelArtifact | ServingConfig | Workload]] = {
    "cluster": Cluster, "software": Software, "model": ModelArtifact, "serving": ServingConfig, "workload": Workload,
}
_SERIES_COLUMNS = {"cluster": "cluster_id", "software": "software_id", "model": "model_id", "serving": "serving_id",
                   "workload": "workload_id"}
_COPY_SQL = (f"COPY {ServerMetric.__tablename__} (run_key, {', '.join(METRIC_COLUMNS)}) "
             "FROM STDIN WITH (FORMAT binary)")
_COPY_TYPES = ("text", "timestamptz", "text", "text", "text", "text", "float8")
_FACT_LISTS: dict[str, type[PreflightNode | PreflightLink | FanoutNode | RolloutStep | CapacityStep | Finding]] = {
    "preflight_nodes": PreflightNode, "preflight_links": PreflightLink, "fanout_nodes": FanoutNode,
    "rollout_steps": RolloutStep, "capacity_steps": CapacityStep, "findings": Finding,
}


def upsert_series(conn: Connection, identity: RunIdentity) -> int:
    """The series id for these identities, creating the identity and series rows that are new."""
    ids: dict[str, int] = {}
    for kind, model in _IDENTITY_MODELS.items():
        ident = getattr(identity, kind)
        stmt = pg_insert(model).values(hash=ident.hash, attrs=ident.attrs, **ident.columns)
        # DO UPDATE (a no-op) rather than DO NOTHING, so RETURNING yields the id of an existing row too
        stmt = stmt.on_conflict_do_update(index_elements=[model.hash], set_={"hash": stmt.excluded.hash})
        ids[_SERIES_COLUMNS[kind]] = conn.execute(stmt.returning(model.id)).scalar_one()
    stmt = pg_insert(Series).values(fingerprint=identity.fingerprint, **ids)
    stmt = stmt.on_conflict_do_update(index_elements=[Series.fingerprint],
                                      set_={"fingerprint": stmt.excluded.fingerprint})
    return conn.execute(stmt.returning(Series.id)).scalar_one()


def prepare_metrics(source: pd.DataFrame | str | Path) -> pd.DataFrame:
    """Server-metric points as a frame in METRIC_COLUMNS order; StoreError naming what is wrong.

    Accepts a DataFrame or a .csv[.gz] / .jsonl / .ndjson[.gz] file with columns ts, node,
    metric, value and optionally phase and labels (a string, or a dict made canonical here).
    """
    if isinstance(source, pd.DataFrame):
        frame = source
    else:
        path = Path(source)
        if not path.is_file():
            raise StoreError(f"server metrics file {path} does not exist")
        name = path.name.lower().removesuffix(".gz")
        try:
            if name.endswith(".csv"):
                frame = pd.read_csv(path, dtype={"labels": str, "phase": str, "node": str}, keep_default_na=False)
            elif name.endswith((".jsonl", ".ndjson")):
                frame = pd.read_json(path, lines=True, dtype={"labels": object, "phase": str, "node": str})
            else:
                raise StoreError(f"server metrics file {path}: unknown format; use .csv, .jsonl or .ndjson")
        except (ValueError, OSError) as exc:
            raise StoreError(f"could not read server metrics file {path}: {exc}") from exc
    missing = [c for c in ("ts", "node", "metric", "value") if c not in frame.columns]
    if missing:
        raise StoreError(f"server metrics: missing columns {missing}; expected {list(METRIC_COLUMNS)}")
    out = pd.DataFrame(index=frame.index)
    ts = frame["ts"]
    if pd.api.types.is_numeric_dtype(ts):  # unix seconds
        out["ts"] = pd.to_datetime(ts, unit="s", utc=True)
    else:
        out["ts"] = pd.to_datetime(ts, utc=True, errors="coerce", format="ISO8601")
    out["phase"] = frame["phase"].fillna("").astype(str) if "phase" in frame else ""
    out["node"] = frame["node"].astype(str)
    out["metric"] = frame["metric"].astype(str)
    if "labels" in frame:
        out["labels"] = [_labels(v) for v in frame["labels"]]
    else:
        out["labels"] = ""
    out["value"] = pd.to_numeric(frame["value"], errors="coerce")
    for col in ("ts", "value"):
        bad = out[col].isna()
        if bad.any():
            row = int(bad.to_numpy().nonzero()[0][0])
            raise StoreError(f"server metrics: {int(bad.sum())} row(s) with no valid {col}; first at row {row} "
                             f"(value {frame[col].iloc[row]!r})")
    return out[list(METRIC_COLUMNS)]


def _labels(value: Any) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={value[k]}" for k in sorted(value))
    if value is None or (isinstance(value, float) and value != value):
        return ""
    return str(value)


def write_facts(conn: Connection, run_key: str, facts: RunFacts | None, metrics: pd.DataFrame | None) -> dict[str, int]:
    """Replace the run's fact rows (and link it to its series); counts per table."""
    for model in FACT_MODELS:
        conn.execute(delete(model).where(model.run_key == run_key))
    counts: dict[str, int] = {}
    if facts is None:
        return counts
    if facts.identity is not None:
        series_id = upsert_series(conn, facts.identity)
        conn.execute(update(Run).where(Run.run_key == run_key).values(series_id=series_id))
    for attr, model in _FACT_LISTS.items():
        rows = getattr(facts, attr)
        if rows:
            conn.execute(insert(model), [{"run_key": run_key, **r.model_dump()} for r in rows])
        counts[attr] = len(rows)
    counts["node_windows"] = upsert_node_windows(conn, run_key, facts.node_windows)
    if metrics is not None and len(metrics):
        raw = conn.connection.driver_connection
        if not isinstance(raw, psycopg.Connection):  # COPY is psycopg 3's (open_store's postgresql+psycopg)
            raise StoreError(f"server metrics: COPY needs a psycopg 3 connection, not {type(raw).__name__}")
        with raw.cursor() as cur, cur.copy(_COPY_SQL) as copy:
            copy.set_types(list(_COPY_TYPES))
            ts = list(metrics["ts"].dt.to_pydatetime())
            for row in zip(ts, *(metrics[c].tolist() for c in METRIC_COLUMNS[1:])):
                copy.write_row((run_key, *row))
    counts["server_metrics"] = 0 if metrics is None else len(metrics)
    return counts


UPSERT_BATCH = 2000  # rows per INSERT ... ON CONFLICT: 12 parameters each, 24,000 per statement


def upsert_node_windows(conn: Connection, run_key: str, rows: list[Any]) -> int:
    """UPSERT the run's per node, per window figures on (run, phase, step, node, metric, source): a retried store
    replaces a figure, never adds a second one."""
    values = [{"run_key": run_key, **r.model_dump()} for r in rows]
    for i in range(0, len(values), UPSERT_BATCH):  # one statement's parameters stay under PostgreSQL's 65,535
        stmt = pg_insert(NodeWindow).values(values[i:i + UPSERT_BATCH])
        stmt = stmt.on_conflict_do_update(
            index_elements=[NodeWindow.run_key, NodeWindow.phase, NodeWindow.step, NodeWindow.node,
                            NodeWindow.metric, NodeWindow.source],
            set_={c: stmt.excluded[c] for c in ("unit", "mean", "max", "samples", "reason")})
        conn.execute(stmt)
    return len(rows)


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str)
