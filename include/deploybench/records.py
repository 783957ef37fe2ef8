"""The typed stage records and results: the one contract between the stages that write a run's folder
(deploybench.pipeline) and what reads it (the store's ingest, the reports, the pages).

On disk a record is ``<run folder>/stages/<stage>.json`` with the keys of ``StageRecord``. Its ``result``
is the stage's own typed result, read back with ``stage_result``: preflight's ``PreflightResult``, fan-out's
``FanoutResult``, rollout's ``RolloutResult`` (the dataclasses the stages build, validated by pydantic with
unknown keys refused), the load stage's ``LoadStageResult`` (deploybench.load.phases.assemble writes it);
or, for preflight, fan-out and rollout, one of the shapes a stage writes when it did not do its work itself,
each marked by its own key: ``SkippedExternal`` (``skipped``: the external backend deploys nothing),
``ExternalRollout`` (the external backend's rollout: the given endpoints, checked ready), and ``Reused...``
(``reused``: a matrix cell on the deployment of an earlier cell). The other records are one model each:
validate's ``ValidateResult``, the lease's ``LeaseResult``, teardown's ``StoppedEngines`` (or ``KeptEngines``,
a matrix cell that left its engines for the next cell), store's ``StoreResult`` and report's ``ReportResult``.
A record that does not match is refused with ``RecordError`` naming the stage, the field and the run folder:
readers never guess between shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, TypeAdapter, ValidationError

from deploybench.config import LoadPhase
from deploybench.errors import DeploybenchError
from deploybench.fanout.result import DERIVED, NODE_DERIVED, FanoutResult
from deploybench.load.probe import ProbeStep
from deploybench.load.results import LoadResult, NodeWindow
from deploybench.preflight.model import PreflightResult
from deploybench.rollout.base import RolloutResult


class RecordError(DeploybenchError):
    """A stage record in a run's folder does not match the contract of this module."""


def refused(where: Path | str, stage: str, exc: ValidationError, under: tuple[str, ...] = ()) -> RecordError:
    """The RecordError of a record that failed validation (``under``: where the model sits in the record):
    every wrong field with its value."""
    wrong = "; ".join(f"field {'.'.join(str(p) for p in (*under, *e['loc'])) or '(record)'}: {e['msg']}"
                      + (f" (got {str(e['input'])[:80]!r})" if e["type"] != "missing" else "")
                      for e in exc.errors()[:5])
    return RecordError(f"run folder {where}: the {stage!r} stage record does not match deploybench.records: "
                       f"{wrong}; re-run the stage to rewrite it (a record written by hand or by an older "
                       "deploybench is not read)")


class StageRecord(BaseModel):
    """One stage's record: written when the stage ends, success or failure (a retried stage overwrites it)."""

    model_config = ConfigDict(extra="forbid")

    stage: str
    status: Literal["running", "success", "failed"]
    started_at: str  # ISO 8601, UTC
    finished_at: str | None = None
    seconds: float | None = None
    summary: str = ""  # one line for people
    result: Any = None  # what the stage measured (its own result's dump; the load stage: LoadStageResult)
    error: str | None = None  # why it failed


class PhaseOutcome(BaseModel):
    """One load phase as run (``<run folder>/load/<phase>.result.json``): its LoadResult (for the probe: the
    best passed step's), and its analysis (the probe's CapacityResult, sustained's Drift, overload's analysis)."""

    model_config = ConfigDict(extra="forbid")

    phase: LoadPhase
    status: Literal["success", "failed"]
    result: LoadResult | None = None
    error: str | None = None
    analysis: dict[str, Any] | None = None
    series: list[str] = []  # scraped /metrics and GPU series of every k6 run of the phase
    # per step (0 but for the probe's steps): each node's figures over that k6 run's window (LoadResult.node_windows)
    node_windows: dict[int, list[NodeWindow]] = {}

    def probe_steps(self) -> list[ProbeStep]:
        """Every step of the capacity search (probe phase; none for the others)."""
        steps = (self.analysis or {}).get("steps") if self.phase is LoadPhase.PROBE else None
        return TypeAdapter(list[ProbeStep]).validate_python(steps or [])


