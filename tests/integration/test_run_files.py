"""A run's folder through the results database (deploybench.store.run_files) against a real PostgreSQL: what a
task on one worker writes, a task on another worker with its own disk reads; hostile rows are refused with nothing
written; a task that fails after measuring still hands on what it measured."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from sqlalchemy import select, text

from deploybench import paths
from deploybench.records import StageRecord
from deploybench.run import read_record, recording
from deploybench.store import db, run_files
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
    with run_files.synced(key, dsn):
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
    with run_files.synced(key, dsn):
        d = paths.run_dir(key)
        assert _tree(d) == {k: v for k, v in first.items() if not k.endswith(".tmp")}
        (d / "stages" / "preflight.json").write_text('{"stage": "preflight"}')
        (d / "stages" / "validate.json").write_text('{"stage": "validate", "again": 1}')
        (d / "load" / "sustained" / "samples.csv").unlink()
    rows = _rows(dsn, key)
    assert set(rows) == {"run.json", "stages/validate.json", "stages/preflight.json"}
    assert rows["stages/validate.json"][0] == hashlib.sha256(b'{"stage": "validate", "again": 1}').hexdigest()

    homes(0)  # back on the first worker: its stale copy is brought up to date
    with run_files.synced(key, dsn):
        d = paths.run_dir(key)
        assert (d / "stages" / "preflight.json").read_text() == '{"stage": "preflight"}'
        assert (d / "stages" / "validate.json").read_text() == '{"stage": "validate", "again": 1}'


def test_nothing_happens_without_a_results_database(homes, monkeypatch):
    monkeypatch.delenv(db.ENV_DSN, raising=False)
    key = "laptop-run"
    with run_files.synced(key, None):
        (paths.run_dir(key) / "run.json").write_text("{}")
    homes(1)
    with run_files.synced(key, None):
        assert not (paths.run_dir(key) / "run.json").exists()  # no database: nothing travelled


def test_shared_mode_leaves_the_folder_to_the_shared_disk(dsn, homes, monkeypatch):
    monkeypatch.setenv(run_files.MODE_ENV, "shared")
    key = "shared-run"
    with run_files.synced(key, dsn):
        (paths.run_dir(key) / "run.json").write_text("{}")
    assert _rows(dsn, key) == {}
    monkeypatch.setenv(run_files.MODE_ENV, "nfs")
    with pytest.raises(run_files.RunFileRefused, match="DEPLOYBENCH_RUN_FILES='nfs' is neither"):
        with run_files.synced(key, dsn):
            pass


def test_a_task_that_fails_after_measuring_still_hands_on_what_it_measured(dsn, homes):
    key = "failing-run"
    homes(0)
    with pytest.raises(RuntimeError, match="the node went away"):
        with run_files.synced(key, dsn):
            with recording(paths.run_dir(key), "load") as rec:
                rec.result = {"measured": {"requests": 412, "p99_ms": 930.5}}
                raise RuntimeError("the node went away")
    homes(1)
    with run_files.synced(key, dsn):
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
    with run_files.synced(key, dsn):
        (paths.run_dir(key) / "run.json").write_text("{}")
    monkeypatch.setattr(run_files, "MAX_FILE_BYTES", 2000)
    with pytest.raises(run_files.RunFileRefused, match=r"file 'load/k6.csv' is 2,001 bytes, over the 2,000 .*"
                                                       r"DEPLOYBENCH_RUN_FILES=shared"):
        with run_files.synced(key, dsn):
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
    with run_files.synced(key, dsn):
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
        with run_files.synced(key, dsn):
            for rel, body in files.items():
                (paths.run_dir(key) / rel).parent.mkdir(parents=True, exist_ok=True)
                (paths.run_dir(key) / rel).write_text(body)
    homes(1)
    with run_files.synced(prefix + "c02", dsn, also=[matrix], prefixes=[prefix]):
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
        assert run_files.related_file(name), name
    assert not run_files.related_file("load/sustained/samples.csv")
    assert not run_files.related_file("report.html")
