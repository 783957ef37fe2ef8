"""A matrix's plan as its cells' proof: what a run claiming to be a cell must be.

The matrix's ``plan`` task writes the plan (every cell: run id, conf, fingerprint) into the matrix's run
folder, which only deploybench's own tasks write. A cell's deploybench_run is an ordinary run with a
predictable run id (``matrix__<matrix run id>__c01``) and, for cells sharing a rollout, a hidden conf
section ``deployment`` (keep the engines for a named run and hand it the lease; adopt another run's
engines). Both would be holes if a form user could fake them: a run created first under a cell's run id
with another configuration would be measured and reported as that cell (Airflow's reset keeps a run's
conf), and a ``deployment`` section typed into any trigger conf would skip the lease queue.

``verify`` closes both at ``validate``, before anything touches a node:
- a run id of a matrix cell is accepted only when that matrix's plan lists it, with exactly this
  configuration (``deployment`` section and matrix tags included);
- a ``deployment`` section is accepted only on such a cell.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deploybench import params as form
from deploybench import paths
from deploybench.config import DeploymentSpec, RunConfig
from deploybench.errors import ConfigError
from deploybench.matrix import RUN_DAG_ID

PLAN_FILE = "plan.json"
MATRIX_DAG_ID = "deploybench_matrix"
# the run id of a matrix cell (deploybench.matrix.plan): matrix__<matrix run id>__c01, c01r2 for a repeat
CELL_RUN_ID = re.compile(r"^matrix__(?P<matrix>.+)__(?P<cell>c[0-9]{2,}(?:r[0-9]+)?)$")


def plan_path(matrix_key: str) -> Path:
    return paths.run_dir(matrix_key) / PLAN_FILE


def save(plan: dict[str, Any]) -> Path:
    """Write the plan (``Plan.to_dict()``) into its matrix's run folder, whole or not at all."""
    from deploybench.run import write_json

    path = plan_path(plan["matrix_key"])
    write_json(path, plan)
    return path


def read(matrix_key: str) -> dict[str, Any] | None:
    try:
        data = json.loads(plan_path(matrix_key).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("cells"), list) else None


def cell_of(run_key: str) -> tuple[str, str] | None:
    """(matrix key, cell id) when ``run_key`` is the key of a matrix cell's deploybench_run, else None."""
    prefix = f"{RUN_DAG_ID}__"
    m = CELL_RUN_ID.match(run_key[len(prefix):]) if run_key.startswith(prefix) else None
    return (paths.dag_run_key(MATRIX_DAG_ID, m["matrix"]), m["cell"]) if m else None


def cells_of(matrix_key: str) -> Callable[[str], bool]:
    """Whether a run key is one of ``matrix_key``'s cells (for the run files' sync: deploybench.store.run_files)."""
    return lambda key: (c := cell_of(key)) is not None and c[0] == matrix_key


def verify(run_key: str, cfg: RunConfig) -> None:
    """Refuse (ConfigError) a run that claims to be a matrix cell without being that cell as planned, and a
    ``deployment`` section on any other run (module docstring)."""
    cell = cell_of(run_key)
    if cell is None:
        if cfg.deployment != DeploymentSpec():
            raise ConfigError(
                f"run {run_key[:250]!r}: the 'deployment' section ({cfg.deployment.model_dump(exclude_defaults=True)}) "
                "is written by a config matrix's plan into its own cells' conf, never by a person: remove it "
                "(deploybench_matrix shares one rollout between cells that differ only in load or SLO)")
        return
    matrix_key, cell_id = cell
    plan = read(matrix_key)
    if plan is None:
        raise ConfigError(
            f"run {run_key[:250]!r}: its run id is that of cell {cell_id} of matrix {matrix_key!r}, which has no "
            f"plan ({plan_path(matrix_key)}); run ids matrix__<matrix run id>__cNN are kept for a matrix's cells: "
            "choose another run id, or trigger deploybench_matrix")
    planned = next((c for c in plan["cells"] if isinstance(c, dict) and c.get("run_key") == run_key
                    and c.get("action") == "run"), None)
    if planned is None:
        raise ConfigError(f"run {run_key[:250]!r}: matrix {matrix_key!r} plans no cell {cell_id} that runs as this "
                          "run; choose another run id")
    if diff := differences(cfg, form.to_config(planned.get("conf") or {})):
        raise ConfigError(
            f"run {run_key[:250]!r} is not cell {cell_id} as matrix {matrix_key!r} planned it: {diff}. A run created "
            "under a cell's run id with another configuration is refused, not measured as that cell: delete that "
            "run in Airflow and clear the matrix's cell, or trigger the matrix again")


def differences(cfg: RunConfig, want: RunConfig) -> str:
    """What ``cfg`` sets otherwise than the planned ``want`` ("load_rate=0.5 (planned 2.0); ..."), "" if nothing."""
    if cfg == want:
        return ""
    ours, theirs = _flat(cfg), _flat(want)
    diff = [f"{k}={ours.get(k)!r} (planned {theirs.get(k)!r})" for k in theirs | ours if ours.get(k) != theirs.get(k)]
    return "; ".join(diff[:6]) + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "")


def _flat(cfg: RunConfig) -> dict[str, Any]:
    return {**form.from_config(cfg), "deployment": cfg.deployment.model_dump(mode="json", exclude_defaults=True)}
