"""What the engine and the GPUs said of a load phase, beside the client's figures (issues 27 and 29).

- ``load_phases.prefix_hit_rate``: the engine's own prefix-cache hit rate over the phase (hit tokens over queried
  tokens, from its counters; the cluster row sums every node's), absent when the engine has no such counters;
- ``load_phases.energy_per_output_token_j``: the GPUs' energy over the measured window per output token (the
  cluster row; absent unless every node reported its power).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("load_phases", sa.Column("prefix_hit_rate", sa.Double(), nullable=True))
    op.add_column("load_phases", sa.Column("energy_per_output_token_j", sa.Double(), nullable=True))


def downgrade() -> None:
    for column in ("energy_per_output_token_j", "prefix_hit_rate"):
        op.drop_column("load_phases", column)
