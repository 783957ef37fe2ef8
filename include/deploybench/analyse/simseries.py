"""A series of stored runs against the simulated engine, for checking history's accuracy.

Each run is a real, short k6 phase (``deploybench.load.run_load``) against simulated engines
on 127.0.0.1, stored with its samples like a DAG run. From run ``change_at`` on, the engines
run with ``slowdown`` (every service time multiplied by it): the software regression that
history must flag at that run. The slowdown knob is not part of the series identity
(``store.identity.FAULT_KNOBS``), so every run lands in the same series.

Used by the accuracy test (tests/integration/test_history_accuracy.py) and by
bench/history_accuracy.py, which repeats it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from deploybench.sim.local import LocalEngines

if TYPE_CHECKING:
    from deploybench.load import Endpoint

log = logging.getLogger(__name__)

MODEL = "sim-model"
ENGINE_START_S = 30.0


@contextmanager
def engines(n: int, model_dir: Path, log_dir: Path, slowdown: float = 1.0) -> Iterator[list[Endpoint]]:
    """``n`` simulated engines on 127.0.0.1 (one per "node"), stopped on exit whatever happens."""
    with LocalEngines(model_dir, log_dir, model=MODEL, start_timeout_s=ENGINE_START_S) as local:
        yield local.start(n, "--slowdown", repr(slowdown))


def run_series(dsn: str, prefix: str, n_runs: int, workdir: Path, *, change_at: int | None = None,
               slowdown: float = 1.1, nodes: int = 1, rate: float = 10.0, duration_s: float = 3.0,
               warmup_s: float = 0.5, prompt_tokens: int = 32, output_tokens: int = 16) -> list[str]:
    """Store ``n_runs`` runs of one series; from index ``change_at`` on the engines are slowed down."""
    from deploybench.config import SLO, LoadSpec
    from deploybench.load import run_load
    from deploybench.manifest import seed_model
    from deploybench.store import RunRecord, write_run
    from deploybench.store.facts import RunFacts
    from deploybench.store.identity import identity_of
    from deploybench.store.ingest import phase_records

    workdir = Path(workdir)
    model_dir = workdir / "model"
    if not model_dir.is_dir():
        seed_model(model_dir, total_mb=1)
    spec = LoadSpec(rate=rate, duration_s=duration_s, warmup_s=warmup_s, prompt_tokens=prompt_tokens,
                    output_tokens=output_tokens, request_timeout_s=10)
    slo = SLO(p99_latency_ms=5000, max_error_rate=0.05)
    names = [f"n{i + 1}" for i in range(nodes)]
    keys: list[str] = []
    current: float | None = None
    stack = None
    try:
        for i in range(n_runs):
            factor = slowdown if change_at is not None and i >= change_at else 1.0
            if factor != current:
                if stack is not None:
                    stack.__exit__(None, None, None)
                stack = engines(nodes, model_dir, workdir, factor)
                eps = stack.__enter__()
                current = factor
            key = f"{prefix}/run_{i:02d}"
            started = datetime.now(UTC)
            got = run_load(eps, spec, slo, workdir / f"run_{i:02d}", phase="sustained", tags={"run": key})
            res = got.model_dump(mode="json")
            # the prefix names the cluster: two series of the same setup stay two series
            cfg = {"inventory": f"sim-{prefix}", "nodes": nodes, "model": {"name": MODEL},
                   "engine": {"profile": "sim", "max_num_seqs": 8, "sim": {"slowdown": factor}},
                   "load": spec.model_dump(mode="json"), "slo": slo.model_dump(mode="json")}
            facts = RunFacts(identity=identity_of(cfg, names, None, {"model": MODEL}, {"profile": "sim"}))
            record = RunRecord(run_key=key, dag_id="simseries", status="success", started_at=started,
                               finished_at=datetime.now(UTC), config=cfg, fingerprint=prefix,
                               inventory=f"sim-{prefix}", node_count=nodes, trigger="cli", tags={"series": prefix})
            write_run(dsn, record, [], phase_records(got), got.samples_path, facts=facts)
            log.info("series %s run %d (slowdown %.2f): P50 %.1f ms P99 %.1f ms", prefix, i, factor,
                     res["latency_p50_ms"] or -1, res["latency_p99_ms"] or -1)
            keys.append(key)
    finally:
        if stack is not None:
            stack.__exit__(None, None, None)
    return keys
