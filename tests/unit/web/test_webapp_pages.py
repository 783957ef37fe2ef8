"""The comparison and history pages and the per-DAG rule, without a database: rendering over
synthetic comparisons and histories (the history from the real change-point code), the query
parsing, and the read rule against a stand-in auth manager."""

from __future__ import annotations

import html
from datetime import UTC, datetime, timedelta

import numpy as np
import pandas as pd
import pytest
from fastapi import FastAPI, HTTPException, Request
from starlette.testclient import TestClient

from deploybench.analyse.compare import Comparison, config_diff
from deploybench.analyse.history import analyse_figures
from deploybench.report import plots
from deploybench.store import RunRecord, StoredRun
from deploybench.web import app as webapp
from deploybench.web import compare_page, history_page
from deploybench.web import markup as html_view
from deploybench.web.access import AccessUnavailable, AirflowReadAccess, RunReaders, may_read

T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
EVIL = "<script>alert(1)</script>"
ROOT = "/deploybench"


def _row(doc: str, marker: str) -> str:
    i = doc.index(marker)
    return doc[doc.rindex("<tr", 0, i): doc.index("</tr>", i)]


# -- configurations side by side ------------------------------------------------------------
def test_config_diff_puts_differing_keys_first_and_a_missing_key_differs():
    rows = config_diff({
        "a": {"engine": {"max_num_seqs": 8, "profile": "sim"}, "nodes": 2},
        "b": {"engine": {"max_num_seqs": 16, "profile": "sim"}, "nodes": 2, "tags": {"x": "1"}},
    })
    assert rows[:2] == [("engine.max_num_seqs", [8, 16], True), ("tags.x", [None, "1"], True)]
    assert rows[2:] == [("engine.profile", ["sim", "sim"], False), ("nodes", [2, 2], False)]


# -- the comparison page --------------------------------------------------------------------
def _comparison(evil: str = "") -> Comparison:
    keys = ["dag__a", f"dag__b{evil}", "dag__c"]
    figures = [(8.0, 530.0, True), (16.0, 640.0, True), (4.0, 1270.0, True)]
    table = pd.DataFrame([
        {"run_key": k, "engine": "sim", "serving": {"max_num_seqs": s}, "config": {"engine": {"max_num_seqs": s},
                                                                                   "inventory": "lab"},
         "capacity_rps": cap, "goodput_rps": 20.0, "achieved_rps": 20.0, "output_tps": 160.0,
         "latency_p50_ms": p99 / 1.3, "latency_p99_ms": p99, "ttft_p99_ms": p99 / 3, "error_rate": 0.0,
         "slo_met": ok, "pareto": k != "dag__c", "slo_p99_ms": 2000.0, "group": "w" * 64, "phase": "sustained"}
        for k, s, (cap, p99, ok) in zip(keys, (8, 16, 4), figures)])
    changes = pd.DataFrame([
        {"run_key": keys[1], "figure": "latency_p99_ms", "baseline": 530.0, "value": 640.0, "change": 0.21,
         "p_value": 1e-40, "significant": True, "direction": "worse"},
        {"run_key": keys[2], "figure": "output_tps", "baseline": 160.0, "value": 160.0, "change": 0.0,
         "p_value": 0.8, "significant": False, "direction": "same"}])
    return Comparison(table=table, groups={"w" * 64: keys}, best={"w" * 64: keys[1]},
                      pareto={"w" * 64: [keys[0], keys[1]]}, baseline=keys[0], changes=changes,
                      params={"alpha": 0.05, "method": "m", "filter": "3 runs picked"})


