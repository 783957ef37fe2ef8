"""Initial schema: runs, stage_results, load_phases, request_samples.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

JSON_EMPTY = sa.text("'{}'::jsonb")


def _run_fk() -> sa.Column:
    return sa.Column("run_key", sa.Text(), sa.ForeignKey("runs.run_key", ondelete="CASCADE"), nullable=False)


def _id() -> sa.Column:
    return sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True)


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("run_key", sa.Text(), primary_key=True),
        sa.Column("dag_id", sa.Text(), nullable=False),
        sa.Column("airflow_run_id", sa.Text(), nullable=True),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("config", postgresql.JSONB(), nullable=False, server_default=JSON_EMPTY),
        sa.Column("fingerprint", sa.Text(), nullable=False),
        sa.Column("inventory", sa.Text(), nullable=False),
        sa.Column("node_count", sa.Integer(), nullable=False),
        sa.Column("tags", postgresql.JSONB(), nullable=False, server_default=JSON_EMPTY),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.CheckConstraint("status IN ('success', 'failed', 'running')", name=op.f("ck_runs_status")),
    )
    op.create_index(op.f("ix_runs_fingerprint"), "runs", ["fingerprint"])
    op.create_index(op.f("ix_runs_started_at"), "runs", ["started_at"])

    op.create_table(
        "stage_results",
        _id(),
        _run_fk(),
        sa.Column("stage", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("seconds", sa.Double(), nullable=True),
        sa.Column("summary", postgresql.JSONB(), nullable=False, server_default=JSON_EMPTY),
        sa.Column("error", sa.Text(), nullable=True),
        sa.UniqueConstraint("run_key", "stage", name=op.f("uq_stage_results_run_key_stage")),
    )

    op.create_table(
        "load_phases",
        _id(),
        _run_fk(),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("node", sa.Text(), nullable=False, server_default=sa.text("'*'")),
        sa.Column("offered_rps", sa.Double(), nullable=False),
        sa.Column("achieved_rps", sa.Double(), nullable=False),
        sa.Column("output_tps", sa.Double(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("errors", sa.BigInteger(), nullable=False),
        sa.Column("error_rate", sa.Double(), nullable=False),
        sa.Column("dropped_iterations", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column("latency_p50_ms", sa.Double(), nullable=True),
        sa.Column("latency_p90_ms", sa.Double(), nullable=True),
        sa.Column("latency_p99_ms", sa.Double(), nullable=True),
        sa.Column("latency_p999_ms", sa.Double(), nullable=True),
        sa.Column("ttft_p50_ms", sa.Double(), nullable=True),
        sa.Column("ttft_p99_ms", sa.Double(), nullable=True),
        sa.Column("duration_s", sa.Double(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("run_key", "phase", "node", name=op.f("uq_load_phases_run_key_phase_node")),
    )

    op.create_table(
        "request_samples",
        _id(),
        _run_fk(),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("node", sa.Text(), nullable=False),
        sa.Column("ts", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("error_kind", sa.Text(), nullable=True),
        sa.Column("latency_ms", sa.Double(), nullable=False),
        sa.Column("ttft_ms", sa.Double(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
    )
    op.create_index(op.f("ix_request_samples_run_key_phase"), "request_samples", ["run_key", "phase"])


def downgrade() -> None:
    op.drop_table("request_samples")
    op.drop_table("load_phases")
    op.drop_table("stage_results")
    op.drop_table("runs")
