"""The comparison and history pages, and per-DAG read permission, against a real PostgreSQL.

Runs are built with store_fixtures (identities, capacity steps, per-request samples) into a
throwaway database and the app is driven in-process with Starlette's TestClient under
/deploybench. Per-DAG permission is checked twice: with a stand-in auth dependency (the rule,
in-process) and inside Airflow's own api-server app with a real JWT and an auth manager that
refuses one DAG (the plumbing, in a subprocess as Airflow caches its auth manager per process).
"""

from __future__ import annotations

import html
import os
import re
from datetime import timedelta
from urllib.parse import quote

import numpy as np
import pytest
from fastapi import FastAPI, Request
from starlette.testclient import TestClient

from deploybench.store import load_run, set_excluded, write_run
from deploybench.web import app as webapp
from tests.support import store_fixtures as fx
from tests.support.access import Access

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(120)]

# name -> (max_num_seqs, median latency ms, capacity steps (offered, achieved, p99, slo ok))
CONFIGS = {
    "seq8": (8, 400.0, [(4, 4, 500, True), (8, 8, 800, True), (16, 12, 2600, False)]),
    "seq16": (16, 480.0, [(4, 4, 600, True), (8, 8, 900, True), (16, 16, 1500, True), (32, 20, 5000, False)]),
    "seq4": (4, 900.0, [(4, 4, 1200, True), (8, 6, 3000, False)]),
}
HISTORY_RUNS = 8
STEP_AT = 4  # history runs from this index on are 40 % slower: the change point
EXCLUDED_AT = 2
SECRET_DAG = "secret_dag"


def _store(dsn: str, key: str, cfg: dict, latency: float, when, rng, capacity=(), **update) -> None:
    """One run with samples around ``latency``; ``update`` changes fields of fx.run_record's record."""
    frame = fx.samples(300, latency, rng, start=when)
    write_run(dsn, fx.run_record(key, cfg, when).model_copy(update=update), [], fx.phase_from(frame, 20), frame,
              facts=fx.facts(cfg, capacity=list(capacity)))


@pytest.fixture(scope="module")
def stored(dsn):
    """Three configurations to compare, a series of eight runs with a slowdown from run 4 (run 2
    excluded), a run of a DAG some users may not read, and a run started from the CLI."""
    rng = np.random.default_rng(7)
    keys: dict[str, str] = {}
    for i, (name, (seqs, lat, cap)) in enumerate(CONFIGS.items()):
        keys[name] = f"deploybench_run__manual__{name}"
        _store(dsn, keys[name], fx.config(max_num_seqs=seqs), lat, fx.T0 + timedelta(hours=i), rng, cap)
    hist_cfg = fx.config(max_num_seqs=32)
    history = []
    for i in range(HISTORY_RUNS):
        key = f"deploybench_run__scheduled__h{i:02d}"
        lat = 400.0 * (1.4 if i >= STEP_AT else 1.0) * (3.0 if i == EXCLUDED_AT else 1.0)
        _store(dsn, key, hist_cfg, lat, fx.T0 + timedelta(days=1, hours=i), rng)
        history.append(key)
    set_excluded(dsn, history[EXCLUDED_AT], True, "node n2 was throttling")
    keys["secret"] = f"{SECRET_DAG}__manual__s1"
    _store(dsn, keys["secret"], fx.config(max_num_seqs=32), 410.0, fx.T0 + timedelta(days=1, minutes=30), rng,
           dag_id=SECRET_DAG)
    keys["cli"] = "cli/run-1"
    _store(dsn, keys["cli"], fx.config(max_num_seqs=8), 400.0, fx.T0 + timedelta(hours=5), rng, dag_id="cli",
           airflow_run_id=None, trigger="cli")
    series = load_run(dsn, history[0]).series_fingerprint
    assert series and load_run(dsn, keys["secret"]).series_fingerprint == series  # the secret run is in it
    return dsn, keys, history, series


