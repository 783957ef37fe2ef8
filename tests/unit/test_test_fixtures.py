"""The shared helpers of tests/conftest.py and tests/support/fixtures.py that every other test leans on: a
time limit that really interrupts, a wait that returns what it waited for or names what never came, and the
work units of a parallel run."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.time_limit(1)
def test_time_limit_interrupts_a_blocking_call():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"exceeded its (1 s bound \(time_limit\)|2 s bound \(time_limit, 1 s x 2)"):
        time.sleep(10)
    assert time.monotonic() - t0 < 5


def test_without_the_marker_there_is_no_alarm():
    import signal

    assert signal.alarm(0) == 0  # no alarm was pending


def test_wait_for_returns_the_value_it_waited_for(wait_for):
    ready_at = time.monotonic() + 0.2
    got = wait_for(lambda: ["ready"] if time.monotonic() >= ready_at else [], 5, "the list")
    assert got == ["ready"] and time.monotonic() >= ready_at


def test_wait_for_names_what_never_came(wait_for):
    with pytest.raises(AssertionError, match=r"not within 0.2 s: the pid file"):
        wait_for(lambda: False, 0.2, "the pid file")


def _root_conftest(config: pytest.Config):
    return next(p for p in config.pluginmanager.get_plugins()
                if str(getattr(p, "__file__", "")).endswith("tests/conftest.py"))


def test_parallel_work_units_keep_what_shares_state_on_one_worker(request):
    conftest = _root_conftest(request.config)
    unit = conftest.work_unit
    # a module's tests share its lab/database: one unit; unit tests go one by one
    assert unit("tests/integration/test_fanout.py::test_a") == unit("tests/integration/test_fanout.py::test_b[x]")
    assert unit("tests/integration/test_fanout.py::test_a") != unit("tests/integration/test_lab.py::test_a")
    assert unit("tests/unit/test_config.py::test_a") != unit("tests/unit/test_config.py::test_b")
    assert unit("tests/unit/load/test_load.py::test_a") != unit("tests/unit/load/test_load.py::test_b")
    # the browser modules share the session's Airflow, but for those that start their own
    assert unit("tests/browser/test_ui.py::test_a") == unit("tests/browser/test_lifecycle.py::test_b")
    own = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "browser").glob("test_*.py")
           if re.search(r"^AIRFLOW = \"own\"", p.read_text(), re.M)}
    assert own == conftest.OWN_AIRFLOW, "tests/conftest.py's OWN_AIRFLOW must list the modules with their own Airflow"
    for path in own:
        assert unit(f"{path}::test_a") == path != unit("tests/browser/test_ui.py::test_a")
