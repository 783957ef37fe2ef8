"""Preflight for a fast fabric, on a netns lab whose links emulate one (issue 33).

The lab cannot reach 100 GbE, so it emulates what matters: every TCP flow of the iperf3 ports is capped at
a quarter of the link (HTB classes chosen by u32 filters on the flow's port bits: this kernel has neither fq
nor netem; deploybench.lab.commands.shape_batch). One stream then cannot pass a healthy link, enough parallel
streams can, and a link with a real fault (its rate halved) still fails with them. Pings shaped to a crawl on
one node (each waits behind the ones before it) add the RTT and jitter that the spec's thresholds must catch.
There is no RDMA device here: the RDMA test is skipped with its reason (its command lines and parsers are
unit-tested against perftest's output format in tests/unit/preflight/test_fabric.py).
"""

from __future__ import annotations

import json
import socket
import subprocess

import pytest

from deploybench import preflight
from deploybench.config import LinkMode, Policy, PreflightSpec
from deploybench.errors import StageFailed
from deploybench.lab import cluster
from deploybench.preflight import links
from deploybench.preflight.checks import fabric_identity
from deploybench.transport import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.netns, pytest.mark.time_limit(180)]

NOMINAL = 200.0
FLOW_CAP = NOMINAL / 4  # one stream reads at most 25 % of nominal
STREAMS = 8
# the iperf3 test is 2 s after 1 s left out (TCP's ramp-up through the capped classes)
SPEC = dict(link_mode=LinkMode.RING, iperf_seconds=2, omit_s=1, link_threshold=0.9, streams=STREAMS)


@pytest.fixture(scope="module")
def lab(netns_lab):
    lab = netns_lab("fab", nodes=3, link_mbit=NOMINAL, model_mb=1)
    for node in lab.inv.names:
        cluster.set_link(lab.name, node, flow_cap_mbit=FLOW_CAP)
    return lab


def capped(lab, node: str, **more) -> None:
    cluster.set_link(lab.name, node, flow_cap_mbit=FLOW_CAP, **more)


def run_preflight(inv, **over):
    spec = PreflightSpec(**{**SPEC, "policy": Policy.ABORT, **over})
    with Cluster(inv) as c:
        try:
            return preflight.run(c, inv.names, spec, source="n01", model_name="sim-model"), None
        except StageFailed as exc:
            return exc.result, str(exc)


def as_dict(res):
    return res if isinstance(res, dict) else res.to_dict()


def test_one_stream_fails_a_healthy_capped_link_and_the_chosen_streams_pass_it(lab):
    inv = lab.inv
    with Cluster(inv) as c:
        one = links.test_link(c, inv.node("n01"), inv.node("n02"), 0, 2, 0.9,
                              spec=PreflightSpec(**{**SPEC, "streams": 1}))
    assert one.error is None and not one.ok and one.streams == 1, one
    assert one.ratio <= 1.1 * FLOW_CAP / NOMINAL, one  # the cap holds: one stream cannot pass

    res, err = run_preflight(inv)
    d = as_dict(res)
    print(json.dumps(d["links"], indent=1))  # the record of a per-flow-capped lab (issue 33's note)
    assert err is None, err
    for lt in d["links"]:
        assert lt["ok"] and lt["streams"] == STREAMS and lt["processes"] == 1, lt
        assert lt["ratio"] >= 0.9, lt
        for x in lt["directions"]:
            assert len(x["stream_mbit"]) == STREAMS and max(x["stream_mbit"]) <= 1.1 * FLOW_CAP, x
        assert lt["latency_ms"] is not None and lt["latency_ms"] < 10 and lt["problems"] == [], lt
        assert lt["rdma"]["status"] == "skipped" and "no RDMA device" in lt["rdma"]["reason"], lt["rdma"]
    # the NIC each node tests over, as its facts report it, and in the cluster's identity
    for n in d["nodes"]:
        nic = next(c for c in n["checks"] if c["name"] == "nic")
        assert nic["status"] == "pass" and nic["value"]["interface"] == "eth0" and nic["value"]["mtu"] == 1500, nic
        assert nic["value"]["driver"] == "veth", nic
        assert fabric_identity(n["facts"]) == {"mtu": 1500, "driver": "veth", "speed_mbit": 10000}, n["facts"]
        rdma = next(c for c in n["checks"] if c["name"] == "rdma")
        assert rdma["status"] == "pass" and "no RDMA device" in rdma["detail"], rdma


