"""Helpers for tests that drive the Airflow UI in headless Chromium (tests/browser)."""

from __future__ import annotations


def park(driver) -> None:
    """Leave the Airflow UI for a blank page before a long wait on a run: a live DAG page re-renders as the run
    moves (headless, in software), and its renderer was measured using a third of a core while a run went on
    (50 CPU-s in 133 s beside the parallel part's tests; 87 CPU-s in 480 s during the backfill test), CPU taken
    from the run being waited for and from every other test. The next look at the UI loads its page again."""
    driver.get("about:blank")


# Chromium abandons a page load when an interface's address changes under it ("Your connection was interrupted",
# net::ERR_NETWORK_CHANGED), and the lab tests that run beside the browser tests add and remove bridges and veth
# pairs on this machine: such a page is loaded again, as a person would press Reload; no other error page is.
NETWORK_CHANGED = "ERR_NETWORK_CHANGED"
RELOADS = 3


def _reloaded_if_network_changed(driver, reloads: list[int]) -> bool:
    """Reload the current document (the frame, when inside one) if it is Chromium's ERR_NETWORK_CHANGED page; at
    most RELOADS times in one wait."""
    if len(reloads) >= RELOADS or NETWORK_CHANGED not in (driver.page_source or ""):
        return False
    reloads.append(1)
    print(f"browser: {NETWORK_CHANGED} (a lab changed this machine's interfaces): reloading, {len(reloads)} of "
          f"{RELOADS}")
    driver.execute_script("location.reload()")
    return True


def wait(driver, timeout_s: float, poll_frequency: float = 0.25, ignored_exceptions: tuple = ()):
    """A WebDriverWait that, while its condition is not met, reloads Chromium's ERR_NETWORK_CHANGED page (every
    browser test waits through this)."""
    from selenium.common.exceptions import NoSuchElementException
    from selenium.webdriver.support.ui import WebDriverWait

    ignored = (NoSuchElementException, *ignored_exceptions)  # NoSuchElement: what WebDriverWait ignores by default

    class Wait(WebDriverWait):
        def until(self, method, message: str = ""):
            reloads: list[int] = []

            def met(d):
                try:
                    if value := method(d):
                        return value
                except ignored:
                    pass
                _reloaded_if_network_changed(d, reloads)
                return False

            return super().until(met, message)

    return Wait(driver, timeout_s, poll_frequency=poll_frequency, ignored_exceptions=ignored)
