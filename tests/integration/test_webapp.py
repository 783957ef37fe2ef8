"""The results pages against a real PostgreSQL, and the plugin inside Airflow.

Runs are written with the real store into a throwaway database (on DEPLOYBENCH_DSN's server if
set, else the embedded one), tests/support/fixtures.py's ``dsn``, and the app is
driven in-process with Starlette's TestClient, mounted under /deploybench as Airflow mounts it.
The Airflow tests run in subprocesses (Airflow caches its plugins and auth manager per process);
everything talks to loopback or a Unix socket only.
"""

from __future__ import annotations

import os
import re
import uuid
from datetime import UTC, datetime, timedelta
from urllib.parse import quote

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from deploybench import paths
from deploybench.store import PhaseRecord, RunRecord, StageRow, load_run, write_run
from deploybench.web import app as webapp
from tests.support.airflow_python import PLUGINS, fresh_python

# time_limit: a lock never released, a server that never answers
pytestmark = [pytest.mark.integration, pytest.mark.time_limit(120)]

T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
EVIL = "<script>alert(1)</script>"




def phases(rps: float, p99: float | None) -> list[PhaseRecord]:
    pct = dict(
        latency_p50_ms=p99 and p99 / 4,
        latency_p90_ms=p99 and p99 / 2,
        latency_p99_ms=p99,
        latency_p999_ms=p99 and p99 * 1.5,
    )
    base = dict(
        phase="sustained",
        offered_rps=rps,
        output_tps=rps * 60,
        requests=1000,
        errors=25,
        error_rate=0.025,
        duration_s=30.0,
        started_at=T0,
    )
    return [
        PhaseRecord(node="*", achieved_rps=rps * 0.98, dropped_iterations=3, **pct, **base),
        PhaseRecord(node="n01", achieved_rps=rps * 0.49, ttft_p50_ms=20, ttft_p99_ms=80, **pct, **base),
        PhaseRecord(node="n02", achieved_rps=rps * 0.49, **pct, **base),
    ]


@pytest.fixture(scope="module")
def runs(dsn):
    """Two runs: an older success, and a newer failed one whose key and error carry markup."""
    tag = uuid.uuid4().hex[:6]
    old = RunRecord(
        run_key=f"deploybench_run__manual__2026-12-02T10:00:00+00:00_{tag}",
        dag_id="deploybench_run",
        airflow_run_id=f"manual__2026-12-02T10:00:00+00:00_{tag}",
        status="success",
        started_at=T0,
        finished_at=T0 + timedelta(minutes=3),
        config={"engine": {"profile": "sim"}},
        fingerprint=f"aaaa{tag}" + "0" * 20,
        inventory="lab",
        node_count=2,
    )
    new = RunRecord(
        run_key=f"cli/{EVIL}_{tag}",
        dag_id="cli",
        status="failed",
        started_at=T0 + timedelta(hours=1),
        config={"engine": {"profile": "vllm"}},
        fingerprint=f"bbbb{tag}" + "0" * 20,
        inventory="lab",
        node_count=2,
    )
    write_run(
        dsn,
        old,
        [
            StageRow(
                stage="preflight",
                status="success",
                started_at=T0,
                seconds=2.5,
                summary={"summary": "2/2 nodes healthy, 2 links tested"},
            ),
            StageRow(
                stage="load", status="success", started_at=T0, seconds=31.0, summary={"summary": "7.84 req/s"}
            ),
        ],
        phases(8.0, 900.0),
        None,
    )
    write_run(
        dsn,
        new,
        [
            StageRow(
                stage="rollout",
                status="failed",
                started_at=T0,
                seconds=4.0,
                summary={"summary": "engine did not start"},
                error=f"node n02: {EVIL} exited 1",
            ),
        ],
        phases(16.0, None),
        None,
    )
    return old, new


@pytest.fixture(scope="module")
def client(dsn):
    parent = FastAPI()
    parent.mount("/deploybench", webapp.create_app(dsn=dsn))
    with TestClient(parent) as c:  # in-process ASGI: no socket
        yield c


def page_url(key: str, suffix: str = "") -> str:
    return f"/deploybench/runs/{quote(key, safe='')}{suffix}"


