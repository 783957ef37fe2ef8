"""Facts of a run's stages, as typed rows: what ``write_run(..., facts=RunFacts(...))`` stores.

Built from the stage results in the run folder by ``deploybench.store.ingest``; each list maps
one to one onto a table of revision 0002. Unknown keys are refused, as for the other
records, so a renamed field fails at the boundary instead of storing NULLs.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from deploybench.store.identity import RunIdentity

# server_metrics columns in COPY order (run_key first, added by the writer)
METRIC_COLUMNS: tuple[str, ...] = ("ts", "phase", "node", "metric", "labels", "value")


class _Row(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PreflightNodeRow(_Row):
    node: str
    ok: bool
    reasons: list[Any] = Field(default_factory=list)
    facts: dict[str, Any] = Field(default_factory=dict)


class PreflightLinkRow(_Row):
    src: str
    dst: str
    round: int = 0
    nominal_mbit: float
    mbit: float | None = None
    ratio: float | None = None
    retransmits: int | None = None
    rtt_ms: float | None = None
    ok: bool
    error: str | None = None
    directions: list[dict[str, Any]] = Field(default_factory=list)
    streams: int | None = None
    latency_ms: float | None = None
    jitter_ms: float | None = None
    ping_loss: float | None = None
    problems: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    rdma: dict[str, Any] | None = None


class FanoutNodeRow(_Row):
    node: str
    status: str
    bytes: int = Field(ge=0)
    seconds: float = Field(ge=0)
    verified: bool
    started_s: float = 0.0  # seconds after the fanout stage began
    error: str | None = None


class RolloutStepRow(_Row):
    step: int
    nodes: int
    added: list[str] = Field(default_factory=list)
    ready_s: dict[str, Any] = Field(default_factory=dict)
    smoke: dict[str, Any] = Field(default_factory=dict)
    seconds: float


class CapacityStepRow(_Row):
    step: int
    offered_rps: float = Field(ge=0)
    achieved_rps: float | None = None
    latency_p99_ms: float | None = None
    ttft_p99_ms: float | None = None
    error_rate: float | None = None
    dropped_iterations: int | None = None
    slo_ok: bool
    detail: dict[str, Any] = Field(default_factory=dict)


class NodeWindowRow(_Row):
    phase: str
    step: int = 0
    node: str
    metric: str
    source: str
    unit: str = ""
    mean: float | None = None
    max: float | None = None
    samples: int = Field(0, ge=0)
    reason: str | None = None


class FindingRow(_Row):
    """A finding (deploybench.analyse.findings.Finding) as the findings table holds it."""

    rule: str
    node: str | None = None
    metric: str
    phase: str
    step: int = 0
    window_start: datetime | None = None
    window_end: datetime | None = None
    observed: float | None = None
    expected: float | None = None
    evidence: str
    advice: str
    detail: dict[str, Any] = Field(default_factory=dict)


class RunFacts(BaseModel):
    """Everything about a run beyond its stages, phases and samples."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    identity: RunIdentity | None = None
    preflight_nodes: list[PreflightNodeRow] = Field(default_factory=list)
    preflight_links: list[PreflightLinkRow] = Field(default_factory=list)
    fanout_nodes: list[FanoutNodeRow] = Field(default_factory=list)
    rollout_steps: list[RolloutStepRow] = Field(default_factory=list)
    capacity_steps: list[CapacityStepRow] = Field(default_factory=list)
    node_windows: list[NodeWindowRow] = Field(default_factory=list)  # issue 29: per node, per window, per source
    findings: list[FindingRow] = Field(default_factory=list)
    server_metrics: pd.DataFrame | str | Path | None = None  # columns METRIC_COLUMNS (labels, phase optional)
