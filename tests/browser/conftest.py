"""A real Airflow, a small lab, a results database and headless Chromium, for the browser tests.

``airflow`` is ``airflow standalone`` (scheduler, dag-processor, api-server, triggerer, LocalExecutor)
with a throwaway AIRFLOW_HOME, this checkout's dags/ and plugins/ (as ``deploybench.airflow.home``
sets them), on a free loopback port, in its own session: ONE for the whole test session (starting
one took about a minute per module), on a throwaway PostgreSQL metadata database (with SQLite a
CLI's "database is locked" made Airflow delete a half-made backfill's runs under the scheduler, which
then died on the missing row). The Airflow connection ``deploybench_results`` names a throwaway
database, so the DAG's tasks and the results pages read and write the same one. Modules keep to
their own DAG runs (run ids they triggered, their own lab: ``LAB`` in the module, see
``lab_inventory``, and their own benchmark files in ``benchmarks_dir``). Stopping notes every
process Airflow started (its descendants, its session, and any process with the fixture's marker in
its environment: task processes run in process groups of their own, k6 in a session of its own),
sends SIGTERM to the process group, then SIGKILL to what is left, and fails if anything is still
running.

``browser`` is Debian's chromium driven by Debian's chromedriver through Selenium, with a fresh
profile and no network beyond what the pages ask of loopback; it is logged in to Airflow once.

For a person looking into a failure: a failed test leaves a screenshot and the page's HTML (the
path is in the report); DEPLOYBENCH_BROWSER_SHOTS=DIR saves every page the tests look at;
DEPLOYBENCH_KEEP_BROWSER_HOME=1 keeps the Airflow home (standalone.log, task logs).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import pytest
from sqlalchemy.engine import make_url

from deploybench import paths, regression
from deploybench.airflow.home import airflow_env

# unique lab names; the store tests' helpers: a throwaway database, and an Airflow connection that names it
from tests.support import lab_names, store_fixtures, ui

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
LAB = lab_names.unique("lbui")  # the lab of a module that names none (``LAB = "..."`` in the module)
LAB_NODES = 2
DAG_ID = "deploybench_run"

START_TIMEOUT_S = 300  # standalone: migrate a fresh PostgreSQL database, start four components, parse the DAG
QUIET_TIMEOUT_S = 600  # a module's last DAG runs finishing before its lab goes down
STOP_TIMEOUT_S = 30
HTTP_TIMEOUT_S = 30
PAGE_TIMEOUT_S = 60

# no proxy for loopback, whatever the environment says
_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's choice; bound again by the api-server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- processes -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Proc:
    """A process as /proc shows it; (pid, start) names it even if the pid is reused later."""

    pid: int
    ppid: int
    session: int
    start: int
    zombie: bool


def _proc(pid: int) -> Proc | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session ... starttime (22nd)
    return Proc(pid, int(f[1]), int(f[3]), int(f[19]), f[0] == "Z")


def _procs() -> dict[int, Proc]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (p := _proc(int(name))) is not None:
            out[p.pid] = p
    return out


def processes_of(root: int, marker: str, known: set[tuple[int, int]] = frozenset()) -> set[tuple[int, int]]:
    """Live processes that are ``root``'s descendants, in ``root``'s session, carry ``marker`` in their
    environment, or are in ``known`` and still alive, as (pid, start) pairs (zombies left out)."""
    procs = _procs()
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    found: set[int] = set()
    todo = [root]
    while todo:  # descendants, whatever session or group they moved to (k6 has a session of its own)
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    needle = marker.encode()
    for p in procs.values():
        if p.session == root or (p.pid, p.start) in known:
            found.add(p.pid)
        elif p.pid not in found:
            try:  # orphans: the environment survives a dead parent (and TMPDIR reaches even k6)
                if needle in Path(f"/proc/{p.pid}/environ").read_bytes():
                    found.add(p.pid)
            except OSError:
                pass
    if root in procs:
        found.add(root)
    found.discard(os.getpid())
    return {(pid, procs[pid].start) for pid in found if pid in procs and not procs[pid].zombie}


def _signal_all(pids: set[tuple[int, int]], sig: int) -> None:
    for pid, start in pids:
        p = _proc(pid)
        if p is None or p.start != start:
            continue  # gone, or the pid is someone else's now
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop_everything(proc: subprocess.Popen, marker: str, timeout_s: float = STOP_TIMEOUT_S) -> set[tuple[int, int]]:
    """Note every process Airflow started, SIGTERM its process group, give it ~10 s, then SIGKILL
    whatever is left; returns what is still alive after ``timeout_s`` (nothing, unless something escaped)."""
    deadline = time.monotonic() + timeout_s
    known = processes_of(proc.pid, marker)  # before any signal: afterwards orphans lose their parent link
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    while True:
        left = processes_of(proc.pid, marker, known)
        if not left or time.monotonic() > deadline:
            break
        _signal_all(left, signal.SIGKILL)
        time.sleep(0.3)
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=5)
    return left


# -- Airflow ---------------------------------------------------------------------------------------
def _log_line(entry: object) -> str:
    """One line of a task log as the REST API gives it (structured), short: level, event, and each error's type
    and value; Airflow's own ::group:: markers left out."""
    if not isinstance(entry, dict):
        return str(entry)
    event = str(entry.get("event", ""))
    if event.startswith("::"):
        return ""
    errors = [f"{e.get('exc_type')}: {e.get('exc_value')}" for e in entry.get("error_detail") or []
              if isinstance(e, dict)]
    return " ".join([str(entry.get("level", "")), event, *errors]).strip()


