"""Prometheus as a source, without a Prometheus: the queries deploybench builds, the reading of hostile answers,
the source's settings (connection, CLI), and the report's section."""

from __future__ import annotations

import json
import re
import socket
import time
from datetime import UTC, datetime, timedelta

import pytest

from deploybench.engines import Metrics, profile
from deploybench.errors import ConfigError
from deploybench.load import prom
from deploybench.load.results import NodeWindow


def _answer(values, metric=None, status="success", result_type="matrix", n=1) -> str:
    return json.dumps({"status": status, "data": {"resultType": result_type,
                                                   "result": [{"metric": metric or {}, "values": values}] * n}})


# -- queries ---------------------------------------------------------------------------------------------------------
def test_every_query_selects_the_node_by_its_escaped_address_and_is_aggregated():
    src = prom.PromSource(url="http://10.9.8.1:9090/")
    got = prom.queries(src, "n01", "10.9.8.11", profile("sim").metrics)
    assert src.url == "http://10.9.8.1:9090"
    assert set(got) == {*prom.NODE_QUERIES, "engine_running", "engine_waiting", "engine_kv_usage"}
    for key, q in got.items():
        # dots escaped for the regex, the backslash escaped for the PromQL string: 10.9.8.110 does not match
        assert 'instance=~"10\\\\.9\\\\.8\\\\.11(:[0-9]+)?"' in q, (key, q)
        assert re.search(r"(^|[ (])(sum|avg|max)\(", q), (key, q)  # one series per node
    assert got["cpu_busy_pct"] == ('100 * (1 - avg(rate(node_cpu_seconds_total{mode="idle",instance=~'
                                   '"10\\\\.9\\\\.8\\\\.11(:[0-9]+)?"}[4s])))')
    assert got["engine_running"].startswith("sum(vllm:num_requests_running{")


def test_engine_series_follow_the_profile_and_selectors_can_differ_per_family():
    src = prom.PromSource(url="https://prom.example/p", node_selector='job="node",node="{node}"',
                          gpu_selector='Hostname="{node}"', engine_selector='pod=~"{node}-.*"', step_s=0.25)
    got = prom.queries(src, "n07", "10.0.0.7", Metrics(names={"running": "sglang:num_running_reqs"}))
    assert got["engine_running"] == 'sum(sglang:num_running_reqs{pod=~"n07-.*"})'
    assert "engine_waiting" not in got and "engine_kv_usage" not in got  # the profile maps neither
    assert got["gpu_util_pct"] == 'avg(DCGM_FI_DEV_GPU_UTIL{Hostname="n07"})'
    assert 'job="node",node="n07"' in got["mem_used_bytes"] and "[2s]" in got["net_rx_bytes_per_s"]


@pytest.mark.parametrize("bad", [
    'instance="x"} or vector(1) #', 'instance="x"}[5m]', "instance=x", '{instance="x"}', 'instance="x",',
    'instance="a\nb"', "",
])
def test_a_selector_that_is_not_a_list_of_matchers_is_refused_naming_it(bad):
    with pytest.raises(ConfigError, match="is not a list of label matchers"):
        prom.parse_source({"url": "http://p:9090", "node_selector": bad})
    with pytest.raises(ConfigError, match="is not a list of label matchers"):
        prom.check_selector(bad)


@pytest.mark.parametrize("node,address", [('n1"}', "10.0.0.1"), ("n1", "10.0.0.1 or up"), ("n1", "")])
def test_a_node_name_or_address_that_cannot_go_in_a_selector_is_refused(node, address):
    with pytest.raises(ConfigError, match="cannot be put in a Prometheus selector"):
        prom.queries(prom.PromSource(url="http://p:9090"), node, address)


def test_the_range_query_asks_the_window_at_the_scrape_interval():
    src = prom.PromSource(url="http://p:9090", step_s=2)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    url = prom.range_url(src, "up", start, start + timedelta(seconds=30))
    assert url.startswith("http://p:9090/api/v1/query_range?query=up&")
    assert "start=1767225600.000" in url and "end=1767225630.000" in url and "step=2s" in url


