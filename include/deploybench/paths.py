"""Where deploybench keeps its state on the controller.

Everything lives under one project-local folder (``.deploybench/`` beside the
checkout, or ``$DEPLOYBENCH_HOME``), so a second run finds what the first left and
``rm -rf .deploybench`` resets the machine.
"""

from __future__ import annotations

import os
from pathlib import Path

# include/deploybench/paths.py -> the checkout root
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def home() -> Path:
    """The state folder: $DEPLOYBENCH_HOME, else <checkout>/.deploybench."""
    env = os.environ.get("DEPLOYBENCH_HOME")
    path = Path(env) if env else PROJECT_ROOT / ".deploybench"
    path.mkdir(parents=True, exist_ok=True)
    return path


def lab_dir(name: str) -> Path:
    return home() / "lab" / name


def runs_dir() -> Path:
    """Artifacts of every run (k6 samples, stage records, reports), one folder per run key.

    With a distributed executor this folder must be shared by all workers
    (set DEPLOYBENCH_HOME to a shared volume)."""
    path = home() / "runs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def dag_run_key(dag_id: str, run_id: str) -> str:
    """The run key of an Airflow DAG run: the results store's idempotency key and the run folder's name."""
    return f"{dag_id}__{run_id}"


def run_dir(run_key: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_key)
    path = runs_dir() / safe
    path.mkdir(parents=True, exist_ok=True)
    return path


def k6_dir() -> Path:
    return PROJECT_ROOT / "k6"
