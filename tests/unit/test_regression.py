"""Reference benchmarks, the versions file, the verdict's message and the regression DAG's shape."""

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from deploybench import regression
from deploybench.errors import ConfigError

DAGS = Path(__file__).resolve().parents[2] / "dags"


def _write(d: Path, name="nightly", versions=True, **over):
    bench = {"name": name, "schedule": "0 3 * * *", "start_date": "2026-03-01", "params": {
        "inventory": "demo", "nodes": 2, "load_rate": 6, "load_duration_s": 8}, **over}
    if versions:
        bench["versions"] = "engine.versions.json"
        (d / "engine.versions.json").write_text(json.dumps({"versions": [
            {"since": "2026-03-01", "software": "sim 1.0", "params": {"sim_slowdown": 1.0}},
            {"since": "2026-03-05", "software": "sim 1.1", "params": {"sim_slowdown": 1.1}}]}))
    (d / f"{name}{regression.SUFFIX}").write_text(json.dumps(bench))
    return regression.by_name(name, d)


def test_the_repository_benchmarks_validate_with_the_form_schema():
    benches = regression.find()
    assert benches, "include/benchmarks/ has no reference benchmark"
    for b in benches:
        assert regression.validate(b), b.name
        assert b.dag_id == regression.DAG_PREFIX + b.name


def test_a_date_runs_the_software_current_on_that_day(tmp_path):
    b = _write(tmp_path)
    before = regression.params_for(b, datetime(2026, 3, 4, 23, 0, tzinfo=UTC))
    after = regression.params_for(b, "2026-03-05T00:00:00+00:00")
    assert before["sim_slowdown"] == 1.0 and after["sim_slowdown"] == 1.1
    assert after["tags"] == {"benchmark": "nightly", "benchmark_rev": b.revision, "software": "sim 1.1"}
    assert before["load_rate"] == 6 and before["inventory"] == "demo"
    with pytest.raises(ConfigError, match="no software version is known for 2026-02-28"):
        regression.params_for(b, "2026-02-28T00:00:00+00:00")


def test_a_bad_parameter_is_refused_naming_the_benchmark_and_the_version(tmp_path):
    b = _write(tmp_path)
    (tmp_path / "engine.versions.json").write_text(json.dumps({"versions": [
        {"since": "2026-03-01", "software": "sim 2.0", "params": {"sim_slowdwn": 1.1}}]}))
    with pytest.raises(ConfigError, match=r"nightly.*sim 2.0.*sim_slowdwn"):
        regression.validate(b)
    with pytest.raises(ConfigError, match="load_rate"):
        regression.validate(_write(tmp_path, name="bad", versions=False,
                                   params={"inventory": "demo", "load_rate": -1}))


def test_versions_must_be_in_date_order(tmp_path):
    b = _write(tmp_path)
    (tmp_path / "engine.versions.json").write_text(json.dumps({"versions": [
        {"since": "2026-03-05", "software": "b"}, {"since": "2026-03-01", "software": "a"}]}))
    with pytest.raises(Exception, match="oldest first"):
        b.load_versions()


def test_schedules_read_the_files_and_leave_a_broken_one_out(tmp_path, caplog):
    _write(tmp_path)
    (tmp_path / f"broken{regression.SUFFIX}").write_text("{not json")
    (tmp_path / f"typo{regression.SUFFIX}").write_text(json.dumps({"name": "typo", "params": {}, "shedule": "x"}))
    got = regression.schedules(tmp_path)
    assert [(s["dag_id"], s["schedule"], str(s["start_date"])) for s in got] == [
        ("deploybench_regression__nightly", "0 3 * * *", "2026-03-01")]
    assert "broken" in caplog.text and "shedule" in caplog.text


def test_the_file_name_must_match_the_name(tmp_path):
    (tmp_path / f"other{regression.SUFFIX}").write_text(json.dumps({"name": "nightly", "params": {}}))
    with pytest.raises(ConfigError, match="must be in nightly.benchmark.json"):
        regression.load(tmp_path / f"other{regression.SUFFIX}")


