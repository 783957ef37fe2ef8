"""A run's folder through the results database, so that the tasks of one run may run on any worker.

A run's tasks hand each other their work through the run folder (``paths.run_dir(run_key)``: ``run.json``, the
stage records, the load stage's samples and outputs, the report). With the LocalExecutor every task runs on one
machine and finds the folder on its disk; with the CeleryExecutor or the KubernetesExecutor the next task may run
on a worker that has never seen the run. ``deploybench.store.run_sync.synced`` closes the gap through the results
database (table ``run_files``, migration 0013_run_files): before a task's work it **pulls** the run's files that
are missing or differ locally; after it, success or failure (a failed stage's record holds what it measured), it
**pushes** the files the task created, changed or deleted, by sha256, in one transaction.

Concurrency on one disk: per run folder, a lock file and a sync index in ``runs/.sync`` (beside the folders, never
in them). Pulls and pushes of one folder take turns on the lock; each pull stages in a folder of its own; the index
holds each file's sha256 when it last matched the database, so a file changed here and not pushed yet (*dirty*) is
never overwritten nor removed by a pull. Between workers: a pull reads in one REPEATABLE READ transaction, pushes of
one run take turns on an advisory lock.

Only when a results database is configured (a ``dsn``: the ``deploybench_results`` connection, or
``DEPLOYBENCH_DSN``): a laptop on the embedded default runs as before. ``DEPLOYBENCH_RUN_FILES=shared`` turns it
off where every worker mounts one shared folder as ``$DEPLOYBENCH_HOME/runs`` instead.

What is pulled is hostile until checked: a path must be relative, normalised and inside the run folder (no ``..``,
no absolute path, no backslash, no NUL), nothing is written through a symlink, declared sizes are bounded
(``MAX_FILE_BYTES`` per file, ``MAX_RUN_BYTES`` per run) and every content must have its declared size and
sha256. A refusal names the run, the file, the figure and the way out, and nothing of the pull is written: every
file is checked into a staging folder first, then moved into place.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.dialects.postgresql import insert

from deploybench import paths
from deploybench.store.errors import StoreError

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 128 * 2**20  # one file of a run folder: a sustained phase at 1,000 req/s for 10 min is ~90 MB
MAX_RUN_BYTES = 512 * 2**20  # the whole folder: bytea rows read into memory one at a time, staged on disk
MAX_FILES = 20_000  # files per run (a run writes some tens)
MAX_PATH_CHARS = 1024
MODE_ENV = "DEPLOYBENCH_RUN_FILES"  # "database" (default) | "shared": the workers mount one shared runs folder
STAGING = ".pull-staging-"  # prefix of a pull's own staging folder (inside the run folder), removed after it
SYNC_DIR = ".sync"  # in runs_dir(), beside the run folders: per folder, a lock file and the sync index
FETCH_CHUNK = 8 * 2**20  # a content is read from the database in pieces of this size, hashed on the way
REPUSH = "push the run's folder again from a worker that has it, or re-run the run"
WAY_OUT = (f"keep the run's files smaller (a shorter or slower load phase), or give every worker one shared folder "
           f"as $DEPLOYBENCH_HOME/runs and set {MODE_ENV}=shared")


class RunFileRefused(StoreError):
    """A run file was refused (a path outside the folder, a size past the bound, a content not as declared)."""


@dataclass(frozen=True)
class Seen:
    """A file of a run folder as this task last saw it: its size and mtime (to skip re-hashing) and sha256."""

    size: int
    mtime_ns: int
    sha256: str


Snapshot = dict[str, Seen]  # relative path -> Seen


def enabled(dsn: str | None) -> bool:
    """Whether tasks sync run folders: a results database is configured and the workers share no runs folder."""
    mode = os.environ.get(MODE_ENV, "database").strip().lower() or "database"
    if mode not in ("database", "shared"):
        raise RunFileRefused(f"{MODE_ENV}={mode[:40]!r} is neither 'database' (run folders travel through the "
                             f"results database) nor 'shared' (every worker mounts one runs folder)")
    return bool(dsn) and mode == "database"


def configured_dsn(dsn: str | None = None) -> str | None:
    """The results database run folders travel through: ``dsn`` (an Airflow connection's), else DEPLOYBENCH_DSN;
    None when neither is set (the embedded default is one machine's: nothing to sync)."""
    from deploybench.store.db import ENV_DSN

    return dsn or os.environ.get(ENV_DSN, "").strip() or None


def check_path(path: object, run_key: str) -> str:
    """``path`` if it is a normalised relative POSIX path inside a run folder; else RunFileRefused."""
    shown = repr(path)[:200]
    if not isinstance(path, str) or not path or len(path) > MAX_PATH_CHARS:
        raise RunFileRefused(f"run {run_key}: file path {shown} is empty, not text or longer than {MAX_PATH_CHARS} "
                             "characters; refused")
    if "\x00" in path or "\\" in path or path.startswith("/"):
        raise RunFileRefused(f"run {run_key}: file path {shown} is absolute or holds a backslash or NUL; only paths "
                             "relative to the run folder are accepted")
    parts = PurePosixPath(path).parts
    if any(p in ("", ".", "..") for p in path.split("/")) or "/".join(parts) != path:
        raise RunFileRefused(f"run {run_key}: file path {shown} is not normalised (an empty, '.' or '..' part); "
                             "only paths inside the run folder are accepted")
    if parts[0].startswith(STAGING.rstrip("-")):
        raise RunFileRefused(f"run {run_key}: file path {shown} is inside the pull's staging folder; refused")
    return path


def _check_size(run_key: str, path: str, size: object) -> int:
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise RunFileRefused(f"run {run_key}: file {path!r} declares size {size!r}; refused")
    if size > MAX_FILE_BYTES:
        raise RunFileRefused(f"run {run_key}: file {path!r} is {size:,} bytes, over the {MAX_FILE_BYTES:,} bytes one "
                             f"run file may hold; {WAY_OUT}")
    return size


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**20), b""):
            h.update(chunk)
    return h.hexdigest()


