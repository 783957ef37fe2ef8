"""A run's folder through the results database, so that the tasks of one run may run on any worker.

A run's tasks hand each other their work through the run folder (``paths.run_dir(run_key)``: ``run.json``, the
stage records, the load stage's samples and outputs, the report). With the LocalExecutor every task runs on one
machine and finds the folder on its disk; with the CeleryExecutor or the KubernetesExecutor the next task may run
on a worker that has never seen the run. ``synced`` closes the gap through the results database (table
``run_files``, migration 0013_run_files): before a task's work it **pulls** the run's files that are missing or differ
locally; after it, success or failure (a failed stage's record holds what it measured), it **pushes** the files
the task created, changed or deleted, by sha256, in one transaction.

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
import hashlib
import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

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
STAGING = ".pull-staging"  # a pull's checked files wait here (inside the run folder) until all passed
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
    if parts[0] == STAGING:
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


def scan(folder: Path, known: Snapshot | None = None) -> Snapshot:
    """The regular files under ``folder`` (symlinks are neither followed nor listed; temporary ``*.tmp`` files and
    the staging folder are skipped). A file whose size and mtime are as in ``known`` keeps its sha256 unread."""
    known = known or {}
    found: Snapshot = {}
    for root, dirs, files in os.walk(folder, followlinks=False):
        rel_root = Path(root).relative_to(folder)
        if rel_root == Path("."):
            dirs[:] = [d for d in dirs if d != STAGING]
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
            was = known.get(rel)
            same = was is not None and was.size == st.st_size and was.mtime_ns == st.st_mtime_ns
            found[rel] = Seen(st.st_size, st.st_mtime_ns, was.sha256 if same and was else _sha256_file(full))
    return found


def _table():
    from deploybench.store.models import RunFile

    return RunFile.__table__


# -- pull ----------------------------------------------------------------------------------------------------
def pull(run_key: str, dsn: str, folder: Path | None = None, only: Callable[[str], bool] | None = None) -> Snapshot:
    """Bring the run's files that are missing or differ here from the results database into its folder; returns
    the folder's snapshot afterwards (what ``push`` compares with). ``only``: just the paths it accepts (a reader
    that needs a few files of the run). RunFileRefused, with nothing written, when a row is hostile."""
    from deploybench.store.db import open_store

    folder = folder or paths.run_dir(run_key)
    table = _table()
    engine = open_store(dsn)
    with engine.connect() as conn:
        rows = conn.execute(select(table.c.path, table.c.sha256, table.c.size)
                            .where(table.c.run_key == run_key)).all()
        if len(rows) > MAX_FILES:
            raise RunFileRefused(f"run {run_key}: the results database holds {len(rows):,} files for it, over the "
                                 f"{MAX_FILES:,} a run may have; refused")
        declared = {check_path(p, run_key): (str(sha), _check_size(run_key, p, size)) for p, sha, size in rows
                    if only is None or only(p)}
        total = sum(size for _, size in declared.values())
        if total > MAX_RUN_BYTES:
            raise RunFileRefused(f"run {run_key}: its files in the results database add up to {total:,} bytes, over "
                                 f"the {MAX_RUN_BYTES:,} a run may hold; {WAY_OUT}")
        local = scan(folder)
        need = sorted(p for p, (sha, _) in declared.items() if p not in local or local[p].sha256 != sha)
        if not need:
            return local
        staging = folder / STAGING
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            for i, rel in enumerate(need):
                content = conn.execute(select(table.c.content).where(table.c.run_key == run_key,
                                                                     table.c.path == rel)).scalar_one()
                sha, size = declared[rel]
                data = bytes(content)
                if len(data) != size:
                    raise RunFileRefused(f"run {run_key}: file {rel!r} holds {len(data):,} bytes where its row "
                                         f"declares {size:,}; refused (push the run's folder again from a worker "
                                         "that has it, or re-run the run)")
                if hashlib.sha256(data).hexdigest() != sha:
                    raise RunFileRefused(f"run {run_key}: file {rel!r} does not match its sha256 {sha[:16]}...; "
                                         "refused (push the run's folder again from a worker that has it, or re-run "
                                         "the run)")
                _write_new(staging / str(i), data)
            for i, rel in enumerate(need):
                _place(folder, rel, staging / str(i), run_key)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log.info("run %s: pulled %d file(s) from the results database into %s", run_key, len(need), folder)
    return scan(folder, local)


def _write_new(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


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
    os.replace(staged, target)  # replaces a symlink itself, never what it points to


# -- push ----------------------------------------------------------------------------------------------------
def push(run_key: str, dsn: str, before: Snapshot, folder: Path | None = None) -> dict[str, int]:
    """Write the files of the run folder created or changed since ``before`` (by sha256) into the results
    database and delete the rows of those deleted, in one transaction. RunFileRefused, with nothing written, when
    a file or the run is over its bound. Returns ``{"written", "deleted", "bytes"}``."""
    from deploybench.store.db import open_store

    folder = folder or paths.run_dir(run_key)
    now = scan(folder, before)
    changed = sorted(p for p, seen in now.items() if p not in before or before[p].sha256 != seen.sha256)
    gone = sorted(p for p in before if p not in now)
    if not changed and not gone:
        return {"written": 0, "deleted": 0, "bytes": 0}
    if len(now) > MAX_FILES:
        raise RunFileRefused(f"run {run_key}: its folder {folder} holds {len(now):,} files, over the {MAX_FILES:,} a "
                             f"run may have; {WAY_OUT}")
    for rel in changed:
        check_path(rel, run_key)
        _check_size(run_key, rel, now[rel].size)
    table = _table()
    written = 0
    with open_store(dsn).begin() as conn:
        for rel in changed:
            data = (folder / rel).read_bytes()
            _check_size(run_key, rel, len(data))
            stmt = insert(table).values(run_key=run_key, path=rel, sha256=hashlib.sha256(data).hexdigest(),
                                        size=len(data), content=data, updated_at=func.now())
            conn.execute(stmt.on_conflict_do_update(index_elements=[table.c.run_key, table.c.path],
                                                    set_={"sha256": stmt.excluded.sha256, "size": stmt.excluded.size,
                                                          "content": stmt.excluded.content,
                                                          "updated_at": stmt.excluded.updated_at}))
            written += len(data)
        if gone:
            conn.execute(delete(table).where(table.c.run_key == run_key, table.c.path.in_(gone)))
        total = conn.execute(select(func.coalesce(func.sum(table.c.size), 0))
                             .where(table.c.run_key == run_key)).scalar_one()
        if total > MAX_RUN_BYTES:  # raising here rolls the transaction back: the database keeps the last good state
            raise RunFileRefused(f"run {run_key}: its files would add up to {int(total):,} bytes in the results "
                                 f"database, over the {MAX_RUN_BYTES:,} a run may hold; {WAY_OUT}")
    log.info("run %s: pushed %d file(s) (%d bytes) to the results database, deleted %d", run_key, len(changed),
             written, len(gone))
    return {"written": len(changed), "deleted": len(gone), "bytes": written}


def related_keys(dsn: str, prefix: str) -> list[str]:
    """The run keys with files in the results database that start with ``prefix`` (a matrix's cells)."""
    from deploybench.store.db import open_store

    table = _table()
    like = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    with open_store(dsn).connect() as conn:
        return sorted(conn.execute(select(table.c.run_key).distinct()
                                   .where(table.c.run_key.like(like, escape="\\"))).scalars())


# -- a task's work between a pull and a push -------------------------------------------------------------------
def related_file(path: str) -> bool:
    """The files a task reads of runs other than its own: a matrix's plan, a cell's run.json, stage records and the
    deployment it kept or adopted (deploybench.matrix.planned, deploybench.matrix.deployment); not their samples."""
    return path in ("run.json", "plan.json", "deployment.json", "adoption.json") or (
        path.startswith("stages/") and path.count("/") == 1)


@contextlib.contextmanager
def synced(run_key: str, dsn: str | None, also: Iterable[str] = (), prefixes: Iterable[str] = ()) -> Iterator[None]:
    """``with synced(key, dsn):`` around one task's work on a run: pulls the run's folder before, pushes what
    changed after, also when the work failed (a failed stage's record holds what it measured). The runs in ``also``
    and those whose keys start with one of ``prefixes`` (a matrix and its cells) are pulled for their
    ``related_file``s only, and pushed like the run's own. Does nothing without a results database (``enabled``)."""
    dsn = configured_dsn(dsn)
    if dsn is None or not enabled(dsn):
        yield
        return
    keys = list(dict.fromkeys([run_key, *also, *(k for p in prefixes for k in related_keys(dsn, p))]))
    seen = {k: pull(k, dsn, only=None if k == run_key else related_file) for k in keys}
    try:
        yield
    except BaseException:
        for k in keys:
            try:
                push(k, dsn, seen[k])
            except Exception:  # noqa: BLE001 - the task's own error is the one to raise; this one is logged
                log.exception("run %s: pushing its folder after the failed task failed too", k)
        raise
    for k in keys:
        push(k, dsn, seen[k])


def pull_if_missing(run_key: str, dsn: str | None, wanted: str = "run.json") -> bool:
    """For a reader (the results pages): pull the run's ``wanted`` file (and its run.json, which names the run)
    when it is not here and a results database is configured. True when a pull brought something."""
    from deploybench.store.db import open_store

    dsn = configured_dsn(dsn)
    folder = paths.runs_dir() / paths.run_folder_name(run_key)
    if dsn is None or not enabled(dsn) or (folder / wanted).is_file():
        return False
    table = _table()
    with open_store(dsn).connect() as conn:  # a key the database does not know leaves no empty folder behind
        known = conn.execute(select(table.c.path).where(table.c.run_key == run_key).limit(1)).first() is not None
    return known and bool(pull(run_key, dsn, only=lambda p: p in ("run.json", wanted)))
