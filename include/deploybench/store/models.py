"""SQLAlchemy models of the results store.

The migrations in ``migrations/versions`` are the source of truth for the schema;
these models describe the same tables for queries and for the test that checks that
models and migrations agree (``alembic.autogenerate.compare_metadata`` on a migrated
database must find nothing). Change both together: a new column is a new migration
plus the same column here.

Every constraint and index has a name from ``NAMING_CONVENTION``, so a later migration
can drop or alter it by a name that is the same on every database.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# alembic's bookkeeping table; not "alembic_version", so that a DSN pointed by mistake at a
# database another alembic project uses (Airflow's metadata DB) fails on our tables, not theirs
VERSION_TABLE = "deploybench_alembic_version"

RUN_STATUSES = ("success", "failed", "running")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _ts(nullable: bool = False, **kw: Any) -> Any:
    return mapped_column(DateTime(timezone=True), nullable=nullable, **kw)


def _fk_run() -> Any:
    return mapped_column(Text, ForeignKey("runs.run_key", ondelete="CASCADE"), nullable=False)


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        CheckConstraint(f"status IN {RUN_STATUSES!r}", name="status"),
        Index(None, "fingerprint"),
        Index(None, "started_at"),
        Index(None, "series_id", "started_at"),
        Index(None, "series_id", "logical_date"),
    )

    run_key: Mapped[str] = mapped_column(Text, primary_key=True)
    dag_id: Mapped[str] = mapped_column(Text, nullable=False)
    airflow_run_id: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(Text, nullable=False)
    started_at: Mapped[datetime] = _ts()
    finished_at: Mapped[datetime | None] = _ts(nullable=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default=text("'{}'::jsonb"))
    fingerprint: Mapped[str] = mapped_column(Text, nullable=False)
    inventory: Mapped[str] = mapped_column(Text, nullable=False)
    node_count: Mapped[int] = mapped_column(Integer, nullable=False)
    tags: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default=text("'{}'::jsonb"))
    created_at: Mapped[datetime] = _ts(server_default=text("now()"))
    updated_at: Mapped[datetime] = _ts(server_default=text("now()"))
    # revision 0002
    trigger: Mapped[str | None] = mapped_column(Text)  # manual | scheduled | backfill | asset | cli | ...
    series_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("series.id", ondelete="SET NULL"))
    excluded: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    exclude_reason: Mapped[str | None] = mapped_column(Text)
    # revision 0004: the Airflow logical date (a backfilled run stands for that date); history orders by it
    logical_date: Mapped[datetime | None] = _ts(nullable=True)


class StageResult(Base):
    __tablename__ = "stage_results"
    __table_args__ = (UniqueConstraint("run_key", "stage"),)

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    run_key: Mapped[str] = _fk_run()
    stage: Mapped[str] = mapped_column(Text, nullable=False)
    status: Mapped[str] = mapped_column(Text, nullable=False)
    started_at: Mapped[datetime | None] = _ts(nullable=True)
    seconds: Mapped[float | None] = mapped_column(Double)
    summary: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default=text("'{}'::jsonb"))
    error: Mapped[str | None] = mapped_column(Text)


class LoadPhase(Base):
    __tablename__ = "load_phases"
    __table_args__ = (UniqueConstraint("run_key", "phase", "node"),)

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    run_key: Mapped[str] = _fk_run()
    phase: Mapped[str] = mapped_column(Text, nullable=False)
    node: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("'*'"))
    offered_rps: Mapped[float] = mapped_column(Double, nullable=False)
    achieved_rps: Mapped[float] = mapped_column(Double, nullable=False)
    output_tps: Mapped[float] = mapped_column(Double, nullable=False)
    requests: Mapped[int] = mapped_column(BigInteger, nullable=False)
    errors: Mapped[int] = mapped_column(BigInteger, nullable=False)
    error_rate: Mapped[float] = mapped_column(Double, nullable=False)
    dropped_iterations: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    latency_p50_ms: Mapped[float | None] = mapped_column(Double)
    latency_p90_ms: Mapped[float | None] = mapped_column(Double)
    latency_p99_ms: Mapped[float | None] = mapped_column(Double)
    latency_p999_ms: Mapped[float | None] = mapped_column(Double)
    ttft_p50_ms: Mapped[float | None] = mapped_column(Double)
    ttft_p99_ms: Mapped[float | None] = mapped_column(Double)
    duration_s: Mapped[float] = mapped_column(Double, nullable=False)
    started_at: Mapped[datetime] = _ts()
    # migration 0007: the engine's prefix-cache hit rate and the GPUs' energy per output token (absent: not measured)
    prefix_hit_rate: Mapped[float | None] = mapped_column(Double)
    energy_per_output_token_j: Mapped[float | None] = mapped_column(Double)
    energy_per_request_j: Mapped[float | None] = mapped_column(Double)  # migration 0011: the same energy per answer
    # migration 0008_cost: the serving nodes' price per million output tokens, in its currency (absent: not priced)
    cost_per_million_output_tokens: Mapped[float | None] = mapped_column(Double)
    cost_currency: Mapped[str | None] = mapped_column(Text)
    # migration 0012_spike: the spike phase's recovery and scale-up times (absent: not a spike, or not measured)
    spike_recovery_s: Mapped[float | None] = mapped_column(Double)
    spike_recovery_reason: Mapped[str | None] = mapped_column(Text)
    scale_up_serving_s: Mapped[float | None] = mapped_column(Double)
    scale_up_slo_s: Mapped[float | None] = mapped_column(Double)
    scale_up: Mapped[bool | None] = mapped_column(Boolean)


class RequestSample(Base):
    """One request as the load generator saw it; written with COPY, read for distributions."""

    __tablename__ = "request_samples"
    __table_args__ = (Index(None, "run_key", "phase"),)

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    run_key: Mapped[str] = _fk_run()
    phase: Mapped[str] = mapped_column(Text, nullable=False)
    node: Mapped[str] = mapped_column(Text, nullable=False)
    ts: Mapped[datetime] = _ts()
    status: Mapped[int] = mapped_column(Integer, nullable=False)
    error_kind: Mapped[str | None] = mapped_column(Text)
    latency_ms: Mapped[float] = mapped_column(Double, nullable=False)
    ttft_ms: Mapped[float | None] = mapped_column(Double)
    prompt_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    output_tokens: Mapped[int] = mapped_column(Integer, nullable=False)


# -- revision 0002: identities, series, facts of every stage, analysis written back -----------------
def _id_col() -> Any:
    return mapped_column(BigInteger, Identity(), primary_key=True)


def _jsonb(default: str = "'{}'::jsonb") -> Any:
    return mapped_column(JSONB, nullable=False, server_default=text(default))


class _IdentityMixin:
    """An identity row: unique on the canonical hash of ``attrs`` (deploybench.store.identity)."""

    id: Mapped[int] = _id_col()
    hash: Mapped[str] = mapped_column(Text, nullable=False, unique=True)
    attrs: Mapped[dict[str, Any]] = _jsonb()
    created_at: Mapped[datetime] = _ts(server_default=text("now()"))


class Cluster(_IdentityMixin, Base):
    __tablename__ = "clusters"

    name: Mapped[str] = mapped_column(Text, nullable=False)
    node_count: Mapped[int] = mapped_column(Integer, nullable=False)


class Software(_IdentityMixin, Base):
    __tablename__ = "software"

    engine: Mapped[str] = mapped_column(Text, nullable=False)
    image: Mapped[str | None] = mapped_column(Text)
    version: Mapped[str | None] = mapped_column(Text)


class ModelArtifact(_IdentityMixin, Base):
    __tablename__ = "model_artifacts"

    name: Mapped[str] = mapped_column(Text, nullable=False)
    manifest_digest: Mapped[str | None] = mapped_column(Text)
    total_bytes: Mapped[int | None] = mapped_column(BigInteger)
    files: Mapped[list[Any]] = _jsonb("'[]'::jsonb")


class ServingConfig(_IdentityMixin, Base):
    __tablename__ = "serving_configs"


class Workload(_IdentityMixin, Base):
    __tablename__ = "workloads"


def _fk(table: str, ondelete: str = "RESTRICT", nullable: bool = False) -> Any:
    return mapped_column(BigInteger, ForeignKey(f"{table}.id", ondelete=ondelete), nullable=nullable)


class Series(Base):
    """Results of the same thing: one row per combination of the five identities."""

    __tablename__ = "series"

    id: Mapped[int] = _id_col()
    fingerprint: Mapped[str] = mapped_column(Text, nullable=False, unique=True)
    cluster_id: Mapped[int] = _fk("clusters")
    software_id: Mapped[int] = _fk("software")
    model_id: Mapped[int] = _fk("model_artifacts")
    serving_id: Mapped[int] = _fk("serving_configs")
    workload_id: Mapped[int] = _fk("workloads")
    created_at: Mapped[datetime] = _ts(server_default=text("now()"))


class PreflightNode(Base):
    __tablename__ = "preflight_nodes"
    __table_args__ = (UniqueConstraint("run_key", "node"),)

    id: Mapped[int] = _id_col()
    run_key: Mapped[str] = _fk_run()
    node: Mapped[str] = mapped_column(Text, nullable=False)
    ok: Mapped[bool] = mapped_column(Boolean, nullable=False)
    reasons: Mapped[list[Any]] = _jsonb("'[]'::jsonb")
    facts: Mapped[dict[str, Any]] = _jsonb()


class PreflightLink(Base):
    __tablename__ = "preflight_links"
    __table_args__ = (UniqueConstraint("run_key", "src", "dst", "round"),)

    id: Mapped[int] = _id_col()
    run_key: Mapped[str] = _fk_run()
    src: Mapped[str] = mapped_column(Text, nullable=False)
    dst: Mapped[str] = mapped_column(Text, nullable=False)
    round: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    nominal_mbit: Mapped[float] = mapped_column(Double, nullable=False)
    mbit: Mapped[float | None] = mapped_column(Double)
    ratio: Mapped[float | None] = mapped_column(Double)
    retransmits: Mapped[int | None] = mapped_column(BigInteger)
    rtt_ms: Mapped[float | None] = mapped_column(Double)
    ok: Mapped[bool] = mapped_column(Boolean, nullable=False)
    error: Mapped[str | None] = mapped_column(Text)
    directions: Mapped[list[Any]] = _jsonb("'[]'::jsonb")  # bidirectional tests: [{src, dst, mbit, ratio, ...}]
    # migration 0006: the fabric (parallel streams, ping's RTT and jitter, the RDMA path)
    streams: Mapped[int | None] = mapped_column(Integer)
    latency_ms: Mapped[float | None] = mapped_column(Double)
    jitter_ms: Mapped[float | None] = mapped_column(Double)
    ping_loss: Mapped[float | None] = mapped_column(Double)
    problems: Mapped[list[Any]] = _jsonb("'[]'::jsonb")
    notes: Mapped[list[Any]] = _jsonb("'[]'::jsonb")
    rdma: Mapped[dict[str, Any] | None] = mapped_column(JSONB)


class FanoutNode(Base):
    __tablename__ = "fanout_nodes"
    __table_args__ = (UniqueConstraint("run_key", "node"),)

    id: Mapped[int] = _id_col()
    run_key: Mapped[str] = _fk_run()
    node: Mapped[str] = mapped_column(Text, nullable=False)
    status: Mapped[str] = mapped_column(Text, nullable=False)
    bytes: Mapped[int] = mapped_column(BigInteger, nullable=False)
    seconds: Mapped[float] = mapped_column(Double, nullable=False)
    verified: Mapped[bool] = mapped_column(Boolean, nullable=False)
    started_s: Mapped[float] = mapped_column(Double, nullable=False, server_default=text("0"))
    error: Mapped[str | None] = mapped_column(Text)


class RolloutStep(Base):
    __tablename__ = "rollout_steps"
    __table_args__ = (UniqueConstraint("run_key", "step"),)

    id: Mapped[int] = _id_col()
    run_key: Mapped[str] = _fk_run()
    step: Mapped[int] = mapped_column(Integer, nullable=False)
    nodes: Mapped[int] = mapped_column(Integer, nullable=False)
    added: Mapped[list[Any]] = _jsonb("'[]'::jsonb")
    ready_s: Mapped[dict[str, Any]] = _jsonb()
    smoke: Mapped[dict[str, Any]] = _jsonb()
    seconds: Mapped[float] = mapped_column(Double, nullable=False)


class CapacityStep(Base):
    """One step of the probe phase's capacity search."""

    __tablename__ = "capacity_steps"
    __table_args__ = (UniqueConstraint("run_key", "step"),)

    id: Mapped[int] = _id_col()
    run_key: Mapped[str] = _fk_run()
    step: Mapped[int] = mapped_column(Integer, nullable=False)
    offered_rps: Mapped[float] = mapped_column(Double, nullable=False)
    achieved_rps: Mapped[float | None] = mapped_column(Double)
    latency_p99_ms: Mapped[float | None] = mapped_column(Double)
    ttft_p99_ms: Mapped[float | None] = mapped_column(Double)
    error_rate: Mapped[float | None] = mapped_column(Double)
    dropped_iterations: Mapped[int | None] = mapped_column(BigInteger)
    slo_ok: Mapped[bool] = mapped_column(Boolean, nullable=False)
    detail: Mapped[dict[str, Any]] = _jsonb()


