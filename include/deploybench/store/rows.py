"""What one run leaves in the results store, as typed records.

These are the store's input boundary: the DAG's store task (or the CLI runner) builds
one RunRecord, a StageRow per pipeline stage and a PhaseRecord per load phase and
node, and hands them with the raw samples to ``write_run``. Unknown keys are refused
and every timestamp must carry a time zone, so a typo or a naive local time fails
here, before anything touches the database.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator

from deploybench.store.facts import FindingRow, NodeWindowRow

RunStatus = Literal["success", "failed", "running"]
StageStatus = Literal["success", "failed", "skipped", "running"]

# node value of a PhaseRecord that aggregates the whole cluster
CLUSTER = "*"

# the sample table's columns, in the order COPY sends them (run_key comes first, added by the writer)
SAMPLE_COLUMNS: tuple[str, ...] = (
    "ts",
    "phase",
    "node",
    "status",
    "error_kind",
    "latency_ms",
    "ttft_ms",
    "prompt_tokens",
    "output_tokens",
)


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunRecord(_Record):
    """One pipeline run, keyed by its idempotency key (e.g. ``"<dag_id>/<airflow run_id>"``)."""

    run_key: str = Field(min_length=1, max_length=512)
    dag_id: str = Field(min_length=1)
    airflow_run_id: str | None = None
    status: RunStatus
    started_at: AwareDatetime
    finished_at: AwareDatetime | None = None
    config: dict[str, Any] = Field(default_factory=dict, description="the RunConfig as JSON (model_dump(mode='json'))")
    fingerprint: str = Field(min_length=1, description="RunConfig.fingerprint(): results of the same thing line up")
    inventory: str = Field(min_length=1)
    node_count: int = Field(ge=0)
    tags: dict[str, str] = Field(default_factory=dict)
    trigger: str | None = Field(None, max_length=64, description="manual, scheduled, backfill, asset, cli, ...")
    logical_date: AwareDatetime | None = Field(None, description="Airflow's logical date: where the run stands in "
                                               "its series (a backfilled run at its date, not the day it ran)")

    @model_validator(mode="after")
    def _times(self) -> RunRecord:
        if self.finished_at is not None and self.finished_at < self.started_at:
            raise ValueError(
                f"run {self.run_key!r}: finished_at={self.finished_at.isoformat()} is before "
                f"started_at={self.started_at.isoformat()}"
            )
        return self

    @classmethod
    def from_config(cls, run_key: str, config: Any, **fields: Any) -> RunRecord:
        """Build from a ``deploybench.config.RunConfig``: config, fingerprint, inventory and tags come from it."""
        fields.setdefault("node_count", config.nodes)
        return cls(
            run_key=run_key,
            config=config.model_dump(mode="json"),
            fingerprint=config.fingerprint(),
            inventory=config.inventory,
            tags=dict(config.tags),
            **fields,
        )


class StageRow(_Record):
    """The outcome of one pipeline stage (preflight, fanout, rollout, load, ...) in one run."""

    stage: str = Field(min_length=1, max_length=200)
    status: StageStatus
    started_at: AwareDatetime | None = None
    seconds: float | None = Field(None, ge=0, allow_inf_nan=False)
    summary: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None


class PhaseRecord(_Record):
    """Aggregates of one load phase (probe, sustained, overload, ...) on one node, or ``node='*'`` for the cluster."""

    phase: str = Field(min_length=1, max_length=200)
    node: str = Field(CLUSTER, min_length=1, max_length=200)
    offered_rps: float = Field(ge=0, allow_inf_nan=False)
    achieved_rps: float = Field(ge=0, allow_inf_nan=False)
    output_tps: float = Field(ge=0, allow_inf_nan=False)
    requests: int = Field(ge=0)
    errors: int = Field(ge=0)
    error_rate: float = Field(ge=0, le=1, allow_inf_nan=False)
    dropped_iterations: int = Field(0, ge=0)
    latency_p50_ms: float | None = Field(None, ge=0, allow_inf_nan=False)  # None: no request succeeded
    latency_p90_ms: float | None = Field(None, ge=0, allow_inf_nan=False)  # None: no request succeeded
    latency_p99_ms: float | None = Field(None, ge=0, allow_inf_nan=False)  # None: no request succeeded
    latency_p999_ms: float | None = Field(None, ge=0, allow_inf_nan=False)  # None: no request succeeded
    ttft_p50_ms: float | None = Field(None, ge=0, allow_inf_nan=False)
    ttft_p99_ms: float | None = Field(None, ge=0, allow_inf_nan=False)
    duration_s: float = Field(ge=0, allow_inf_nan=False)
    started_at: AwareDatetime
    prefix_hit_rate: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)  # the engine's, None: not counted
    energy_per_output_token_j: float | None = Field(None, ge=0, allow_inf_nan=False)  # None: power not measured
    energy_per_request_j: float | None = Field(None, ge=0, allow_inf_nan=False)  # migration 0011; None: as above
    # the serving nodes' price over the window per million output tokens (migration 0008); None: no price or no token
    cost_per_million_output_tokens: float | None = Field(None, ge=0, allow_inf_nan=False)
    cost_currency: str | None = Field(None, pattern=r"^[A-Z]{3}$")
    # the spike phase's cluster row (migration 0012_spike, deploybench.load.spike): its recovery time (None: absent,
    # the reason says why; or not a spike) and, scaling up under load, the times to the added engines serving and to
    # the SLO holding again, from the spike's start
    spike_recovery_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    spike_recovery_reason: str | None = Field(None, max_length=2000)
    scale_up_serving_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    scale_up_slo_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    scale_up: bool | None = None  # the spike phase scaled up under load (None: not a spike phase)

    @model_validator(mode="after")
    def _coherent(self) -> PhaseRecord:
        where = f"phase {self.phase!r} node {self.node!r}"
        if self.errors > self.requests:
            raise ValueError(f"{where}: errors={self.errors} is more than requests={self.requests}")
        if self.cost_per_million_output_tokens is not None and self.cost_currency is None:
            raise ValueError(f"{where}: cost_per_million_output_tokens={self.cost_per_million_output_tokens} has no "
                             "currency; set cost_currency (e.g. 'USD')")
        pct = [self.latency_p50_ms, self.latency_p90_ms, self.latency_p99_ms, self.latency_p999_ms]
        if any(p is None for p in pct) and not all(p is None for p in pct):
            raise ValueError(f"{where}: latency percentiles must be all set or all None, got {pct}")
        if all(p is not None for p in pct) and pct != sorted(p for p in pct if p is not None):
            raise ValueError(f"{where}: latency percentiles must not decrease from p50 to p99.9, got {pct}")
        if self.ttft_p50_ms is not None and self.ttft_p99_ms is not None and self.ttft_p99_ms < self.ttft_p50_ms:
            raise ValueError(f"{where}: ttft_p99_ms={self.ttft_p99_ms} is below ttft_p50_ms={self.ttft_p50_ms}")
        if self.requests and not math.isclose(self.error_rate, self.errors / self.requests, abs_tol=1e-6):
            raise ValueError(
                f"{where}: error_rate={self.error_rate} does not match errors/requests="
                f"{self.errors}/{self.requests}={self.errors / self.requests:.6f}"
            )
        return self


class StoredRun(_Record):
    """A run as read back from the store, with its stages and phases."""

    run: RunRecord
    stages: list[StageRow]
    phases: list[PhaseRecord]
    sample_count: int
    created_at: datetime
    updated_at: datetime
    series_id: int | None = None  # None: stored without identities (before revision 0002, or no config)
    series_fingerprint: str | None = None
    excluded: bool = False
    exclude_reason: str | None = None
    node_windows: list[NodeWindowRow] = Field(default_factory=list)  # per node, per window, per source (0008)
    findings: list[FindingRow] = []  # migration 0010 (deploybench.analyse.findings)