def scan(folder: Path, known: Snapshot | None = None, only: Callable[[str], bool] | None = None) -> Snapshot:
    """The regular files under ``folder`` (symlinks are neither followed nor listed; temporary ``*.tmp`` files and
    pulls' staging folders are skipped); ``only``: just the paths it accepts (the others are not hashed). A file
    whose size and mtime are as in ``known`` keeps its sha256 unread."""
    known = known or {}
    found: Snapshot = {}
    for root, dirs, files in os.walk(folder, followlinks=False):
        rel_root = Path(root).relative_to(folder)
        if rel_root == Path("."):
            dirs[:] = [d for d in dirs if not d.startswith(STAGING.rstrip("-"))]
        for name in files:
            if name.endswith(".tmp"):
                continue
            full = Path(root) / name
            try:
                st = full.lstat()
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            rel = (rel_root / name).as_posix()
            if only is not None and not only(rel):
                continue
            was = known.get(rel)
            same = was is not None and was.size == st.st_size and was.mtime_ns == st.st_mtime_ns
            found[rel] = Seen(st.st_size, st.st_mtime_ns, was.sha256 if same and was else _sha256_file(full))
    return found


def _table():
    from deploybench.store.models import RunFile

    return RunFile.__table__


# -- this disk's sync state: a lock and an index per run folder, beside it (never in it) -----------------------
def _sync_dir(folder: Path) -> Path:
    """``runs/.sync``: no run folder starts with ``.`` (paths.run_folder_name), so this is no run's."""
    d = folder.parent / SYNC_DIR
    d.mkdir(exist_ok=True)
    return d


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive flock on ``runs/.sync/<folder>.lock`` while one pull or push works on ``folder``: two pulls of
    one folder on one disk (sibling cells, the api-server and a task) take turns, and a push's scan and reads see
    no pull's half-placed files. Released when the process dies, so a killed task never blocks the next."""
    fd = os.open(_sync_dir(folder) / f"{folder.name}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _index_path(folder: Path) -> Path:
    return _sync_dir(folder) / f"{folder.name}.json"


def load_index(folder: Path) -> dict[str, str]:
    """The sync index of ``folder`` on this disk: path -> the sha256 it had when it last matched the results
    database (pulled or pushed). A local file whose sha256 differs from it is *dirty*: this disk's work not pushed
    yet, which a pull neither overwrites nor removes. Unreadable or malformed: empty (every differing file dirty)."""
    try:
        data = json.loads(_index_path(folder).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _save_index(folder: Path, index: dict[str, str]) -> None:
    path = _index_path(folder)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(index, sort_keys=True))
    os.replace(tmp, path)


def _dirty(rel: str, local: Snapshot, index: dict[str, str]) -> bool:
    return rel in local and index.get(rel) != local[rel].sha256


# -- pull ----------------------------------------------------------------------------------------------------
def pull(run_key: str, dsn: str, folder: Path | None = None, only: Callable[[str], bool] | None = None,
         mirror: bool = False, known: Snapshot | None = None) -> Snapshot:
    """Bring the run's files that are missing or differ here from the results database into its folder; returns
    the folder's snapshot afterwards (what ``push`` compares with). ``only``: just the paths it accepts (a reader
    that needs a few files of the run). ``mirror`` (a task's own run): also remove the local files the database
    no longer has (a re-run's other worker deleted them). A *dirty* file (``load_index``) is never overwritten nor
    removed. ``known``: a snapshot whose unchanged files (size, mtime) are not hashed again. RunFileRefused, with
    nothing written, when a row is hostile."""
    from deploybench.store.db import open_store

    folder = folder or paths.run_dir(run_key)
    table = _table()
    engine = open_store(dsn)
    with _locked(folder), engine.connect() as conn:
        # one snapshot of the database for the listing and every content: a concurrent push is seen whole or not
        conn = conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            rows = conn.execute(select(table.c.path, table.c.sha256, table.c.size, func.octet_length(table.c.content))
                                .where(table.c.run_key == run_key)).all()
            if len(rows) > MAX_FILES:
                raise RunFileRefused(f"run {run_key}: the results database holds {len(rows):,} files for it, over "
                                     f"the {MAX_FILES:,} a run may have; refused")
            declared: dict[str, tuple[str, int]] = {}
            for p, sha, size, stored in rows:
                if only is not None and not only(p):
                    continue
                rel = check_path(p, run_key)
                size = _check_size(run_key, rel, size)
                if stored != size:  # before a byte of it is read
                    raise RunFileRefused(f"run {run_key}: file {rel!r} holds {int(stored or 0):,} bytes where its "
                                         f"row declares {size:,}; refused ({REPUSH})")
                declared[rel] = (str(sha), size)
            total = sum(size for _, size in declared.values())
            if total > MAX_RUN_BYTES:
                raise RunFileRefused(f"run {run_key}: its files in the results database add up to {total:,} bytes, "
                                     f"over the {MAX_RUN_BYTES:,} a run may hold; {WAY_OUT}")
            index = load_index(folder)
            local = scan(folder, known, only)
            for rel, (sha, _) in declared.items():  # the same on both sides: in sync
                if rel in local and local[rel].sha256 == sha:
                    index[rel] = sha
            need = sorted(p for p, (sha, _) in declared.items()
                          if (p not in local or local[p].sha256 != sha) and not _dirty(p, local, index))
            kept = sorted(p for p, (sha, _) in declared.items() if _dirty(p, local, index) and local[p].sha256 != sha)
            stale = sorted(p for p in local if mirror and p not in declared and not _dirty(p, local, index))
            if kept:
                log.info("run %s: %d file(s) changed here and not pushed yet are kept over the database's: %s",
                         run_key, len(kept), ", ".join(kept[:10]))
            staged: dict[str, Path] = {}
            if need:
                staging = Path(tempfile.mkdtemp(dir=folder, prefix=STAGING))
                try:
                    for rel in need:
                        staged[rel] = _fetch(conn, table, run_key, rel, *declared[rel], staging)
                    for rel in need:
                        _place(folder, rel, staged[rel], run_key)
                        index[rel] = declared[rel][0]
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
        for rel in stale:
            with contextlib.suppress(FileNotFoundError):
                (folder / rel).unlink()
            index.pop(rel, None)
        _save_index(folder, index)
    log.info("run %s: pulled %d file(s) from the results database into %s%s", run_key, len(need), folder,
             f", removed {len(stale)} it no longer has" if stale else "")
    return scan(folder, local, only)


def _fetch(conn: Any, table: Any, run_key: str, rel: str, sha: str, size: int, staging: Path) -> Path:
    """One row's content into a new file under ``staging``, read in FETCH_CHUNK pieces and hashed on the way;
    RunFileRefused when it is not as declared."""
    fd, name = tempfile.mkstemp(dir=staging)
    h, got = hashlib.sha256(), 0
    with os.fdopen(fd, "wb") as f:
        while got < size or (size == 0 and got == 0):
            chunk = conn.execute(select(func.substring(table.c.content, got + 1, FETCH_CHUNK))
                                 .where(table.c.run_key == run_key, table.c.path == rel)).scalar_one_or_none()
            if chunk is None:
                raise RunFileRefused(f"run {run_key}: file {rel!r} is gone from the results database while it was "
                                     f"read; refused ({REPUSH})")
            data = bytes(chunk)
            if not data:
                break
            h.update(data)
            f.write(data)
            got += len(data)
            if got > size:
                break
    if got != size:
        raise RunFileRefused(f"run {run_key}: file {rel!r} holds {got:,} bytes where its row declares {size:,}; "
                             f"refused ({REPUSH})")
    if h.hexdigest() != sha:
        raise RunFileRefused(f"run {run_key}: file {rel!r} does not match its sha256 {sha[:16]}...; refused "
                             f"({REPUSH})")
    return Path(name)


def _place(folder: Path, rel: str, staged: Path, run_key: str) -> None:
    """Move ``staged`` to ``folder/rel``, creating the folders on the way, never through a symlink."""
    parts = rel.split("/")
    d = folder
    for part in parts[:-1]:
        d = d / part
        if d.is_symlink() or (d.exists() and not d.is_dir()):
            raise RunFileRefused(f"run {run_key}: {d} is a symlink or not a folder; file {rel!r} is not written "
                                 "through it (remove it from the run folder)")
        d.mkdir(exist_ok=True)
    target = d / parts[-1]
    if target.is_dir() and not target.is_symlink():
        raise RunFileRefused(f"run {run_key}: {target} is a folder; file {rel!r} is not written over it")
    os.chmod(staged, 0o644)
    os.replace(staged, target)  # replaces a symlink itself, never what it points to


# -- push ----------------------------------------------------------------------------------------------------
def _read_regular(folder: Path, rel: str, run_key: str) -> bytes:
    """The bytes of ``folder/rel``, opened without following a symlink at its last part and checked to be a regular
    file on the descriptor that is read (a file swapped for a symlink or a fifo after the scan is refused)."""
    try:
        fd = os.open(folder / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise RunFileRefused(f"run {run_key}: file {rel!r} cannot be opened as a plain file ({exc}); remove it or "
                             "make it a plain file") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise RunFileRefused(f"run {run_key}: file {rel!r} is not a regular file; refused")
        _check_size(run_key, rel, st.st_size)
        data = f.read(MAX_FILE_BYTES + 1)
    return data


def push(run_key: str, dsn: str, before: Snapshot, folder: Path | None = None,
         only: Callable[[str], bool] | None = None) -> dict[str, int]:
    """Write the files of the run folder created or changed since ``before`` (by sha256) into the results
    database and delete the rows of those deleted, in one transaction. ``only``: just the paths it accepts (what a
    task deliberately writes in another run's folder). RunFileRefused, with nothing written, when a file or the
    run is over its bound. Returns ``{"written", "deleted", "bytes"}``."""
    from deploybench.store.db import open_store

    folder = folder or paths.run_dir(run_key)
    with _locked(folder):
        now = scan(folder, before, only)
        index = load_index(folder)
        changed = sorted(p for p, seen in now.items() if (p not in before or before[p].sha256 != seen.sha256)
                         and index.get(p) != seen.sha256)
        gone = sorted(p for p in before if p not in now and p in index and (only is None or only(p)))
        if not changed and not gone:
            return {"written": 0, "deleted": 0, "bytes": 0}
        if len(now) > MAX_FILES:
            raise RunFileRefused(f"run {run_key}: its folder {folder} holds {len(now):,} files, over the "
                                 f"{MAX_FILES:,} a run may have; {WAY_OUT}")
        for rel in changed:
            check_path(rel, run_key)
            _check_size(run_key, rel, now[rel].size)
        table = _table()
        written = 0
        shas: dict[str, str] = {}
        with open_store(dsn).begin() as conn:
            # pushes of one run take turns, so the bound below holds whatever pushes run at once
            conn.execute(select(func.pg_advisory_xact_lock(func.hashtext(f"deploybench.run_files:{run_key}"))))
            for rel in changed:
                data = _read_regular(folder, rel, run_key)
                _check_size(run_key, rel, len(data))
                shas[rel] = hashlib.sha256(data).hexdigest()
                stmt = insert(table).values(run_key=run_key, path=rel, sha256=shas[rel], size=len(data), content=data,
                                            updated_at=func.now())
                conn.execute(stmt.on_conflict_do_update(
                    index_elements=[table.c.run_key, table.c.path],
                    set_={"sha256": stmt.excluded.sha256, "size": stmt.excluded.size,
                          "content": stmt.excluded.content, "updated_at": stmt.excluded.updated_at}))
                written += len(data)
            if gone:
                conn.execute(delete(table).where(table.c.run_key == run_key, table.c.path.in_(gone)))
            total = conn.execute(select(func.coalesce(func.sum(table.c.size), 0))
                                 .where(table.c.run_key == run_key)).scalar_one()
            if total > MAX_RUN_BYTES:  # raising here rolls the transaction back: the database keeps the last good state
                raise RunFileRefused(f"run {run_key}: its files would add up to {int(total):,} bytes in the results "
                                     f"database, over the {MAX_RUN_BYTES:,} a run may hold; {WAY_OUT}")
        index.update(shas)
        for rel in gone:
            index.pop(rel, None)
        _save_index(folder, index)
    log.info("run %s: pushed %d file(s) (%d bytes) to the results database, deleted %d", run_key, len(changed),
             written, len(gone))
    return {"written": len(changed), "deleted": len(gone), "bytes": written}


def related_keys(dsn: str, prefix: str, member: Callable[[str], bool] | None = None) -> list[str]:
    """The run keys with files in the results database that start with ``prefix`` (a matrix's cells); with
    ``member``, only those it accepts (the caller's exact test, e.g. that a key is one matrix's cell: a user's run id
    that merely starts like a cell's is not one; the matrix's own code, a layer above, says which)."""
    from deploybench.store.db import open_store

    table = _table()
    like = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    with open_store(dsn).connect() as conn:
        keys = sorted(conn.execute(select(table.c.run_key).distinct()
                                   .where(table.c.run_key.like(like, escape="\\"))).scalars())
    return keys if member is None else [k for k in keys if member(k)]


def pull_wanted(run_key: str, dsn: str | None, wanted: Iterable[str] = ("run.json", "report.html")) -> bool:
    """For a reader (the results pages): bring the run's ``wanted`` files here when they are missing or differ from
    the database's (one small query of their sha256, no scan of the folder). True when the last of ``wanted`` is
    here afterwards (the file the reader serves). No database, or a run it does not know: what is on disk."""
    from deploybench.store.db import open_store

    wanted = list(dict.fromkeys(wanted))
    dsn = configured_dsn(dsn)
    folder = paths.runs_dir() / paths.run_folder_name(run_key)
    if dsn is None or not enabled(dsn):
        return (folder / wanted[-1]).is_file()
    table = _table()
    with open_store(dsn).connect() as conn:
        listed = conn.execute(select(table.c.path, table.c.sha256)
                              .where(table.c.run_key == run_key, table.c.path.in_(wanted))).all()
    rows: dict[str, str] = {str(p): str(sha) for p, sha in listed}
    if not rows:  # a key the database does not know leaves no empty folder behind
        return (folder / wanted[-1]).is_file()
    def differs(rel: str, sha: str) -> bool:
        target = folder / rel
        try:
            return not target.is_file() or target.is_symlink() or _sha256_file(target) != sha
        except OSError:
            return True

    if any(differs(rel, sha) for rel, sha in rows.items()):
        pull(run_key, dsn, paths.run_dir(run_key), only=lambda p: p in rows)
    return (folder / wanted[-1]).is_file()


KEPT_BY_PRUNE = ("run.json", "report.html")  # what the results pages serve of a run (pull_wanted)


def prune(dsn: str | None, older_than_days: float) -> dict[str, int]:
    """Retention of ``run_files``: drop the files of the runs whose last push is more than ``older_than_days`` days
    old (their tasks are long done; a stored run's samples are in the store's ``request_samples``), except
    ``KEPT_BY_PRUNE``, so that the results pages still serve their reports. Returns ``{"runs", "files", "bytes"}``.
    RunFileRefused for a negative or non-finite number of days, before anything is deleted."""
    import math

    from deploybench.store.db import open_store

    if isinstance(older_than_days, bool) or not isinstance(older_than_days, int | float) \
            or not math.isfinite(older_than_days) or older_than_days < 0:
        raise RunFileRefused(f"--older-than {older_than_days!r}: give a number of days, 0 or more (e.g. 30)")
    table = _table()
    with open_store(configured_dsn(dsn)).begin() as conn:
        last = (select(table.c.run_key).group_by(table.c.run_key)
                .having(func.max(table.c.updated_at) < func.now() - func.make_interval(0, 0, 0, 0, 0, 0,
                                                                                      older_than_days * 86400)))
        gone = conn.execute(delete(table).where(table.c.run_key.in_(last), table.c.path.not_in(KEPT_BY_PRUNE))
                            .returning(table.c.run_key, table.c.size)).all()
    return {"runs": len({k for k, _ in gone}), "files": len(gone), "bytes": int(sum(n for _, n in gone))}