class NodeWindow(Base):
    """One node's figure over one load window (a phase, or a probe step) from one source (migration 0009):
    ``mean``/``max`` NULL when absent, ``reason`` says why."""

    __tablename__ = "node_windows"
    __table_args__ = (UniqueConstraint("run_key", "phase", "step", "node", "metric", "source"),)

    id: Mapped[int] = _id_col()
    run_key: Mapped[str] = _fk_run()
    phase: Mapped[str] = mapped_column(Text, nullable=False)
    step: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    node: Mapped[str] = mapped_column(Text, nullable=False)
    metric: Mapped[str] = mapped_column(Text, nullable=False)
    source: Mapped[str] = mapped_column(Text, nullable=False)
    unit: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))
    mean: Mapped[float | None] = mapped_column(Double)
    max: Mapped[float | None] = mapped_column(Double)
    samples: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    reason: Mapped[str | None] = mapped_column(Text)


class Finding(Base):
    """One finding of a run (migration 0010, deploybench.analyse.findings): a rule that fired, with its evidence."""

    __tablename__ = "findings"
    __table_args__ = (Index(None, "run_key"), Index(None, "rule", "node"))

    id: Mapped[int] = _id_col()
    run_key: Mapped[str] = _fk_run()
    rule: Mapped[str] = mapped_column(Text, nullable=False)
    node: Mapped[str | None] = mapped_column(Text)  # None: the whole cluster
    metric: Mapped[str] = mapped_column(Text, nullable=False)
    phase: Mapped[str] = mapped_column(Text, nullable=False)
    step: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    window_start: Mapped[datetime | None] = _ts(nullable=True)
    window_end: Mapped[datetime | None] = _ts(nullable=True)
    observed: Mapped[float | None] = mapped_column(Double)
    expected: Mapped[float | None] = mapped_column(Double)
    evidence: Mapped[str] = mapped_column(Text, nullable=False)
    advice: Mapped[str] = mapped_column(Text, nullable=False)
    detail: Mapped[dict[str, Any]] = _jsonb()