def test_editing_what_is_measured_starts_a_new_history(tmp_path):
    a = _write(tmp_path)
    b = _write(tmp_path, params={**a.params, "load_rate": 7})
    c = _write(tmp_path, schedule="@hourly")
    assert a.revision != b.revision and a.revision == c.revision


def test_the_message_names_benchmark_metric_magnitude_and_links_the_report(tmp_path):
    b = _write(tmp_path)
    verdict = {"run_key": "deploybench_regression__nightly__backfill__2026-03-05", "software": "sim 1.1",
               "logical_date": "2026-03-05T00:00:00+00:00",
               "report_url": regression.report_url("http://af:8080/", "k/1"),
               "metrics": {"latency_p50_ms": {"verdict": "regression", "magnitude": 0.1012, "p_value": 0.0004,
                                              "value": 330.0, "level": 300.0, "how": "single-run test",
                                              "against": ["r1", "r2", "r3", "r4"]}}}
    subject, text = regression.message(b, verdict, ["latency_p50_ms"])
    assert subject == "[deploybench] regression in benchmark nightly: latency_p50_ms +10.1%"
    assert "p = 0.0004" in text and "sim 1.1" in text and "r4" in text
    assert "Report: http://af:8080/deploybench/runs/k%2F1/report" in text


def test_unknown_judge_settings_are_refused(tmp_path):
    b = _write(tmp_path, judge={"alpha": 0.001, "bnad": 2})
    with pytest.raises(ConfigError, match="bnad"):
        b.judge_params()
    assert _write(tmp_path, judge={"alpha": 0.001}).judge_params().alpha == 0.001


def test_notifiers_come_from_the_registry(tmp_path):
    from airflow.providers.smtp.notifications.smtp import SmtpNotifier

    from deploybench.airflow import notify

    specs = [regression.Notify(kind="smtp", to=["a@example.com"], conn_id="mail"),
             regression.Notify(kind="notifier", notifier="airflow.providers.smtp.notifications.smtp.SmtpNotifier",
                               message_arg="subject", kwargs={"to": "b@example.com", "from_email": "x@y"})]
    got = notify.notifiers(specs, "subj {{ not a template }}", "body <b>")
    assert all(isinstance(n, SmtpNotifier) for n in got)
    assert got[0].smtp_conn_id == "mail" and got[0].to == ["a@example.com"]
    assert "{% raw %}" in got[0].subject and "&lt;b&gt;" in got[0].html_content
    with pytest.raises(ConfigError, match="cannot be imported"):
        notify.notifiers([regression.Notify(kind="notifier", notifier="airflow.providers.no_such.Notifier")], "s", "t")


def test_the_regression_dag_runs_every_stage_then_results_then_judge(monkeypatch, tmp_path):
    from airflow.dag_processing.dagbag import DagBag

    _write(tmp_path)
    monkeypatch.setenv(regression.ENV_DIR, str(tmp_path))
    bag = DagBag(dag_folder=str(DAGS / "deploybench_regression.py"))
    assert bag.import_errors == {}
    dag = bag.dags["deploybench_regression__nightly"]
    assert dag.max_active_runs == 1 and dag.catchup is False
    assert dag.schedule == "0 3 * * *"  # from the benchmark file
    assert str(dag.start_date.date()) == "2026-03-01" and dag.end_date is None
    order = ["plan", "validate", "lease.acquire", "preflight.nodes_and_links", "fanout.copy_and_verify",
             "rollout.canary_then_scale", "load.probe", "load.sustained", "load.overload", "teardown",
             "lease.release", "store.write_results", "report.render", "results", "judge"]
    for a, b in zip(order, order[1:]):
        assert b in dag.get_task(a).get_flat_relative_ids(upstream=False), f"{a} must come before {b}"
    assert {t.task_id for t in dag.leaves} == {"finish", "judge"}  # a failed verdict fails the run
    outlets = dag.get_task("results").outlets
    assert [o.uri for o in outlets] == ["deploybench://results/nightly"]
    assert dag.get_task("judge").retries == 0
