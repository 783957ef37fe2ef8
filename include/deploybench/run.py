"""A run: its folder (paths.run_dir(run_key)), the stage list, and the recorder every stage writes through.

The folder holds ``run.json`` (the validated config, the nodes, how the run was started) and one record
per stage, ``stages/<stage>.json`` (deploybench.records.StageRecord). The pipeline writes them; the
store's ingest, the reports and the pages read them here, through ``Run.stage`` / ``Run.stages``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from deploybench import paths
from deploybench.config import LoadPhase, RunConfig
from deploybench.errors import ConfigError, StageFailed
from deploybench.inventory import Inventory
from deploybench.records import (
    FanoutStage,
    LoadStageResult,
    PreflightStage,
    RolloutStage,
    StageRecord,
    refused,
    stage_result,
)
from deploybench.transport import Cluster

log = logging.getLogger(__name__)

# The stages of a run, in the order they run: the one declaration (the DAG's tasks, the reports' stage
# table, the store's stage rows and the CLI all follow it).
STAGES = ("validate", "lease", "preflight", "fanout", "rollout", "load", "teardown", "store", "report")
LEASED_STAGES = STAGES[2:6]  # preflight..load: they touch nodes, only under the cluster's lease
REQUIRED_STAGES = ("validate", *LEASED_STAGES)  # a run without one of them did not measure anything
STORED_STAGES = STAGES[:STAGES.index("teardown") + 1]  # store and report describe the storing itself
LOAD_PHASES = tuple(p.value for p in LoadPhase)  # probe -> sustained -> overload


def now() -> str:
    return datetime.now(UTC).isoformat()


def write_json(path: Path, data: Any) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def record_path(run_dir: Path, stage: str) -> Path:
    return run_dir / "stages" / f"{stage}.json"


def read_record(run_dir: Path, stage: str) -> StageRecord | None:
    """The stage's record in ``run_dir``; None if it never ran; RecordError if it does not match the contract."""
    p = record_path(run_dir, stage)
    if not p.is_file():
        return None
    try:
        return StageRecord.model_validate_json(p.read_text())
    except ValidationError as exc:
        raise refused(run_dir, stage, exc) from exc


def save_record(run_dir: Path, rec: StageRecord) -> None:
    (run_dir / "stages").mkdir(parents=True, exist_ok=True)
    # the keys as ever: "error" only on a record that has one
    write_json(record_path(run_dir, rec.stage), rec.model_dump(mode="json", exclude={"error"} if rec.error is None
                                                               else None))


def check_owner(folder: Path, run_key: str, named: str | None = None) -> None:
    """Refuse a run folder whose run.json names another run key (ConfigError): a run never reads, replaces
    or reports another run's records. ``named``: the key already read from run.json."""
    named = named if named is not None else paths.folder_run_key(folder)
    if named is not None and named != run_key:
        raise ConfigError(f"run folder {folder} belongs to run {named[:250]!r}, not to {run_key[:250]!r}; nothing "
                          "of it is read or replaced. Move the folder away if it is not that run's, or use another "
                          "run id")


@dataclass
class Run:
    """A run's folder and what validate() wrote into it."""

    key: str
    dir: Path
    cfg: RunConfig
    inventory: Inventory
    nodes: list[str]
    meta: dict[str, Any]
    # the workload validate resolved (deploybench.workloads.Workload.summary): its name, its file's and its data's
    # sha256, its settings; {} for a run validated before workloads had names
    traffic: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def open(cls, run_key: str) -> Run:
        d = paths.run_dir(run_key)
        try:
            data = json.loads((d / "run.json").read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"run {run_key!r} has not been validated yet (no {d / 'run.json'})") from exc
        check_owner(d, run_key, data.get("run_key") if isinstance(data, dict) else None)
        cfg = RunConfig.model_validate(data["config"])
        traffic = data.get("workload") if isinstance(data.get("workload"), dict) else {}
        return cls(run_key, d, cfg, Inventory.load(cfg.inventory), data["nodes"], data["meta"], traffic)

    @classmethod
    def open_if_validated(cls, run_key: str) -> Run | None:
        """The run, or None when validate never wrote it (a failed validate leaves nothing to do)."""
        return cls.open(run_key) if (paths.run_dir(run_key) / "run.json").is_file() else None

    def cluster(self, ssh_overrides: dict | None = None) -> Cluster:
        return Cluster(self.inventory, ssh_overrides, run_key=self.key)

    @property
    def source(self) -> str:
        return self.cfg.source_node or self.nodes[0]

    def stage(self, name: str) -> StageRecord | None:
        return read_record(self.dir, name)

    def stages(self) -> dict[str, StageRecord]:
        """The records of the stages that ran, in STAGES order."""
        return {s: r for s in STAGES if (r := self.stage(s)) is not None}

    def result(self, name: str) -> dict[str, Any]:
        """A stage's result as written on disk ({} when the stage did not run or wrote none): for a look at the
        record itself; the library reads results typed (``typed`` and the methods below)."""
        rec = self.stage(name)
        return rec.result if rec is not None and isinstance(rec.result, dict) else {}

    def typed(self, name: str) -> Any:
        """A stage's typed result (deploybench.records.stage_result); None when it did not run or wrote none."""
        rec = self.stage(name)
        return stage_result(rec, self.dir) if rec is not None else None

    def preflight_result(self) -> PreflightStage | None:
        """Preflight's typed result (deploybench.records); None when it did not run or wrote no result."""
        return self.typed("preflight")

    def fanout_result(self) -> FanoutStage | None:
        return self.typed("fanout")

    def rollout_result(self) -> RolloutStage | None:
        return self.typed("rollout")

    def endpoints(self) -> list[dict[str, Any]]:
        """The engines the run's rollout left serving ({"node", "url", "model"} each); [] without a rollout."""
        ro = self.rollout_result()
        return list(ro.endpoints) if ro is not None else []

    def load_result(self) -> LoadStageResult | None:
        """The load stage's typed result; None when the load stage did not run or wrote no result."""
        return self.typed("load")


def run_status(records: dict[str, StageRecord]) -> str:
    """failed if any stage failed or a work stage never ran; else success."""
    if any(r.status == "failed" for r in records.values()):
        return "failed"
    return "success" if all(s in records for s in REQUIRED_STAGES) else "failed"


@contextlib.contextmanager
def recording(run_dir: Path, name: str) -> Iterator[StageRecord]:
    """Time a stage and write its record, success or failure. Yields the StageRecord the stage fills:
    ``result`` (what it measured) and ``summary`` (one line for people)."""
    rec = StageRecord(stage=name, status="running", started_at=now())
    t0 = time.monotonic()
    try:
        if name in LEASED_STAGES:
            from deploybench.lease import raise_if_lost

            raise_if_lost()  # the heartbeat found the lease broken or taken: no more work on the cluster
        yield rec
        rec.status = "success"
    except StageFailed as exc:
        rec.status, rec.error = "failed", str(exc)
        if exc.result is not None and rec.result is None:
            rec.result = exc.result
        raise
    except Exception as exc:
        rec.status, rec.error = "failed", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        rec.seconds = round(time.monotonic() - t0, 3)
        rec.finished_at = now()
        if rec.error is not None and not rec.summary:  # a failure's summary is its error
            rec.summary = rec.error[:300]
        save_record(run_dir, rec)
        log.info("stage %s: %s in %.1f s - %s", name, rec.status, rec.seconds, rec.summary)
