"""The results pages without a database: rendering helpers, DSN order, the report path guard, HTTP errors."""

from __future__ import annotations

import html
import math
from datetime import UTC, datetime, timedelta, timezone

import pytest
from fastapi import FastAPI, HTTPException, Request
from starlette.testclient import TestClient

from deploybench.store import PhaseRecord, RunRecord, StageRow, StoredRun, StoreError
from deploybench.web import app as webapp
from deploybench.web import markup as html_view

T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
EVIL = "<script>alert(1)</script>"


def make_run(key: str = "deploybench_run__manual__1", **kw) -> RunRecord:
    fields = dict(
        run_key=key,
        dag_id="deploybench_run",
        status="success",
        started_at=T0,
        finished_at=T0 + timedelta(minutes=2),
        config={"engine": {"profile": "sim"}},
        fingerprint="0123456789abcdef",
        inventory="lab",
        node_count=2,
    )
    return RunRecord(**{**fields, **kw})


def make_phase(node: str = "*", phase: str = "sustained", latency: float | None = 900.0) -> PhaseRecord:
    pct = dict(
        latency_p50_ms=latency and 200.0,
        latency_p90_ms=latency and 400.0,
        latency_p99_ms=latency,
        latency_p999_ms=latency and 1200.0,
    )
    return PhaseRecord(
        phase=phase,
        node=node,
        offered_rps=8.0,
        achieved_rps=1234.5678,
        output_tps=480.0,
        requests=1000,
        errors=10,
        error_rate=0.01,
        duration_s=30.0,
        started_at=T0,
        **pct,
    )


def stored(run: RunRecord, phases: list[PhaseRecord], stages: list[StageRow] | None = None) -> StoredRun:
    return StoredRun(
        run=run, stages=stages or [], phases=phases, sample_count=1500, created_at=T0, updated_at=T0
    )


# -- formatting ------------------------------------------------------------------------------
def test_numbers_are_formatted_and_missing_values_are_na():
    assert html_view.fmt_num(1234.5678) == "1,234.57"
    assert html_view.fmt_num(1234) == "1,234"
    assert html_view.fmt_num(0.5, 1) == "0.5"
    assert html_view.fmt_num(None) == html_view.fmt_num(math.nan) == html_view.fmt_num(math.inf) == "n/a"
    assert html_view.fmt_ms(None) == "n/a"
    assert html_view.fmt_ms(899.96) == "900.0"
    assert html_view.fmt_pct(0.0123) == "1.23%"
    assert html_view.fmt_pct(None) == "n/a"
    assert (
        html_view.fmt_time(datetime(2026, 12, 2, 11, 0, tzinfo=timezone(timedelta(hours=1))))
        == "2026-12-02 10:00:00 UTC"
    )


def test_escaping_covers_attributes_and_none():
    assert html_view.esc(EVIL) == "&lt;script&gt;alert(1)&lt;/script&gt;"
    assert html_view.esc("a'b\"c") == "a&#x27;b&quot;c"
    assert html_view.esc(None) == ""


def test_run_key_with_script_is_escaped_in_list_and_run_page():
    key = f"cli/{EVIL}'\"&"
    run = make_run(key, fingerprint=f"fp{EVIL}", tags={"who": EVIL}, config={"engine": {"profile": EVIL}})
    stage = StageRow(stage="load", status="failed", seconds=1.5, summary={"summary": EVIL}, error=EVIL)
    listing = html_view.render_run_list([html_view.RunRow(run, make_phase())], "/deploybench", fingerprint=EVIL)
    page = html_view.render_run_page(stored(run, [make_phase(node=EVIL)], [stage]), "/deploybench", None)
    for doc in (listing, page):
        assert "<script" not in doc
        assert html.escape(EVIL) in doc
    # the link carries the key percent-encoded ('/' included), so it reaches /runs/{run_key:path} whole
    assert "/deploybench/runs/cli%2F%3Cscript%3Ealert%281%29%3C%2Fscript%3E%27%22%26" in listing


def test_list_shows_headline_numbers_and_na_without_phases():
    rows = [html_view.RunRow(make_run("a"), make_phase()), html_view.RunRow(make_run("b", status="failed"), None)]
    doc = html_view.render_run_list(rows, "")
    assert "1,234.57" in doc and "900.0" in doc and "1.00%" in doc
    assert doc.index(">a</code>") < doc.index(">b</code>")
    row_b = doc[doc.index(">b</code>") :]
    assert row_b.count("n/a") >= 4  # phase, req/s, P99, error rate
    assert "<code>0123456789ab</code>" in doc  # short fingerprint, full one in the title
    assert "No runs match" in html_view.render_run_list([], "")


