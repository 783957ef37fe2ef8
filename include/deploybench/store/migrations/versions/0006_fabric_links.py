"""The fabric of a link test: parallel streams, ping's RTT and jitter, the RDMA path (issue 33).

- ``preflight_links``: ``streams`` (iperf3 -P over every process of the test), ``latency_ms`` and
  ``jitter_ms`` (ping's mean RTT and mdev over the tested network, idle), ``ping_loss`` (fraction),
  ``problems`` (why the link fails besides its bandwidth), ``notes`` (findings that do not fail it, such
  as one slow stream of several), ``rdma`` (perftest's record, or why it was skipped).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_EMPTY = sa.text("'[]'::jsonb")


def upgrade() -> None:
    op.add_column("preflight_links", sa.Column("streams", sa.Integer(), nullable=True))
    op.add_column("preflight_links", sa.Column("latency_ms", sa.Double(), nullable=True))
    op.add_column("preflight_links", sa.Column("jitter_ms", sa.Double(), nullable=True))
    op.add_column("preflight_links", sa.Column("ping_loss", sa.Double(), nullable=True))
    op.add_column("preflight_links", sa.Column("problems", postgresql.JSONB(), nullable=False, server_default=_EMPTY))
    op.add_column("preflight_links", sa.Column("notes", postgresql.JSONB(), nullable=False, server_default=_EMPTY))
    op.add_column("preflight_links", sa.Column("rdma", postgresql.JSONB(), nullable=True))


def downgrade() -> None:
    for column in ("rdma", "notes", "problems", "ping_loss", "jitter_ms", "latency_ms", "streams"):
        op.drop_column("preflight_links", column)