class ServerMetric(Base):
    """One scraped point of an engine's /metrics series (written with COPY, like the samples)."""

    __tablename__ = "server_metrics"
    __table_args__ = (Index(None, "run_key", "metric"),)

    id: Mapped[int] = _id_col()
    run_key: Mapped[str] = _fk_run()
    phase: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))
    node: Mapped[str] = mapped_column(Text, nullable=False)
    metric: Mapped[str] = mapped_column(Text, nullable=False)
    labels: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))
    ts: Mapped[datetime] = _ts()
    value: Mapped[float] = mapped_column(Double, nullable=False)


class Comparison(Base):
    """A comparison as it was made: the runs, the baseline, the parameters and what came out."""

    __tablename__ = "comparisons"
    __table_args__ = (Index(None, "created_at"),)

    id: Mapped[int] = _id_col()
    created_at: Mapped[datetime] = _ts(server_default=text("now()"))
    run_keys: Mapped[list[Any]] = _jsonb("'[]'::jsonb")
    baseline_run_key: Mapped[str | None] = mapped_column(Text)
    method: Mapped[str] = mapped_column(Text, nullable=False)
    params: Mapped[dict[str, Any]] = _jsonb()
    result: Mapped[dict[str, Any]] = _jsonb()


class ChangePoint(Base):
    """A change in one metric of one series, at ``run_key`` (the first run after the change)."""

    __tablename__ = "change_points"
    __table_args__ = (UniqueConstraint("series_id", "metric", "run_key", "method"), Index(None, "series_id", "metric"))

    id: Mapped[int] = _id_col()
    series_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("series.id", ondelete="CASCADE"), nullable=False)
    metric: Mapped[str] = mapped_column(Text, nullable=False)
    run_key: Mapped[str] = _fk_run()
    method: Mapped[str] = mapped_column(Text, nullable=False)
    params: Mapped[dict[str, Any]] = _jsonb()
    direction: Mapped[str] = mapped_column(Text, nullable=False)
    mean_before: Mapped[float] = mapped_column(Double, nullable=False)
    mean_after: Mapped[float] = mapped_column(Double, nullable=False)
    magnitude: Mapped[float] = mapped_column(Double, nullable=False)
    p_value: Mapped[float | None] = mapped_column(Double)
    detected_at: Mapped[datetime] = _ts(server_default=text("now()"))


