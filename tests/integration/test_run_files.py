"""A run's folder through the results database (deploybench.store.run_files) against a real PostgreSQL: what a
task on one worker writes, a task on another worker with its own disk reads; hostile rows are refused with nothing
written; a task that fails after measuring still hands on what it measured."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import pytest
from sqlalchemy import select, text

from deploybench import paths
from deploybench.matrix.planned import cells_of
from deploybench.records import StageRecord
from deploybench.run import read_record, recording
from deploybench.store import db, run_files, run_sync
from deploybench.store.models import RunFile

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(120)]


@pytest.fixture
def homes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Two deploybench homes, as two workers' disks; ``use(i)`` makes the i-th the current one."""
    made = [tmp_path / "worker-a", tmp_path / "worker-b"]
    for h in made:
        h.mkdir()
    monkeypatch.delenv(run_files.MODE_ENV, raising=False)

    def use(i: int) -> Path:
        monkeypatch.setenv("DEPLOYBENCH_HOME", str(made[i]))
        return made[i]

    use(0)
    return use


def _rows(dsn: str, key: str) -> dict[str, tuple[str, int]]:
    with db.open_store(dsn).connect() as conn:
        got = conn.execute(select(RunFile.path, RunFile.sha256, RunFile.size).where(RunFile.run_key == key)).all()
    return {p: (s, n) for p, s, n in got}


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_what_one_worker_writes_the_next_reads_and_changes(dsn, homes):
    key = "deploybench_run__manual__2026-12-06T10:00:00+00:00"
    homes(0)
    with run_sync.synced(key, dsn):
        d = paths.run_dir(key)
        (d / "run.json").write_text(json.dumps({"run_key": key}))
        (d / "stages").mkdir()
        (d / "stages" / "validate.json").write_text('{"stage": "validate"}')
        (d / "load" / "sustained").mkdir(parents=True)
        (d / "load" / "sustained" / "samples.csv").write_bytes(b"ts,latency_ms\n" + b"1,2\n" * 5000)
        (d / "scratch.tmp").write_text("half a file")  # a write in progress is never handed on
    first = _tree(paths.run_dir(key))
    assert set(_rows(dsn, key)) == {"run.json", "stages/validate.json", "load/sustained/samples.csv"}

    homes(1)  # another worker: nothing of the run on its disk
    assert not (paths.runs_dir() / paths.run_folder_name(key)).exists()
    with run_sync.synced(key, dsn):
        d = paths.run_dir(key)
        assert _tree(d) == {k: v for k, v in first.items() if not k.endswith(".tmp")}
        (d / "stages" / "preflight.json").write_text('{"stage": "preflight"}')
        (d / "stages" / "validate.json").write_text('{"stage": "validate", "again": 1}')
        (d / "load" / "sustained" / "samples.csv").unlink()
    rows = _rows(dsn, key)
    assert set(rows) == {"run.json", "stages/validate.json", "stages/preflight.json"}
    assert rows["stages/validate.json"][0] == hashlib.sha256(b'{"stage": "validate", "again": 1}').hexdigest()

    homes(0)  # back on the first worker: its stale copy is brought up to date
    with run_sync.synced(key, dsn):
        d = paths.run_dir(key)
        assert (d / "stages" / "preflight.json").read_text() == '{"stage": "preflight"}'
        assert (d / "stages" / "validate.json").read_text() == '{"stage": "validate", "again": 1}'


def test_nothing_happens_without_a_results_database(homes, monkeypatch):
    monkeypatch.delenv(db.ENV_DSN, raising=False)
    key = "laptop-run"
    with run_sync.synced(key, None):
        (paths.run_dir(key) / "run.json").write_text("{}")
    homes(1)
    with run_sync.synced(key, None):
        assert not (paths.run_dir(key) / "run.json").exists()  # no database: nothing travelled