def test_the_streams_spread_over_several_iperf3_processes_on_their_own_ports(lab):
    res, err = run_preflight(lab.inv, processes=2)
    assert err is None, err
    for lt in as_dict(res)["links"]:
        assert lt["ok"] and lt["processes"] == 2 and lt["streams"] == STREAMS, lt
        assert all(len(x["stream_mbit"]) == STREAMS for x in lt["directions"]), lt


def test_a_link_with_a_real_fault_still_fails_with_the_streams(lab):
    capped(lab, "n03", mbit=NOMINAL / 2)
    try:
        res, err = run_preflight(lab.inv)
    finally:
        capped(lab, "n03")
    d = as_dict(res)
    assert err is not None and list(d["excluded"]) == ["n03"], (err, d["excluded"])
    for lt in d["links"]:
        faulty = "n03" in (lt["src"], lt["dst"])
        assert lt["ok"] is not faulty, lt
        if faulty:
            assert lt["streams"] == STREAMS and lt["ratio"] <= 0.6, lt
            assert f"with {STREAMS} streams" in d["excluded"]["n03"], d["excluded"]


# The bandwidth threshold of the latency test: the link's bandwidth is not what it is about. With 0.9, a CI run on
# a loaded machine measured the restored link at 0.897 of nominal and failed it on bandwidth.
LATENCY_TEST_THRESHOLD = 0.5


def test_rtt_and_jitter_thresholds_fire_on_a_link_with_added_delay(lab):
    inv = lab.inv
    spec = PreflightSpec(**SPEC)
    capped(lab, "n02", icmp_kbit=16)  # a ping waits ~50 ms per ping queued before it
    try:
        with Cluster(inv) as c:
            lt = links.test_link(c, inv.node("n01"), inv.node("n02"), 0, 2, LATENCY_TEST_THRESHOLD, spec=spec)
    finally:
        capped(lab, "n02")
    assert lt.error is None and not lt.ok, lt
    assert lt.ratio >= LATENCY_TEST_THRESHOLD, lt  # the bandwidth is fine: the link fails on its latency alone
    assert lt.latency_ms > 10 and lt.jitter_ms > 5, lt
    assert any("RTT" in p and "max_rtt_ms" in p for p in lt.problems), lt.problems
    assert any("jitter" in p and "max_jitter_ms" in p for p in lt.problems), lt.problems
    with Cluster(inv) as c:  # restored: the same test passes
        again = links.test_link(c, inv.node("n01"), inv.node("n02"), 0, 2, LATENCY_TEST_THRESHOLD, spec=spec)
    assert again.ok and again.problems == [], again


def test_iperf3_reports_each_stream_of_a_parallel_bidirectional_test_on_loopback():
    """parse_iperf3 against iperf3's own JSON (-P 3 --bidir): three streams each way whose sum is the total."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            res = subprocess.run(links.client_argv("127.0.0.1", "127.0.0.1", port, 1, "bidir", streams=3),
                                 capture_output=True, text=True, timeout=30)
            if "refused" not in res.stdout:
                break
        got = links.parse_iperf3(res.stdout)
    finally:
        server.kill()
        server.wait()
    assert len(got["stream_mbit"]) == 3 and len(got["reverse_stream_mbit"]) == 3, got
    assert sum(got["stream_mbit"]) == pytest.approx(got["mbit"], rel=0.01)
    assert sum(got["reverse_stream_mbit"]) == pytest.approx(got["reverse_mbit"], rel=0.01)


def test_ping_summary_of_the_real_ping_parses():
    res = subprocess.run(links.ping_argv("127.0.0.1", "127.0.0.1", 5, 0.01), capture_output=True, text=True,
                         timeout=30)
    got = links.parse_ping(res.stdout)
    assert got["sent"] == 5 and got["received"] == 5 and got["loss"] == 0, got
    assert 0 < got["min_ms"] <= got["avg_ms"] <= got["max_ms"] and got["mdev_ms"] >= 0, got


def test_several_clients_in_one_command_report_each_output_and_exit_code():
    script = links.clients_script([["sh", "-c", "echo one"], ["sh", "-c", "echo two; exit 3"]])
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert links.split_outputs(res.stdout) == [(0, "one"), (3, "two")], res.stdout
