"""Shared fixtures. Tests never touch the user's state: DEPLOYBENCH_HOME points into a temp folder
per session unless a test needs the real one."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import pytest

if TYPE_CHECKING:
    from deploybench.inventory import Inventory
    from deploybench.lab.state import LabFiles

# tests/integration/store_fixtures.py (stored runs built for the store, compare, history and page tests)
# is importable as `store_fixtures` from every test folder
sys.path.append(str(Path(__file__).resolve().parent / "integration"))  # last: it shadows no installed package

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


@pytest.fixture(scope="session", autouse=True)
def _leave_nothing_running():
    """At the end of the session, stop the embedded PostgreSQL the tests started and drop the temp home."""
    yield
    if not _OWN_HOME:
        return
    from deploybench.store import embedded

    embedded.stop()
    shutil.rmtree(os.environ["DEPLOYBENCH_HOME"], ignore_errors=True)


@pytest.fixture(scope="session")
def airflow_db():
    """Airflow's metadata DB (SQLite, in the session's home), migrated once."""
    from deploybench.airflow.home import metadata_db_ready

    env = dict(os.environ)
    if not metadata_db_ready(env):
        res = subprocess.run(["airflow", "db", "migrate"], env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
    return env


# -- how `make test` runs the suite: in parallel (pytest-xdist), then the quiet part alone ------------------
# `make test` runs pytest twice: `-n N -m "not quiet"`, then `-m quiet` with no other test beside it. `quiet`
# marks tests whose assertions compare a measured speed with a model (capacity, latency, throughput, a 10 %
# slowdown): on 2 shared cores, a neighbour's CPU would be measured with them. In the parallel part the
# tests of one module stay together on one worker (they share the module's lab, database or Airflow), all
# of tests/browser share one (one Airflow per session) but for the modules with an Airflow of their own,
# and unit tests are spread one by one. Each worker is a session of its own: its own DEPLOYBENCH_HOME,
# embedded PostgreSQL and Airflow metadata database (the top of this file runs in every worker).
PARALLEL = "PYTEST_XDIST_WORKER" in os.environ
TIME_LIMIT_FACTOR = 2 if PARALLEL else 1  # time_limit bounds a hang; on shared cores a test is slower


# browser modules that start an Airflow of their own (AIRFLOW_METADATA = "sqlite" in the module): a unit each
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("netns") and (why := needs_netns()):
            item.add_marker(pytest.mark.skip(reason=why))  # the one place a lab test is skipped: not root


def run(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(autouse=True)
def _time_limit(request: pytest.FixtureRequest) -> Iterator[None]:
    """``@pytest.mark.time_limit(s)`` (on a test, or in a module's ``pytestmark``): the test fails with a
    TimeoutError after ``s`` seconds instead of hanging the suite (pytest-timeout is not installed; SIGALRM
    interrupts the main thread, where pytest runs tests, also inside a blocking call)."""
    marker = request.node.get_closest_marker("time_limit")
    if marker is None:
        yield
        return
    seconds = int(marker.args[0]) * TIME_LIMIT_FACTOR

    def expired(signum: int, frame: object) -> None:
        scaled = f", {marker.args[0]} s x {TIME_LIMIT_FACTOR} in a parallel run" if TIME_LIMIT_FACTOR > 1 else ""
        raise TimeoutError(f"{request.node.nodeid} exceeded its {seconds} s bound (time_limit{scaled})")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


T = TypeVar("T")


def _wait_for(condition: Callable[[], T], timeout_s: float, what: str, every_s: float = 0.05) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(every_s)


@pytest.fixture
def wait_for() -> Callable[..., object]:
    """``wait_for(condition, timeout_s, what)``: poll ``condition`` until it returns something true (that
    value is returned); an AssertionError naming ``what`` after ``timeout_s``. For waiting on a state
    instead of sleeping a fixed time."""
    return _wait_for


def _throwaway_database() -> Iterator[str]:
    import store_fixtures

    test_dsn, _ = store_fixtures.make_database()
    try:
        yield test_dsn
    finally:
        store_fixtures.drop_database(test_dsn)


@pytest.fixture(scope="module")
def dsn() -> Iterator[str]:
    """A throwaway database on DEPLOYBENCH_DSN's server (else the embedded PostgreSQL, started if needed),
    for the tests of one module; dropped after the module's last test."""
    yield from _throwaway_database()


@pytest.fixture
def fresh_dsn() -> Iterator[str]:
    """Like ``dsn``, but a database of its own for each test."""
    yield from _throwaway_database()


def _lab_name(prefix: str) -> str:
    """A lab name nobody else uses (tests/integration/lab_names.py)."""
    import lab_names

    return lab_names.unique(prefix)


@pytest.fixture
def lab_name() -> Callable[[str], str]:
    """``lab_name(prefix)``: a unique lab name, for a test that brings a lab up and down itself."""
    return _lab_name


class Lab(NamedTuple):
    """A lab a test module brought up: ``name, inv, files = lab``."""

    name: str
    inv: Inventory
    files: LabFiles

    def wipe(self, nodes: list[str]) -> None:
        """Empty the model roots of ``nodes`` (a symlink is removed, never followed)."""
        for node in nodes:
            for child in self.files.models(node).iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()


def needs_netns() -> str | None:
    """Why a netns lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "a netns lab needs root"
    if shutil.which("sshd") is None and not os.path.exists("/usr/sbin/sshd"):
        return "a netns lab needs sshd (openssh-server)"
    return None


@pytest.fixture(scope="module")
def netns_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Lab]]:
    """``netns_lab(prefix, nodes=, link_mbit=, model_mb=, mode="netns", own_home=True)`` -> Lab: a lab for this
    module (own name, own DEPLOYBENCH_HOME), brought down after the module's last test whatever happened, also
    when bringing it up failed half-way. Skips where a netns lab cannot run. ``own_home=False`` keeps the
    session's DEPLOYBENCH_HOME: for a module that runs the DAG through dag.test(), whose Airflow home, runs
    and embedded PostgreSQL are the session's (and stopped at its end)."""
    from deploybench.lab import cluster
    from deploybench.lab.state import LabFiles

    if (why := needs_netns()) is not None:
        pytest.skip(why)
    names: list[str] = []
    with pytest.MonkeyPatch.context() as mp:

        def up(prefix: str, *, nodes: int, link_mbit: float, model_mb: int, mode: str = "netns",
               own_home: bool = True) -> Lab:
            if own_home and not names:  # the module's first lab decides where its state lives
                mp.setenv("DEPLOYBENCH_HOME", str(tmp_path_factory.mktemp("lab-home")))
            name = _lab_name(prefix)
            names.append(name)
            inv = cluster.up(name, nodes=nodes, link_mbit=link_mbit, mode=mode, model_mb=model_mb)
            return Lab(name, inv, LabFiles(name))

        try:
            yield up
        finally:
            for name in reversed(names):
                cluster.down(name)
