"""Shared fixtures. Tests never touch the user's state: DEPLOYBENCH_HOME points into a temp folder
per session unless a test needs the real one."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

# Every test session gets its own deploybench home (lab state, runs, embedded PostgreSQL,
# Airflow's metadata DB), so tests never touch the user's demo state. This must happen
# before anything imports Airflow, which reads its configuration at import time.
_OWN_HOME = "DEPLOYBENCH_HOME" not in os.environ
if _OWN_HOME:
    os.environ["DEPLOYBENCH_HOME"] = tempfile.mkdtemp(prefix="deploybench-test-")
from deploybench.airflow_env import airflow_env  # noqa: E402

os.environ.update(airflow_env())


@pytest.fixture(scope="session", autouse=True)
def _leave_nothing_running():
    """At the end of the session, stop the embedded PostgreSQL the tests started and drop the temp home."""
    yield
    if not _OWN_HOME:
        return
    from deploybench.store import embedded

    embedded.stop()
    shutil.rmtree(os.environ["DEPLOYBENCH_HOME"], ignore_errors=True)


def is_root() -> bool:
    return os.geteuid() == 0


def have(binary: str) -> bool:
    return shutil.which(binary) is not None


@pytest.fixture(scope="session")
def airflow_db():
    """Airflow's metadata DB (SQLite, in the session's home), migrated once."""
    from deploybench.airflow_env import metadata_db_ready

    env = dict(os.environ)
    if not metadata_db_ready(env):
        res = subprocess.run(["airflow", "db", "migrate"], env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
    return env


def run(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
