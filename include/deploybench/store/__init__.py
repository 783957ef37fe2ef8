"""The results store: every run, its stages, load phases and raw samples in PostgreSQL.

Public API (what the DAG's store task and the report call)::

    from deploybench.store import RunRecord, StageRow, PhaseRecord, write_run, load_run

    write_run(dsn_or_engine_or_None, run, stages, phases, samples_frame_or_path, facts=RunFacts(...))

``facts`` (revision 0002) carries the run's identities — cluster, software, model artifact,
serving config, workload, each unique on a canonical hash, and the series over them — and
the facts of every stage. ``query`` selects runs (by key or filter) for ``deploybench.analyse``.

The DSN is resolved by ``deploybench.store.db`` (argument > DEPLOYBENCH_DSN > embedded
PostgreSQL); the schema is the Alembic migrations in ``migrations/``, applied by every
open. Nothing here imports Airflow, and importing this package opens no connection.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> submodule; imported on first use, so `deploybench store --help` (and every other
# command, which imports deploybench.cli.store) does not pay for pandas and SQLAlchemy
_EXPORTS = {
    "migrate": "db",
    "open_store": "db",
    "resolve_dsn": "db",
    "StoreError": "errors",
    "count_samples": "reader",
    "latest_runs": "reader",
    "load_run": "reader",
    "load_samples": "reader",
    "CLUSTER": "rows",
    "SAMPLE_COLUMNS": "rows",
    "PhaseRecord": "rows",
    "RunRecord": "rows",
    "StageRow": "rows",
    "StoredRun": "rows",
    "WriteResult": "writer",
    "write_run": "writer",
    "RunFacts": "facts",
    "RunIdentity": "identity",
    "identity_of": "identity",
    "RunFilter": "query",
    "EmptySelection": "query",
    "UnknownRuns": "query",
    "select_runs": "query",
    "set_excluded": "query",
}

if TYPE_CHECKING:
    from deploybench.store.db import migrate, open_store, resolve_dsn
    from deploybench.store.errors import StoreError
    from deploybench.store.facts import RunFacts
    from deploybench.store.identity import RunIdentity, identity_of
    from deploybench.store.query import EmptySelection, RunFilter, UnknownRuns, select_runs, set_excluded
    from deploybench.store.reader import count_samples, latest_runs, load_run, load_samples
    from deploybench.store.rows import (
        CLUSTER,
        SAMPLE_COLUMNS,
        PhaseRecord,
        RunRecord,
        StageRow,
        StoredRun,
    )
    from deploybench.store.writer import WriteResult, write_run


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "CLUSTER",
    "EmptySelection",
    "RunFacts",
    "RunFilter",
    "RunIdentity",
    "UnknownRuns",
    "identity_of",
    "select_runs",
    "set_excluded",
    "SAMPLE_COLUMNS",
    "PhaseRecord",
    "RunRecord",
    "StageRow",
    "StoreError",
    "StoredRun",
    "WriteResult",
    "count_samples",
    "latest_runs",
    "load_run",
    "load_samples",
    "migrate",
    "open_store",
    "resolve_dsn",
    "write_run",
]
