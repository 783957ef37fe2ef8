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
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    Identity,
    Index,
    Integer,
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
