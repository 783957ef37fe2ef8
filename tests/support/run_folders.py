"""A run folder with every stage's record, as the pipeline leaves it (``from tests.support import
run_folders``): for the report's tests without a database, the unit plots test and the
Chromium render test alike."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import pandas as pd

from deploybench.config import RunConfig
from deploybench.fanout.result import FanoutResult, NodeCopy
from deploybench.preflight.model import LinkTest, PreflightResult
from deploybench.records import StageRecord
from deploybench.run import Run, save_record
from tests.support.load_records import T0, write_load_stage


def window_samples(n: int = 300, phase: str = "sustained") -> pd.DataFrame:
    """``n`` requests at 20 req/s on node n1 from T0, the last 10 of them HTTP 503; latencies log-normal."""
    rng = np.random.default_rng(1)
    return pd.DataFrame({"ts": [T0 + timedelta(seconds=i / 20) for i in range(n)], "phase": phase, "node": "n1",
                         "status": [200] * (n - 10) + [503] * 10, "error_kind": None,
                         "latency_ms": rng.lognormal(6, 0.2, n), "ttft_ms": None, "prompt_tokens": 32,
                         "output_tokens": 8})


def make_run_folder(tmp_path: Path) -> Run:
    """A run with every stage's record in ``tmp_path``: validate, preflight, fanout and the load stage."""
    samples = pd.concat([window_samples(), window_samples(200, "overload")])
    samples.to_csv(tmp_path / "samples.csv", index=False)
    # the stages' own result types, as the stages write them (deploybench.records reads them back typed)
    preflight = PreflightResult([], [LinkTest("n1", "n2", 0, 1000.0, mbit=950.0, ratio=0.95, ok=True)], ["n1", "n2"],
                                {}, "all healthy", 1.0)
    fanout = FanoutResult("sim-model", "d" * 64, 2**20, [], "n1", "chain",
                          [NodeCopy("n2", "copied", bytes=2**20, seconds=1.0, verified=True, started_at=0.1)])
    results = {"validate": {"nodes": ["n1", "n2"]}, "preflight": preflight.to_dict(), "fanout": fanout.to_dict(),
               "load": write_load_stage(tmp_path / "load", str(tmp_path / "samples.csv"))}
    for stage, result in results.items():
        save_record(tmp_path, StageRecord(stage=stage, status="success", started_at=T0.isoformat(), seconds=0.1,
                                          summary="ok", result=result))
    return Run("deploybench_run/r1", tmp_path, RunConfig(inventory="lab"), None, ["n1", "n2"], {})  # type: ignore[arg-type]
