"""A task's work on a run between a pull of its folder and a push (deploybench.store.run_files): ``synced``.

Which runs a task pulls and what it pushes of each: its own run whole (the pull mirrors the database, except this
disk's unpushed work), the runs it reads besides (a matrix cell's matrix and sibling cells) only for the records it
reads, and of those only the one file it writes there. A task stopped by SIGTERM still pushes, records first.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from deploybench import paths
from deploybench.store.run_files import Snapshot, configured_dsn, enabled, pull, push, related_keys

log = logging.getLogger(__name__)


def related_file(path: str) -> bool:
    """The files a task reads of runs other than its own: a matrix's plan, a cell's run.json, stage records and the
    deployment it kept or adopted (deploybench.matrix.planned, deploybench.matrix.deployment); not their samples."""
    return path in ("run.json", "plan.json", "deployment.json", "adoption.json") or (
        path.startswith("stages/") and path.count("/") == 1)


def written_elsewhere(path: str) -> bool:
    """The only file a task writes in a run folder not its own, and so the only one it pushes there: a cell's kept
    deployment (deploybench.matrix.deployment.KEPT), marked by its taker's preflight (``_mark``) and by the matrix's
    cleanup. Anything else of another run is that run's own tasks' to push (its samples may be half written)."""
    return path == "deployment.json"


def is_record(path: str) -> bool:
    """A small file a later task decides on (run.json, a stage record, a load phase's result): pushed first when a
    task is stopped, before the samples, so that the grace period carries what matters most."""
    return path == "run.json" or (path.startswith("stages/") and path.count("/") == 1) or path.endswith(".result.json")


class TaskKilled(BaseException):
    """SIGTERM reached a task inside ``synced``: raised so that its failure path pushes before the process ends."""


@contextlib.contextmanager
def _on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into TaskKilled in the main thread while the block runs. Airflow's supervisor sends the task
    process SIGTERM, then SIGKILL after a grace period; the task runner's own handler only calls the operator's
    on_kill and returns (airflow/sdk/execution_time/task_runner.py, ``_run_task_and_map_outcome._on_term``, in
    apache-airflow-task-sdk for Airflow 3.3), so the task would go on until killed and push nothing. The previous
    handler runs first (on_kill still happens; one that raises ends the block the same way), and is back in place
    after the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        if callable(previous):
            previous(signum, frame)
        raise TaskKilled(f"signal {signum} (SIGTERM): the task is being stopped")

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_seen_here: dict[str, Snapshot] = {}  # folder -> its last snapshot in this process: unchanged files keep their sha256


def synced(run_key: str, dsn: str | None, also: Iterable[str] = (), prefixes: Iterable[str] = (),
           member: Callable[[str], bool] | None = None, files: Callable[[str], bool] | None = None
           ) -> contextlib.AbstractContextManager[None]:
    """``with synced(key, dsn):`` around one task's work on a run: pulls the run's folder before (mirroring the
    database: a file another worker's re-run deleted goes here too, unless it is this disk's unpushed work), pushes
    what changed after, also when the work failed or the task was stopped by SIGTERM (a failed stage's record holds
    what it measured; records first, samples last). ``files``: only these paths of the run, pulled and pushed, no
    mirroring (a hook that reads run.json). The runs in ``also`` and those whose keys start with one of ``prefixes``
    (a matrix and its cells; with ``member``, only the keys it accepts: that matrix's cells) are pulled for their
    ``related_file``s only, and pushed only for the file a task writes there (``written_elsewhere``). Does nothing
    without a results database (``enabled``)."""
    return _synced(run_key, dsn, list(also), list(prefixes), member, files)


@contextlib.contextmanager
def _synced(run_key: str, dsn: str | None, also: list[str], prefixes: list[str],
            member: Callable[[str], bool] | None,
            files: Callable[[str], bool] | None) -> Iterator[None]:
    dsn = configured_dsn(dsn)
    if dsn is None or not enabled(dsn):
        yield
        return
    keys = list(dict.fromkeys([run_key, *also, *(k for p in prefixes for k in related_keys(dsn, p, member))]))
    pulled = {k: (files, files is None) if k == run_key else (related_file, False) for k in keys}
    seen: dict[str, Snapshot] = {}
    for k in keys:
        folder = paths.run_dir(k)
        only, mirror = pulled[k]
        seen[k] = pull(k, dsn, folder, only=only, mirror=mirror, known=_seen_here.get(str(folder)))
        _seen_here[str(folder)] = {**_seen_here.get(str(folder), {}), **seen[k]}
    pushed = {k: files if k == run_key else written_elsewhere for k in keys}

    def push_part(k: str, part: Callable[[str], bool] | None) -> None:
        want = pushed[k]
        push(k, dsn, seen[k], only=want if part is None else part if want is None
             else (lambda p: part(p) and want(p)))

    try:
        with _on_sigterm():
            yield
    except BaseException:
        try:
            with _on_sigterm():
                for part in (is_record, None):  # a stopped task has seconds left: the records first, samples last
                    for k in keys:
                        try:
                            push_part(k, part)
                        except Exception:  # noqa: BLE001 - the task's own error is the one to raise; this is logged
                            log.exception("run %s: pushing its folder after the failed task failed too", k)
        except TaskKilled:
            log.error("run %s: stopped again while pushing its folder after a failure", run_key)
        raise
    for k in keys:
        push_part(k, None)