def test_shared_mode_leaves_the_folder_to_the_shared_disk(dsn, homes, monkeypatch):
    monkeypatch.setenv(run_files.MODE_ENV, "shared")
    key = "shared-run"
    with run_sync.synced(key, dsn):
        (paths.run_dir(key) / "run.json").write_text("{}")
    assert _rows(dsn, key) == {}
    monkeypatch.setenv(run_files.MODE_ENV, "nfs")
    with pytest.raises(run_files.RunFileRefused, match="DEPLOYBENCH_RUN_FILES='nfs' is neither"):
        with run_sync.synced(key, dsn):
            pass


def test_a_task_that_fails_after_measuring_still_hands_on_what_it_measured(dsn, homes):
    key = "failing-run"
    homes(0)
    with pytest.raises(RuntimeError, match="the node went away"):
        with run_sync.synced(key, dsn):
            with recording(paths.run_dir(key), "load") as rec:
                rec.result = {"measured": {"requests": 412, "p99_ms": 930.5}}
                raise RuntimeError("the node went away")
    homes(1)
    with run_sync.synced(key, dsn):
        got = read_record(paths.run_dir(key), "load")
    assert isinstance(got, StageRecord) and got.status == "failed"
    assert got.result == {"measured": {"requests": 412, "p99_ms": 930.5}}
    assert "the node went away" in (got.error or "")


def _plant(dsn: str, key: str, path: str, content: bytes, *, sha: str | None = None, size: int | None = None) -> None:
    """A row written past deploybench, as a hostile writer to the database would."""
    with db.open_store(dsn).begin() as conn:
        conn.execute(text("INSERT INTO run_files (run_key, path, sha256, size, content) VALUES (:k, :p, :s, :n, :c)"),
                     {"k": key, "p": path, "s": sha or hashlib.sha256(content).hexdigest(),
                      "n": len(content) if size is None else size, "c": content})


@pytest.mark.parametrize(("path", "why"), [
    ("../outside.json", "not normalised"),
    ("stages/../../outside.json", "not normalised"),
    ("/etc/deploybench-owned", "is absolute"),
    ("stages//x.json", "not normalised"),
    ("stages\\..\\x.json", "backslash"),
    (".pull-staging/0", "staging folder"),
])
def test_a_hostile_path_is_refused_and_nothing_is_written(dsn, homes, tmp_path, path, why):
    key = f"hostile-path-{abs(hash(path))}"
    _plant(dsn, key, "run.json", b'{"fine": true}')
    _plant(dsn, key, path, b"planted")
    before = {p for p in tmp_path.rglob("*")}
    with pytest.raises(run_files.RunFileRefused, match=why):
        run_files.pull(key, dsn)
    made = {p for p in tmp_path.rglob("*") if run_files.SYNC_DIR not in p.parts} - before  # beside: the pull's lock
    assert all(p.is_dir() for p in made), made  # at most the empty run folder: not even the good row's file
    assert not Path("/etc/deploybench-owned").exists()


def test_oversized_and_mismatched_content_is_refused(dsn, homes, monkeypatch):
    monkeypatch.setattr(run_files, "MAX_FILE_BYTES", 1000)
    _plant(dsn, "big-row", "load/samples.csv", b"x" * 1001)
    with pytest.raises(run_files.RunFileRefused, match=r"file 'load/samples.csv' is 1,001 bytes, over the 1,000"):
        run_files.pull("big-row", dsn)
    _plant(dsn, "lying-size", "report.html", b"x" * 10, size=5)
    with pytest.raises(run_files.RunFileRefused, match=r"holds 10 bytes where its row declares 5"):
        run_files.pull("lying-size", dsn)
    _plant(dsn, "bad-sha", "stages/load.json", b'{"p99_ms": 1}', sha="0" * 64)
    with pytest.raises(run_files.RunFileRefused, match=r"does not match its sha256"):
        run_files.pull("bad-sha", dsn)
    for key in ("big-row", "lying-size", "bad-sha"):
        assert _tree(paths.run_dir(key)) == {}
    monkeypatch.setattr(run_files, "MAX_RUN_BYTES", 1500)
    _plant(dsn, "big-run", "a.csv", b"a" * 800)
    _plant(dsn, "big-run", "b.csv", b"b" * 800)
    with pytest.raises(run_files.RunFileRefused, match=r"add up to 1,600 bytes, over the 1,500"):
        run_files.pull("big-run", dsn)


