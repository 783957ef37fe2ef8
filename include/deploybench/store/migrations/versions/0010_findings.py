"""Findings (issue 29): the runbook's troubleshooting table as rules over a run's results
(deploybench.analyse.findings), one row per finding: the rule, the node (NULL: the whole cluster), the metric, the
window (phase, step, its time span), the numbers (observed against expected or a threshold), the evidence in words
and what to do. Written with the run by the store stage (deleted and inserted again: a re-run replaces them).

Revision ID: 0010_findings
Revises: 0009_node_windows
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0010_findings"
down_revision = "0009_node_windows"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "findings",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column("run_key", sa.Text(),
                  sa.ForeignKey("runs.run_key", ondelete="CASCADE", name=op.f("fk_findings_run_key_runs")),
                  nullable=False),
        sa.Column("rule", sa.Text(), nullable=False),
        sa.Column("node", sa.Text()),
        sa.Column("metric", sa.Text(), nullable=False),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("window_start", sa.DateTime(timezone=True)),
        sa.Column("window_end", sa.DateTime(timezone=True)),
        sa.Column("observed", sa.Double()),
        sa.Column("expected", sa.Double()),
        sa.Column("evidence", sa.Text(), nullable=False),
        sa.Column("advice", sa.Text(), nullable=False),
        sa.Column("detail", postgresql.JSONB(), nullable=False, server_default=sa.text("'{}'::jsonb")),
    )
    op.create_index(op.f("ix_findings_run_key"), "findings", ["run_key"])
    op.create_index(op.f("ix_findings_rule_node"), "findings", ["rule", "node"])


def downgrade() -> None:
    op.drop_index(op.f("ix_findings_rule_node"), table_name="findings")
    op.drop_index(op.f("ix_findings_run_key"), table_name="findings")
    op.drop_table("findings")
