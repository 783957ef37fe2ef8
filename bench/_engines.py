"""Simulated engines on 127.0.0.1 for the load benchmarks (subprocesses, stopped on exit)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from deploybench.config import EngineSpec
from deploybench.load import Endpoint
from deploybench.manifest import seed_model
from deploybench.sim.local import MODEL, LocalEngines

__all__ = ["MODEL", "local_engines"]


@contextlib.contextmanager
def local_engines(engine: EngineSpec, n: int) -> Iterator[list[Endpoint]]:
    with tempfile.TemporaryDirectory(prefix="db-bench-") as tmp:
        seed_model(Path(tmp) / "model", total_mb=1)
        with LocalEngines(Path(tmp) / "model", Path(tmp)) as local:
            yield local.start(n, engine=engine)