def test_nothing_is_written_through_a_symlink(dsn, homes, tmp_path):
    key = "symlinked"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    folder = paths.run_dir(key)
    os.symlink(outside, folder / "stages")
    _plant(dsn, key, "stages/validate.json", b"{}")
    with pytest.raises(run_files.RunFileRefused, match="is a symlink or not a folder"):
        run_files.pull(key, dsn)
    assert list(outside.iterdir()) == []


def test_a_push_over_the_bounds_is_refused_naming_the_file_and_leaves_the_database_as_it_was(dsn, homes,
                                                                                              monkeypatch):
    key = "too-much"
    with run_sync.synced(key, dsn):
        (paths.run_dir(key) / "run.json").write_text("{}")
    monkeypatch.setattr(run_files, "MAX_FILE_BYTES", 2000)
    with pytest.raises(run_files.RunFileRefused, match=r"file 'load/k6.csv' is 2,001 bytes, over the 2,000 .*"
                                                       r"DEPLOYBENCH_RUN_FILES=shared"):
        with run_sync.synced(key, dsn):
            (paths.run_dir(key) / "load").mkdir()
            (paths.run_dir(key) / "load" / "k6.csv").write_bytes(b"y" * 2001)
            (paths.run_dir(key) / "run.json").write_text('{"changed": 1}')
    assert _rows(dsn, key) == {"run.json": (hashlib.sha256(b"{}").hexdigest(), 2)}  # one transaction: none of it
    monkeypatch.setattr(run_files, "MAX_FILE_BYTES", 10_000)
    monkeypatch.setattr(run_files, "MAX_RUN_BYTES", 3000)
    before = run_files.scan(paths.run_dir(key))
    (paths.run_dir(key) / "load" / "more.csv").write_bytes(b"z" * 1500)
    with pytest.raises(run_files.RunFileRefused, match=r"would add up to 3,5\d\d bytes"):
        run_files.push(key, dsn, {k: v for k, v in before.items() if k == "run.json"})
    assert set(_rows(dsn, key)) == {"run.json"}


def test_the_results_page_pulls_a_report_its_server_never_saw(dsn, homes):
    from deploybench.web.app import report_file

    key = "paged-run"
    homes(0)
    with run_sync.synced(key, dsn):
        d = paths.run_dir(key)
        (d / "run.json").write_text(json.dumps({"run_key": key}))
        (d / "report.html").write_text("<html>the report</html>")
        (d / "load").mkdir()
        (d / "load" / "samples.csv").write_text("ts,latency_ms\n1,2\n")
    homes(1)  # the api-server's disk
    assert report_file(key) is None  # without the database: not here
    got = report_file(key, dsn)
    assert got is not None and got.read_text() == "<html>the report</html>"
    assert {p.name for p in got.parent.rglob("*")} == {"run.json", "report.html"}  # not the samples: what it serves
    assert report_file("never-ran", dsn) is None


