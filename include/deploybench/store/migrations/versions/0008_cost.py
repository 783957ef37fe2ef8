"""What a load phase cost (issue 29): the serving nodes' price per node-hour (the inventory's) over the measured
window, per million output tokens, and its currency.

- ``load_phases.cost_per_million_output_tokens``: the cluster row's; absent unless every serving node has a price
  and the window answered output tokens (deploybench.load.cost);
- ``load_phases.cost_currency``: the ISO 4217 code of that price (one per inventory).

Revision ID: 0008_cost
Revises: 0007
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_cost"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("load_phases", sa.Column("cost_per_million_output_tokens", sa.Double(), nullable=True))
    op.add_column("load_phases", sa.Column("cost_currency", sa.Text(), nullable=True))


def downgrade() -> None:
    for column in ("cost_currency", "cost_per_million_output_tokens"):
        op.drop_column("load_phases", column)
