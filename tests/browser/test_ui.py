"""The Airflow UI as a person meets it, in headless Chromium against a real Airflow (issues 11 and 32).

Log in, open deploybench_run, press Trigger. The form opens with its everyday fields (the preset among them)
in its first section, open, and every other section closed; with the defaults it must be submittable (no
section flagged red, the modal's Trigger button enabled), and triggering it as it stands gives the run exactly
the form's defaults. Then point the form at a 2-node lab, choose the preset ``quick``, change a few fields
(one the preset also sets: the typed value must win), trigger, wait for the run to succeed, and read what a
person reads: what the preset set (the validate task's log, run.json), the run's "Benchmark results" tab,
the series history and the comparison page of the results plugin, checked against what the run stored.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from urllib.parse import quote

import pytest

from deploybench import params, paths, presets
from tests.support.ui import park, wait

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

# The run triggered from the form: the preset PRESET, and what the test types (field, value), by section; every
# other field keeps its default, or takes the preset's value where the preset sets one.
PRESET = "quick"
LOAD_DURATION_S = 8
CHANGES = {
    # the preset sets load_duration_s=10: the typed 8 must win
    params.OPEN_SECTION: [("load_duration_s", str(LOAD_DURATION_S))],
    "Preflight": [("link_threshold", "0.5")],  # 1-2 s iperf3 tests on a busy 2-core machine read ~75 %
    # 16 output tokens: P99 ~0.4 s instead of ~1.9 s with the default 64, far from the 2 s SLO that the
    # rollout gates enforce (a loaded machine must not fail the run)
    # and the traffic by name: shared system prompts, so the run's pages show the engine's prefix-cache hit rate
    "Workload": [("workload", "shared-prefix"), ("output_tokens", "16")],
}


def _wait(driver, timeout_s: float = PAGE_TIMEOUT_S) -> WebDriverWait:
    return wait(driver, timeout_s)


# -- the trigger form ------------------------------------------------------------------------------
_SECTIONS_JS = """
return [...arguments[0].querySelectorAll('[data-part=item-trigger]')].map(b => {
  const title = b.querySelector('p') || b;
  return {name: b.innerText.trim(), icon: !!b.querySelector(':scope > div:first-child svg'),
          color: getComputedStyle(title).color, expanded: b.getAttribute('aria-expanded') === 'true'};
});
"""
# the form's fields a person sees now: a field is a labelled row (Chakra's field root) whose input, select or
# number input is named or id'd "element_<name>"; shown when it takes up room and the section around it is not
# closed (a closed one is data-state=closed and hidden; the one open from the start carries no data-state)
_VISIBLE_FIELDS_JS = """
const named = r => [r, ...r.querySelectorAll('[name],[id]')].map(e => (e.getAttribute('name') || '') + ' ' + e.id)
  .map(t => (t.match(/element_([A-Za-z0-9_]+)/) || [])[1]).find(Boolean);
return [...arguments[0].querySelectorAll('[data-scope=field][data-part=root]')]
  .filter(e => e.getClientRects().length > 0 && getComputedStyle(e).visibility !== 'hidden')
  .filter(e => { const c = e.closest('[data-part=item-content]');
                 return !c || (c.dataset.state !== 'closed' && !c.hidden); })
  .map(named).filter(Boolean);
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


def visible_fields(dialog) -> list[str]:
    """The names of the form fields shown now (a closed section's are not), in the form's order."""
    return dialog.parent.execute_script(_VISIBLE_FIELDS_JS, dialog)


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
    open_section(dialog, section)
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


def open_section(dialog, section: str) -> None:
    """Open ``section`` (a click on its title, as a person does) unless it is open."""
    trigger = next(b for b in dialog.find_elements(By.CSS_SELECTOR, "[data-part=item-trigger]")
                   if b.text.strip() == section)
    if trigger.get_attribute("aria-expanded") != "true":
        _still(trigger)
        _click(trigger)


