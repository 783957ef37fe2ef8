"""Issue 30, hole 8: the results pages attacked from outside, over HTTP.

Each test plays a reader (or nobody) against the app as Airflow mounts it (``/deploybench``, driven
in-process by Starlette's TestClient) over runs written with the real store into a throwaway
PostgreSQL (tests/support/fixtures.py's ``dsn``). Who the reader is comes from a stand-in auth dependency, as
in tests/integration/test_webapp_pages.py: Airflow's own plumbing is tested there.

The store holds a series of DAG ``team_a`` and ``team_b`` runs together (a, a, a, b, b, b, a: the
latency steps up with team_b's first run), a series of team_b alone, and a series of many small team_a
runs to pick from.
"""

from __future__ import annotations

import dataclasses
import html
import re
from datetime import timedelta
from urllib.parse import quote

import numpy as np
import pytest
from fastapi import FastAPI, HTTPException, Request
from sqlalchemy import event
from starlette.testclient import TestClient

from deploybench import paths, report
from deploybench.store import load_run, write_run
from deploybench.store.db import open_store
from deploybench.web import app as webapp
from tests.support import store_fixtures as fx
from tests.support.access import Access
from tests.support.run_folders import make_run_folder

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(120)]

DAG_A, DAG_B = "team_a", "team_b"
PICKS = 100  # the run= keys of the comparison attack


def _client(dsn: str, access: Access | None) -> TestClient:
    """The app behind a login: no ``access`` is a request without one (401), as Airflow's get_user answers."""

    async def auth(request: Request) -> None:
        if access is None:
            raise HTTPException(401, "Not authenticated")
        request.state.deploybench_access = access

    parent = FastAPI()
    parent.mount("/deploybench", webapp.create_app(dsn=dsn, auth=auth))
    return TestClient(parent)


def _store(dsn: str, key: str, dag_id: str, cfg: dict, latency: float, when, rng, n: int = 300) -> None:
    frame = fx.samples(n, latency, rng, start=when)
    record = fx.run_record(key, cfg, when).model_copy(update={"dag_id": dag_id, "airflow_run_id": key.split("__")[-1]})
    write_run(dsn, record, [], fx.phase_from(frame, 20), frame, facts=fx.facts(cfg))


@pytest.fixture(scope="module")
def stored(dsn):
    rng = np.random.default_rng(30)
    shared_cfg = fx.config(max_num_seqs=32)
    order = [(DAG_A, "a1", 400.0), (DAG_A, "a2", 400.0), (DAG_A, "a3", 400.0), (DAG_B, "b1", 560.0),
             (DAG_B, "b2", 560.0), (DAG_B, "b3", 560.0), (DAG_A, "a4", 560.0)]
    keys = {}
    for i, (dag, name, latency) in enumerate(order):
        keys[name] = f"{dag}__manual__{name}"
        _store(dsn, keys[name], dag, shared_cfg, latency, fx.T0 + timedelta(hours=i), rng)
    keys["hidden"] = f"{DAG_B}__manual__hidden"
    _store(dsn, keys["hidden"], DAG_B, fx.config(max_num_seqs=64), 400.0, fx.T0 + timedelta(days=1), rng)
    picks = [f"{DAG_A}__manual__p{i:03d}" for i in range(PICKS)]
    for i, key in enumerate(picks):
        _store(dsn, key, DAG_A, fx.config(max_num_seqs=128), 400.0, fx.T0 + timedelta(days=2, minutes=i), rng, n=40)
    series = {name: load_run(dsn, keys[name]).series_fingerprint for name in ("a1", "hidden")}
    assert series["a1"] == load_run(dsn, keys["b1"]).series_fingerprint != series["hidden"]
    return dsn, keys, picks, series


@pytest.fixture(scope="module")
def reader_a(stored):
    """A user who may read the runs of DAG team_a only."""
    with _client(stored[0], Access({DAG_A})) as c:
        yield c


@pytest.fixture(scope="module")
def admin(stored):
    with _client(stored[0], Access(set(), all_dags=True)) as c:
        yield c


def test_a_hundred_run_keys_are_refused_before_the_store_is_read(admin, stored):
    """Issue 30, hole 8: 100 run= keys on the comparison page (the 40-run cap bound only filters), each a
    rank test per figure against the store: refused with 400, naming the count, the cap and the way out."""
    _, _, picks, _ = stored
    r = admin.get("/deploybench/compare", params=[("run", k) for k in picks])
    assert r.status_code == 400, r.text[-500:]
    assert "100 runs picked; a comparison takes at most 40" in r.text and "compare by a filter" in r.text
    assert html.escape(picks[-1]) not in r.text  # the 100 keys are not echoed back into the form
    within = admin.get("/deploybench/compare", params=[("run", k) for k in picks[:2]])
    assert within.status_code == 200, within.text[-500:]


