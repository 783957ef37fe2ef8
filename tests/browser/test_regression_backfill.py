"""The scheduled regression benchmark under the real scheduler: two backfills (5 dates and 1) on a 2-node lab.

``airflow standalone`` (the ``airflow`` fixture of conftest.py) parses two reference benchmarks
from a throwaway benchmarks folder: ``slowed``, whose versions file switches to software 50 %
slower (``sim_slowdown`` 1.5) on the fourth date, and ``steady``, whose software never changes.
``slowed`` is backfilled over 5 dates with ``airflow backfill create`` (the CLI), ``steady`` over the
first of them from the DAG page's Trigger -> Backfill dialog in headless Chromium (without chromium,
the REST call the dialog makes); they queue for the one lab's lease. Expected: the DAG run of
the fourth ``slowed`` date fails with ``regression`` and the SMTP server on loopback (aiosmtpd)
receives exactly one message, naming the benchmark, the metric and the magnitude and linking the
report; every other run of both succeeds, and every stored run is announced on its benchmark's
results Asset.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.error
from datetime import date, timedelta
from pathlib import Path
from urllib.parse import quote

import pytest

from deploybench import paths, regression
from deploybench.airflow.home import airflow_env
from deploybench.sim.local import free_port
from tests.support import lab_names, ui
from tests.support.ui import park

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")  # as conftest's browser fixture

pytestmark = [
    pytest.mark.e2e, pytest.mark.integration, pytest.mark.netns,
    pytest.mark.quiet,  # the slowdown must stand out of the run-to-run noise: no neighbours' load in it
]
pytest.importorskip("aiosmtpd", reason="needs aiosmtpd (requirements-test.txt)")

LAB = lab_names.unique("lbrg")  # conftest's lab_inventory brings it up for this module
FIRST = date(2026, 3, 1)
# slowed: 5 dates (was 8, then 6; each run costs about half a minute here, one at a time on the lab):
# - 3 before the slow date: the judge needs min_baseline = 3 earlier runs to know the noise at all, and
#   its prediction test is Student's t with (earlier runs - 1) degrees of freedom: at alpha 0.01 the
#   critical t is 6.96 with 3 earlier runs (4.54 with 4), so the slowdown must be large against a few % of
#   run-to-run noise: 50 % slower software, not 10 % (whether the judge finds 10 % is test_history_accuracy.py's
#   question, over 8 runs; this test is about the scheduler, the backfills, the lease and the mail). The
#   assertion below needs "regression" and p < 0.01.
# - 1 after it: a flagged run starts a new level, so the next run of the slow software must not be
#   reported again ("the first slow date only"); one such run shows it, more add nothing new.
DATES = [FIRST + timedelta(days=i) for i in range(5)]
SLOW_FROM = DATES[3]
# steady: 1 date. It shows the dialog's backfill, the lease taken in turns and a run of unchanged software that
# passes; that a series of unchanged software is never flagged is test_history_accuracy.py's (8 runs of each),
# and each run here adds about 35 s to the quiet part of `make test` (they run one at a time).
STEADY_DATES = DATES[:1]
SMTP_CONN = "deploybench_test_smtp"
DONE_TIMEOUT_S = 60 * 60
# Short runs (about 30 s each; 6 run one after another): canary_nodes = nodes, a rollout of one step with one
# gate (this test is about the judge; the rollout's steps are tested in tests/integration/test_rollout_lab.py);
# a sustained phase of 5 s at 8 req/s, 40 requests (test_history_accuracy.py finds a 10 % slowdown in 20).
PARAMS = {
    "inventory": LAB, "nodes": 2, "canary_nodes": 2, "iperf_seconds": 1, "link_threshold": 0.5,
    "gate_duration_s": 3, "load_rate": 8, "load_duration_s": 5, "warmup_s": 1, "output_tokens": 16,
    "prompt_tokens": 64, "lease_wait_s": 3600,
}


def _benchmark(d: Path, name: str, slow_from: date | None) -> None:
    versions = [{"since": str(FIRST), "software": "sim 1.0", "params": {"sim_slowdown": 1.0}}]
    if slow_from:
        versions.append({"since": str(slow_from), "software": "sim 1.5 (50 % slower)",
                         "params": {"sim_slowdown": 1.5}})
    (d / f"{name}.versions.json").write_text(json.dumps({"versions": versions}))
    (d / f"{name}{regression.SUFFIX}").write_text(json.dumps({
        "name": name, "description": f"test benchmark {name}", "schedule": "@daily", "start_date": str(FIRST),
        # ends with the backfill's last date: unpausing starts no scheduled run of today (catchup is off)
        "end_date": str(DATES[-1]),
        "versions": f"{name}.versions.json", "params": PARAMS, "metrics": ["latency_p50_ms", "output_tps"],
        "notify": [{"kind": "smtp", "conn_id": SMTP_CONN, "to": ["perf@example.com"],
                    "from_email": "deploybench@example.com"}]}))


@pytest.fixture(scope="module")
def benchmarks(benchmarks_dir):
    """The two benchmark files, in the folder the session's Airflow reads ($DEPLOYBENCH_BENCHMARKS_DIR);
    removed after the module (their DAGs go with them at the next parse)."""
    _benchmark(benchmarks_dir, "slowed", SLOW_FROM)
    _benchmark(benchmarks_dir, "steady", None)
    yield benchmarks_dir
    for name in ("slowed", "steady"):
        for path in (benchmarks_dir / f"{name}{regression.SUFFIX}", benchmarks_dir / f"{name}.versions.json"):
            path.unlink(missing_ok=True)


class Mailbox:
    """What the SMTP server received (aiosmtpd's handler interface)."""

    def __init__(self):
        self.messages: list[dict] = []
        self.lock = threading.Lock()

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's name
        from email import message_from_bytes, policy

        msg = message_from_bytes(envelope.content, policy=policy.default)
        body = msg.get_body(("html", "plain"))
        with self.lock:
            self.messages.append({"to": envelope.rcpt_tos, "subject": str(msg["subject"]),
                                  "body": body.get_content() if body else ""})
        return "250 OK"


@pytest.fixture(scope="module")
def mailbox():
    """A real SMTP server on loopback."""
    from aiosmtpd.controller import Controller

    box = Mailbox()
    ctl = Controller(box, hostname="127.0.0.1", port=free_port())
    ctl.start()
    box.port = ctl.port
    yield box
    ctl.stop()


def _cli_env(af) -> dict:
    """The environment the fixture gave Airflow, for an ``airflow`` CLI command against the same home."""
    env = airflow_env({k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")})
    env.update({"AIRFLOW_HOME": str(af.home), "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": af.db_url})
    return env


def _cli_backfill(af, dag_id: str) -> None:
    """``airflow backfill create`` for the dates, against the fixture's Airflow (its metadata database
    is PostgreSQL here: the CLI writes while the scheduler runs)."""
    argv = ["airflow", "backfill", "create", "--dag-id", dag_id, "--from-date", str(DATES[0]), "--to-date",
            str(DATES[-1]), "--max-active-runs", "1", "--reprocess-behavior", "none"]
    res = subprocess.run(argv, env=_cli_env(af), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]


DAY_INPUT, TIME_INPUT = "input[placeholder='YYYY/MM/DD']", "input[placeholder='HH:mm']"  # the date picker's


def ui_backfill(browser, url: str, dag_id: str, first: date, last: date, timeout_s: float = 60) -> str:
    """The DAG page's Trigger -> Backfill dialog, as a person fills it: the date range typed into its
    pickers (UTC), then the dialog's dry run must announce one run per date, then Run Backfill.
    Returns the dialog's announcement."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec

    # a picker closing re-renders the dialog: an element found a moment ago may be gone when asked about
    wait = ui.wait(browser, timeout_s, ignored_exceptions=(StaleElementReferenceException,))
    browser.get(f"{url}/dags/{dag_id}")
    wait.until(ec.element_to_be_clickable((By.XPATH, "//button[normalize-space()='Trigger']"))).click()
    dialog = wait.until(lambda d: next((e for e in d.find_elements(By.CSS_SELECTOR, "[role=dialog][data-state=open]")
                                        if "Single Run" in e.text and "Backfill" in e.text), None))
    dialog.find_element(By.XPATH, ".//*[normalize-space()='Backfill']").click()
    wait.until(lambda d: len(dialog.find_elements(By.CSS_SELECTOR, "[data-testid=datetime-input]")) == 2)
    for i, day in enumerate((first, last)):
        dialog.find_elements(By.CSS_SELECTOR, "[data-testid=datetime-input]")[i].click()
        day_in = wait.until(lambda d: next((e for e in d.find_elements(By.CSS_SELECTOR, DAY_INPUT)
                                            if e.is_displayed()), None))
        day_in.send_keys(day.strftime("%Y/%m/%d"))
        time_in = next(e for e in browser.find_elements(By.CSS_SELECTOR, TIME_INPUT) if e.is_displayed())
        time_in.send_keys("00:00")
        time_in.send_keys(Keys.ESCAPE)
        wait.until(lambda d: not any(e.is_displayed() for e in d.find_elements(By.CSS_SELECTOR, DAY_INPUT)))
    count = (last - first).days + 1
    want = "1 run will be triggered." if count == 1 else f"{count} runs will be triggered."  # the UI's en strings
    wait.until(lambda d: want in dialog.text)
    button = dialog.find_element(By.XPATH, ".//button[normalize-space()='Run Backfill']")
    wait.until(lambda d: button.is_enabled())
    button.click()  # once: on PostgreSQL no 503 'database is locked' to retry (the SQLite days' retries are gone)
    wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, "[role=dialog][data-state=open]"))
    return want


def rest_backfill(af, dag_id: str) -> None:
    """What the dialog sends: its dry run (the count it shows), then the backfill."""
    form = {"dag_id": dag_id, "from_date": f"{STEADY_DATES[0]}T00:00:00Z", "to_date": f"{STEADY_DATES[-1]}T00:00:00Z",
            "max_active_runs": 1, "reprocess_behavior": "none", "run_backwards": False, "dag_run_conf": {}}
    dry = af.request("POST", "/api/v2/backfills/dry_run", form)
    assert [b["logical_date"][:10] for b in dry["backfills"]] == [str(d) for d in STEADY_DATES], dry
    af.request("POST", "/api/v2/backfills", form)


def _runs(af, dag_id: str) -> list[dict]:
    got = af.request("GET", f"/api/v2/dags/{dag_id}/dagRuns?limit=100&order_by=logical_date")
    return got["dag_runs"]


def _all_done(af, dates: dict[str, list[date]]) -> bool:
    for dag_id, want in dates.items():
        runs = [r for r in _runs(af, dag_id) if r["run_type"] == "backfill"]
        if len(runs) < len(want) or any(r["state"] not in ("success", "failed") for r in runs):
            return False
    return True


def _day(run: dict) -> date:
    return date.fromisoformat(run["logical_date"][:10])


def test_backfill_flags_the_first_slow_date_only_and_mails_once(airflow, benchmarks, lab_inventory, mailbox,
                                                                results_dsn, request):
    af = airflow
    slowed, steady = regression.DAG_PREFIX + "slowed", regression.DAG_PREFIX + "steady"
    af.request("POST", "/api/v2/connections", {
        "connection_id": SMTP_CONN, "conn_type": "smtp", "host": "127.0.0.1", "port": mailbox.port,
        "extra": json.dumps({"disable_ssl": True, "disable_tls": True, "timeout": 10, "retry_limit": 1})})
    for dag_id in (slowed, steady):
        af.wait_for(f"{dag_id} parsed", lambda d=dag_id: _parsed(af, d), 300, every_s=2)

    t0 = time.monotonic()
    # the CLI, with the environment of the fixture's Airflow
    _cli_backfill(af, slowed)
    # the UI: the DAG page's Trigger -> Backfill dialog (or, without chromium, the REST call it makes)
    if CHROMIUM.is_file() and CHROMEDRIVER.is_file():
        browser = request.getfixturevalue("browser")
        shown = ui_backfill(browser, af.url, steady, STEADY_DATES[0], STEADY_DATES[-1])
        print(f"the Backfill dialog said: {shown}")
        park(browser)
    else:
        rest_backfill(af, steady)
    assert len(af.request("GET", f"/api/v2/backfills?dag_id={steady}")["backfills"]) == 1
    for dag_id in (slowed, steady):  # created while paused; runs start once unpaused
        af.request("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})

    dates = {slowed: DATES, steady: STEADY_DATES}
    af.wait_for("both backfills finished", lambda: _all_done(af, dates), DONE_TIMEOUT_S, every_s=10)
    wall = time.monotonic() - t0
    print(f"two backfills of {len(DATES)} and {len(STEADY_DATES)} dates on one 2-node lab: {wall:.0f} s")

    runs = {dag_id: [r for r in _runs(af, dag_id) if r["run_type"] == "backfill"] for dag_id in (slowed, steady)}
    verdicts = {dag_id: {_day(r): regression.read_verdict(paths.dag_run_key(dag_id, r["dag_run_id"])) or {}
                         for r in rs} for dag_id, rs in runs.items()}
    states = {dag_id: {_day(r): r["state"] for r in rs} for dag_id, rs in runs.items()}
    summary = {dag_id: {str(d): (states[dag_id][d], v.get("verdict"), regression.describe(v) if v else None)
                        for d, v in vs.items()} for dag_id, vs in verdicts.items()}
    assert sorted(states[slowed]) == DATES and sorted(states[steady]) == STEADY_DATES, summary
    unexpected = [(dag_id, r) for dag_id, rs in runs.items() for r in rs
                  if r["state"] != ("failed" if (dag_id, _day(r)) == (slowed, SLOW_FROM) else "success")]
    why = "\n".join(_why_failed(af, dag_id, r) for dag_id, r in unexpected)
    print(why or "every run ended as expected")  # whole in the captured output (pytest shortens the message)

    # slowed: the first date of the slow software fails with a regression of the latency, no other date does
    assert {d for d, s in states[slowed].items() if s == "failed"} == {SLOW_FROM}, why
    bad = verdicts[slowed][SLOW_FROM]
    assert bad["verdict"] == "regression" and bad["software"] == "sim 1.5 (50 % slower)", summary
    p50 = bad["metrics"]["latency_p50_ms"]
    print(f"slowed {SLOW_FROM}: latency_p50_ms {p50['magnitude']:+.1%}, p = {p50['p_value']:.2g}")
    # 50 % slower service times: the median latency grows by 50 % or so (longer batches queue more)
    assert p50["verdict"] == "regression" and 0.3 <= p50["magnitude"] <= 1.5 and p50["p_value"] < 0.01, p50
    assert len(p50["against"]) == 3  # the three dates before it, in logical-date order
    for d in DATES:
        if d != SLOW_FROM:
            assert verdicts[slowed][d]["verdict"] in ("no change", "suspect", "improvement"), summary
    # steady: nothing
    assert set(states[steady].values()) == {"success"}, why
    assert all(v["verdict"] != "regression" for v in verdicts[steady].values()), summary
    judge = af.request("GET", f"/api/v2/dags/{slowed}/dagRuns/{quote(_run_id(runs[slowed], SLOW_FROM), safe='')}"
                              f"/taskInstances/judge")
    assert judge["state"] == "failed", judge

    # exactly one message, naming benchmark, metric and magnitude, linking the report
    assert len(mailbox.messages) == 1, [m["subject"] for m in mailbox.messages]
    msg = mailbox.messages[0]
    assert msg["to"] == ["perf@example.com"]
    assert "slowed" in msg["subject"] and "latency_p50_ms" in msg["subject"], msg["subject"]
    assert f"{p50['magnitude']:+.1%}" in msg["subject"], msg["subject"]
    key = paths.dag_run_key(slowed, _run_id(runs[slowed], SLOW_FROM))
    assert regression.report_url(af.url, key) in msg["body"], msg["body"]

    # the two benchmarks took turns on the lab: a run that released the lease did not let its DAG's next date
    # take it again ahead of the other benchmark's run, which was already waiting (first come, first served)
    from deploybench.inventory import Inventory
    from deploybench.lease import LeaseStore

    cluster = Inventory.load(lab_inventory).name
    dag_of = {paths.dag_run_key(dag_id, r["dag_run_id"]): dag_id for dag_id, rs in runs.items() for r in rs}
    takers = [dag_of.get(e["run_key"], e["run_key"]) for e in
              reversed(LeaseStore(results_dsn).events(cluster, limit=500)) if e["event"] in ("acquired", "taken_over")]
    print("the lease went to: " + " ".join("slowed" if t == slowed else "steady" if t == steady else t
                                           for t in takers))
    assert sorted(takers) == sorted([slowed] * len(DATES) + [steady] * len(STEADY_DATES)), takers
    both_left = 2 * len(STEADY_DATES)  # until steady's last run took the lease, the other benchmark's always waited
    assert all(a != b for a, b in zip(takers[:both_left], takers[1:both_left])), takers

    # the store orders the benchmark's runs by logical date
    from deploybench.store.query import RunFilter, select_runs

    stored = select_runs(results_dsn, RunFilter(tags={"benchmark": "slowed"}, status=None))
    assert [t.date() for t in stored["logical_date"]] == DATES

    # every stored run was announced on its benchmark's Asset (the failed judge comes after the announcement)
    for name in ("slowed", "steady"):
        dag_id = regression.DAG_PREFIX + name
        events = af.request("GET", f"/api/v2/assets/events?limit=100&source_dag_id={dag_id}")
        assert {e["uri"] for e in events["asset_events"]} == {f"deploybench://results/{name}"}, events
        got = sorted(e["extra"]["run_key"] for e in events["asset_events"])
        want = sorted(paths.dag_run_key(dag_id, r["dag_run_id"]) for r in runs[dag_id])
        assert got == want, (name, events)


def _why_failed(af, dag_id: str, run: dict) -> str:
    """A run in an unexpected state, explained: its failed tasks (with tries) and its failed stage records."""
    from deploybench.run import Run

    try:  # the explanation must not hide the assertion it explains
        tis = af.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run['dag_run_id'], safe='')}/taskInstances")
        failed: object = [f"{t['task_id']} ({t['state']}, try {t['try_number']})" for t in tis["task_instances"]
                          if t["state"] not in ("success", "skipped")]
    except (urllib.error.URLError, KeyError) as exc:
        failed = f"(task instances not read: {exc!r})"
    recs = Run.open_if_validated(paths.dag_run_key(dag_id, run["dag_run_id"]))
    stage_errors = [f"{s}: {r.error}" for s, r in (recs.stages() if recs else {}).items() if r.status == "failed"]
    return (f"{dag_id} {_day(run)}: {run['state']}; tasks not succeeded: {failed or 'none'}; "
            f"failed stages: {stage_errors or 'none'}; failed tasks' logs: "
            f"{af.failed_task_logs(dag_id, run['dag_run_id'])}")


def _run_id(runs: list[dict], day: date) -> str:
    return next(r["dag_run_id"] for r in runs if _day(r) == day)


def _parsed(af, dag_id: str) -> bool:
    try:
        af.request("GET", f"/api/v2/dags/{dag_id}")
        return True
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return False
        raise