class Capacity(BaseModel):
    """The capacity the load stage worked from: the probe's search (CapacityResult), the probe's failure
    (``capacity_rps`` None, ``reason``), or ``load.rate`` when the probe did not run (``source`` "config")."""

    model_config = ConfigDict(extra="forbid")

    capacity_rps: float | None
    steps: list[ProbeStep] = []
    bracket: tuple[float | None, float | None] | None = None
    converged: bool | None = None
    reason: str | None = None
    seconds: float | None = None
    source: Literal["config"] | None = None
    # a conversation workload rated in sessions (load.phases.in_requests): capacity_rps stays requests/s
    rate_unit: Literal["requests", "sessions"] = "requests"
    requests_per_session: float | None = None

    @property
    def capacity_sessions_per_s(self) -> float | None:
        """The capacity in conversations per second, for a workload rated in sessions (else None)."""
        if self.capacity_rps is None or not self.requests_per_session or self.rate_unit != "sessions":
            return None
        return self.capacity_rps / self.requests_per_session


class LoadStageResult(BaseModel):
    """The load stage's result: the headline phase's LoadResult fields (sustained, else overload, else the
    probe's; none when every phase failed) beside ``phases``, ``capacity`` and ``series``."""

    model_config = ConfigDict(extra="allow")  # the headline LoadResult's fields, typed by ``headline``

    phases: dict[str, PhaseOutcome]
    capacity: Capacity
    series: list[str]

    @classmethod
    def of(cls, record: StageRecord, where: Path | str) -> LoadStageResult:
        try:
            got = cls.model_validate(record.result)
            got.headline()
        except ValidationError as exc:
            raise refused(where, record.stage, exc, ("result",)) from exc
        for name, ph in got.phases.items():
            try:
                ph.probe_steps()
            except ValidationError as exc:
                raise refused(where, record.stage, exc, ("result", "phases", name, "analysis", "steps")) from exc
            if name != ph.phase:
                raise RecordError(f"run folder {where}: the 'load' stage record: field result.phases.{name} holds "
                                  f"phase {ph.phase!r}; re-run the load stage to rewrite it")
        return got

    def headline(self) -> LoadResult | None:
        extra = self.model_extra or {}
        return LoadResult.model_validate(extra) if extra else None

    def ran(self) -> list[LoadResult]:
        """The LoadResult of every phase that produced one, in the order the phases ran."""
        return [ph.result for ph in self.phases.values() if ph.result is not None]

    def sample_paths(self) -> list[str]:
        """Every samples file: each phase's, and each capacity-search step's."""
        found = [r.samples_path for r in self.ran()]
        found += [s.samples_path for ph in self.phases.values() for s in ph.probe_steps()]
        return list(dict.fromkeys(p for p in found if p))



# -- preflight, fan-out and rollout: their own results, or the shapes of work not done here ------------------------
class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class SkippedExternal(_Shape):
    """Preflight (when ``rollout.external_preflight`` is off) or fan-out of the external backend: nothing done."""

    skipped: Literal["external"]
    deployed_by: str
    nodes: list[str] = []


class ReusedFrom(_Shape):
    """Where a matrix cell's reused stage came from (deploybench.matrix.deployment.reused_record)."""

    from_: str = Field(alias="from")
    via: str | None = None
    age_s: float | None = None
    max_reuse_s: float | None = None


class ReusedPreflight(_Shape):
    healthy: list[str]
    reused: ReusedFrom
    # what the owner's preflight read of each node's fabric (deploybench.preflight.checks.fabric_identity): the
    # cluster's identity of a cell on a reused deployment is the owner's
    fabric: dict[str, dict[str, Any]] = {}


class ReusedFanout(_Shape):
    """The identity of the model the adopted deployment verified (its per-node facts stay with its run)."""

    model: str | None = None
    manifest_digest: str | None = None
    total_bytes: int | None = None
    files: list[dict[str, Any]] = []
    verified_nodes: list[str] = []
    strategy: str | None = None
    reused: ReusedFrom


class ReusedRollout(_Shape):
    profile: str | None = None
    backend: str | None = None
    image: str | None = None
    version: str | None = None
    endpoints: list[dict[str, Any]]
    reused: ReusedFrom


class ExternalRollout(_Shape):
    """The external backend's rollout (deploybench.rollout.external.run): the given endpoints, each ready."""

    profile: str
    backend: Literal["external"]
    skipped: Literal["external"]
    deployed_by: str
    version: str
    steps: list[Any] = []
    plan: list[int] = []
    endpoints: list[dict[str, Any]]
    ready_s: dict[str, float] = {}
    failure: dict[str, Any] | None = None
    seconds: float = 0.0


class ValidateResult(_Shape):
    """Validate: the nodes the run works on (resolved from the inventory) and its config's fingerprint."""

    nodes: list[str]
    fingerprint: str


