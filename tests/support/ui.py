"""Helpers for tests that drive the Airflow UI in headless Chromium (tests/browser)."""

from __future__ import annotations


def park(driver) -> None:
    """Leave the Airflow UI for a blank page before a long wait on a run: a live DAG page re-renders as the run
    moves (headless, in software), and its renderer was measured using a third of a core while a run went on
    (50 CPU-s in 133 s beside the parallel part's tests; 87 CPU-s in 480 s during the backfill test), CPU taken
    from the run being waited for and from every other test. The next look at the UI loads its page again."""
    driver.get("about:blank")