# -- the source's settings ---------------------------------------------------------------------------------------------
def test_a_connection_gives_the_url_and_its_extras_unknown_ones_refused():
    got = prom.PromSource.of_connection("prom.example/prometheus", 9091, "https",
                                        {"node_selector": 'node="{node}"', "remote_write": True})
    assert got.url == "https://prom.example:9091/prometheus" and got.remote_write
    assert got.remote_write_url() == "https://prom.example:9091/prometheus/api/v1/write"
    with pytest.raises(ConfigError, match="node_selectr"):
        prom.PromSource.of_connection("p", 9090, None, {"node_selectr": "x"})
    with pytest.raises(ConfigError, match="has no host"):
        prom.PromSource.of_connection("", 9090, None, {})


def test_the_cli_takes_a_url_or_a_json_object_and_refuses_anything_else():
    assert prom.parse_source("http://10.0.0.1:9090").url == "http://10.0.0.1:9090"
    assert prom.parse_source('{"url": "http://p:9090", "step_s": 5}').step_s == 5
    assert prom.parse_source(None) is None
    for bad in ("ftp://p:9090", "p:9090", '{"url": "http://p", "bogus": 1}', "http://p:9090/?q=1"):
        with pytest.raises(ConfigError, match="Prometheus source"):
            prom.parse_source(bad)


# -- hostile answers ---------------------------------------------------------------------------------------------------
def test_a_matrix_is_read_with_nan_inf_text_and_out_of_window_points_left_out():
    values = [[100, "1"], [101, "NaN"], [102, "+Inf"], [103, "abc"], [104, "3"], [200, "9"], [105, "-1e300"],
              ["x", "4"], [106], [107, ["5"]], [108, True]]
    (s,) = prom.read_matrix(200, _answer(values, {"instance": "a:9100"}), start=100, end=110, slack_s=1)
    assert s.points == [(100.0, 1.0), (104.0, 3.0)] and s.dropped == 9 and s.labels == {"instance": "a:9100"}
    fig = prom.figure("n01", "gpu_util_pct", [s], "q")
    assert (fig.mean, fig.max, fig.samples, fig.source) == (2.0, 3.0, 2, "prometheus")
    assert "9 points left out" in fig.reason


@pytest.mark.parametrize("status,body,why", [
    (200, "not json", "not JSON"),
    (200, "[1, 2]", "JSON list, not an object"),
    (422, json.dumps({"status": "error", "errorType": "execution", "error": "query timed out"}), "query timed out"),
    (200, json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}}), "not a matrix"),
    (200, json.dumps({"status": "success", "data": {"resultType": "matrix", "result": "x"}}), "not a matrix"),
    (200, _answer([[1, "1"]], n=prom.MAX_SERIES + 1), "series, over the bound"),
    (200, _answer([[1, "1"]] * (prom.MAX_POINTS + 1)), "points, over the bound"),
    (200, _answer([[1, "1"]], {"l": "x" * 300}), "labels are not"),
    (200, _answer([[1, "1"]], {"l": 5}), "labels are not"),
    (200, json.dumps({"status": "success", "data": {"resultType": "matrix", "result": [{"metric": {}}]}}),
     "no 'values' list"),
    (200, " " * (prom.MAX_ANSWER_BYTES + 1), "over the"),
])
def test_an_answer_that_is_not_a_bounded_matrix_is_refused_saying_why(status, body, why):
    with pytest.raises(prom.PromAnswerError, match=why):
        prom.read_matrix(status, body)


