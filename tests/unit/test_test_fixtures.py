"""The shared helpers of tests/conftest.py that every other test leans on: a time limit that really
interrupts, and a wait that returns what it waited for or names what never came."""

from __future__ import annotations

import time

import pytest


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
