"""Each simulated fault on one node of a 3-node netns lab, through a whole run (deploybench.analyse.diagnosis):
the rule that stands for it names that node in the stored findings, no finding names another node, and a clean
run has no finding at all. The report and the run page show them (tests/unit/report/test_findings_html.py)."""

from __future__ import annotations

import pytest

from deploybench import paths
from deploybench.lab import cluster as lab_cluster
from deploybench.sim import faults
from tests.support import fault_runs, lab_names

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(90), pytest.mark.netns]


LAB = lab_names.unique("fd")


@pytest.fixture(scope="module")
def lab():
    inv = lab_cluster.up(LAB, nodes=3, link_mbit=500, mode="netns", model_mb=2)
    try:
        yield LAB, str(paths.lab_dir(LAB) / "inventory.json"), [n.name for n in inv.nodes]
    finally:
        lab_cluster.down(LAB)


def test_a_clean_run_has_no_finding(lab, dsn):
    _, inventory, _ = lab
    out = fault_runs.lab_run("deploybench_run/fd_clean", inventory, dsn)
    assert out.findings == [], [f.line() for f in out.findings]


@pytest.mark.parametrize("fault", faults.FAULTS)
def test_each_fault_is_named_on_its_node_by_its_rule(lab, dsn, fault):
    _, inventory, nodes = lab
    node = nodes[1]
    out = fault_runs.lab_run(f"deploybench_run/fd_{fault}", inventory, dsn, fault, node, report=fault == "throttle")
    lines = [f.line() for f in out.findings]
    assert out.named, (fault, node, lines)
    assert out.false == [], lines  # every finding names the faulty node
    hit = next(f for f in out.findings if f.rule == fault_runs.EXPECTED[fault])
    assert hit.phase == "sustained" and hit.window_start is not None and hit.evidence and hit.advice
    if out.report is not None:  # the report shows the finding, its evidence and advice
        with open(out.report) as fh:
            html = fh.read()
        section = html[html.index("<h2>Findings</h2>"):]
        assert f"<td>gpu_throttled</td><td>{node}</td>" in section and "slowdown reasons 0x20" in section
        assert "SM clock 1000 MHz" in section and "cooling" in section