def test_run_page_shows_none_latencies_as_na_and_report_link_only_when_given():
    run = make_run()
    doc = html_view.render_run_page(stored(run, [make_phase(), make_phase("n01", latency=None)]), "/x", None)
    cells = doc[doc.index("<b>cluster</b>") :]
    assert "900.0" in cells
    assert ">n/a<" in cells[cells.index(">n01<") :]
    assert "HTML report" not in doc
    linked = html_view.render_run_page(stored(run, []), "/x", "/x/runs/k/report")
    assert "href='/x/runs/k/report'>HTML report" in linked
    assert "No load phase was stored" in linked


def test_headline_phase_prefers_the_cluster_sustained_phase():
    probe, sustained, node = make_phase(phase="probe"), make_phase(), make_phase("n01")
    assert html_view.headline_phase([node, sustained, probe]) is sustained
    assert html_view.headline_phase([node, probe]) is probe
    assert html_view.headline_phase([node]) is None


def test_stage_summary_uses_the_pipeline_line_else_json():
    assert (
        html_view.stage_summary(StageRow(stage="s", status="success", summary={"summary": "4 nodes"}))
        == "4 nodes"
    )
    assert (
        html_view.stage_summary(StageRow(stage="s", status="success", summary={"b": 1, "a": 2}))
        == '{"a": 2, "b": 1}'
    )
    assert html_view.stage_summary(StageRow(stage="s", status="success")) == ""


# -- which database --------------------------------------------------------------------------
@pytest.fixture
def no_embedded(monkeypatch):
    from deploybench.store import embedded

    monkeypatch.setattr(embedded, "running_dsn", lambda database=embedded.DATABASE: None)
    monkeypatch.delenv("DEPLOYBENCH_DSN", raising=False)


def test_dsn_order_connection_then_env_then_running_embedded(monkeypatch, no_embedded):
    from deploybench.airflow import connections as airflow_glue
    from deploybench.store import embedded

    monkeypatch.setattr(airflow_glue, "results_dsn", lambda: "postgresql+psycopg://conn@h/db")
    monkeypatch.setenv("DEPLOYBENCH_DSN", "postgresql://env@h/db")
    assert webapp.resolve_results_dsn() == "postgresql+psycopg://conn@h/db"
    monkeypatch.setattr(airflow_glue, "results_dsn", lambda: None)
    assert webapp.resolve_results_dsn() == "postgresql+psycopg://env@h/db"
    monkeypatch.delenv("DEPLOYBENCH_DSN")
    monkeypatch.setattr(
        embedded, "running_dsn", lambda database=embedded.DATABASE: "postgresql+psycopg://emb@/db"
    )
    assert webapp.resolve_results_dsn() == "postgresql+psycopg://emb@/db"


def test_without_airflow_or_any_database_the_reason_is_given(monkeypatch, no_embedded):
    from deploybench.airflow import connections as airflow_glue

    def no_airflow():
        raise ImportError("No module named 'airflow'")

    monkeypatch.setattr(airflow_glue, "results_dsn", no_airflow)
    with pytest.raises(webapp.ResultsUnavailable, match="deploybench_results.*DEPLOYBENCH_DSN.*never starts"):
        webapp.resolve_results_dsn()
    monkeypatch.setenv("DEPLOYBENCH_DSN", "mysql://x@h/db")
    with pytest.raises(StoreError, match="PostgreSQL"):
        webapp.resolve_results_dsn()


def test_a_broken_airflow_connection_is_reported_not_skipped(monkeypatch, no_embedded):
    from deploybench.airflow import connections as airflow_glue

    def broken():
        raise ValueError("extra is not JSON")

    monkeypatch.setattr(airflow_glue, "results_dsn", broken)
    monkeypatch.setenv("DEPLOYBENCH_DSN", "postgresql://env@h/db")
    with pytest.raises(
        webapp.ResultsUnavailable, match="connection 'deploybench_results'.*extra is not JSON"
    ):
        webapp.resolve_results_dsn()


# -- the report path -------------------------------------------------------------------------
def test_report_file_stays_inside_the_runs_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPLOYBENCH_HOME", str(tmp_path))
    (tmp_path / "report.html").write_text("not a run's report")
    assert webapp.report_file("..") is None  # run_dir('..') is the home folder itself
    assert webapp.report_file(".") is None
    assert webapp.report_file("k") is None  # no report yet
    target = tmp_path / "runs" / "k" / "report.html"
    target.write_text("<html>report</html>")
    assert webapp.report_file("k") == target.resolve()
    (tmp_path / "runs" / "s").mkdir()
    (tmp_path / "runs" / "s" / "report.html").symlink_to(tmp_path / "report.html")
    assert webapp.report_file("s") is None