def test_a_matrix_cell_brings_its_matrix_and_sibling_cells_records_not_their_samples(dsn, homes, tmp_path,
                                                                                     monkeypatch):
    """A cell's tasks read its matrix's plan and the records and kept deployment of the cell whose engines it
    adopts; they pull those files of the other runs (and push what they change in them), never their samples."""
    from deploybench.airflow.stages import run_folder

    matrix, prefix = "deploybench_matrix__m1", "deploybench_run__matrix__m1__"
    homes(0)
    for key, files in ((matrix, {"plan.json": "{}", "comparison.html": "<html/>"}),
                       (prefix + "c01", {"run.json": "{}", "stages/rollout.json": "{}", "deployment.json": "{}",
                                         "load/samples.csv": "ts\n1\n"})):
        with run_sync.synced(key, dsn):
            for rel, body in files.items():
                (paths.run_dir(key) / rel).parent.mkdir(parents=True, exist_ok=True)
                (paths.run_dir(key) / rel).write_text(body)
    homes(1)
    with run_sync.synced(prefix + "c02", dsn, also=[matrix], prefixes=[prefix]):
        assert set(_tree(paths.run_dir(matrix))) == {"plan.json"}
        c01 = paths.run_dir(prefix + "c01")
        assert set(_tree(c01)) == {"run.json", "stages/rollout.json", "deployment.json"}
        (c01 / "deployment.json").write_text('{"cleaned_at": "now"}')  # the cleanup marks the kept deployment
    assert _rows(dsn, prefix + "c01")["deployment.json"][0] == hashlib.sha256(b'{"cleaned_at": "now"}').hexdigest()
    assert len(_rows(dsn, prefix + "c01")) == 4  # its samples stay in the database, untouched
    # the task factory's run_folder gives a cell these too (its matrix found by the cell's own key), on a third disk
    monkeypatch.setenv("DEPLOYBENCH_HOME", str(tmp_path / "worker-c"))
    monkeypatch.setenv(db.ENV_DSN, dsn)
    with run_folder(prefix + "c03"):
        assert (paths.run_dir(prefix + "c01") / "deployment.json").is_file()
        assert (paths.run_dir(matrix) / "plan.json").is_file()


def test_the_related_files_are_the_matrix_modules_own_names():
    from deploybench.matrix import deployment, planned

    for name in (deployment.KEPT, deployment.ADOPTED, planned.PLAN_FILE, "run.json", "stages/rollout.json"):
        assert run_sync.related_file(name), name
    assert not run_sync.related_file("load/sustained/samples.csv")
    assert not run_sync.related_file("report.html")


def _push_from(dsn: str, key: str, home: Path, files: dict[str, bytes | None]) -> None:
    """Another worker (its own disk, ``home``) pulls the run, writes (None: deletes) ``files`` and pushes."""
    folder = home / "runs" / paths.run_folder_name(key)
    folder.mkdir(parents=True, exist_ok=True)
    before = run_files.pull(key, dsn, folder, mirror=True)
    for rel, body in files.items():
        if body is None:
            (folder / rel).unlink()
        else:
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(body)
    run_files.push(key, dsn, before, folder)


def test_concurrent_pulls_of_one_folder_each_stage_their_own_files(dsn, homes):
    """Sibling cells, or the api-server and a task, pull one folder on one disk at once: each pull stages in its own
    folder under the folder's lock, and every pull ends with the database's files in place."""
    import threading

    key = "pulled-twice"
    files = {f"stages/s{i:02d}.json": f'{{"i": {i}}}'.encode() * 50 for i in range(40)}
    _push_from(dsn, key, homes(1), files)
    homes(0)
    folder = paths.run_dir(key)
    for _ in range(3):
        for p in folder.rglob("*.json"):
            p.unlink()
        errors: list[BaseException] = []

        def one(errors: list[BaseException] = errors) -> None:
            try:
                run_files.pull(key, dsn)
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert _tree(folder) == files
    assert not [p for p in folder.iterdir() if p.name.startswith(".pull-staging")]


def test_another_pulls_staging_folder_is_left_alone_and_never_pushed(dsn, homes):
    key = "foreign-staging"
    _push_from(dsn, key, homes(1), {"run.json": b"{}"})
    homes(0)
    folder = paths.run_dir(key)
    other = folder / ".pull-staging-inflight"  # a pull in another process, mid-way
    other.mkdir()
    (other / "tmpabc").write_bytes(b"staged by the other pull")
    before = run_files.pull(key, dsn, mirror=True)
    assert (other / "tmpabc").read_bytes() == b"staged by the other pull"
    assert set(before) == {"run.json"}
    (folder / "report.html").write_text("<html/>")
    run_files.push(key, dsn, before)
    assert set(_rows(dsn, key)) == {"run.json", "report.html"}


