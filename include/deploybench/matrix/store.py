"""What the results store knows about a matrix's cells before they run: which were measured, how long runs take.

Both read the ``runs`` table (and the run's software through its series). "Measured" is the
skip rule of the matrix: a stored run with status ``success``, not excluded from analysis, with
the cell's configuration fingerprint, the same SLO and the same software (engine, image).
"""

from __future__ import annotations

from typing import Any

from deploybench.config import RunConfig
from deploybench.engines import profile_name
from deploybench.matrix import measure_key


def measured(target: Any, cells: list[tuple[str, RunConfig]]) -> dict[str, list[str]]:
    """measure_key -> run keys that measured it, newest first (see the module doc)."""
    from sqlalchemy import select

    from deploybench.store.db import open_store
    from deploybench.store.models import Run, Series, Software

    fingerprints = sorted({cfg.fingerprint() for _, cfg in cells})
    wanted = {k for k, _ in cells}
    if not fingerprints:
        return {}
    engine = open_store(target)
    query = (select(Run.run_key, Run.config, Software.engine, Software.image)
             .outerjoin(Series, Series.id == Run.series_id).outerjoin(Software, Software.id == Series.software_id)
             .where(Run.fingerprint.in_(fingerprints), Run.status == "success", Run.excluded.is_(False))
             .order_by(Run.started_at.desc(), Run.run_key))
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    out: dict[str, list[str]] = {}
    for key, config, engine_name, image in rows:
        try:
            cfg = RunConfig.model_validate(config)
        except ValueError:
            continue  # a run stored under an older schema: not comparable
        if engine_name is not None and (engine_name, image) != (profile_name(cfg.engine), cfg.engine.image):
            continue  # the store saw other software than the config asked for (a backend's actual image)
        mk = measure_key(cfg)
        if mk in wanted:
            out.setdefault(mk, []).append(key)
    return out


def durations(target: Any, cfgs: list[RunConfig]) -> dict[str, float]:
    """fingerprint -> median wall seconds (started -> finished) of stored runs of that configuration."""
    from statistics import median

    from sqlalchemy import select

    from deploybench.store.db import open_store
    from deploybench.store.models import Run

    fingerprints = sorted({c.fingerprint() for c in cfgs})
    if not fingerprints:
        return {}
    engine = open_store(target)
    query = select(Run.fingerprint, Run.started_at, Run.finished_at).where(
        Run.fingerprint.in_(fingerprints), Run.finished_at.is_not(None))
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    seen: dict[str, list[float]] = {}
    for fp, started, finished in rows:
        if finished is None:  # not reached: the query keeps finished runs only
            continue
        seen.setdefault(fp, []).append((finished - started).total_seconds())
    return {fp: round(median(v), 1) for fp, v in seen.items() if v}
