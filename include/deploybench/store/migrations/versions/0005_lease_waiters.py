"""The queue of runs waiting for a cluster's lease: first come, first served.

- ``lease_waiters``: one row per run waiting for a cluster (``since``: when it first found the
  cluster busy; ``seen_at``: its last poll). A free lease goes to the waiter with the oldest
  ``since`` that polled within ``deploybench.lease.WAITER_STALE_S``; a run that stopped polling
  (cancelled, its triggerer gone) loses its place after that long.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "lease_waiters",
        sa.Column("cluster", sa.Text(), nullable=False),
        sa.Column("run_key", sa.Text(), nullable=False),
        sa.Column("dag_id", sa.Text()),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.PrimaryKeyConstraint("cluster", "run_key", name=op.f("pk_lease_waiters")),
    )


def downgrade() -> None:
    op.drop_table("lease_waiters")