def test_comparison_page_names_best_run_baseline_and_highlights_differing_keys():
    cmp = _comparison()
    q = compare_page.CompareQuery(runs=tuple(cmp.run_keys()), baseline="dag__a")
    doc = compare_page.render(compare_page.ComparisonView(cmp, {}), q, ROOT)
    assert "<h1>Comparison</h1>" in doc
    best = doc[doc.index("Best configuration meeting the SLO"):]
    assert best[: best.index("</p>")].endswith("run <a href='/deploybench/runs/dag__b'>dag__b</a>")
    assert "Baseline: <a href='/deploybench/runs/dag__a'><code>dag__a</code></a>" in doc
    assert _row(doc, "<code>engine.max_num_seqs</code>").startswith("<tr class='diff'>")
    assert _row(doc, "<code>inventory</code>").startswith("<tr>")
    assert doc.index("<code>engine.max_num_seqs</code>") < doc.index("<details>") < doc.index("<code>inventory</code>")
    assert "1 configuration key differs between the runs" in doc
    assert _row(doc, "+21.0%").startswith("<tr class='worse'>") and "1e-40" in _row(doc, "+21.0%")
    assert "Pareto front: throughput up, P99 latency down" in doc and doc.count("<svg") == 2
    assert "<option value='dag__a' selected>" in doc  # the baseline stays chosen in the form
    assert doc.count("type='hidden' name='run'") == 3


def test_comparison_page_escapes_run_keys_everywhere_including_the_plots():
    cmp = _comparison(EVIL)
    q = compare_page.CompareQuery(runs=tuple(cmp.run_keys()))
    doc = compare_page.render(compare_page.ComparisonView(cmp, {}), q, ROOT)
    assert "<script" not in doc and html.escape(EVIL) in doc


def test_comparison_page_before_a_selection_and_with_an_error():
    empty = compare_page.render(None, compare_page.CompareQuery(), ROOT)
    assert "Pick runs" in empty and "name='model'" in empty
    err = compare_page.render(None, compare_page.CompareQuery(), ROOT, error=f"bad {EVIL}")
    assert f"<p class='err'>bad {html.escape(EVIL)}</p>" in err and "Pick runs" not in err


def test_compare_query_parses_the_form_and_names_bad_values():
    q = compare_page.CompareQuery.parse(["a", "a", " ", "b"], "", "", None, "", ["suite=i7", ""], "2026-12-01",
                                          "", False, 0.01)
    assert q.runs == ("a", "b") and q.baseline is None and q.model is None and q.tags == {"suite": "i7"}
    assert q.since == datetime(2026, 12, 1, tzinfo=UTC) and q.until is None and q.has_filter
    with pytest.raises(HTTPException, match="'yesterday' is not an ISO date"):
        compare_page.CompareQuery.parse([], None, None, None, None, [], "yesterday", None, False, 0.05)
    with pytest.raises(HTTPException, match="tag 'suite' is not KEY=VALUE"):
        compare_page.CompareQuery.parse([], None, None, None, None, ["suite"], None, None, False, 0.05)
    with pytest.raises(HTTPException, match="series 'abc' is too short"):
        compare_page.CompareQuery.parse([], None, None, "abc", None, [], None, None, False, 0.05)
    cap = compare_page.MAX_RUNS
    at_cap = [f"k{i}" for i in range(cap)]
    def parse(runs: list[str]) -> compare_page.CompareQuery:
        return compare_page.CompareQuery.parse(runs, None, None, None, None, [], None, None, False, 0.05)

    assert len(parse([*at_cap, "k0"]).runs) == cap  # a repeated key is one run
    with pytest.raises(HTTPException, match=f"{cap + 1} runs picked; a comparison takes at most {cap}: tick "
                                            "fewer runs, or compare by a filter") as refused:
        parse([*at_cap, "one more"])
    assert refused.value.status_code == 400


def test_compare_route_shows_the_form_again_with_the_reason(monkeypatch):
    parent = FastAPI()
    parent.mount(ROOT, webapp.create_app(dsn="postgresql+psycopg://ok@127.0.0.1/x"))
    with TestClient(parent) as c:  # fails while parsing: no database is asked
        r = c.get(f"{ROOT}/compare", params={"since": "yesterday"})
        assert r.status_code == 400 and "<h1>Comparison</h1>" in r.text and "is not an ISO date" in r.text
        assert c.get(f"{ROOT}/compare", params={"alpha": 2}).status_code == 400
        many = c.get(f"{ROOT}/compare", params=[("run", f"k{i}") for i in range(compare_page.MAX_RUNS + 1)])
        assert many.status_code == 400 and f"{compare_page.MAX_RUNS + 1} runs picked" in many.text
        assert "name='run'" not in many.text and "name='model'" in many.text  # a filter form, not 41 keys
        few = c.get(f"{ROOT}/compare", params=[("run", "k1"), ("run", "k2"), ("since", "yesterday")])
        assert few.status_code == 400 and few.text.count("type='hidden' name='run'") == 2  # the keys kept