def test_list_shows_both_runs_newest_first(client, runs):
    old, new = runs
    r = client.get("/deploybench/")
    assert r.status_code == 200
    assert "<script" not in r.text
    i_new, i_old = r.text.index(webapp.esc(new.run_key)), r.text.index(webapp.esc(old.run_key))
    assert i_new < i_old
    old_row = r.text[i_old : r.text.index("</tr>", i_old)]
    assert "7.84" in old_row and "900.0" in old_row and "2.50%" in old_row and "sim" in old_row
    new_row = r.text[i_new : r.text.index("</tr>", i_new)]
    assert "15.68" in new_row and "n/a" in new_row and "failed" in new_row  # no request succeeded: P99 n/a
    assert f"href='{page_url(old.run_key)}'" in r.text


def test_filters_by_status_and_fingerprint(client, runs):
    old, new = runs
    failed = client.get("/deploybench/", params={"status": "failed"}).text
    assert webapp.esc(new.run_key) in failed and webapp.esc(old.run_key) not in failed
    by_fp = client.get("/deploybench/", params={"fingerprint": old.fingerprint[:12]}).text
    assert webapp.esc(old.run_key) in by_fp and webapp.esc(new.run_key) not in by_fp
    none = client.get("/deploybench/", params={"status": "running", "fingerprint": old.fingerprint}).text
    assert "No runs match" in none
    assert client.get("/deploybench/", params={"status": "lost"}).status_code == 400


def test_run_page_shows_stages_and_phases(client, runs):
    old, new = runs
    r = client.get(page_url(old.run_key))
    assert r.status_code == 200
    stages, phases_html = r.text.split("<h2>Load phases</h2>")
    assert "2/2 nodes healthy, 2 links tested" in stages and "31.0" in stages
    assert "<b>cluster</b>" in phases_html and ">n01<" in phases_html and ">n02<" in phases_html
    assert phases_html.index("<b>cluster</b>") < phases_html.index(">n01<")
    assert (
        "900.0" in phases_html and "1,350.0" in phases_html and "80.0" in phases_html
    )  # P99, P99.9, TTFT P99

    failed = client.get(page_url(new.run_key))
    assert failed.status_code == 200 and "<script" not in failed.text
    assert f"node n02: {webapp.esc(EVIL)} exited 1" in failed.text
    assert "engine did not start" in failed.text


def test_json_api_matches_the_store(client, dsn, runs):
    old, new = runs
    listing = client.get("/deploybench/api/runs").json()["runs"]
    keys = [row["run_key"] for row in listing]
    assert keys.index(new.run_key) < keys.index(old.run_key)
    row = listing[keys.index(old.run_key)]
    assert RunRecord.model_validate({k: row[k] for k in RunRecord.model_fields}) == old
    assert PhaseRecord.model_validate(row["headline_phase"]) == phases(8.0, 900.0)[0]
    assert row["url"] == page_url(old.run_key)
    assert [
        r["run_key"] for r in client.get("/deploybench/api/runs", params={"status": "failed"}).json()["runs"]
    ] == [new.run_key]

    one = client.get(f"/deploybench/api/runs/{quote(new.run_key, safe='')}").json()
    stored = load_run(dsn, new.run_key)
    assert one.pop("report_url") is None
    assert type(stored).model_validate(one) == stored


def test_unknown_run_is_404(client, runs):
    r = client.get(page_url("no-such-run"))
    assert r.status_code == 404 and "no run &#x27;no-such-run&#x27; in the results store" in r.text
    assert client.get("/deploybench/api/runs/no-such-run").status_code == 404
    assert client.get(page_url("no-such-run", "/report")).status_code == 404
    assert client.get("/deploybench/dag-runs/other_dag/manual__1").status_code == 404


def test_report_is_served_when_present_and_404_when_absent(client, runs):
    old, _ = runs
    report = paths.run_dir(old.run_key) / "report.html"
    report.unlink(missing_ok=True)
    absent = client.get(page_url(old.run_key, "/report"))
    assert absent.status_code == 404 and "has no HTML report" in absent.text
    assert "HTML report" not in client.get(page_url(old.run_key)).text

    report.write_text("<!doctype html><title>r</title><h1>the report</h1>")
    served = client.get(page_url(old.run_key, "/report"))
    assert served.status_code == 200 and "<h1>the report</h1>" in served.text
    assert served.headers["content-type"].startswith("text/html")
    assert "script-src" not in served.headers["content-security-policy"]
    assert f"href='{page_url(old.run_key, '/report')}'>HTML report" in client.get(page_url(old.run_key)).text
    assert client.get(f"/deploybench/api/runs/{quote(old.run_key, safe='')}").json()[
        "report_url"
    ] == page_url(old.run_key, "/report")


