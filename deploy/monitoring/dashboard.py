"""The Grafana dashboard of a benchmark run, as code: writes deploy/monitoring/dashboards/deploybench-run.json.

    python deploy/monitoring/dashboard.py            # (re)write the JSON beside this file
    python deploy/monitoring/dashboard.py --check    # exit 1 if the JSON is not what this script writes

Built with Grafana's own dashboards-as-code library, grafana-foundation-sdk (requirements-test.txt): no Grafana runs
on these machines, so the library's typed builders stand for Grafana's dashboard schema, and
tests/integration/test_monitoring.py runs every panel's PromQL through a real Prometheus.

Per node (the ``node`` label that deploy/monitoring/prometheus.yml gives each target: the inventory's node name, so
an engine's series and its GPUs' line up): throughput (output tokens/s, requests/s), latency (P99 end-to-end and
time to first token), GPU utilisation, GPU power, KV cache usage and the engine's queue (waiting and running
requests). Runs and load phases are annotations read from deploybench's results database (its ``runs`` and
``load_phases`` tables) through a Grafana PostgreSQL datasource. Series names: vLLM's (include/deploybench/
engine_profiles/vllm.toml, from vllm/v1/metrics/loggers.py) and NVIDIA's DCGM exporter's (etc/default-counters.csv).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common, dashboard, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    LegendDisplayMode,
    LegendPlacement,
    SortOrder,
    TooltipDisplayMode,
)
from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos

OUT = Path(__file__).with_name("dashboards") / "deploybench-run.json"
UID = "deploybench-run"
PROM = DataSourceRef(type_val="prometheus", uid="${prometheus}")
RESULTS = DataSourceRef(type_val="grafana-postgresql-datasource", uid="${results}")
NODE = 'node=~"$node"'
RATE = "$__rate_interval"

# (title, unit, [(PromQL, legend)]): one time-series panel each, one line per node (and per query)
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Throughput: output tokens/s", "short", [
        (f"sum by (node) (rate(vllm:generation_tokens_total{{{NODE}}}[{RATE}]))", "{{node}}")]),
    ("Throughput: requests/s answered", "reqps", [
        (f"sum by (node) (rate(vllm:request_success_total{{{NODE}}}[{RATE}]))", "{{node}}")]),
    ("Latency: P99 end-to-end", "s", [
        (f"histogram_quantile(0.99, sum by (node, le) (rate(vllm:e2e_request_latency_seconds_bucket{{{NODE}}}"
         f"[{RATE}])))", "{{node}}")]),
    ("Latency: P99 time to first token", "s", [
        (f"histogram_quantile(0.99, sum by (node, le) (rate(vllm:time_to_first_token_seconds_bucket{{{NODE}}}"
         f"[{RATE}])))", "{{node}}")]),
    ("GPU utilisation (mean of the node's GPUs)", "percent", [
        (f"avg by (node) (DCGM_FI_DEV_GPU_UTIL{{{NODE}}})", "{{node}}")]),
    ("GPU power (the node's GPUs together)", "watt", [
        (f"sum by (node) (DCGM_FI_DEV_POWER_USAGE{{{NODE}}})", "{{node}}")]),
    ("KV cache usage", "percentunit", [
        (f"max by (node) (vllm:kv_cache_usage_perc{{{NODE}}})", "{{node}}")]),
    ("Queue: requests waiting and running", "short", [
        (f"sum by (node) (vllm:num_requests_waiting{{{NODE}}})", "{{node}} waiting"),
        (f"sum by (node) (vllm:num_requests_running{{{NODE}}})", "{{node}} running")]),
]

# Annotations from the results database (deploybench.store.models: runs, load_phases). Grafana's SQL annotations
# read the columns time, timeend, text and tags; $__timeFilter is Grafana's macro for the dashboard's time range.
ANNOTATIONS: list[tuple[str, str, str]] = [
    ("deploybench runs", "#8AB8FF",
     "SELECT started_at AS time, COALESCE(finished_at, now()) AS timeend, "
     "'run ' || run_key || ' (' || status || ', ' || node_count || ' nodes)' AS text, 'run' AS tags "
     "FROM runs WHERE $__timeFilter(started_at) ORDER BY started_at"),
    ("load phases", "#FADE2A",
     "SELECT started_at AS time, started_at + make_interval(secs => duration_s) AS timeend, "
     "phase || ' of ' || run_key || ': ' || round(achieved_rps::numeric, 2) || ' req/s, P99 ' "
     "|| COALESCE(round(latency_p99_ms::numeric) || ' ms', 'absent') AS text, 'phase,' || phase AS tags "
     "FROM load_phases WHERE node = '*' AND $__timeFilter(started_at) ORDER BY started_at"),
]


def _panel(n: int, title: str, unit: str, queries: list[tuple[str, str]]) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).unit(unit).datasource(PROM)
             .grid_pos(GridPos(h=8, w=12, x=12 * (n % 2), y=8 * (n // 2)))
             .legend(common.VizLegendOptions().display_mode(LegendDisplayMode.TABLE).placement(LegendPlacement.BOTTOM)
                     .show_legend(True).calcs(["mean", "max", "lastNotNull"]))
             .tooltip(common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING)))
    for i, (expr, legend) in enumerate(queries):
        panel = panel.with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id("ABCD"[i]))
    return panel


def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (a dict)."""
    board = (dashboard.Dashboard("deploybench: benchmark run").uid(UID).tags(["deploybench", "benchmark"])
             .description("Per node: throughput, latency, GPU utilisation and power, KV cache and queue; runs and "
                          "load phases from deploybench's results database as annotations.")
             .time("now-1h", "now").refresh("10s").timezone("utc")
             .with_variable(dashboard.DatasourceVariable("prometheus").label("Prometheus").type("prometheus"))
             .with_variable(dashboard.DatasourceVariable("results").label("deploybench results")
                            .type("grafana-postgresql-datasource"))
             .with_variable(dashboard.QueryVariable("node").label("node").datasource(PROM)
                            .query("label_values(vllm:num_requests_running, node)").multi(True).include_all(True)
                            .all_value(".*")))
    for n, (title, unit, queries) in enumerate(PANELS):
        board = board.with_panel(_panel(n, title, unit, queries))
    for name, colour, _ in ANNOTATIONS:
        board = board.annotation(dashboard.AnnotationQuery().name(name).datasource(RESULTS).enable(True)
                                 .icon_color(colour))
    data = json.loads(JSONEncoder(sort_keys=True, indent=2).encode(board.build()))
    # the library types the built-in annotation target only; a SQL datasource's target is its query, as Grafana
    # stores it (rawSql in table format)
    sql = {name: query for name, _, query in ANNOTATIONS}
    for anno in data["annotations"]["list"]:
        if anno.get("name") in sql:
            anno["target"] = {"editorMode": "code", "format": "table", "rawQuery": True, "rawSql": sql[anno["name"]],
                              "refId": "Anno"}
    return data


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is not what {Path(__file__).name} writes: run `python {__file__}`", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
