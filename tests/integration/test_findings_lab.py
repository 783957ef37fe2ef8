"""Each simulated fault on one node of a 3-node netns lab, through a whole run (tests/support/fault_runs.py): the
rule that stands for it names that node in the stored findings (the cluster, for client_limited and
throughput_drift), no finding names another node, and a clean run has no finding at all. The faults that are not
the engine's: k6 held to 2 VUs (client_limited), the engines' steps slowing with every answer (throughput_drift), one
node's link shaped to a fifth of its nominal speed (link_below_threshold: preflight stops that run, and the stored
findings and the report still show it). The report and the run page show them
(tests/unit/report/test_findings_html.py)."""

from __future__ import annotations

import pytest

from deploybench import paths
from deploybench.lab import cluster as lab_cluster
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


@pytest.mark.parametrize("fault", fault_runs.FAULTS)
def test_each_fault_is_named_on_its_node_by_its_rule(lab, dsn, fault):
    name, inventory, nodes = lab
    node = nodes[1]
    out = fault_runs.lab_run(f"deploybench_run/fd_{fault}", inventory, dsn, fault, node,
                             report=fault in ("throttle", "slow_link"), lab=name)
    lines = [f.line() for f in out.findings]
    assert out.named, (fault, node, lines)
    assert out.false == [], lines  # every finding names the faulty node (or, for a cluster's fault, only its rule)
    hit = next(f for f in out.findings if f.rule == fault_runs.EXPECTED[fault])
    print(f"\n{fault} on {node}: {hit.line()}")
    assert hit.evidence and hit.advice
    if fault == "slow_link":  # preflight stopped the run before any load; its record still gives the finding
        assert out.stopped is not None and "preflight" in out.stopped and "load" not in out.stages, out
        assert hit.phase == "preflight" and hit.observed < 0.3 and f"preflight blamed {node}" in hit.evidence
        assert {f.rule for f in out.findings} == {"link_below_threshold"}
    else:
        assert out.stopped is None and hit.phase == "sustained" and hit.window_start is not None
    if fault == "client":  # the client's signs, and GPUs under-used
        assert hit.node is None and hit.metric == "k6 dropped iterations" and hit.observed > 0.01, hit
        assert hit.detail["gpu_util_pct"] < 80
    if fault == "drift":  # the last third served well under the first, against what each offered
        assert hit.node is None and hit.detail["fall"] > 0.2 and hit.observed < hit.expected, hit
    if out.report is not None:  # the report shows the finding, its evidence and advice
        with open(out.report) as fh:
            html = fh.read()
        section = html[html.index("<h2>Findings</h2>"):]
        if fault == "throttle":
            assert f"<td>gpu_throttled</td><td>{node}</td>" in section and "slowdown reasons 0x20" in section
            assert "SM clock 1000 MHz" in section and "cooling" in section
        else:
            assert f"<td>link_below_threshold</td><td>{node}</td>" in section and "ethtool" in section