class StoppedEngines(RootModel[dict[str, str]]):
    """Teardown: each node (or Kubernetes object) -> "stopped" or "error: ..." (deploybench.rollout.teardown)."""

    def errors(self) -> dict[str, str]:
        return {n: s for n, s in self.root.items() if s.startswith("error")}


class KeptDeployment(_Shape):
    """A deployment left running for the next matrix cell (deploybench.matrix.deployment.keep)."""

    kept: Literal[True]
    kept_by: str
    kept_for: str
    owner: str  # the run whose engines they are (kept_by, or the run it adopted them from)
    cluster: str
    nodes: list[str]
    deployment: str  # what is deployed (deploybench.matrix.deployment.fingerprint)
    kept_at: str
    preflight_at: str | None = None
    fanout_at: str | None = None
    deployed_at: str | None = None


class KeptEngines(_Shape):
    """Teardown of a matrix cell that left its engines for the next cell."""

    kept: KeptDeployment


class StoreResult(RootModel[dict[str, int]]):
    """Store: rows written per kind (stages, phases, samples, replaced, and the facts tables that got rows:
    deploybench.store.ingest.store_run)."""


class ReportResult(_Shape):
    """Report: where the HTML report is, and the verdict on the run's series history (none when not stored)."""

    path: str
    verdicts: Any = None
    verdict_line: str = ""


class LeaseResult(_Shape):
    """The lease's record (deploybench.pipeline.acquire_lease / release_lease): what was asked, what was granted,
    whom it cleaned up after, and how it ended."""

    cluster: str
    spec: dict[str, Any]
    holder: dict[str, Any] | None = None  # who held the cluster when it was refused
    waited_s: float | None = None
    taken_over: Any = None
    cleaned: list[dict[str, Any]] = []
    acquired_at: str | None = None
    released_at: str | None = None
    released: bool | None = None
    leftovers: bool | None = None
    handed_over_to: str | None = None
    stopped: dict[str, str] | None = None


PreflightStage = PreflightResult | ReusedPreflight | SkippedExternal
FanoutStage = FanoutResult | ReusedFanout | SkippedExternal
RolloutStage = RolloutResult | ReusedRollout | ExternalRollout


def _fanout(data: dict[str, Any]) -> dict[str, Any]:
    """A fan-out record without what ``FanoutResult.to_dict`` derives (it is computed again, not read)."""
    out = {k: v for k, v in data.items() if k not in DERIVED}
    if isinstance(out.get("nodes"), list):
        out["nodes"] = [{k: v for k, v in n.items() if k not in NODE_DERIVED} if isinstance(n, dict) else n
                        for n in out["nodes"]]
    return out


def _shape(stage: str, data: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(the type, the data to validate) of a preflight, fan-out or rollout result, by its marking key."""
    if "reused" in data:
        return {"preflight": ReusedPreflight, "fanout": ReusedFanout, "rollout": ReusedRollout}[stage], data
    if data.get("skipped") == "external":
        return (ExternalRollout if stage == "rollout" else SkippedExternal), data
    if stage == "fanout":
        return FanoutResult, _fanout(data)
    return {"preflight": PreflightResult, "rollout": RolloutResult}[stage], data


TeardownStage = KeptEngines | StoppedEngines
# the stages whose result is one model, whatever happened
_ONE_MODEL: dict[str, Any] = {"validate": ValidateResult, "lease": LeaseResult, "teardown": TeardownStage,
                              "store": StoreResult, "report": ReportResult}
TYPED_STAGES = ("validate", "lease", "preflight", "fanout", "rollout", "load", "teardown", "store", "report")


def stage_result(record: StageRecord, where: Path | str) -> Any:
    """The typed result of a stage's record (``TYPED_STAGES``: every stage; the module doc);
    None when the record holds none (a stage that failed before it measured anything). RecordError names what
    does not match."""
    if record.result is None:
        return None
    if record.stage == "load":
        return LoadStageResult.of(record, where)
    if record.stage not in TYPED_STAGES or not isinstance(record.result, dict):
        raise RecordError(f"run folder {where}: the {record.stage!r} stage record's result is not a "
                          f"{' or '.join(TYPED_STAGES)} result; re-run the stage to rewrite it")
    model, data = (_ONE_MODEL[record.stage], record.result) if record.stage in _ONE_MODEL else \
        _shape(record.stage, record.result)
    try:
        return TypeAdapter(model).validate_python(data)
    except ValidationError as exc:
        raise refused(where, record.stage, exc, ("result",)) from exc