def choose(dialog, section: str, name: str, value: str) -> None:
    """Pick the option ``value`` of the select ``name`` (its label starts with the value: values_display), as a
    person does: open the section, click the select, click the option."""
    open_section(dialog, section)
    driver = dialog.parent
    box = _wait(driver, 10).until(lambda d: next(
        (e for e in dialog.find_elements(By.ID, f"element_{name}") if e.is_displayed()), None))
    _still(box)
    _click(box)
    option = _wait(driver, 10).until(lambda d: next(
        (o for o in dialog.find_elements(By.CSS_SELECTOR, "[role=option]")
         if o.is_displayed() and o.text.strip().startswith(f"{value} - ")), None))
    _click(option)
    _wait(driver, 5).until(lambda d: any(i.get_attribute("value") == value for i in dialog.find_elements(
        By.CSS_SELECTOR, f"input[name=element_{name}]")))


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
    return {"tasks": states, "stage errors": {k: v for k, v in errors.items() if v},
            "failed tasks' logs": airflow.failed_task_logs(DAG_ID, run_id)}


def submit(airflow, dialog) -> str:
    """Press the modal's Trigger button; the id of the run it made."""
    before = _run_ids(airflow)
    submit_button(dialog).click()
    new = airflow.wait_for("the triggered run", lambda: _run_ids(airflow) - before, 30, every_s=0.5)
    assert len(new) == 1, new
    return new.pop()


def finished(airflow, run_id: str) -> dict:
    """The DAG run once it succeeded or failed."""
    return airflow.wait_for(
        f"run {run_id} to finish",
        lambda: (r := airflow.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}"))["state"]
        in ("success", "failed") and r,
        RUN_TIMEOUT_S, every_s=2,
    )


def task_log(airflow, run_id: str, task_id: str) -> str:
    """A task's log (first try) as the UI's log view reads it, through the REST API."""
    got = airflow.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}"
                                 "/logs/1?full_content=true")
    return json.dumps(got.get("content"))


@pytest.fixture(scope="module")
def form_run(airflow, browser, lab_inventory, results_dsn, shot) -> dict:
    """A run triggered from the form (the lab's inventory, the preset PRESET, and CHANGES), finished; with its
    run.json and its stored results."""
    dialog = open_trigger_form(browser, airflow.url)
    set_field(dialog, params.OPEN_SECTION, "inventory", str(lab_inventory))
    choose(dialog, params.OPEN_SECTION, params.PRESET, PRESET)
    for section, changes in CHANGES.items():
        for name, value in changes:
            set_field(dialog, section, name, value)
    assert_submittable(dialog, f"with the preset {PRESET} and the test's changes")
    shot("02-trigger-form-changed")
    run_id = submit(airflow, dialog)
    park(browser)
    run = finished(airflow, run_id)
    assert run["state"] == "success", _why_failed(airflow, run_id)
    from deploybench.store import load_run

    key = paths.dag_run_key(DAG_ID, run_id)
    stored = load_run(results_dsn, key)
    assert stored is not None, f"run {key} is not in the results database the connection names"
    return {"run_id": run_id, "key": key, "conf": run["conf"], "stored": stored,
            "run_json": json.loads((paths.run_dir(key) / "run.json").read_text())}


# -- tests -----------------------------------------------------------------------------------------
def test_the_form_opens_with_the_everyday_fields_and_every_other_section_closed(airflow, browser, shot):
    """Before a person opens a section they see the everyday fields (15) and the titles of the closed sections."""
    dialog = open_trigger_form(browser, airflow.url)
    shot("01-trigger-form-defaults")
    sections = browser.execute_script(_SECTIONS_JS, dialog)
    names = [s["name"] for s in sections]
    assert names[0] == params.OPEN_SECTION and sections[0]["expanded"], sections
    for section in params.SECTIONS:
        assert section in names, names
    assert [s["name"] for s in sections if s["expanded"]] == [params.OPEN_SECTION], sections
    shown = visible_fields(dialog)
    assert shown == list(params.EVERYDAY_ORDER) and len(shown) == 15, shown
    assert_submittable(dialog, "with its defaults")
    # one section open at a time: opening another closes the everyday one (set_field opens it again)
    open_section(dialog, "Workload")
    _wait(browser, 10).until(lambda d: [s["name"] for s in d.execute_script(_SECTIONS_JS, dialog)
                                        if s["expanded"]] == ["Workload"])
    assert visible_fields(dialog) == ["workload", "prompt_tokens", "output_tokens", "api", "stream", "output_spread"]