def test_a_stored_key_cannot_reach_outside_the_runs_folder(client, dsn, runs):
    """'..' is a valid run key; its folder would be the deploybench home, whose files are not reports."""
    old, _ = runs
    write_run(dsn, old.model_copy(update={"run_key": ".."}), [], [], None)
    (paths.home() / "report.html").write_text("secret")
    try:
        r = client.get("/deploybench/runs/%2E%2E/report")
        assert r.status_code == 404 and "secret" not in r.text
    finally:
        (paths.home() / "report.html").unlink()


def test_dag_run_tab_shows_the_run_of_that_dag_run(client, runs):
    old, _ = runs
    r = client.get(f"/deploybench/dag-runs/deploybench_run/{quote(old.airflow_run_id, safe='')}")
    assert r.status_code == 200 and webapp.esc(old.run_key) in r.text


def test_unreachable_store_is_503_with_the_reason(runs):
    parent = FastAPI()
    parent.mount("/deploybench", webapp.create_app(dsn="postgresql+psycopg://nobody@127.0.0.1:1/none"))
    with TestClient(parent) as c:
        r = c.get("/deploybench/")
        assert r.status_code == 503
        assert "the results store is unavailable" in r.text and "127.0.0.1" in r.text
        assert "Traceback" not in r.text
        assert c.get("/deploybench/api/runs").json()["detail"].startswith("the results store is unavailable")


# -- inside Airflow --------------------------------------------------------------------------
def test_airflow_plugins_manager_loads_the_plugin():
    out = fresh_python("""
        import json
        from airflow import plugins_manager
        info = [p for p in plugins_manager.get_plugin_info() if p["name"] == "deploybench_results"]
        apps, _ = plugins_manager.get_fastapi_plugins()
        print(json.dumps({"errors": plugins_manager.get_import_errors(), "info": info,
                          "prefixes": [a["url_prefix"] for a in apps]}, default=str))
    """)
    assert out["errors"] == {}
    assert "/deploybench" in out["prefixes"]
    [info] = out["info"]
    assert [(v["name"], v["destination"], v["url_route"]) for v in info["external_views"]] == [
        ("Benchmarks", "nav", "deploybench"),
        ("Benchmark results", "dag_run", "deploybench-run"),
    ]
    assert info["external_views"][1]["href"] == "/deploybench/dag-runs/{DAG_ID}/{RUN_ID}"


def test_importing_the_plugin_opens_no_connection_and_starts_nothing():
    out = fresh_python(f"""
        import importlib.util, json, sys
        import airflow.plugins_manager  # Airflow's own import-time work is not the plugin's
        before = set(sys.modules)
        events = []
        watched = ("socket.connect", "socket.getaddrinfo", "subprocess.Popen", "os.posix_spawn", "os.exec")
        sys.addaudithook(lambda event, args: events.append(event) if event in watched else None)
        plugin = {str(PLUGINS / "deploybench_results.py")!r}
        spec = importlib.util.spec_from_file_location("deploybench_results", plugin)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        print(json.dumps({{"events": events, "new": sorted(set(sys.modules) - before)}}))
    """)
    assert out["events"] == []
    for heavy in (
        "psycopg",
        "deploybench.store.db",
        "deploybench.store.reader",
        "deploybench.store.embedded",
        "deploybench.airflow.connections",
    ):
        assert heavy not in out["new"], heavy