def _client(dsn: str, access: Access | None) -> TestClient:
    async def auth(request: Request) -> None:
        request.state.deploybench_access = access

    parent = FastAPI()
    parent.mount("/deploybench", webapp.create_app(dsn=dsn, auth=auth if access else None))
    return TestClient(parent)


@pytest.fixture(scope="module")
def admin(stored):
    with _client(stored[0], Access(set(), all_dags=True)) as c:
        yield c


@pytest.fixture(scope="module")
def limited(stored):
    """A user who may read deploybench_run only."""
    with _client(stored[0], Access({"deploybench_run"})) as c:
        yield c


def _row(doc: str, marker: str) -> str:
    """The table row that contains ``marker``."""
    i = doc.index(marker)
    return doc[doc.rindex("<tr", 0, i): doc.index("</tr>", i)]


# -- comparison ------------------------------------------------------------------------------
def test_comparison_names_the_best_run_and_tests_against_the_baseline(admin, stored):
    _, k, _, _ = stored
    r = admin.get("/deploybench/compare", params=[("run", k["seq8"]), ("run", k["seq16"]), ("run", k["seq4"]),
                                                  ("baseline", k["seq8"])])
    assert r.status_code == 200, r.text[-2000:]
    doc = r.text
    assert "<h1>Comparison</h1>" in doc and "<script" not in doc
    assert r.headers["content-security-policy"].startswith("default-src 'none'")
    assert "script-src" not in r.headers["content-security-policy"]
    best = doc[doc.index("Best configuration meeting the SLO"):]
    best = best[: best.index("</p>")]
    assert html.escape(k["seq16"]) in best and html.escape(k["seq8"]) not in best
    assert f"Baseline: <a href='/deploybench/runs/{quote(k['seq8'], safe='')}'>" in doc
    changes = doc[doc.index("Change against the baseline"):]
    p99 = _row(changes, "P99 e2e ms")  # the first figure row of seq16's P99 (seq4 is further down)
    assert html.escape(k["seq16"]) in p99 and ">yes<" in p99 and ">worse<" in p99
    assert "Pareto front: throughput up, P99 latency down" in doc  # the SVG plot's title, as text
    assert doc.count("<svg") >= 2
    # configurations side by side: the one differing key highlighted, an equal one not
    configs = doc[doc.index("Configurations side by side"):doc.index("Workload group 1")]
    assert "1 configuration key differs between the runs" in configs
    assert _row(configs, "<code>engine.max_num_seqs</code>").startswith("<tr class='diff'>")
    assert _row(configs, "<code>inventory</code>").startswith("<tr>")


def test_comparison_by_filter_and_the_form_keeps_it(admin, stored):
    _, k, history, series = stored
    r = admin.get("/deploybench/compare", params={"series": series[:12], "baseline": history[0]})
    assert r.status_code == 200, r.text[-2000:]
    assert f"value='{series[:12]}'" in r.text  # the filter stays in the form
    assert html.escape(history[-1]) in r.text
    assert html.escape(history[EXCLUDED_AT]) not in r.text.split("Baseline:")[1]  # excluded: left out
    assert html.escape(k["seq8"]) not in r.text  # another series
    both = admin.get("/deploybench/compare", params={"run": k["seq8"], "model": "sim-model"})
    assert both.status_code == 400 and "not both" in both.text and "<h1>Comparison</h1>" in both.text
    unknown = admin.get("/deploybench/compare", params={"run": "nope/1"})
    assert unknown.status_code == 404 and "nope/1" in unknown.text
    empty = admin.get("/deploybench/compare")
    assert empty.status_code == 200 and "Pick runs" in empty.text


def test_run_list_ticks_runs_into_the_comparison(admin, stored):
    _, k, _, _ = stored
    doc = admin.get("/deploybench/").text
    assert "action='/deploybench/compare'" in doc
    assert f"<input type='checkbox' name='run' value='{html.escape(k['seq8'])}'" in doc
    assert f"<input type='radio' name='baseline' value='{html.escape(k['seq8'])}'" in doc


