"""A run's folder in the results database, so that any Airflow executor works (issue 31).

- ``run_files``: one row per file of a run folder (``paths.run_dir(run_key)``): its path relative to the folder,
  sha256, size and content. Each task of a run pulls what it lacks before its work and pushes what it wrote after
  it (deploybench.store.run_files), so the next task finds the stage records, load samples and reports on another
  worker's disk. No foreign key to ``runs``: the files exist from validate on, the ``runs`` row only from the
  store stage.

Revision ID: 0013_run_files
Revises: 0012_spike
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_run_files"
down_revision = "0012_spike"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "run_files",
        sa.Column("run_key", sa.Text(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("sha256", sa.Text(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.PrimaryKeyConstraint("run_key", "path", name=op.f("pk_run_files")),
    )


def downgrade() -> None:
    op.drop_table("run_files")