def test_a_pull_keeps_this_disks_unpushed_work(dsn, homes):
    """A file changed here and not pushed yet (a lease record rewritten by its release, still pushing) is not
    overwritten by the database's older copy; a file that was in sync is brought up to date."""
    key = "dirty-kept"
    homes(0)
    with run_sync.synced(key, dsn):
        d = paths.run_dir(key)
        (d / "stages").mkdir()
        (d / "stages" / "lease.json").write_text('{"status": "running"}')
        (d / "stages" / "validate.json").write_text('{"v": 1}')
    (d / "stages" / "lease.json").write_text('{"status": "released"}')  # this disk's newer work, not pushed yet
    _push_from(dsn, key, homes(1), {"stages/validate.json": b'{"v": 2}'})
    homes(0)
    run_files.pull(key, dsn, mirror=True)
    assert (d / "stages" / "lease.json").read_text() == '{"status": "released"}'
    assert (d / "stages" / "validate.json").read_text() == '{"v": 2}'
    with run_sync.synced(key, dsn):  # another task here: the release's record is its writer's to push, not this one's
        pass
    assert _rows(dsn, key)["stages/lease.json"][0] == hashlib.sha256(b'{"status": "running"}').hexdigest()


def test_a_pull_of_the_own_run_removes_what_a_re_run_deleted_elsewhere(dsn, homes):
    """A re-run on another worker deleted the previous attempt's records: the pull of the run's own folder removes
    them here too (the store stage must not ingest them), but keeps a file this disk wrote and never pushed."""
    key = "re-run"
    homes(0)
    with run_sync.synced(key, dsn):
        d = paths.run_dir(key)
        (d / "run.json").write_text("{}")
        (d / "stages").mkdir()
        (d / "stages" / "load.json").write_text('{"attempt": 1}')
        (d / "load").mkdir()
        (d / "load" / "sustained.result.json").write_text('{"attempt": 1}')
    _push_from(dsn, key, homes(1), {"stages/load.json": None, "load/sustained.result.json": None})
    homes(0)
    (d / "notes.txt").write_text("written here, never pushed")
    with run_sync.synced(key, dsn):
        assert set(_tree(d)) == {"run.json", "notes.txt"}
    # a reader's pull of a few files (not the run's own task) removes nothing
    _push_from(dsn, key, homes(1), {"run.json": None})
    homes(0)
    run_files.pull(key, dsn, only=lambda p: p == "report.html")
    assert (d / "run.json").is_file()


def test_a_stopped_task_pushes_its_records_before_it_ends(dsn, homes):
    """SIGTERM (Airflow stopping a task, SIGKILL after a grace period) inside synced raises TaskKilled, so the
    failure path pushes what the task wrote; the previous handler is back afterwards."""
    import signal

    key = "stopped"
    called: list[int] = []

    def airflows(signum: int, frame: object) -> None:  # as Airflow's task runner: calls on_kill, returns
        called.append(signum)

    before = signal.signal(signal.SIGTERM, airflows)
    with pytest.raises(run_sync.TaskKilled):
        with run_sync.synced(key, dsn):
            d = paths.run_dir(key)
            (d / "stages").mkdir()
            (d / "stages" / "load.json").write_text('{"status": "failed", "measured": 412}')
            (d / "load").mkdir()
            (d / "load" / "samples.csv").write_text("ts\n1\n")
            os.kill(os.getpid(), signal.SIGTERM)
    assert called == [signal.SIGTERM]  # the handler before (Airflow's calls the operator's on_kill) ran too
    assert signal.getsignal(signal.SIGTERM) is airflows  # back to the handler before synced's
    signal.signal(signal.SIGTERM, before)
    assert set(_rows(dsn, key)) == {"stages/load.json", "load/samples.csv"}


