"""A run's logical date, and the ``suspect`` verdict.

- ``runs.logical_date``: the Airflow logical date of the DAG run (NULL for a CLI run or a manual
  run without one). A series is ordered by ``coalesce(logical_date, started_at)``, so a backfilled
  run lands at the date it stands for, not at the day it was measured.
- ``verdicts.verdict`` may be ``suspect``: one run outside the series' noise band that the
  change-point method cannot confirm yet (deploybench.analyse.judge).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("logical_date", sa.DateTime(timezone=True), nullable=True))
    op.create_index(op.f("ix_runs_series_id_logical_date"), "runs", ["series_id", "logical_date"])
    op.drop_constraint(op.f("ck_verdicts_verdict"), "verdicts", type_="check")
    op.create_check_constraint(op.f("ck_verdicts_verdict"), "verdicts",
                               "verdict IN ('regression', 'improvement', 'no change', 'suspect')")


def downgrade() -> None:
    op.execute("DELETE FROM verdicts WHERE verdict = 'suspect'")
    op.drop_constraint(op.f("ck_verdicts_verdict"), "verdicts", type_="check")
    op.create_check_constraint(op.f("ck_verdicts_verdict"), "verdicts",
                               "verdict IN ('regression', 'improvement', 'no change')")
    op.drop_index(op.f("ix_runs_series_id_logical_date"), table_name="runs")
    op.drop_column("runs", "logical_date")
