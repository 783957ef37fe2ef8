"""The Airflow UI as a person meets it, in headless Chromium against a real Airflow (issue 11).

Log in, open deploybench_run, press Trigger: with the defaults the form must be submittable (no
section flagged red, the modal's Trigger button enabled). Then point the form at a 2-node lab and
shorten the run (fields in the Cluster, Preflight and Load sections), trigger, wait for the run to succeed, and
read what a person reads: the run's "Benchmark results" tab, the series history and the comparison
page of the results plugin, checked against what the run stored.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from urllib.parse import quote

import pytest

from deploybench import paths

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")  # Debian's packages
pytestmark = [
    pytest.mark.browser, pytest.mark.integration,
    pytest.mark.skipif(not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()),
                       reason="needs Debian's chromium and chromium-driver (.ci/bootstrap installs them)"),
]
pytest.importorskip("selenium", reason="needs the selenium wheel (requirements-test.txt)")
from selenium.common.exceptions import ElementClickInterceptedException, TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support import expected_conditions as ec  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

DAG_ID = "deploybench_run"
LAB_NODES = 2  # the lab_inventory fixture's
PAGE_TIMEOUT_S = 60
FORM_TIMEOUT_S = 30
RUN_TIMEOUT_S = 480
STAGES = ("validate", "preflight", "fanout", "rollout", "load", "teardown")

# What the test changes in the form (field, value), by section; everything else keeps its default.
LOAD_DURATION_S = 8
CHANGES = {
    "Preflight": [("link_threshold", "0.5")],  # 2 s iperf3 tests on a busy 2-core machine read ~75 %
    # 16 output tokens: P99 ~0.4 s instead of ~1.9 s with the default 64, far from the 2 s SLO that the
    # rollout gates enforce (a loaded machine must not fail the run)
    "Load": [("load_duration_s", str(LOAD_DURATION_S)), ("warmup_s", "2"), ("output_tokens", "16")],
}


def _wait(driver, timeout_s: float = PAGE_TIMEOUT_S) -> WebDriverWait:
    return WebDriverWait(driver, timeout_s, poll_frequency=0.25)


# -- the trigger form ------------------------------------------------------------------------------
_SECTIONS_JS = """
return [...arguments[0].querySelectorAll('[data-part=item-trigger]')].map(b => {
  const title = b.querySelector('p') || b;
  return {name: b.innerText.trim(), icon: !!b.querySelector(':scope > div:first-child svg'),
          color: getComputedStyle(title).color, expanded: b.getAttribute('aria-expanded') === 'true'};
});
"""
_EMPTY_REQUIRED_JS = """
return [...arguments[0].querySelectorAll('input[required], textarea[required]')]
  .filter(e => e.value === '').map(e => e.name || e.id);