# -- history ---------------------------------------------------------------------------------
def test_history_marks_the_change_point_the_verdict_and_greys_the_excluded_run(admin, stored):
    _, _, history, series = stored
    r = admin.get(f"/deploybench/series/{series}")
    assert r.status_code == 200, r.text[-2000:]
    doc = r.text
    assert f"<h1>History of series <code>{series[:12]}</code></h1>" in doc
    runs = doc[doc.index("Runs of this series"):]
    changed = _row(runs, html.escape(history[STEP_AT]))
    assert changed.startswith("<tr class='changepoint'>") and "change point in latency_p99_ms: regression" in changed
    assert _row(runs, html.escape(history[STEP_AT - 1])).startswith("<tr>")
    excluded = _row(runs, html.escape(history[EXCLUDED_AT]))
    assert excluded.startswith("<tr class='excluded'>") and "excluded: node n2 was throttling" in excluded
    verdict = doc[doc.index("Verdict on the newest run"):]
    verdict = verdict[: verdict.index("</p>")]
    assert html.escape(history[-1]) in verdict and "latency_p99_ms: <b>regression</b>" in verdict
    assert "change point: regression +" in doc  # the label on the P99 plot, SVG text
    assert "excluded or failed (not analysed)" in doc  # the grey points' legend
    assert admin.get(f"/deploybench/series/{series[:10]}").status_code == 200  # a unique prefix
    assert admin.get("/deploybench/series/ffffffffffff").status_code == 404
    assert admin.get("/deploybench/series/abc").status_code == 400
    for wildcards in ("%25" * 8, "_" * 8):  # matched literally, not as LIKE patterns of every series
        assert admin.get(f"/deploybench/series/{wildcards}").status_code == 404


def test_every_run_page_links_to_its_series_history(admin, stored):
    _, k, history, series = stored
    doc = admin.get(f"/deploybench/runs/{quote(history[0], safe='')}").text
    assert f"href='/deploybench/series/{series}'>History of this series</a>" in doc
    tab = admin.get(f"/deploybench/dag-runs/deploybench_run/{quote('manual__seq8', safe='')}").text
    other = load_run(stored[0], k["seq8"]).series_fingerprint
    assert f"href='/deploybench/series/{other}'" in tab and other != series


# -- per-DAG permission ----------------------------------------------------------------------
def test_a_user_limited_to_one_dag_sees_only_its_runs(limited, admin, stored):
    _, k, history, series = stored
    listing = limited.get("/deploybench/").text
    assert html.escape(k["seq8"]) in listing
    assert html.escape(k["secret"]) not in listing and html.escape(k["cli"]) not in listing
    assert html.escape(k["secret"]) in admin.get("/deploybench/").text  # the admin does see it
    api = [r["run_key"] for r in limited.get("/deploybench/api/runs").json()["runs"]]
    assert k["seq8"] in api and k["secret"] not in api

    secret = limited.get(f"/deploybench/runs/{quote(k['secret'], safe='')}")
    assert secret.status_code == 403 and "may not read run" in secret.text
    assert limited.get(f"/deploybench/api/runs/{quote(k['secret'], safe='')}").status_code == 403
    assert limited.get(f"/deploybench/runs/{quote(k['secret'], safe='')}/report").status_code == 403
    assert limited.get(f"/deploybench/dag-runs/{SECRET_DAG}/manual__s1").status_code == 403
    assert limited.get(f"/deploybench/runs/{quote(k['cli'], safe='')}").status_code == 403  # no DAG: all DAGs
    assert admin.get(f"/deploybench/runs/{quote(k['cli'], safe='')}").status_code == 200


