"""The environment a project-local Airflow runs with (no Airflow import here).

The demo, the tests and anyone running `airflow ...` by hand in this checkout share
one AIRFLOW_HOME under .deploybench/, with this checkout's dags/ and plugins/.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from deploybench import paths


def airflow_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    home = paths.home() / "airflow"
    home.mkdir(parents=True, exist_ok=True)
    env.setdefault("AIRFLOW_HOME", str(home))
    env["AIRFLOW__CORE__DAGS_FOLDER"] = str(paths.PROJECT_ROOT / "dags")
    env["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(paths.PROJECT_ROOT / "plugins")
    env["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    env.setdefault("AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT", "120")
    env.setdefault("AIRFLOW__LOGGING__LOGGING_LEVEL", "INFO")
    bindir = str(Path(sys.executable).parent)
    if bindir not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def metadata_db_ready(env: dict[str, str]) -> bool:
    return (Path(env["AIRFLOW_HOME"]) / "airflow.db").is_file()


WORKER_NAME_ENV = "DEPLOYBENCH_WORKER_NAME"


def worker_hostname() -> str:
    """The host name a worker reports for its task instances (``[core] hostname_callable``): $DEPLOYBENCH_WORKER_NAME,
    else the machine's. For workers that share a network namespace (the compose stack's Celery workers share the
    lab's, and so Docker gives them one host name), so that the Grid and the REST API tell them apart."""
    import socket

    return os.environ.get(WORKER_NAME_ENV, "").strip() or socket.getfqdn()
