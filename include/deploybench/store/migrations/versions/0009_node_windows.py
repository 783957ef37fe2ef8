"""Per node, per load window figures, each with its source (issue 29).

- ``node_windows``: one row per run, phase, step (a probe step; 0 for the other phases), node, figure (``metric``:
  cpu_busy_pct, mem_used_bytes, net_rx_bytes_per_s, gpu_util_pct, engine_running ...) and ``source``
  ("prometheus": the team's Prometheus over the window; "scrape": deploybench's own scrape of the engine's page):
  ``mean``/``max`` over the window's ``samples``, NULL when absent, with the ``reason``.

Revision ID: 0009_node_windows
Revises: 0008_cost
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_node_windows"
down_revision = "0008_cost"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_windows",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column("run_key", sa.Text(),
                  sa.ForeignKey("runs.run_key", ondelete="CASCADE", name=op.f("fk_node_windows_run_key_runs")),
                  nullable=False),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("node", sa.Text(), nullable=False),
        sa.Column("metric", sa.Text(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("unit", sa.Text(), nullable=False, server_default=sa.text("''")),
        sa.Column("mean", sa.Double(), nullable=True),
        sa.Column("max", sa.Double(), nullable=True),
        sa.Column("samples", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.UniqueConstraint("run_key", "phase", "step", "node", "metric", "source",
                            name=op.f("uq_node_windows_run_key_phase_step_node_metric_source")),
    )


def downgrade() -> None:
    op.drop_table("node_windows")
