"""The fixtures every test folder may ask for, loaded as a pytest plugin (tests/conftest.py names it in
``pytest_plugins``): Airflow's metadata DB, a time limit that interrupts, waiting on a state, throwaway
databases, unique lab names and a module's netns lab (skipped where one cannot run). How the session
itself is set up (its own DEPLOYBENCH_HOME, the parallel run's work units) stays in tests/conftest.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import pytest

from tests.support import lab_names

if TYPE_CHECKING:
    from deploybench.inventory import Inventory
    from deploybench.lab.state import LabFiles

PARALLEL = "PYTEST_XDIST_WORKER" in os.environ  # a worker of `make test`'s parallel part (tests/conftest.py)
TIME_LIMIT_FACTOR = 2 if PARALLEL else 1  # time_limit bounds a hang; on shared cores a test is slower


@pytest.fixture(scope="session")
def airflow_db():
    """Airflow's metadata DB (SQLite, in the session's home), migrated once."""
    from deploybench.airflow.home import metadata_db_ready

    env = dict(os.environ)
    if not metadata_db_ready(env):
        res = subprocess.run(["airflow", "db", "migrate"], env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
    return env


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("netns") and (why := needs_netns()):
            item.add_marker(pytest.mark.skip(reason=why))  # the one place a lab test is skipped: not root
        if "airflow_db" in getattr(item, "fixturenames", ()):  # also through dag_test_run: `-m "not airflow"`
            item.add_marker(pytest.mark.airflow)


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
    from tests.support import store_fixtures  # pandas, SQLAlchemy, psycopg: only for the tests that ask

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
    """A lab name nobody else uses (tests/support/lab_names.py)."""
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
