"""How a test session is set up: tests never touch the user's state (DEPLOYBENCH_HOME points into a temp
folder per session unless a test needs the real one), and how a parallel run groups tests on workers. The
fixtures tests ask for live in tests/support/fixtures.py, loaded from here as a plugin."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# Every test session gets its own deploybench home (lab state, runs, embedded PostgreSQL,
# Airflow's metadata DB), so tests never touch the user's demo state. This must happen
# before anything imports Airflow, which reads its configuration at import time.
# Under pytest-xdist every worker is a session of its own and inherits the controller's environment: a home
# the controller made for itself (DEPLOYBENCH_TEST_HOME) is not the user's, and each worker makes its own
# (a shared one would share an embedded PostgreSQL that one worker's test restarts under another's feet).
_OWN_HOME = os.environ.get("DEPLOYBENCH_HOME", "") in ("", os.environ.get("DEPLOYBENCH_TEST_HOME"))
if _OWN_HOME:
    os.environ["DEPLOYBENCH_HOME"] = os.environ["DEPLOYBENCH_TEST_HOME"] = tempfile.mkdtemp(prefix="deploybench-test-")
    # the controller of a parallel run never starts anything in it: its (empty) home goes at exit
    atexit.register(shutil.rmtree, os.environ["DEPLOYBENCH_HOME"], ignore_errors=True)
from deploybench.airflow.home import airflow_env  # noqa: E402

os.environ.update(airflow_env())

# the fixtures every test folder may ask for (dsn, wait_for, lab_name, netns_lab, time_limit, ...), and the
# helpers beside them: `from tests.support import store_fixtures` (tests/support/__init__.py)
pytest_plugins = ["tests.support.fixtures"]


@pytest.fixture(scope="session", autouse=True)
def _leave_nothing_running():
    """At the end of the session, stop the embedded PostgreSQL the tests started and drop the temp home."""
    yield
    if not _OWN_HOME:
        return
    from deploybench.store import embedded

    embedded.stop()
    shutil.rmtree(os.environ["DEPLOYBENCH_HOME"], ignore_errors=True)


# -- how `make test` runs the suite: in parallel (pytest-xdist), then the quiet part alone ------------------
# `make test` runs pytest twice: `-n N -m "not quiet"`, then `-m quiet` with no other test beside it. `quiet`
# marks tests whose assertions compare a measured speed with a model (capacity, latency, throughput, a 10 %
# slowdown): on 2 shared cores, a neighbour's CPU would be measured with them. In the parallel part the
# tests of one module stay together on one worker (they share the module's lab, database or Airflow), all
# of tests/browser share one (one Airflow per session) but for the modules with an Airflow of their own,
# and unit tests are spread one by one. Each worker is a session of its own: its own DEPLOYBENCH_HOME,
# embedded PostgreSQL and Airflow metadata database (the top of this file runs in every worker).
# A time limit is doubled in a worker (tests/support/fixtures.py: TIME_LIMIT_FACTOR).


# browser modules that start an Airflow of their own (AIRFLOW = "own" in the module): a unit each
OWN_AIRFLOW = {"tests/browser/test_matrix.py"}


def work_unit(nodeid: str) -> str:
    """The tests that must run on one worker, one after another, named by what they share."""
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/unit/"):
        return nodeid
    return "tests/browser" if path.startswith("tests/browser/") and path not in OWN_AIRFLOW else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's scheduler of work units (its --dist loadscope), grouped by ``work_unit``. Not --dist loadgroup:
    with pytest 9.2, xdist 3.8's group marks leave the test ids, which that scheduler reads, unchanged."""
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)