"""


def is_red(css_color: str) -> bool:
    """Whether a computed CSS colour is a red (Chakra's error colour; oklch in Chromium 15x)."""
    nums = [float(x) for x in re.findall(r"[-\d.]+", css_color)]
    if css_color.startswith("oklch") and len(nums) >= 3:
        _, chroma, hue = nums[:3]
        return chroma > 0.1 and (hue < 45 or hue > 330)
    if css_color.startswith("rgb") and len(nums) >= 3:
        r, g, b = nums[:3]
        return r > 150 and g < 110 and b < 110
    return False


def flagged_sections(dialog) -> list[str]:
    """Sections whose title is drawn red or carries the error icon."""
    sections = dialog.parent.execute_script(_SECTIONS_JS, dialog)
    return [s["name"] for s in sections if s["icon"] or is_red(s["color"])]


def open_trigger_form(driver, url: str):
    """The trigger modal of deploybench_run, as the "Trigger" button on the DAG page opens it."""
    driver.get(f"{url}/dags/{DAG_ID}")
    _wait(driver).until(ec.element_to_be_clickable((By.XPATH, "//button[normalize-space()='Trigger']"))).click()
    dialog = _wait(driver).until(lambda d: next(
        (e for e in d.find_elements(By.CSS_SELECTOR, "[role=dialog][data-state=open]")
         if "Trigger Dag" in e.text and e.find_elements(By.CSS_SELECTOR, "[data-part=item-trigger]")), None))
    return dialog


def submit_button(dialog):
    return dialog.find_element(By.CSS_SELECTOR, "[data-testid=trigger-dag-submit]")


def assert_submittable(dialog, state: str) -> None:
    """Enabled Trigger button and no red section, after the form has validated its fields (bounded);
    ``state`` says which values the form holds, for the failure message."""
    deadline = time.monotonic() + FORM_TIMEOUT_S
    steady_since = None
    while time.monotonic() < deadline:
        ok = submit_button(dialog).is_enabled() and not flagged_sections(dialog)
        if ok and steady_since is None:
            steady_since = time.monotonic()
        if not ok:
            steady_since = None
        if steady_since is not None and time.monotonic() - steady_since >= 2:  # stays so once validated
            return
        time.sleep(0.25)
    driver = dialog.parent
    pytest.fail(
        f"the trigger form cannot be submitted {state}: Trigger button "
        f"{'enabled' if submit_button(dialog).is_enabled() else 'DISABLED'}, sections flagged red: "
        f"{flagged_sections(dialog)}, required fields left empty: {driver.execute_script(_EMPTY_REQUIRED_JS, dialog)}"
    )


def _still(element, timeout_s: float = 10) -> None:
    """Scroll ``element`` to the middle and wait until it stops moving (a section opens with an animation)."""
    driver = element.parent
    last = None

    def settled(_):
        nonlocal last
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
        now = element.rect
        done, last = now == last, now
        return done

    _wait(driver, timeout_s).until(settled)
    time.sleep(0.1)


def _click(element) -> None:
    """Click as a person does; if something still covers the element (an animation), wait for it to
    settle and click again, and at last click it from script (which also gives it the focus)."""
    for _ in range(2):
        try:
            element.click()
            return
        except ElementClickInterceptedException:
            _still(element)
    element.parent.execute_script("arguments[0].click(); arguments[0].focus()", element)


def set_field(dialog, section: str, name: str, value: str) -> None:
    """Open ``section`` and type ``value`` into the field ``name`` (select all, then type, as a person)."""
    trigger = next(b for b in dialog.find_elements(By.CSS_SELECTOR, "[data-part=item-trigger]")
                   if b.text.strip() == section)
    if trigger.get_attribute("aria-expanded") != "true":
        _still(trigger)
        _click(trigger)
    field = _wait(dialog.parent, 10).until(lambda d: next(
        (e for e in dialog.find_elements(By.CSS_SELECTOR, f"[name=element_{name}]") if e.is_displayed()), None))
    _still(field)
    shown = None
    for _ in range(3):
        _click(field)
        field.send_keys(Keys.CONTROL, "a")
        field.send_keys(Keys.DELETE)
        for char in value:  # key by key: the form re-renders on every change and drops keys sent in a burst
            field.send_keys(char)
            time.sleep(0.02)
        field.send_keys(Keys.TAB)
        try:
            _wait(dialog.parent, 3).until(lambda d: field.get_attribute("value") == value)
            return
        except TimeoutException:
            shown = field.get_attribute("value")
    pytest.fail(f"field {name} in section {section} shows {shown!r} after typing {value!r} three times")


# -- the run ---------------------------------------------------------------------------------------
def _run_ids(airflow) -> set[str]:
    runs = airflow.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns?limit=100")["dag_runs"]
    return {r["dag_run_id"] for r in runs}


def _why_failed(airflow, run_id: str) -> dict:
    tis = airflow.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances")
    states = {t["task_id"] + (f"[{t['map_index']}]" if t["map_index"] >= 0 else ""): t["state"]
              for t in tis["task_instances"]}
    stages = paths.run_dir(paths.dag_run_key(DAG_ID, run_id)) / "stages"
    errors = {p.stem: json.loads(p.read_text()).get("error") for p in stages.glob("*.json")}
    return {"tasks": states, "stage errors": {k: v for k, v in errors.items() if v}}


@pytest.fixture(scope="module")
def form_run(airflow, browser, lab_inventory, results_dsn, shot) -> dict:
    """A run triggered from the form (the lab's inventory, and CHANGES), finished; with its stored results."""
    before = _run_ids(airflow)
    dialog = open_trigger_form(browser, airflow.url)
    set_field(dialog, "Cluster", "inventory", str(lab_inventory))
    for section, changes in CHANGES.items():
        for name, value in changes:
            set_field(dialog, section, name, value)
    assert_submittable(dialog, "with the test's changes")
    shot("02-trigger-form-changed")
    submit_button(dialog).click()
    new = airflow.wait_for("the triggered run", lambda: _run_ids(airflow) - before, 30, every_s=0.5)
    assert len(new) == 1, new
    run_id = new.pop()
    run = airflow.wait_for(
        f"run {run_id} to finish",
        lambda: (r := airflow.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}"))["state"]
        in ("success", "failed") and r,
        RUN_TIMEOUT_S, every_s=2,
    )
    assert run["state"] == "success", _why_failed(airflow, run_id)
    from deploybench.store import load_run

    key = paths.dag_run_key(DAG_ID, run_id)
    stored = load_run(results_dsn, key)
    assert stored is not None, f"run {key} is not in the results database the connection names"
    return {"run_id": run_id, "key": key, "conf": run["conf"], "stored": stored}


# -- tests -----------------------------------------------------------------------------------------
def test_trigger_form_can_be_submitted_with_its_defaults(airflow, browser, shot):
    dialog = open_trigger_form(browser, airflow.url)
    shot("01-trigger-form-defaults")
    sections = [s["name"] for s in browser.execute_script(_SECTIONS_JS, dialog)]
    for section in ("Cluster", "Preflight", "Rollout", "Load", "SLO"):
        assert section in sections, sections
    assert_submittable(dialog, "with its defaults")


def test_the_run_gets_what_was_typed_into_the_form(form_run, lab_inventory):
    conf = form_run["conf"]
    assert conf["inventory"] == str(lab_inventory)
    for changes in CHANGES.values():
        for name, value in changes:
            assert float(conf[name]) == float(value), (name, conf[name])
    stored = form_run["stored"]
    assert stored.run.status == "success"
    assert stored.run.node_count == LAB_NODES
    assert {s.stage: s.status for s in stored.stages}.keys() >= set(STAGES)


# -- the results pages -----------------------------------------------------------------------------
_TABLE_JS = """
const h = [...document.querySelectorAll('h2')].find(e => e.textContent.trim() === arguments[0]);
let t = h && h.nextElementSibling;
while (t && t.tagName !== 'TABLE') t = t.querySelector('table') || t.nextElementSibling;
if (!t) return null;
const head = [...t.querySelectorAll('tr')][0];
const names = [...head.children].map(c => c.innerText.trim());
return [...t.querySelectorAll('tr')].slice(1).map(r =>
  Object.fromEntries([...r.children].map((c, i) => [names[i], c.innerText.trim()])));
"""


def table_under(driver, heading: str) -> list[dict[str, str]]:
    """The rows of the first table after the <h2> ``heading``, as {column header: cell text}."""
    rows = driver.execute_script(_TABLE_JS, heading)
    assert rows is not None, f"no table under the heading {heading!r}; the page says:\n{body_text(driver)[:2000]}"
    return rows


def body_text(driver) -> str:
    return driver.find_element(By.TAG_NAME, "body").text


def heading(driver, timeout_s: float = PAGE_TIMEOUT_S) -> str:
    """The page's <h1> once it is there (an error page of the plugin has '<h1>404</h1>' etc.)."""
    return _wait(driver, timeout_s).until(
        lambda d: (h := d.find_elements(By.TAG_NAME, "h1")) and h[0].text.strip()) or ""


def open_results_tab(driver, url: str, run_id: str) -> str:
    """The run's page in Airflow, then its "Benchmark results" tab; the driver is left inside the tab's
    frame. Returns the frame's heading."""
    driver.switch_to.default_content()
    driver.get(f"{url}/dags/{DAG_ID}/runs/{quote(run_id, safe='')}")
    tab = _wait(driver).until(ec.element_to_be_clickable(
        (By.XPATH, "//a[normalize-space()='Benchmark results'] | //button[normalize-space()='Benchmark results']")))
    tab.click()
    frame = _wait(driver).until(ec.presence_of_element_located((By.TAG_NAME, "iframe")))
    assert "/deploybench/dag-runs/" in (frame.get_attribute("src") or ""), frame.get_attribute("src")
    driver.switch_to.frame(frame)
    return heading(driver)


def follow(driver, text: str) -> str:
    """Click the link whose text starts with ``text`` (inside the current frame); returns the new heading."""
    before = driver.find_element(By.TAG_NAME, "h1")
    link = _wait(driver, 10).until(lambda d: next(
        (a for a in d.find_elements(By.TAG_NAME, "a") if a.text.strip().startswith(text)), None))
    link.click()
    _wait(driver).until(ec.staleness_of(before))
    return heading(driver)


def test_benchmark_results_tab_shows_the_runs_stages_and_throughput(airflow, browser, form_run, shot):
    from deploybench.web.markup import fmt_num, headline_phase

    stored = form_run["stored"]
    assert open_results_tab(browser, airflow.url, form_run["run_id"]) == f"Run {form_run['key']}"
    shot("03-benchmark-results-tab")
    stages = {r["stage"]: r["status"] for r in table_under(browser, "Stages")}
    for stage in STAGES:
        assert stages.get(stage) == "success", stages
    ph = headline_phase(stored.phases)
    assert ph is not None and ph.phase == "sustained" and ph.requests > 0, stored.phases
    phases = table_under(browser, "Load phases")
    cluster = [r for r in phases if r["phase"] == "sustained" and r["node"] == "cluster"]
    assert len(cluster) == 1, phases
    # what a person reads is what the run stored: requests/s, requests, errors
    assert cluster[0]["achieved req/s"] == fmt_num(ph.achieved_rps), (cluster[0], ph)
    assert cluster[0]["requests"] == fmt_num(ph.requests), (cluster[0], ph)
    assert cluster[0]["errors"] == "0", cluster[0]
    nodes = {r["node"] for r in phases if r["phase"] == "sustained"} - {"cluster"}
    assert len(nodes) == LAB_NODES, phases
    text = body_text(browser)
    assert form_run["conf"]["inventory"] in text


def test_series_history_and_comparison_pages_show_the_run(airflow, browser, form_run, shot):
    stored = form_run["stored"]
    key, fp = form_run["key"], stored.series_fingerprint
    assert fp, "the run was stored without a series"
    open_results_tab(browser, airflow.url, form_run["run_id"])

    assert follow(browser, "History of this series") == f"History of series {fp[:12]}"
    shot("04-series-history")
    runs = table_under(browser, "Runs of this series")
    mine = [r for r in runs if r["run"] == key]
    assert len(mine) == 1 and mine[0]["status"] == "success", runs
    text = body_text(browser)
    assert "Metrics over time" in text and fp in text
    assert browser.find_elements(By.CSS_SELECTOR, "figure svg"), "the history page draws no plot"

    assert follow(browser, "Compare the runs of this series") == "Comparison"
    shot("05-comparison")
    text = body_text(browser)
    assert "Configurations side by side" in text, text[:2000]
    assert "Best configuration meeting the SLO" in text, text[:2000]
    assert key in text
    assert len(browser.find_elements(By.CSS_SELECTOR, "figure svg")) >= 2, "no throughput-latency/Pareto plots"
