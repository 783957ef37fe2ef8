"""The GPUs' energy per request answered, beside the energy per output token of 0007 (issue 29).

- ``load_phases.energy_per_request_j``: the GPUs' energy over the measured window per request answered in it (the
  cluster row; absent unless every node reported its power, as the energy per output token).

Revision ID: 0011_energy_per_request
Revises: 0010_findings
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_energy_per_request"
down_revision = "0010_findings"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("load_phases", sa.Column("energy_per_request_j", sa.Double(), nullable=True))


def downgrade() -> None:
    op.drop_column("load_phases", "energy_per_request_j")
