"""Report plots and the run report's HTML from a run folder, without a database."""

from __future__ import annotations

import json

import pandas as pd

from deploybench.report import plots, write_html
from tests.support.run_folders import make_run_folder, window_samples


def test_windows_count_requests_and_errors_per_second():
    w = plots.windows(window_samples())
    assert len(w) == 15 and (w["rps"] == 20).all()
    assert w["error_rate"].iloc[-1] == 0.5 and w["error_rate"].iloc[0] == 0


def test_plots_are_inline_svg_with_readable_text_and_empty_when_no_data():
    links = [{"src": "n1", "dst": "n2", "mbit": 900.0, "ratio": 0.9}, {"src": "n2", "dst": "n1", "mbit": 400.0,
                                                                         "ratio": 0.4}]
    svg = plots.bandwidth_matrix(links)
    assert svg.startswith("<svg") and "Preflight bandwidth" in svg and "40%" in svg
    both = plots.bandwidth_matrix([{"src": "n1", "dst": "n2", "mbit": 300.0, "ratio": 0.3, "directions": [
        {"src": "n1", "dst": "n2", "mbit": 950.0, "ratio": 0.95}, {"src": "n2", "dst": "n1", "mbit": 300.0,
                                                                    "ratio": 0.3}]}])
    assert "95%" in both and "30%" in both  # each direction in its own cell
    assert "Fan-out timeline" in plots.fanout_timeline([{"node": "n2", "status": "copied", "started_at": 0.5,
                                                         "seconds": 2.0}])
    assert "Capacity search" in plots.capacity_steps([{"offered_rps": 4, "achieved_rps": 4, "slo_ok": True},
                                                      {"offered_rps": 8, "achieved_rps": 6, "slo_ok": False}], 4)
    assert plots.bandwidth_matrix([]) == "" and plots.over_time(pd.DataFrame(), "x") == ""
    assert plots.throughput_latency({}, "x") == "" and plots.per_node_bars([]) == ""


def test_run_report_has_every_section_from_the_run_folder(tmp_path):
    page = write_html(make_run_folder(tmp_path)).read_text()
    for text in ("Throughput vs P99 latency", "Capacity search steps", "Sustained phase over time",
                 "Overload ramp and recovery", "Per node: requests/s", "Preflight bandwidth", "Fan-out timeline"):
        assert text in page, text
    assert json.dumps("deploybench_run/r1")[1:-1] in page and page.count("<svg") >= 6