def test_the_baseline_samples_are_read_once_however_many_runs_are_compared(admin, stored):
    """Issue 30, hole 8: a comparison with a baseline re-read the baseline's samples for every run and
    figure, so each added run= key cost the baseline's whole sample set again; read once instead."""
    dsn, k, _, _ = stored
    baseline = k["a1"]
    reads: list[str] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        values = parameters.values() if isinstance(parameters, dict) else parameters or ()
        if "request_samples" in statement and baseline in values:
            reads.append(statement)

    engine = open_store(dsn)  # the engine the pages use too: one per database per process
    event.listen(engine, "before_cursor_execute", count)
    try:
        per_size = {}
        for others in ([k["a2"]], [k["a2"], k["a3"], k["a4"]]):
            reads.clear()
            r = admin.get("/deploybench/compare", params=[("run", baseline), *(("run", o) for o in others),
                                                          ("baseline", baseline)])
            assert r.status_code == 200 and "Change against the baseline" in r.text, r.text[-500:]
            per_size[len(others)] = len(reads)
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert per_size[1] == per_size[3] <= 6, per_size  # 5 sample tests + 1 goodput, whatever the run count


@pytest.mark.parametrize("prefix", ["%" * 8, "_" * 8, "%_%_%_%_"])
def test_a_wildcard_series_prefix_matches_no_series(reader_a, admin, stored, prefix):
    """Issue 30, hole 8: a series prefix of SQL wildcards ('%', '_') matched every series: the history page
    answered "starts N series" listing every fingerprint, those of unreadable DAGs too, and the filter of
    the comparison page selected every run. Matched literally, it is no series."""
    _, _, _, series = stored
    for client in (reader_a, admin):
        r = client.get(f"/deploybench/series/{quote(prefix, safe='')}")
        assert r.status_code == 404, r.text[-500:]
        for fp in series.values():
            assert fp[:12] not in r.text
    by_filter = admin.get("/deploybench/compare", params={"series": prefix})
    assert by_filter.status_code == 404 and "Best configuration" not in by_filter.text, by_filter.text[-500:]


def test_a_reader_of_dag_a_learns_nothing_about_a_series_of_dag_b(reader_a, admin, stored):
    """Issue 30, hole 8: a reader allowed only DAG team_a probes the history page for a series of team_b
    (full fingerprint and prefixes): the answer must be the one for a series that does not exist (it was
    403, "may not read any run of series", which confirms the series exists)."""
    _, _, _, series = stored
    hidden = series["hidden"]
    assert admin.get(f"/deploybench/series/{hidden}").status_code == 200  # it is there for a reader of team_b
    for probe in (hidden, hidden[:12], hidden[:8]):
        unknown = "f" * len(probe) if not hidden.startswith("f") else "e" * len(probe)
        got, none = reader_a.get(f"/deploybench/series/{probe}"), reader_a.get(f"/deploybench/series/{unknown}")
        assert (got.status_code, got.text.replace(probe, unknown)) == (none.status_code, none.text)
        assert got.status_code == 404
    readable = reader_a.get(f"/deploybench/series/{series['a1']}")
    assert readable.status_code == 200 and "<h1>History of series" in readable.text


def test_the_api_schema_and_docs_need_a_login(stored):
    """Issue 30, hole 8: /deploybench/openapi.json (every route and parameter of the pages) was served to a
    request without login, as FastAPI's schema route stands outside the app's auth dependency; nor may
    /docs or /redoc be."""
    with _client(stored[0], None) as anonymous:
        assert anonymous.get("/deploybench/").status_code == 401  # the pages themselves do need a login
        for path in ("/openapi.json", "/docs", "/redoc"):
            r = anonymous.get(f"/deploybench{path}")
            assert r.status_code in (401, 403, 404), (path, r.text[:300])
            assert not re.search(r"openapi|swagger|/api/runs", r.text, re.IGNORECASE), (path, r.text[:300])


def test_the_static_report_shows_no_run_of_a_dag_the_reader_may_not_read(reader_a, admin, stored):
    """Issue 30, hole 8: the run report is written once, at report time, with the history of the run's
    series; served to a reader of team_a, it named team_b's runs (the change point at b1, "runs before
    b1"). The report of a4 must show only what every reader of a4 may read."""
    dsn, k, _, series = stored
    key = k["a4"]
    folder = paths.run_dir(key)
    folder.mkdir(parents=True, exist_ok=True)
    run = dataclasses.replace(make_run_folder(folder), key=key,
                              meta={"dag_id": DAG_A, "airflow_run_id": key.split("__")[-1]})
    report.write_html(run, report.history_for(run, dsn))  # what the report task does
    live = admin.get(f"/deploybench/series/{series['a1']}").text
    assert html.escape(k["b1"]) in live  # team_b's runs are in this series

    r = reader_a.get(f"/deploybench/runs/{quote(key, safe='')}/report")
    assert r.status_code == 200 and "History of this series" in r.text, r.text[-500:]
    for name in ("b1", "b2", "b3"):
        assert k[name] not in r.text and html.escape(k[name]) not in r.text
    assert DAG_B not in r.text