@dataclass
class Airflow:
    """A running Airflow: its URL, home, log, and a REST client with a token from POST /auth/token."""

    url: str
    home: Path
    log: Path
    proc: subprocess.Popen
    db_url: str = ""  # its metadata database (SQLAlchemy URL): an `airflow` CLI command must use the same
    _token: str | None = field(default=None, repr=False)

    def password(self) -> str:
        return json.loads((self.home / "simple_auth_manager_passwords.json.generated").read_text())["admin"]

    def request(self, method: str, path: str, body: dict | None = None, token: bool = True) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {self.token()}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        with _LOOPBACK.open(req, timeout=HTTP_TIMEOUT_S) as resp:
            return json.loads(resp.read() or b"null")

    def token(self) -> str:
        if self._token is None:
            got = self.request("POST", "/auth/token", {"username": "admin", "password": self.password()},
                               token=False)
            self._token = got["access_token"]
        return self._token

    def failed_task_logs(self, dag_id: str, run_id: str, chars: int = 1500) -> dict[str, str]:
        """For a failed assertion: the end of the log of every failed task of a run (its last try), from the
        REST API. A task that failed before deploybench's code ran (its process killed, the execution API
        unreachable) leaves no stage record; its log is then the only account of why."""
        try:
            run = quote(run_id, safe="")
            tis = self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run}/taskInstances?limit=100")
            out = {}
            for ti in tis["task_instances"]:
                if ti["state"] != "failed":
                    continue
                got = self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run}/taskInstances/{ti['task_id']}"
                                          f"/logs/{max(ti['try_number'], 1)}?full_content=true")
                lines = got.get("content") if isinstance(got, dict) else got
                out[ti["task_id"]] = "\n".join(_log_line(x) for x in lines or [] if _log_line(x))[-chars:]
            return out
        except Exception as exc:  # the explanation must not hide the assertion it explains
            return {"(logs not read)": repr(exc)}

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def wait_for(self, what: str, probe, timeout_s: float, every_s: float = 1.0):
        """Call ``probe`` until it returns something truthy (connection errors, HTTP 404 and 5xx count as
        not yet; another 4xx fails at once); fail with the last error and the Airflow log after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        last: object = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"airflow standalone exited with {self.proc.returncode} while waiting for {what}:\n"
                            f"{self.log_tail()}")
            try:
                got = probe()
                if got:
                    return got
                last = got
            except urllib.error.HTTPError as exc:
                if 400 <= exc.code < 500 and exc.code != 404:  # a wrong request does not get better by waiting
                    pytest.fail(f"{what}: HTTP {exc.code} {exc.reason}: {exc.read()[:1000]!r}")
                last = exc  # 404: not there yet; 5xx: SQLite busy under concurrent writes
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                last = exc  # not up yet
            time.sleep(every_s)
        pytest.fail(f"{what}: not within {timeout_s:.0f} s (last: {last!r}); Airflow log:\n{self.log_tail()}")


@pytest.fixture(scope="session")
def results_dsn() -> Iterator[str]:
    """A throwaway results database on DEPLOYBENCH_DSN's server, else the embedded PostgreSQL; dropped after."""
    dsn, _ = store_fixtures.make_database()
    yield dsn
    store_fixtures.drop_database(dsn)