# -- the history page -----------------------------------------------------------------------
def _history_view() -> history_page.HistoryView:
    rng = np.random.default_rng(3)
    n = 9
    p99 = np.where(np.arange(n) >= 5, 700.0, 500.0) * (1 + rng.normal(0, 0.005, n))
    figs = pd.DataFrame({
        "run_key": [f"dag__r{i}" for i in range(n)], "started_at": [T0 + timedelta(hours=i) for i in range(n)],
        "dag_id": "dag", "status": ["failed" if i == 7 else "success" for i in range(n)],
        "excluded": [i == 2 for i in range(n)], "exclude_reason": [EVIL if i == 2 else None for i in range(n)],
        "capacity_rps": None, "latency_p99_ms": np.where(np.arange(n) == 2, 2000.0, p99),
        "latency_p50_ms": p99 / 2, "output_tps": 160.0, "model": "sim-model", "cluster": "lab7", "engine": "sim",
        "workload": "w" * 64})
    analysed = figs[(figs["status"] == "success") & ~figs["excluded"]]
    return history_page.HistoryView("f" * 64, figs, analyse_figures(1, "f" * 64, analysed), hidden=1)


def test_history_page_marks_the_change_point_verdict_and_greys_excluded_and_failed_runs():
    view = _history_view()
    assert [c.run_key for c in view.history.changes if c.metric == "latency_p99_ms"] == ["dag__r5"]
    doc = history_page.render(view, ROOT)
    assert f"<h1>History of series <code>{'f' * 12}</code></h1>" in doc and "<script" not in doc
    runs = doc[doc.index("Runs of this series"):]
    changed = _row(runs, ">dag__r5<")
    assert changed.startswith("<tr class='changepoint'>") and "change point in latency_p99_ms: regression +" in changed
    assert _row(runs, ">dag__r4<").startswith("<tr>")
    excluded = _row(runs, ">dag__r2<")
    assert excluded.startswith("<tr class='excluded'>") and f"excluded: {html.escape(EVIL)}" in excluded
    assert _row(runs, ">dag__r7<").startswith("<tr class='excluded'>") and "failed: not analysed" in runs
    verdict = doc[doc.index("Verdict on the newest run"):]
    verdict = verdict[: verdict.index("</p>")]
    assert ">dag__r8<" in verdict and "latency_p99_ms: <b>regression</b>" in verdict
    assert "change point: regression +" in doc and "excluded or failed (not analysed)" in doc  # plot text
    assert "1 run of DAGs you may not read is left out" in doc
    assert f"href='{ROOT}/compare?series={'f' * 64}'" in doc


def test_history_page_without_an_analysable_run_says_so():
    view = _history_view()
    view.history = None
    doc = history_page.render(view, ROOT)
    assert "No run of this series can be analysed" in doc and "Verdict on the newest run" not in doc


# -- plots ----------------------------------------------------------------------------------
def test_new_plots_keep_labels_as_escaped_text_and_take_dollar_signs():
    svg = plots.pareto({"a$b": (4.0, 500.0), EVIL: (8.0, 400.0), "c": (2.0, 900.0)}, [EVIL], "P", 800.0)
    assert svg.startswith("<svg") and "<script" not in svg and "a$b" in svg and "Pareto front" in svg
    assert plots.pareto({"x": (float("nan"), 1.0)}, [], "P") == ""
    hist = plots.metric_history([{"t": T0, "value": 1.0, "excluded": False}, {"t": T0 + timedelta(hours=1),
                                 "value": 2.0, "excluded": True}], [{"t": T0, "text": "change point: $x"}], "T", "ms")
    assert "change point: $x" in hist and "excluded or failed" in hist
    assert plots.metric_history([{"t": T0, "value": None}], [], "T", "ms") == ""


# -- run list and run page ------------------------------------------------------------------
def test_run_list_is_a_form_that_opens_the_comparison():
    run = RunRecord(run_key=f"k{EVIL}", dag_id="d", status="success", started_at=T0, fingerprint="f" * 16,
                    inventory="lab", node_count=1)
    doc = html_view.render_run_list([html_view.RunRow(run, None)], ROOT)
    assert f"<form method='get' action='{ROOT}/compare'>" in doc
    assert f"<input type='checkbox' name='run' value='k{html.escape(EVIL)}'" in doc
    assert f"<input type='radio' name='baseline' value='k{html.escape(EVIL)}'" in doc


