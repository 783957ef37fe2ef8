"""Where deploybench keeps its state on the controller.

Everything lives under one project-local folder (``.deploybench/`` beside the
checkout, or ``$DEPLOYBENCH_HOME``), so a second run finds what the first left and
``rm -rf .deploybench`` resets the machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
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

    With a distributed executor it needs no sharing: each task pulls a run's folder from the results database
    and pushes what it wrote (deploybench.store.run_files)."""
    path = home() / "runs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def dag_run_key(dag_id: str, run_id: str) -> str:
    """The run key of an Airflow DAG run: the results store's idempotency key and the run folder's name."""
    return f"{dag_id}__{run_id}"


_KEPT = frozenset(string.ascii_letters + string.digits + "-_.")


def run_folder_name(run_key: str) -> str:
    """The run folder's name: injective, so two run keys never share a folder. ASCII letters, digits, ``-``,
    ``_`` and ``.`` stand for themselves (a key made of them only keeps its name); any other character, and a
    leading ``.`` (no hidden folder, no ``..``), is ``~`` and its UTF-8 bytes in hex (``:`` -> ``~3A``).
    Since ``~`` itself is escaped, the name decodes to exactly one key. Airflow's run ids may hold ``:``,
    ``+`` and ``~``. A name past what a file system takes (255 bytes) is cut and ends in ``~~`` and the key's
    sha256 (no escaped name holds ``~~``)."""
    name = "".join(c if c in _KEPT and not (i == 0 and c == ".") else "".join(f"~{b:02X}" for b in c.encode())
                   for i, c in enumerate(run_key))
    if len(name) > 200:
        name = name[:130].rstrip("~0123456789ABCDEF") + "~~" + hashlib.sha256(run_key.encode()).hexdigest()
    return name


def _legacy_folder_name(run_key: str) -> str:
    """The name run folders had before run_folder_name: every other character as ``_`` (not injective)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in run_key)


def folder_run_key(folder: Path) -> str | None:
    """The run key a run folder's ``run.json`` names; None when it has none (not validated yet)."""
    try:
        key = json.loads((folder / "run.json").read_text()).get("run_key")
    except (OSError, ValueError, AttributeError):
        return None
    return key if isinstance(key, str) else None


def run_dir(run_key: str) -> Path:
    """The run's folder under runs_dir(), created if missing (``run_folder_name``). A run validated before
    the names became injective keeps its old folder, but only while that folder's run.json names this very
    key: a key that merely maps to the same old name never reads another run's folder."""
    path = runs_dir() / run_folder_name(run_key)
    if not path.exists():
        legacy = runs_dir() / _legacy_folder_name(run_key)
        if legacy != path and legacy.is_dir() and folder_run_key(legacy) == run_key:
            return legacy
    path.mkdir(parents=True, exist_ok=True)
    return path


def k6_dir() -> Path:
    return PROJECT_ROOT / "k6"