def _own_temp_dir(prefix: str) -> Iterator[Path]:
    """A temp folder removed after use. Not tmp_path_factory's: pytest keeps only the newest three
    basetemps, so other pytest sessions on the machine delete a long session's folders under it."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def benchmarks_dir() -> Iterator[Path]:
    """The folder Airflow reads benchmark files from ($DEPLOYBENCH_BENCHMARKS_DIR in its environment, so
    its tasks find them too); empty at start, a module writes its own benchmarks into it."""
    yield from _own_temp_dir("deploybench-browser-benchmarks-")


@pytest.fixture(scope="session")
def shared_airflow(results_dsn, benchmarks_dir) -> Iterator[Airflow]:
    """The session's ``airflow standalone``, on a throwaway PostgreSQL metadata database."""
    with _standalone(results_dsn, benchmarks_dir, "postgres") as af:
        yield af


@pytest.fixture(scope="module")
def airflow(request, results_dsn, benchmarks_dir) -> Iterator[Airflow]:
    """``airflow standalone`` on a free loopback port; deploybench_run parsed and unpaused. The session's
    one (PostgreSQL metadata), unless the module sets ``AIRFLOW = "own"``: then one of its own (on a
    throwaway PostgreSQL database too), stopped after the module. Each module's ``lab_inventory`` waits for
    the module's DAG runs to end before its lab goes down, so no task touches a lab being taken down."""
    if getattr(request.module, "AIRFLOW", "shared") != "own":
        yield request.getfixturevalue("shared_airflow")
        return
    with _standalone(results_dsn, benchmarks_dir, "postgres") as af:
        yield af