def test_comparison_and_history_leave_out_what_the_user_may_not_read(limited, admin, stored):
    _, k, history, series = stored
    refused = limited.get("/deploybench/compare", params=[("run", k["seq8"]), ("run", k["secret"])])
    assert refused.status_code == 403 and html.escape(k["secret"]) in refused.text
    base = limited.get("/deploybench/compare", params=[("run", k["seq8"]), ("run", k["seq16"]),
                                                       ("baseline", k["secret"])])
    assert base.status_code == 403
    by_filter = limited.get("/deploybench/compare", params={"series": series})
    assert by_filter.status_code == 200 and html.escape(k["secret"]) not in by_filter.text
    assert html.escape(k["secret"]) in admin.get("/deploybench/compare", params={"series": series}).text

    hist = limited.get(f"/deploybench/series/{series}").text
    assert html.escape(k["secret"]) not in hist and "1 run of DAGs you may not read is left out" in hist
    assert html.escape(k["secret"]) in admin.get(f"/deploybench/series/{series}").text
    nobody = _client(stored[0], Access(set()))
    with nobody:  # a series without a run the user may read answers as one that does not exist
        hidden, unknown = nobody.get(f"/deploybench/series/{series}"), nobody.get(f"/deploybench/series/{'f' * 64}")
        assert hidden.status_code == unknown.status_code == 404
        assert hidden.text.replace(series, "f" * 64) == unknown.text
        assert re.search(r"No runs match", nobody.get("/deploybench/").text)


SECRET_AUTH_MANAGER = f'''
from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager


class NoSecretDag(SimpleAuthManager):
    """SimpleAuthManager, except that user 'outsider' may not read {SECRET_DAG}."""

    def is_authorized_dag(self, *, method, user, access_entity=None, details=None):
        if user.get_name() == "outsider" and details is not None and details.id == "{SECRET_DAG}":
            return False
        return super().is_authorized_dag(method=method, user=user, access_entity=access_entity, details=details)
'''


def test_inside_airflows_api_server_the_comparison_and_history_pages_answer_per_user(stored, airflow_db,
                                                                                    tmp_path):
    """Airflow's real app, its JWT cookie (what the UI's iframe sends) and matplotlib in the api-server."""
    from tests.support.airflow_python import fresh_python

    dsn, k, history, series = stored
    (tmp_path / "deploybench_test_auth2.py").write_text(SECRET_AUTH_MANAGER)
    out = fresh_python(
        f"""
        import json
        from airflow.api_fastapi.app import create_app, get_auth_manager
        from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
        from starlette.testclient import TestClient
        result = {{}}
        for name in ("viewer", "outsider"):
            client = TestClient(create_app())
            client.cookies.set("_token", get_auth_manager().generate_jwt(
                SimpleAuthManagerUser(username=name, role="viewer")))
            history = client.get("/deploybench/series/{series}")
            compare = client.get("/deploybench/compare", params={{"series": "{series}", "baseline": "{history[0]}"}})
            secret = client.get("/deploybench/compare", params=[("run", "{k['seq8']}"), ("run", "{k['secret']}")])
            result[name] = {{"history": [history.status_code, history.text],
                            "compare": [compare.status_code, compare.text], "secret": secret.status_code}}
        print(json.dumps(result))
    """,
        DEPLOYBENCH_DSN=dsn,
        PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        AIRFLOW__CORE__AUTH_MANAGER="deploybench_test_auth2.NoSecretDag",
    )
    secret = html.escape(k["secret"])
    viewer, outsider = out["viewer"], out["outsider"]
    assert viewer["history"][0] == 200 and f"History of series <code>{series[:12]}</code>" in viewer["history"][1]
    assert secret in viewer["history"][1] and "<svg" in viewer["history"][1]
    assert viewer["compare"][0] == 200 and "Best configuration meeting the SLO" in viewer["compare"][1]
    assert secret in viewer["compare"][1] and viewer["secret"] == 200
    assert outsider["history"][0] == 200 and secret not in outsider["history"][1]
    assert "1 run of DAGs you may not read is left out" in outsider["history"][1]
    assert outsider["compare"][0] == 200 and secret not in outsider["compare"][1]
    assert outsider["secret"] == 403