class Verdict(Base):
    """The history's verdict on one run for one metric: regression, improvement, no change or suspect (0004)."""

    __tablename__ = "verdicts"
    __table_args__ = (
        UniqueConstraint("run_key", "metric", "method"),
        CheckConstraint("verdict IN ('regression', 'improvement', 'no change', 'suspect')", name="verdict"),
    )

    id: Mapped[int] = _id_col()
    series_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("series.id", ondelete="CASCADE"), nullable=False)
    run_key: Mapped[str] = _fk_run()
    metric: Mapped[str] = mapped_column(Text, nullable=False)
    method: Mapped[str] = mapped_column(Text, nullable=False)
    params: Mapped[dict[str, Any]] = _jsonb()
    verdict: Mapped[str] = mapped_column(Text, nullable=False)
    magnitude: Mapped[float | None] = mapped_column(Double)
    p_value: Mapped[float | None] = mapped_column(Double)
    created_at: Mapped[datetime] = _ts(server_default=text("now()"))


# -- the cluster lease (migration 0003; deploybench.lease) -------------------------------------------
LEASE_EVENTS = ("acquired", "released", "taken_over", "broken", "recovered", "lost")


class ClusterLease(Base):
    """Which run holds a cluster (NULL holder: free); expires when its heartbeat stops."""

    __tablename__ = "cluster_leases"
    __table_args__ = (CheckConstraint("holder IS NULL OR expires_at IS NOT NULL", name="expiry"),)

    cluster: Mapped[str] = mapped_column(Text, primary_key=True)
    holder: Mapped[str | None] = mapped_column(Text)
    dag_id: Mapped[str | None] = mapped_column(Text)
    host: Mapped[str | None] = mapped_column(Text)
    pid: Mapped[int | None] = mapped_column(Integer)
    acquired_at: Mapped[datetime | None] = _ts(nullable=True)
    heartbeat_at: Mapped[datetime | None] = _ts(nullable=True)
    expires_at: Mapped[datetime | None] = _ts(nullable=True)
    ttl_s: Mapped[float | None] = mapped_column(Double)
    pending_cleanup: Mapped[list[dict[str, Any]]] = mapped_column(JSONB, nullable=False,
                                                                   server_default=text("'[]'::jsonb"))
    updated_at: Mapped[datetime] = _ts(server_default=text("now()"))


