"""The cluster lease: one row per cluster naming the run that holds it, and a log of lease events.

- ``cluster_leases``: one row per cluster (the inventory's name). ``holder`` is the run key of the
  run that holds the cluster (NULL: free), with where it runs (DAG, host, pid), when it took the
  lease, its last heartbeat and when the lease expires without one. ``pending_cleanup`` lists
  runs whose leftovers on the nodes have not been cleaned up yet (a holder that expired, a lease
  broken by hand, a run whose teardown failed); whoever takes the lease next cleans them first.
- ``lease_events``: acquired, released, renewed after a gap, taken over from an expired holder,
  broken, leftovers recovered, lost: with the run key and the details (what was cleaned).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

EVENTS = ("acquired", "released", "taken_over", "broken", "recovered", "lost")


def _ts(name: str, nullable: bool = True, **kw) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable, **kw)


def upgrade() -> None:
    op.create_table(
        "cluster_leases",
        sa.Column("cluster", sa.Text(), nullable=False),
        sa.Column("holder", sa.Text()),
        sa.Column("dag_id", sa.Text()),
        sa.Column("host", sa.Text()),
        sa.Column("pid", sa.Integer()),
        _ts("acquired_at"),
        _ts("heartbeat_at"),
        _ts("expires_at"),
        sa.Column("ttl_s", sa.Double()),
        sa.Column("pending_cleanup", postgresql.JSONB(), nullable=False, server_default=sa.text("'[]'::jsonb")),
        _ts("updated_at", nullable=False, server_default=sa.text("now()")),
        sa.PrimaryKeyConstraint("cluster", name=op.f("pk_cluster_leases")),
        sa.CheckConstraint("holder IS NULL OR expires_at IS NOT NULL", name=op.f("ck_cluster_leases_expiry")),
    )
    op.create_table(
        "lease_events",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("cluster", sa.Text(), nullable=False),
        sa.Column("event", sa.Text(), nullable=False),
        sa.Column("run_key", sa.Text()),
        sa.Column("detail", postgresql.JSONB(), nullable=False, server_default=sa.text("'{}'::jsonb")),
        _ts("at", nullable=False, server_default=sa.text("now()")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_lease_events")),
        sa.CheckConstraint(f"event IN {EVENTS!r}", name=op.f("ck_lease_events_event")),
    )
    op.create_index(op.f("ix_lease_events_cluster_at"), "lease_events", ["cluster", "at"])
    op.create_index(op.f("ix_lease_events_run_key"), "lease_events", ["run_key"])


def downgrade() -> None:
    op.drop_table("lease_events")
    op.drop_table("cluster_leases")