def test_no_series_or_none_finite_is_absent_with_the_reason_never_zero():
    empty = prom.figure("n01", "gpu_power_w", [], "sum(DCGM_FI_DEV_POWER_USAGE{})")
    assert empty.mean is None and empty.max is None and empty.samples == 0
    assert empty.reason == "prometheus: no series for sum(DCGM_FI_DEV_POWER_USAGE{})" and empty.unit == "W"
    (nan,) = prom.read_matrix(200, _answer([[1, "NaN"], [2, "Inf"]]))
    got = prom.figure("n01", "gpu_power_w", [nan], "q")
    assert got.mean is None and "2 points, none a finite number" in got.reason
    two = prom.read_matrix(200, _answer([[1, "1"]], n=2))
    assert prom.figure("n01", "x", two, "q").mean is None


def test_a_prometheus_that_does_not_answer_is_asked_once_and_every_figure_says_so():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = prom.PromSource(url=f"http://127.0.0.1:{port}", timeout_s=1)
    end = datetime.now(UTC)
    t0 = time.monotonic()
    got = prom.node_windows(src, [("n01", "127.0.0.1"), ("n02", "127.0.0.2")], end - timedelta(seconds=5), end,
                            profile("sim").metrics)
    assert time.monotonic() - t0 < 5  # one refused connection, not 26 waits
    assert len(got) == 2 * (len(prom.NODE_QUERIES) + 3)
    assert all(w.mean is None and w.reason.startswith(f"prometheus at {src.url} did not answer") for w in got)


# -- the report's section ----------------------------------------------------------------------------------------------
def test_the_section_shows_each_figure_with_its_source_and_absent_ones_say_so():
    from deploybench.report.node_windows import section

    rows = [{"phase": "sustained", "step": 0, **w.model_dump()} for w in (
        NodeWindow(node="n01", metric="gpu_util_pct", source="prometheus", unit="%", mean=41.5, max=60.0, samples=6),
        NodeWindow(node="n01", metric="gpu_util_pct", source="scrape", unit="%", mean=40.0, max=58.0, samples=7),
        NodeWindow(node="n01", metric="gpu_power_w", source="prometheus", unit="W",
                   reason="prometheus at http://p:9090 did not answer: <refused>"))]
    html = "".join(section(rows + [{**rows[0], "phase": "probe", "step": 2}]))
    assert html.index("<h4>probe, step 2</h4>") < html.index("<h4>sustained</h4>")
    assert "<td>prometheus</td>" in html and "<td>scrape</td>" in html and "41.5" in html and "40" in html
    assert "absent" in html and "did not answer: &lt;refused&gt;" in html  # escaped
    assert section([]) == []


def test_the_airflow_connection_is_read_by_name_and_its_absence_means_no_source(monkeypatch):
    from deploybench.airflow.connections import prometheus_source

    monkeypatch.setenv("AIRFLOW_CONN_DEPLOYBENCH_PROMETHEUS", json.dumps(
        {"conn_type": "http", "host": "10.1.2.1", "port": 9090, "schema": "https",
         "extra": {"node_selector": 'node="{node}"', "remote_write": True}}))
    got = prometheus_source()
    assert got is not None and got.url == "https://10.1.2.1:9090" and got.node_selector == 'node="{node}"'
    assert got.remote_write
    monkeypatch.setenv("AIRFLOW_CONN_DEPLOYBENCH_PROMETHEUS", json.dumps(
        {"conn_type": "http", "host": "10.1.2.1", "extra": {"node_selector": "x"}}))
    with pytest.raises(ConfigError, match="not a list of label matchers"):
        prometheus_source()
    monkeypatch.delenv("AIRFLOW_CONN_DEPLOYBENCH_PROMETHEUS")
    assert prometheus_source() is None


def test_a_bad_source_given_to_deploybench_run_is_refused_before_the_run_starts(monkeypatch, tmp_path):
    from deploybench.cli.run import run_inline

    monkeypatch.setenv("DEPLOYBENCH_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="'http://p:9090/x\\?a=1'"):
        run_inline("cli__t", {}, prometheus="http://p:9090/x?a=1")
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # no stage record, not even validate's