@contextmanager
def _standalone(results_dsn: str, benchmarks_dir: Path, metadata: str) -> Iterator[Airflow]:
    """Start ``airflow standalone`` (metadata: "postgres", a throwaway database, or "sqlite", a file in
    its home), wait until deploybench_run is parsed and unpaused; stop everything it started after."""
    home = Path(tempfile.mkdtemp(prefix="deploybench-browser-airflow-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    marker = f"deploybench-browser-{uuid.uuid4().hex}"
    tmpdir = home / marker
    tmpdir.mkdir()
    env = airflow_env({k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")})
    metadata_dsn = None
    if metadata == "postgres":
        metadata_dsn, _ = store_fixtures.make_database()
        db_url = str(make_url(metadata_dsn).set(drivername="postgresql+psycopg2").render_as_string(
            hide_password=False))
    else:
        db_url = f"sqlite:///{home / 'airflow.db'}"
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db_url,
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": url,
        "AIRFLOW__API__WORKERS": "1",
        # task processes reach the api-server's execution API here, not at the default :8080
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{url}/execution/",
        "AIRFLOW__CORE__PARALLELISM": "4",  # LocalExecutor workers: 4, not 32, on a 2-core machine
        # Alone (the quiet part, one module by hand) an idle scheduler loop sleeps 0.25 s, not 1 s: a finished
        # task's successor starts 0.1-0.3 s after it, not 0.7-0.9 s (a run here is ~16 short tasks in a row; the
        # backfill runs 12). Not in the parallel part, where the 2 cores are busy: there it did not pay (at 6
        # workers, one run each: 486 s and 749 CPU-s with it, 479 s and 630 CPU-s without).
        "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "1" if os.environ.get("PYTEST_XDIST_WORKER") else "0.25",
        "AIRFLOW_CONN_DEPLOYBENCH_RESULTS": store_fixtures.airflow_connection(results_dsn),
        "DEPLOYBENCH_BROWSER_TEST": marker,
        regression.ENV_DIR: str(benchmarks_dir),
        # deploybench hands k6 a minimal environment, TMPDIR included: the marker reaches it this way
        "TMPDIR": str(tmpdir),
    })
    log = home / "standalone.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["airflow", "standalone"], env=env, cwd=home, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    af = Airflow(url=url, home=home, log=log, proc=proc, db_url=db_url)
    try:
        af.wait_for("the admin password file", lambda: (home / "simple_auth_manager_passwords.json.generated")
                    .is_file(), START_TIMEOUT_S)
        af.wait_for(f"the api-server at {url}", lambda: af.request("GET", "/api/v2/version", token=False)
                    or True, START_TIMEOUT_S)
        af.wait_for(f"{DAG_ID} parsed", lambda: _dag_is_parsed(af), START_TIMEOUT_S, every_s=2)
        # new DAGs start paused
        af.wait_for(f"{DAG_ID} unpaused", lambda: af.request("PATCH", f"/api/v2/dags/{DAG_ID}",
                                                              {"is_paused": False})["is_paused"] is False, 60)
        yield af
    finally:
        left = stop_everything(proc, marker)
        if metadata_dsn:
            store_fixtures.drop_database(metadata_dsn)
        kept = os.environ.get("DEPLOYBENCH_KEEP_BROWSER_HOME")
        if not kept:
            shutil.rmtree(home, ignore_errors=True)
        assert not left, f"processes of the Airflow fixture still running after stop (pid, start): {left}"


def _dag_is_parsed(af: Airflow) -> bool:
    try:
        af.request("GET", f"/api/v2/dags/{DAG_ID}")
        return True
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            errors = af.request("GET", "/api/v2/importErrors")
            if errors.get("total_entries"):
                pytest.fail(f"the DAG folder has import errors: {errors['import_errors']}")
            return False
        raise


@pytest.fixture(scope="module")
def matrix_dag(airflow) -> str:
    """deploybench_matrix, parsed and unpaused on the module's Airflow."""
    dag_id = "deploybench_matrix"

    def unpaused() -> bool:
        try:
            return airflow.request("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})["is_paused"] is False
        except Exception as exc:  # noqa: BLE001 - 404 until the dag-processor has parsed it
            if "404" in str(exc):
                return False
            raise
    airflow.wait_for(f"{dag_id} parsed and unpaused", unpaused, 240, every_s=2)
    return dag_id


# -- the lab ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lab_inventory(airflow, request) -> Iterator[Path]:
    """A 2-node lab of the module's own (``LAB`` in the module, else lbui) with a small model; its
    inventory.json is what the form is pointed at. Before it goes down, the module's DAG runs end."""
    from deploybench.lab import cluster

    lab = getattr(request.module, "LAB", LAB)
    cluster.up(lab, nodes=LAB_NODES, link_mbit=200, model_mb=4)
    try:
        yield paths.lab_dir(lab) / "inventory.json"
    finally:
        try:
            _wait_quiet(airflow)
        finally:
            cluster.down(lab)


def _active_runs(af: Airflow) -> list[dict]:
    got = af.request("GET", "/api/v2/dags/~/dagRuns?state=queued&state=running&limit=100")
    return got["dag_runs"]


def _wait_quiet(af: Airflow) -> None:
    """Wait until no DAG run is queued or running; after QUIET_TIMEOUT_S mark what is left failed (its
    teardowns still run), wait for that, and fail naming the runs."""
    deadline = time.monotonic() + QUIET_TIMEOUT_S
    while (active := _active_runs(af)) and time.monotonic() < deadline:
        time.sleep(2)
    if not active:
        return
    for run in active:
        af.request("PATCH", f"/api/v2/dags/{run['dag_id']}/dagRuns/{quote(run['dag_run_id'], safe='')}",
                   {"state": "failed"})
    af.wait_for("the teardowns of runs marked failed", lambda: not _active_runs(af), 300, every_s=2)
    pytest.fail(f"DAG runs still active {QUIET_TIMEOUT_S} s after the module's tests (marked failed): "
                f"{[(r['dag_id'], r['dag_run_id'], r['state']) for r in active]}")


# -- the browser -----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def chromium_profile() -> Iterator[Path]:
    yield from _own_temp_dir("deploybench-browser-chromium-")


@pytest.fixture(scope="session")
def browser(shared_airflow, chromium_profile):
    """Headless Chromium, logged in to the session's Airflow as admin (a module with an Airflow of its
    own does not use it); every chromium process gone afterwards."""
    airflow = shared_airflow
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = chromium_profile
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-proxy-server", "--window-size=1400,1000", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    marker = f"deploybench-browser-chromium-{uuid.uuid4().hex}"
    service = Service(CHROMEDRIVER, env={**os.environ, "DEPLOYBENCH_BROWSER_TEST": marker},
                      log_output=str(profile / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    driver_pid = service.process.pid
    try:
        driver.set_page_load_timeout(PAGE_TIMEOUT_S)
        driver.get(airflow.url + "/auth/login")
        wait = ui.wait(driver, PAGE_TIMEOUT_S, poll_frequency=0.5)
        wait.until(ec.presence_of_element_located((By.NAME, "username"))).send_keys("admin")
        driver.find_element(By.NAME, "password").send_keys(airflow.password())
        driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait.until(lambda d: "/auth/login" not in d.current_url)
        yield driver
    finally:
        driver.quit()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (left := processes_of(driver_pid, marker)) and time.monotonic() < deadline:
            _signal_all(left, signal.SIGKILL)
            time.sleep(0.3)
        assert not left, f"chromium/chromedriver processes still running after quit: {left}"


# -- what the browser showed -----------------------------------------------------------------------
def shots_dir() -> Path:
    """Where screenshots go: $DEPLOYBENCH_BROWSER_SHOTS (CI can keep it as an artifact), else a temp folder."""
    path = Path(
        os.environ.get("DEPLOYBENCH_BROWSER_SHOTS")
        or Path(tempfile.gettempdir()) / "deploybench-browser-shots"
    )
    path.mkdir(parents=True, exist_ok=True)
    return path


def screenshot(driver, name: str, always: bool = False) -> Path | None:
    """Save what the browser shows (whole window) and the current frame's HTML; only when
    $DEPLOYBENCH_BROWSER_SHOTS is set, unless ``always`` (a failure)."""
    if not (always or os.environ.get("DEPLOYBENCH_BROWSER_SHOTS")):
        return None
    base = shots_dir() / "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    driver.save_screenshot(str(base.with_suffix(".png")))
    base.with_suffix(".html").write_text(driver.page_source)
    return base.with_suffix(".png")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failure with a browser open, keep a screenshot and the page's HTML and name them in the report."""
    report = yield
    driver = item.funcargs.get("browser") if hasattr(item, "funcargs") else None
    if report.failed and driver is not None:
        try:
            path = screenshot(driver, f"FAILED-{item.name}-{report.when}", always=True)
            report.sections.append(("browser", f"screenshot of the failure: {path} (and .html)"))
        except Exception as exc:  # noqa: BLE001 - the browser may be what failed; the report must still be written
            report.sections.append(("browser", f"no screenshot: {exc!r}"))
    return report


@pytest.fixture(scope="session")
def shot(browser):
    """``shot(name)`` saves what the browser shows now, when $DEPLOYBENCH_BROWSER_SHOTS is set."""
    return lambda name: screenshot(browser, name)