def test_triggering_with_the_defaults_gives_the_run_the_forms_defaults(airflow, browser):
    """Trigger as the form opens, nothing changed: the run gets every field at its default and no preset. The
    defaults name the demo lab, which this session does not have: validate stops the run there, before any node
    is touched, and says how to get one."""
    from deploybench.inventory import resolve

    if resolve(params.default_inventory()).is_file():
        pytest.skip("this home has a demo lab: triggering the defaults would benchmark it")
    dialog = open_trigger_form(browser, airflow.url)
    assert_submittable(dialog, "with its defaults")
    run_id = submit(airflow, dialog)
    park(browser)
    run = finished(airflow, run_id)
    conf, want = run["conf"], params.defaults()
    assert conf[params.PRESET] is None, conf
    differ = {n: (conf.get(n), v) for n, v in want.items() if (None if conf.get(n) == "" else conf.get(n)) != v}
    assert not differ, f"fields not at their defaults (sent, default): {differ}"
    assert set(conf) == {*want, params.PRESET}, set(conf) ^ {*want, params.PRESET}
    assert run["state"] == "failed"
    error = json.loads((paths.run_dir(paths.dag_run_key(DAG_ID, run_id)) / "stages" / "validate.json")
                       .read_text())["error"]
    assert "inventory 'demo' does not exist" in error and "deploybench lab up" in error, error


def test_the_run_gets_the_preset_and_what_was_typed_into_the_form(airflow, form_run, lab_inventory):
    conf = form_run["conf"]
    assert conf["inventory"] == str(lab_inventory) and conf[params.PRESET] == PRESET
    for changes in CHANGES.values():
        for name, value in changes:
            assert (conf[name] == value if name == "workload" else float(conf[name]) == float(value)), (name, conf)
    assert form_run["run_json"]["config"]["load"]["workload"] == "shared-prefix"
    assert form_run["run_json"]["workload"]["name"] == "shared-prefix"
    # the preset filled in what was left at its default; what was typed won, also where the preset sets it
    preset = presets.preset(PRESET)
    used = form_run["run_json"]["preset"]
    assert used["name"] == PRESET and used["kept"] == {"load_duration_s": LOAD_DURATION_S}, used
    assert used["set"] == {k: v for k, v in preset.values.items() if k != "load_duration_s"}, used
    load = form_run["run_json"]["config"]["load"]
    assert load["duration_s"] == LOAD_DURATION_S and load["warmup_s"] == preset.values["warmup_s"], load
    assert form_run["run_json"]["config"]["preflight"]["iperf_seconds"] == preset.values["iperf_seconds"]
    log = task_log(airflow, form_run["run_id"], "validate")
    assert f"preset '{PRESET}' set" in log and f"kept the typed load_duration_s={LOAD_DURATION_S}" in log, log[-3000:]
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
    from deploybench.report.html import fmt_pct
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
    # the traffic typed into the form, and the engine's own prefix-cache hit rate of it (the sim caches prefixes)
    assert ph.prefix_hit_rate is not None and ph.prefix_hit_rate > 0, ph
    assert cluster[0]["prefix hit rate"] == fmt_pct(ph.prefix_hit_rate, 1), (cluster[0], ph)
    assert "shared-prefix" in body_text(browser)
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
    assert "Workload group 1: shared-prefix" in text, text[:2000]
    assert key in text
    assert len(browser.find_elements(By.CSS_SELECTOR, "figure svg")) >= 2, "no throughput-latency/Pareto plots"