# -- HTTP behaviour with the store replaced --------------------------------------------------
@pytest.fixture
def client(monkeypatch):
    runs = {key: stored(make_run(key), [make_phase()]) for key in ("k", "a/report")}

    def load_run(target, key):
        if target == "postgresql+psycopg://down@127.0.0.1/x":
            raise StoreError(
                "reading run 'k' from postgresql+psycopg://down@127.0.0.1/x failed: connection refused"
            )
        return runs.get(key)

    monkeypatch.setattr(webapp.store, "load_run", load_run)
    parent = FastAPI()
    parent.mount("/deploybench", webapp.create_app(dsn="postgresql+psycopg://ok@127.0.0.1/x"))
    parent.mount("/down", webapp.create_app(dsn="postgresql+psycopg://down@127.0.0.1/x"))
    with TestClient(parent) as c:  # in-process: no socket, no network
        yield c


def test_unknown_run_is_404_with_a_message_in_html_and_json(client):
    r = client.get("/deploybench/runs/nope")
    assert r.status_code == 404 and "no run &#x27;nope&#x27; in the results store" in r.text
    r = client.get("/deploybench/api/runs/nope")
    assert r.status_code == 404 and r.json()["detail"].startswith("no run 'nope'")


def test_store_failure_is_503_with_the_reason_and_no_traceback(client):
    r = client.get("/down/runs/k")
    assert r.status_code == 503
    assert "connection refused" in r.text and "Traceback" not in r.text
    assert client.get("/down/api/runs/k").json() == {
        "detail": "the results store is unavailable: reading run 'k' from "
        "postgresql+psycopg://down@127.0.0.1/x failed: connection refused"
    }


def test_pages_carry_a_csp_without_scripts_and_links_under_the_mount(client):
    r = client.get("/deploybench/runs/k")
    assert r.status_code == 200
    assert "script-src" not in r.headers["content-security-policy"]
    assert r.headers["content-security-policy"].startswith("default-src 'none'")
    assert "href='/deploybench/api/runs/k'" in r.text


def test_bad_query_is_400(client):
    r = client.get("/deploybench/api/runs", params={"status": "nonsense"})
    assert r.status_code == 400 and "status" in r.json()["detail"]
    assert client.get("/deploybench/", params={"limit": 0}).status_code == 400


def test_no_schema_or_docs_are_served_beside_the_pages():
    """FastAPI's /openapi.json, /docs and /redoc are routes of their own that the app's auth dependency does
    not guard: the app has none of them, so nothing is served without login."""

    async def refuse(request: Request) -> None:
        raise HTTPException(401, "not signed in")

    parent = FastAPI()
    parent.mount("/deploybench", webapp.create_app(dsn="postgresql+psycopg://ok@127.0.0.1/x", auth=refuse))
    with TestClient(parent) as c:
        assert c.get("/deploybench/").status_code == 401
        for path in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"):
            r = c.get(f"/deploybench{path}")
            assert r.status_code in (401, 404) and "openapi" not in r.text.lower(), path


def test_a_key_ending_in_report_still_has_its_page(client):
    r = client.get("/deploybench/runs/a%2Freport")  # the route sees '/runs/a/report'
    assert r.status_code == 200 and "<h1>Run <code>a/report</code></h1>" in r.text


def test_a_results_connection_on_a_unix_socket_keeps_its_folder_and_port(monkeypatch):
    """A Postgres connection whose host is a socket folder (the embedded PostgreSQL's) must not be
    turned into a host name by PostgresHook.get_uri()."""
    import json

    import psycopg

    from deploybench.airflow import connections as airflow_glue

    monkeypatch.setenv("AIRFLOW_CONN_DEPLOYBENCH_RESULTS", json.dumps(
        {"conn_type": "postgres", "host": "/run/deploybench/pg", "port": 5433, "login": "bench",
         "password": "s3cret", "schema": "results"}))
    dsn = airflow_glue.results_dsn()
    params = psycopg.conninfo.conninfo_to_dict(dsn.replace("postgresql+psycopg://", "postgresql://"))
    assert params == {"user": "bench", "password": "s3cret", "dbname": "results", "host": "/run/deploybench/pg",
                      "port": "5433"}
    monkeypatch.setenv("AIRFLOW_CONN_DEPLOYBENCH_RESULTS", json.dumps(
        {"conn_type": "postgres", "host": "db.example", "port": 5432, "login": "u", "schema": "r"}))
    assert "@db.example:5432/r" in airflow_glue.results_dsn()
