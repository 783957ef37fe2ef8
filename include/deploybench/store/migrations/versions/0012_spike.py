"""The spike phase's recovery and scale-up times on its cluster row (issue 31).

- ``load_phases.spike_recovery_s``: from the spike's end until P99 latency and the error rate are back under the SLO
  and stay there (deploybench.load.spike); absent when they did not come back within the recovery window, with
  ``spike_recovery_reason`` saying why;
- ``load_phases.scale_up_serving_s`` / ``scale_up_slo_s``: scaling up under load, from the spike's start until every
  added engine served (health OK), and until the SLO held again; absent when that did not happen;
- ``load_phases.scale_up``: whether the spike phase scaled up under load (also when it failed to: both times then
  absent); NULL for other phases.

Revision ID: 0012_spike
Revises: 0011_energy_per_request
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_spike"
down_revision = "0011_energy_per_request"
branch_labels = None
depends_on = None

COLUMNS: tuple[tuple[str, sa.types.TypeEngine], ...] = (
    ("spike_recovery_s", sa.Double()), ("spike_recovery_reason", sa.Text()),
    ("scale_up_serving_s", sa.Double()), ("scale_up_slo_s", sa.Double()), ("scale_up", sa.Boolean()))


def upgrade() -> None:
    for name, kind in COLUMNS:
        op.add_column("load_phases", sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    for name, _ in reversed(COLUMNS):
        op.drop_column("load_phases", name)
