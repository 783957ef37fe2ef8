"""Identities and series, facts of every stage, server metrics, analysis written back.

Adds, without touching what 0001 stored:

- identity rows unique on a canonical hash: clusters, software, model_artifacts (with the
  file manifest), serving_configs, workloads; ``series`` (one per combination of the five);
- runs: ``trigger``, ``series_id`` (NULL for runs stored before this revision), ``excluded``
  with ``exclude_reason``;
- facts: preflight_nodes, preflight_links, fanout_nodes, rollout_steps, capacity_steps,
  server_metrics (COPY, like request_samples);
- analysis: comparisons, change_points, verdicts, each with the method and parameters.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

JSON_EMPTY = sa.text("'{}'::jsonb")
JSON_LIST = sa.text("'[]'::jsonb")
IDENTITIES = ("clusters", "software", "model_artifacts", "serving_configs", "workloads")


def _id() -> sa.Column:
    return sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True)


def _run_fk(table: str) -> sa.Column:
    return sa.Column(
        "run_key", sa.Text(),
        sa.ForeignKey("runs.run_key", ondelete="CASCADE", name=op.f(f"fk_{table}_run_key_runs")), nullable=False,
    )


def _now() -> sa.Column:
    return sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()"))


def _identity(table: str, *columns: sa.Column) -> None:
    op.create_table(
        table,
        _id(),
        sa.Column("hash", sa.Text(), nullable=False),
        sa.Column("attrs", postgresql.JSONB(), nullable=False, server_default=JSON_EMPTY),
        _now(),
        *columns,
        sa.UniqueConstraint("hash", name=op.f(f"uq_{table}_hash")),
    )


def _series_fk(table: str, nullable: bool = False, ondelete: str = "CASCADE") -> sa.Column:
    return sa.Column(
        "series_id", sa.BigInteger(),
        sa.ForeignKey("series.id", ondelete=ondelete, name=op.f(f"fk_{table}_series_id_series")), nullable=nullable,
    )


def upgrade() -> None:
    _identity("clusters", sa.Column("name", sa.Text(), nullable=False),
              sa.Column("node_count", sa.Integer(), nullable=False))
    _identity("software", sa.Column("engine", sa.Text(), nullable=False), sa.Column("image", sa.Text()),
              sa.Column("version", sa.Text()))
    _identity("model_artifacts", sa.Column("name", sa.Text(), nullable=False), sa.Column("manifest_digest", sa.Text()),
              sa.Column("total_bytes", sa.BigInteger()),
              sa.Column("files", postgresql.JSONB(), nullable=False, server_default=JSON_LIST))
    _identity("serving_configs")
    _identity("workloads")

    fks = {"cluster_id": "clusters", "software_id": "software", "model_id": "model_artifacts",
           "serving_id": "serving_configs", "workload_id": "workloads"}
    op.create_table(
        "series",
        _id(),
        sa.Column("fingerprint", sa.Text(), nullable=False),
        *[sa.Column(col, sa.BigInteger(), sa.ForeignKey(f"{ref}.id", ondelete="RESTRICT",
                                                         name=op.f(f"fk_series_{col}_{ref}")), nullable=False)
          for col, ref in fks.items()],
        _now(),
        sa.UniqueConstraint("fingerprint", name=op.f("uq_series_fingerprint")),
    )

    op.add_column("runs", sa.Column("trigger", sa.Text(), nullable=True))
    op.add_column("runs", _series_fk("runs", nullable=True, ondelete="SET NULL"))
    op.add_column("runs", sa.Column("excluded", sa.Boolean(), nullable=False, server_default=sa.text("false")))
    op.add_column("runs", sa.Column("exclude_reason", sa.Text(), nullable=True))
    op.create_index(op.f("ix_runs_series_id_started_at"), "runs", ["series_id", "started_at"])

    op.create_table(
        "preflight_nodes", _id(), _run_fk("preflight_nodes"),
        sa.Column("node", sa.Text(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("reasons", postgresql.JSONB(), nullable=False, server_default=JSON_LIST),
        sa.Column("facts", postgresql.JSONB(), nullable=False, server_default=JSON_EMPTY),
        sa.UniqueConstraint("run_key", "node", name=op.f("uq_preflight_nodes_run_key_node")),
    )
    op.create_table(
        "preflight_links", _id(), _run_fk("preflight_links"),
        sa.Column("src", sa.Text(), nullable=False),
        sa.Column("dst", sa.Text(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("nominal_mbit", sa.Double(), nullable=False),
        sa.Column("mbit", sa.Double()),
        sa.Column("ratio", sa.Double()),
        sa.Column("retransmits", sa.BigInteger()),
        sa.Column("rtt_ms", sa.Double()),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("error", sa.Text()),
        sa.Column("directions", postgresql.JSONB(), nullable=False, server_default=JSON_LIST),
        sa.UniqueConstraint("run_key", "src", "dst", "round", name=op.f("uq_preflight_links_run_key_src_dst_round")),
    )
    op.create_table(
        "fanout_nodes", _id(), _run_fk("fanout_nodes"),
        sa.Column("node", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("seconds", sa.Double(), nullable=False),
        sa.Column("verified", sa.Boolean(), nullable=False),
        sa.Column("started_s", sa.Double(), nullable=False, server_default=sa.text("0")),
        sa.Column("error", sa.Text()),
        sa.UniqueConstraint("run_key", "node", name=op.f("uq_fanout_nodes_run_key_node")),
    )
    op.create_table(
        "rollout_steps", _id(), _run_fk("rollout_steps"),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("nodes", sa.Integer(), nullable=False),
        sa.Column("added", postgresql.JSONB(), nullable=False, server_default=JSON_LIST),
        sa.Column("ready_s", postgresql.JSONB(), nullable=False, server_default=JSON_EMPTY),
        sa.Column("smoke", postgresql.JSONB(), nullable=False, server_default=JSON_EMPTY),
        sa.Column("seconds", sa.Double(), nullable=False),
        sa.UniqueConstraint("run_key", "step", name=op.f("uq_rollout_steps_run_key_step")),
    )
    op.create_table(
        "capacity_steps", _id(), _run_fk("capacity_steps"),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("offered_rps", sa.Double(), nullable=False),
        sa.Column("achieved_rps", sa.Double()),
        sa.Column("latency_p99_ms", sa.Double()),
        sa.Column("ttft_p99_ms", sa.Double()),
        sa.Column("error_rate", sa.Double()),
        sa.Column("dropped_iterations", sa.BigInteger()),
        sa.Column("slo_ok", sa.Boolean(), nullable=False),
        sa.Column("detail", postgresql.JSONB(), nullable=False, server_default=JSON_EMPTY),
        sa.UniqueConstraint("run_key", "step", name=op.f("uq_capacity_steps_run_key_step")),
    )
    op.create_table(
        "server_metrics", _id(), _run_fk("server_metrics"),
        sa.Column("phase", sa.Text(), nullable=False, server_default=sa.text("''")),
        sa.Column("node", sa.Text(), nullable=False),
        sa.Column("metric", sa.Text(), nullable=False),
        sa.Column("labels", sa.Text(), nullable=False, server_default=sa.text("''")),
        sa.Column("ts", sa.DateTime(timezone=True), nullable=False),
        sa.Column("value", sa.Double(), nullable=False),
    )
    op.create_index(op.f("ix_server_metrics_run_key_metric"), "server_metrics", ["run_key", "metric"])

    op.create_table(
        "comparisons", _id(), _now(),
        sa.Column("run_keys", postgresql.JSONB(), nullable=False, server_default=JSON_LIST),
        sa.Column("baseline_run_key", sa.Text()),
        sa.Column("method", sa.Text(), nullable=False),
        sa.Column("params", postgresql.JSONB(), nullable=False, server_default=JSON_EMPTY),
        sa.Column("result", postgresql.JSONB(), nullable=False, server_default=JSON_EMPTY),
    )
    op.create_index(op.f("ix_comparisons_created_at"), "comparisons", ["created_at"])
    op.create_table(
        "change_points", _id(), _series_fk("change_points"),
        sa.Column("metric", sa.Text(), nullable=False),
        _run_fk("change_points"),
        sa.Column("method", sa.Text(), nullable=False),
        sa.Column("params", postgresql.JSONB(), nullable=False, server_default=JSON_EMPTY),
        sa.Column("direction", sa.Text(), nullable=False),
        sa.Column("mean_before", sa.Double(), nullable=False),
        sa.Column("mean_after", sa.Double(), nullable=False),
        sa.Column("magnitude", sa.Double(), nullable=False),
        sa.Column("p_value", sa.Double()),
        sa.Column("detected_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.UniqueConstraint("series_id", "metric", "run_key", "method",
                            name=op.f("uq_change_points_series_id_metric_run_key_method")),
    )
    op.create_index(op.f("ix_change_points_series_id_metric"), "change_points", ["series_id", "metric"])
    op.create_table(
        "verdicts", _id(), _series_fk("verdicts"), _run_fk("verdicts"),
        sa.Column("metric", sa.Text(), nullable=False),
        sa.Column("method", sa.Text(), nullable=False),
        sa.Column("params", postgresql.JSONB(), nullable=False, server_default=JSON_EMPTY),
        sa.Column("verdict", sa.Text(), nullable=False),
        sa.Column("magnitude", sa.Double()),
        sa.Column("p_value", sa.Double()),
        _now(),
        sa.UniqueConstraint("run_key", "metric", "method", name=op.f("uq_verdicts_run_key_metric_method")),
        sa.CheckConstraint("verdict IN ('regression', 'improvement', 'no change')", name=op.f("ck_verdicts_verdict")),
    )


def downgrade() -> None:
    for table in ("verdicts", "change_points", "comparisons", "server_metrics", "capacity_steps", "rollout_steps",
                  "fanout_nodes", "preflight_links", "preflight_nodes"):
        op.drop_table(table)
    op.drop_index(op.f("ix_runs_series_id_started_at"), table_name="runs")
    for col in ("exclude_reason", "excluded", "series_id", "trigger"):
        op.drop_column("runs", col)
    op.drop_table("series")
    for table in reversed(IDENTITIES):
        op.drop_table(table)