class LeaseWaiter(Base):
    """A run waiting for a cluster's lease (migration 0005): the oldest live waiter is served first."""

    __tablename__ = "lease_waiters"

    cluster: Mapped[str] = mapped_column(Text, primary_key=True)
    run_key: Mapped[str] = mapped_column(Text, primary_key=True)
    dag_id: Mapped[str | None] = mapped_column(Text)
    since: Mapped[datetime] = _ts(server_default=text("now()"))
    seen_at: Mapped[datetime] = _ts(server_default=text("now()"))


class LeaseEvent(Base):
    """What happened to a cluster's lease, and what a run cleaned up after a dead one."""

    __tablename__ = "lease_events"
    __table_args__ = (CheckConstraint(f"event IN {LEASE_EVENTS!r}", name="event"), Index(None, "cluster", "at"),
                      Index(None, "run_key"))

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    cluster: Mapped[str] = mapped_column(Text, nullable=False)
    event: Mapped[str] = mapped_column(Text, nullable=False)
    run_key: Mapped[str | None] = mapped_column(Text)
    detail: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default=text("'{}'::jsonb"))
    at: Mapped[datetime] = _ts(server_default=text("now()"))


# -- a run's folder, for executors whose workers share no disk (migration 0013_run_files; deploybench.store.run_files)
class RunFile(Base):
    """One file of a run folder: its path relative to the folder, sha256, size and content."""

    __tablename__ = "run_files"

    run_key: Mapped[str] = mapped_column(Text, primary_key=True)
    path: Mapped[str] = mapped_column(Text, primary_key=True)
    sha256: Mapped[str] = mapped_column(Text, nullable=False)
    size: Mapped[int] = mapped_column(BigInteger, nullable=False)
    content: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    updated_at: Mapped[datetime] = _ts(server_default=text("now()"))