def test_inside_airflows_api_server_the_pages_need_an_airflow_user(dsn, runs, airflow_db):
    """Airflow's real FastAPI app, with this plugin mounted: no token -> 401 (and no API schema); a token ->
    the pages."""
    old, _ = runs
    out = fresh_python(
        f"""
        import json
        from airflow.api_fastapi.app import create_app, get_auth_manager
        from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
        from starlette.testclient import TestClient
        client = TestClient(create_app())
        anonymous = client.get("/deploybench/")
        schema = [client.get(f"/deploybench/{{p}}").status_code for p in ("openapi.json", "docs", "redoc")]
        forged = client.get("/deploybench/", headers={{"Authorization": "Bearer not-a-jwt"}})
        token = get_auth_manager().generate_jwt(SimpleAuthManagerUser(username="viewer", role="viewer"))
        with_header = client.get("/deploybench/", headers={{"Authorization": f"Bearer {{token}}"}})
        client.cookies.set("_token", token)  # what the UI's iframe sends
        tab = client.get("/deploybench/dag-runs/deploybench_run/{quote(old.airflow_run_id, safe="")}")
        plugins = client.get("/api/v2/plugins").json()
        print(json.dumps({{"anonymous": anonymous.status_code, "schema": schema, "forged": forged.status_code,
                          "header": [with_header.status_code, with_header.text], "tab": tab.status_code,
                          "views": [v for p in plugins["plugins"] for v in p["external_views"]]}}))
    """,
        DEPLOYBENCH_DSN=dsn,
        AIRFLOW__CORE__AUTH_MANAGER=(
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
        ),
    )
    assert out["anonymous"] == 401
    assert out["schema"] == [404, 404, 404]  # no schema or docs beside the pages (FastAPI's are unguarded)
    assert out["forged"] in (401, 403)
    assert out["header"][0] == 200 and webapp.esc(old.run_key) in out["header"][1]
    assert re.search(r"href='/deploybench/runs/[^']+'", out["header"][1])
    assert out["tab"] == 200
    assert {v["url_route"] for v in out["views"]} >= {"deploybench", "deploybench-run"}


AUTH_MANAGER = '''
from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager


class OneDagPerUser(SimpleAuthManager):
    """SimpleAuthManager, except: 'outsider' may not read deploybench_run, 'dagonly' may read no DAG as a whole."""

    def is_authorized_dag(self, *, method, user, access_entity=None, details=None):
        dag = details.id if details else None
        if user.get_name() == "outsider" and dag == "deploybench_run":
            return False
        if user.get_name() == "dagonly" and dag is None:
            return False
        return super().is_authorized_dag(method=method, user=user, access_entity=access_entity, details=details)
'''


def test_inside_airflows_api_server_each_user_sees_the_runs_of_the_dags_they_may_read(
    dsn, runs, airflow_db, tmp_path
):
    """Airflow's real app and JWTs, with an auth manager that refuses one DAG to one user: that user's list
    leaves the DAG's run out and its page is 403; a user without access to all DAGs loses the CLI run."""
    old, new = runs
    (tmp_path / "deploybench_test_auth.py").write_text(AUTH_MANAGER)
    out = fresh_python(
        f"""
        import json
        from airflow.api_fastapi.app import create_app, get_auth_manager
        from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
        from starlette.testclient import TestClient
        client = TestClient(create_app())
        result = {{}}
        for name in ("viewer", "outsider", "dagonly"):
            token = get_auth_manager().generate_jwt(SimpleAuthManagerUser(username=name, role="viewer"))
            headers = {{"Authorization": f"Bearer {{token}}"}}
            result[name] = {{
                "list": client.get("/deploybench/", headers=headers).text,
                "old": client.get("/deploybench/runs/{quote(old.run_key, safe="")}", headers=headers).status_code,
                "tab": client.get("/deploybench/dag-runs/deploybench_run/{quote(old.airflow_run_id, safe="")}",
                                  headers=headers).status_code,
                "cli": client.get("/deploybench/runs/{quote(new.run_key, safe="")}", headers=headers).status_code,
            }}
        print(json.dumps(result))
    """,
        DEPLOYBENCH_DSN=dsn,
        PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        AIRFLOW__CORE__AUTH_MANAGER="deploybench_test_auth.OneDagPerUser",
    )
    old_key, cli_key = webapp.esc(old.run_key), webapp.esc(new.run_key)
    viewer, outsider, dagonly = out["viewer"], out["outsider"], out["dagonly"]
    assert old_key in viewer["list"] and cli_key in viewer["list"]
    assert (viewer["old"], viewer["tab"], viewer["cli"]) == (200, 200, 200)
    assert old_key not in outsider["list"] and cli_key in outsider["list"]
    assert (outsider["old"], outsider["tab"], outsider["cli"]) == (403, 403, 200)
    assert old_key in dagonly["list"] and cli_key not in dagonly["list"]
    assert (dagonly["old"], dagonly["cli"]) == (200, 403)