def test_run_page_links_to_its_series_or_says_it_has_none():
    run = RunRecord(run_key="k", dag_id="d", status="success", started_at=T0, fingerprint="c" * 16,
                    inventory="lab", node_count=1)
    stored = StoredRun(run=run, stages=[], phases=[], sample_count=0, created_at=T0, updated_at=T0,
                       series_fingerprint="a" * 64, excluded=True, exclude_reason="noisy neighbour")
    doc = html_view.render_run_page(stored, ROOT, None)
    assert f"<a href='{ROOT}/series/{'a' * 64}'>History of this series</a>" in doc
    assert "excluded from analysis: noisy neighbour" in doc
    bare = html_view.render_run_page(stored.model_copy(update={"series_fingerprint": None}), ROOT, None)
    assert "History of this series" not in bare and "stored without identities" in bare


# -- the per-DAG rule -----------------------------------------------------------------------
class Manager:
    """Records what the results pages ask Airflow's auth manager; allows the DAGs in ``allowed``."""

    def __init__(self, allowed: set[str | None]) -> None:
        self.allowed, self.calls = allowed, []

    def is_authorized_dag(self, *, method, user, access_entity=None, details=None):
        self.calls.append((method, access_entity.value if access_entity else None, details and details.id))
        return (details.id if details else None) in self.allowed


class User:
    def get_name(self) -> str:
        return "ada"


def test_a_dag_run_needs_its_dag_and_a_cli_run_needs_every_dag():
    manager = Manager({"deploybench_run"})
    access = AirflowReadAccess(manager, User())
    assert may_read(access, "deploybench_run", "manual__1")
    assert not may_read(access, "secret", "manual__1")
    assert not may_read(access, "cli", None)  # no Airflow run: asks about all DAGs (details=None)
    assert may_read(access, "deploybench_run", "manual__2")  # cached: not asked again
    assert manager.calls == [("GET", "RUN", "deploybench_run"), ("GET", "RUN", "secret"), ("GET", "RUN", None)]
    assert may_read(AirflowReadAccess(Manager({None}), User()), "cli", None)


def test_the_dags_team_is_passed_as_airflow_passes_it_and_a_failed_lookup_refuses():
    seen = []

    class Teams(Manager):
        def is_authorized_dag(self, *, method, user, access_entity=None, details=None):
            seen.append(details.team_name)
            return details.team_name == "red"

    assert AirflowReadAccess(Teams(set()), User(), {"d": "red"}.get).may_read_dag("d") and seen == ["red"]

    def broken(dag_id: str) -> str | None:
        raise RuntimeError("no such table: team")

    with pytest.raises(AccessUnavailable, match="team of DAG 'd'.*no such table"):
        AirflowReadAccess(Teams(set()), User(), broken).may_read_dag("d")


def test_a_run_report_shows_what_every_reader_of_the_run_may_read():
    """A DAG run's readers share its DAG only; a CLI run's readers may read every DAG (the report's history)."""
    dag_run = RunReaders.of_row({"dag_id": "team_a", "airflow_run_id": "manual__1"})
    assert may_read(dag_run, "team_a", "manual__2")
    assert not may_read(dag_run, "team_b", "manual__1") and not may_read(dag_run, "team_a", None)
    cli = RunReaders.of_row({"dag_id": "cli", "airflow_run_id": float("nan")})  # NaN: select_runs' missing id
    assert may_read(cli, "team_b", "manual__1") and may_read(cli, "cli", None)


def test_an_auth_dependency_that_names_no_user_is_refused_not_trusted():
    async def forgetful(request: Request) -> None:
        return None

    parent = FastAPI()
    parent.mount(ROOT, webapp.create_app(dsn="postgresql+psycopg://ok@127.0.0.1/x", auth=forgetful))
    with TestClient(parent) as c:
        r = c.get(f"{ROOT}/")
        assert r.status_code == 403 and "refuse to guess" in r.text