def test_a_push_during_a_pull_is_seen_whole_or_not_at_all(dsn, homes, monkeypatch, tmp_path):
    """The pull reads the listing and every content in one REPEATABLE READ transaction: a push landing between its
    listing and its reads is no 'does not match its sha256' refusal, just not there yet."""
    key = "raced"
    _push_from(dsn, key, tmp_path / "w1", {"stages/a.json": b'{"old": 1}', "stages/b.json": b'{"old": 2}'})
    homes(0)
    real, raced = run_files._fetch, []

    def fetch_after_a_push(*args, **kwargs):
        if not raced:
            raced.append(1)
            _push_from(dsn, key, tmp_path / "w1", {"stages/a.json": b'{"new": 1}', "stages/b.json": None})
        return real(*args, **kwargs)

    monkeypatch.setattr(run_files, "_fetch", fetch_after_a_push)
    run_files.pull(key, dsn)
    d = paths.run_dir(key)
    assert _tree(d) == {"stages/a.json": b'{"old": 1}', "stages/b.json": b'{"old": 2}'}
    monkeypatch.setattr(run_files, "_fetch", real)
    run_files.pull(key, dsn, mirror=True)
    assert _tree(d) == {"stages/a.json": b'{"new": 1}'}


def test_a_size_mismatch_is_refused_before_the_content_is_read(dsn, homes, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the content was read")

    _plant(dsn, "lying-early", "load/samples.csv", b"x" * 100, size=99)
    monkeypatch.setattr(run_files, "_fetch", never)
    with pytest.raises(run_files.RunFileRefused, match=r"holds 100 bytes where its row declares 99"):
        run_files.pull("lying-early", dsn)


def test_a_big_content_is_read_in_pieces(dsn, homes, monkeypatch):
    monkeypatch.setattr(run_files, "FETCH_CHUNK", 1000)
    body = bytes(range(256)) * 40  # 10,240 bytes: 11 pieces
    _plant(dsn, "pieces", "load/samples.bin", body)
    run_files.pull("pieces", dsn)
    assert (paths.run_dir("pieces") / "load" / "samples.bin").read_bytes() == body


def test_a_push_reads_no_file_through_a_symlink_nor_a_fifo(homes, tmp_path):
    folder = paths.run_dir("odd-files")
    (tmp_path / "secret").write_text("not the run's")
    os.symlink(tmp_path / "secret", folder / "link.json")
    os.mkfifo(folder / "pipe.json")
    with pytest.raises(run_files.RunFileRefused, match="cannot be opened as a plain file"):
        run_files._read_regular(folder, "link.json", "odd-files")
    with pytest.raises(run_files.RunFileRefused, match="is not a regular file"):
        run_files._read_regular(folder, "pipe.json", "odd-files")


def test_a_cell_pushes_only_the_kept_deployment_of_its_siblings(dsn, homes):
    """A sibling cell's samples half written on this disk, its run.json changed here: not this task's to push; the
    kept deployment it marks is. A user's run whose id merely starts like the matrix's cells is no cell."""
    matrix, prefix = "deploybench_matrix__m2", "deploybench_run__matrix__m2__"
    sibling, user_run = prefix + "c01", prefix + "x__c07"
    for key in (sibling, user_run):
        _push_from(dsn, key, homes(1), {"run.json": b"{}", "deployment.json": b'{"kept_for": "c02"}'})
    assert run_files.related_keys(dsn, prefix, cells_of(matrix)) == [sibling]
    homes(0)
    with run_sync.synced(prefix + "c02", dsn, also=[matrix], prefixes=[prefix], member=cells_of(matrix)):
        assert not (paths.runs_dir() / paths.run_folder_name(user_run)).exists()
        s = paths.run_dir(sibling)
        (s / "deployment.json").write_text('{"kept_for": "c02", "adopted_by": "c02"}')
        (s / "run.json").write_text('{"rewritten": "by its own task on this disk"}')
        (s / "load").mkdir()
        (s / "load" / "samples.csv").write_text("ts\n1\n")  # half written by the sibling's own task
    rows = _rows(dsn, sibling)
    assert set(rows) == {"run.json", "deployment.json"}
    assert rows["run.json"][0] == hashlib.sha256(b"{}").hexdigest()
    assert rows["deployment.json"][0] == hashlib.sha256(b'{"kept_for": "c02", "adopted_by": "c02"}').hexdigest()
    from deploybench.matrix import deployment

    assert run_sync.written_elsewhere(deployment.KEPT)


def test_the_results_page_replaces_a_stale_report_and_says_whether_one_is_there(dsn, homes):
    key = "stale-page"
    _push_from(dsn, key, homes(1), {"run.json": json.dumps({"run_key": key}).encode(),
                                    "report.html": b"<html>1</html>"})
    homes(0)
    assert run_files.pull_wanted(key, dsn) is True
    _push_from(dsn, key, homes(1), {"report.html": b"<html>2</html>"})
    homes(0)
    assert run_files.pull_wanted(key, dsn) is True
    assert (paths.run_dir(key) / "report.html").read_text() == "<html>2</html>"
    _push_from(dsn, "no-report", homes(1), {"run.json": b"{}"})
    homes(0)
    assert run_files.pull_wanted("no-report", dsn) is False


def test_prune_drops_old_runs_files_but_what_the_pages_serve(dsn, homes):
    old, new = "pruned-old", "pruned-new"
    for key in (old, new):
        _push_from(dsn, key, homes(1), {"run.json": b"{}", "report.html": b"<html/>", "load/samples.csv": b"x" * 300})
    with db.open_store(dsn).begin() as conn:
        conn.execute(text("UPDATE run_files SET updated_at = now() - interval '40 days' WHERE run_key = :k"),
                     {"k": old})
    got = run_files.prune(dsn, 30)
    assert got["files"] >= 1 and got["bytes"] >= 300
    assert set(_rows(dsn, old)) == {"run.json", "report.html"}
    assert set(_rows(dsn, new)) == {"run.json", "report.html", "load/samples.csv"}
    with pytest.raises(run_files.RunFileRefused, match=r"--older-than -1: give a number of days"):
        run_files.prune(dsn, -1)
    with pytest.raises(run_files.RunFileRefused, match=r"--older-than nan"):
        run_files.prune(dsn, float("nan"))


def test_concurrent_pushes_of_one_run_keep_its_bound(dsn, tmp_path, monkeypatch):
    """Two workers push 1,000 bytes each of one run at once, with room for 1,500: the pushes take turns on the run's
    advisory lock, so the second sees the first's rows and is refused; never both in."""
    import threading

    monkeypatch.setattr(run_files, "MAX_RUN_BYTES", 1500)
    key = "pushed-at-once"
    folders = []
    for name in ("w1", "w2"):
        f = tmp_path / name / "runs" / paths.run_folder_name(key)
        f.mkdir(parents=True)
        (f / f"{name}.csv").write_bytes(b"s" * 1000)
        folders.append(f)
    errors: list[BaseException] = []
    # both pushes inside their transactions at once, if the lock lets them (it does not: the first waits out the
    # barrier alone, bounded, and goes on)
    together, real = threading.Barrier(2, timeout=3), run_files._read_regular

    def read_together(*args):
        with contextlib.suppress(threading.BrokenBarrierError):
            together.wait()
        return real(*args)

    monkeypatch.setattr(run_files, "_read_regular", read_together)

    def one(folder: Path) -> None:
        try:
            run_files.push(key, dsn, {}, folder)
        except run_files.RunFileRefused as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(f,)) for f in folders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(errors) == 1, errors
    assert "would add up to 2,000 bytes" in str(errors[0])
    assert sum(n for _, n in _rows(dsn, key).values()) == 1000
