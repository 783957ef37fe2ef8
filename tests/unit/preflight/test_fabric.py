"""Preflight's fabric, the pure parts: how many streams and processes, the iperf3 and ping command lines and
what their output becomes, perftest's command lines and parsers (against its output format: linux-rdma/perftest
src/perftest_parameters.h, RESULT_FMT_G / REPORT_FMT and RESULT_FMT_LAT / REPORT_FMT_LAT; the lab has no RDMA
device), what a node reports about its NIC and RDMA ports (hostile until checked), the lab's per-flow shaping,
and the fabric in the cluster's identity. The lab tests are tests/integration/test_preflight_fabric.py."""

from __future__ import annotations

import pytest

from deploybench.config import PreflightSpec, RdmaMode
from deploybench.errors import DeploybenchError
from deploybench.inventory import Node
from deploybench.lab import commands
from deploybench.preflight import checks, links, rdma
from deploybench.preflight.model import LinkTest, RdmaTest


@pytest.mark.parametrize(("nominal_mbit", "over", "streams", "processes"), [
    (1_000, {}, 1, 1),  # the lab's and a 1-10 GbE link: one stream, as before
    (10_000, {}, 1, 1),
    (25_000, {}, 4, 1),  # ceil(1.25 x 2.5)
    (100_000, {}, 13, 2),  # one per 10 Gbit/s and a quarter more, one process per 8 streams
    (400_000, {}, 50, 7),
    (400_000, {"stream_gbit": 1}, 128, 16),  # iperf3's own limit; the processes' too
    (100_000, {"streams": 4, "processes": 8}, 4, 4),  # given; never more processes than streams
])
def test_streams_and_processes_follow_the_nominal_speed(nominal_mbit, over, streams, processes):
    spec = PreflightSpec(**over)
    assert links.streams_for(nominal_mbit, spec) == streams
    assert links.processes_for(streams, spec) == processes
    shares = links.split_streams(streams, processes)
    assert sum(shares) == streams and max(shares) - min(shares) <= 1


def test_client_command_line_carries_streams_omit_zerocopy_and_affinity():
    argv = links.client_argv("10.0.0.2", "10.0.0.1", 5202, 2, "bidir", streams=8, omit_s=1, zerocopy=True, core=3)
    assert argv[:4] == ["timeout", "-k", "2", "18"]  # 2 s + 1 s omitted + slack
    assert argv[argv.index("-P") + 1] == "8" and argv[argv.index("-O") + 1] == "1" and "-Z" in argv
    assert argv[argv.index("-A") + 1] == "3,3" and argv[-1] == "--bidir" and argv[argv.index("-p") + 1] == "5202"
    plain = links.client_argv("10.0.0.2", "10.0.0.1", 5201, 2, "forward")
    assert not {"-P", "-O", "-Z", "-A", "--bidir", "-R"} & set(plain)


def _stream(bps: float, client_sends: bool) -> dict:
    return {"sender": {"bits_per_second": bps, "sender": client_sends, "mean_rtt": 100},
            "receiver": {"bits_per_second": bps, "sender": client_sends}}


def test_parse_iperf3_lists_each_streams_rate_by_direction_and_merge_sums_processes():
    import json

    text = json.dumps({"end": {
        "streams": [_stream(3e8, True), _stream(1e8, True), _stream(2e8, False)],
        "sum_received": {"bits_per_second": 4e8}, "sum_sent": {"retransmits": 2},
        "sum_received_bidir_reverse": {"bits_per_second": 2e8}, "sum_sent_bidir_reverse": {"retransmits": 1}}})
    got = links.parse_iperf3(text)
    assert got["stream_mbit"] == [300.0, 100.0] and got["reverse_stream_mbit"] == [200.0] and got["mbit"] == 400
    both = links.merge_iperf3([got, got])
    assert both["mbit"] == 800 and both["reverse_mbit"] == 400 and both["retransmits"] == 4
    assert both["stream_mbit"] == [300.0, 100.0, 300.0, 100.0] and both["rtt_ms"] == pytest.approx(0.1)


def test_the_verdict_is_on_the_sum_and_a_stream_far_below_the_others_is_a_finding():
    lt = LinkTest("n01", "n02", 0, 1000.0, threshold=0.9)
    f = {"mbit": 950.0, "retransmits": 0, "rtt_ms": 0.1, "stream_mbit": [130.0, 130.0, 130.0, 130.0, 130.0, 130.0,
                                                                          130.0, 40.0],
         "reverse_mbit": 960.0, "reverse_retransmits": 0, "reverse_stream_mbit": [120.0] * 8}
    links._fill(lt, {"bidir": f}, 0.9)
    assert lt.ok and lt.ratio == 0.95 and lt.directions[0].stream_mbit[-1] == 40.0
    assert len(lt.notes) == 1 and "1 of 8 streams" in lt.notes[0] and "stream 8 40 Mbit/s" in lt.notes[0]


IPUTILS_PING = """PING 10.0.0.2 (10.0.0.2) from 10.0.0.1 : 56(84) bytes of data.

--- 10.0.0.2 ping statistics ---
10 packets transmitted, 9 received, 10% packet loss, time 185ms
rtt min/avg/max/mdev = 48.120/61.693/310.004/57.217 ms
"""


def test_ping_summary_and_the_latency_verdict():
    got = links.parse_ping(IPUTILS_PING)
    assert got == {"sent": 10, "received": 9, "loss": 0.1, "min_ms": 48.12, "avg_ms": 61.693, "max_ms": 310.004,
                   "mdev_ms": 57.217}
    lost = links.parse_ping("5 packets transmitted, 0 received, 100% packet loss, time 40ms\n")
    assert lost["loss"] == 1.0 and lost["avg_ms"] is None
    with pytest.raises(DeploybenchError, match="no summary"):
        links.parse_ping("ping: cannot flood; minimal interval allowed for user is 200ms")
    lt = LinkTest("n01", "n02", 0, 1000.0, ok=True, latency_ms=got["avg_ms"], jitter_ms=got["mdev_ms"], ping_loss=0.1)
    links._judge_latency(lt, PreflightSpec(max_rtt_ms=10, max_jitter_ms=5))
    assert not lt.ok and len(lt.problems) == 3
    fine = LinkTest("n01", "n02", 0, 1000.0, ok=True, latency_ms=0.05, jitter_ms=0.01, ping_loss=0.0)
    links._judge_latency(fine, PreflightSpec())
    assert fine.ok and fine.problems == []


def test_ping_command_is_bounded_and_binds_the_tested_address():
    argv = links.ping_argv("10.0.0.2", "10.0.0.1", 10, 0.02)
    assert argv[:3] == ["timeout", "-k", "2"] and argv[argv.index("-I") + 1] == "10.0.0.1" and argv[-1] == "10.0.0.2"
    assert argv[argv.index("-c") + 1] == "10" and argv[argv.index("-i") + 1] == "0.02"


# perftest's tables, laid out as its format strings print them (values of a 200 Gb/s HDR pair)
IB_WRITE_BW = """---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF\t\tDevice         : mlx5_0
 Number of qps   : 1\t\tTransport type : IB
 Connection type : RC\t\tUsing SRQ      : OFF
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
 65536      728119           0.00               190.85\t\t   0.364021
---------------------------------------------------------------------------------------
"""
IB_WRITE_LAT = (
    "---------------------------------------------------------------------------------------\n"
    " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   "
    "99% percentile[usec]   99.9% percentile[usec] \n"
    " 2       1000          0.98           4.21         1.02     \t       1.04     \t0.06\t\t1.31 \t\t4.21   \n"
    "---------------------------------------------------------------------------------------\n")


def test_perftest_tables_parse_and_other_units_are_refused():
    assert rdma.parse_bw(IB_WRITE_BW) == {"bytes": 65536, "iterations": 728119, "peak_gbit": 0.0, "gbit": 190.85,
                                          "mpps": 0.364021}
    lat = rdma.parse_lat(IB_WRITE_LAT)
    assert lat["typical_us"] == 1.02 and lat["p99_us"] == 1.31 and lat["p999_us"] == 4.21
    with pytest.raises(DeploybenchError, match="--report_gbits"):
        rdma.parse_bw(IB_WRITE_BW.replace("Gb/sec", "MB/sec"))
    with pytest.raises(DeploybenchError, match="no 'BW average"):
        rdma.parse_bw(" Did not detect devices \n If device exists, check if driver is up\n")


def test_perftest_command_lines():
    assert rdma.bw_argv("mlx5_0", 1, 18515, 2) == ["ib_write_bw", "-d", "mlx5_0", "-i", "1", "-p", "18515", "-D",
                                                   "2", "--report_gbits", "-F"]
    assert rdma.bw_argv("mlx5_0", 1, 18515, 2, "10.0.0.2")[-1] == "10.0.0.2"
    assert rdma.lat_argv("mlx5_1", 2, 18516, server="10.0.0.2") == ["ib_write_lat", "-d", "mlx5_1", "-i", "2", "-p",
                                                                     "18516", "-n", "1000", "-F", "10.0.0.2"]


def _node(name: str, **kw) -> Node:
    return Node(name=name, address="10.0.0.1", link_mbit=200_000, **kw)


HCA = {"rdma": ["mlx5_0|1|200 Gb/sec (4X HDR)|4: ACTIVE|InfiniBand", "mlx5_1|1|100 Gb/sec (4X EDR)|1: DOWN|Ethernet",
                "bad name;rm -rf /|1|200 Gb/sec|4: ACTIVE|InfiniBand", "mlx5_2|x|?|?|?"]}


def test_rdma_ports_from_a_node_are_checked_and_the_active_one_chosen():
    ports = rdma.devices(HCA)
    assert [(p["device"], p["port"], p["gbit"]) for p in ports] == [("mlx5_0", 1, 200.0), ("mlx5_1", 1, 100.0)]
    assert rdma.chosen(_node("n01"), HCA)[0]["device"] == "mlx5_0"
    port, why = rdma.chosen(_node("n01", rdma_device="mlx5_1"), HCA)
    assert port is None and "no RDMA port is ACTIVE (mlx5_1/1 1: DOWN)" in why
    port, why = rdma.chosen(_node("n01", rdma_device="mlx5_9"), HCA)
    assert port is None and "'mlx5_9' is not there" in why
    assert rdma.chosen(_node("n01"), {})[1] == "n01 has no RDMA device (/sys/class/infiniband is empty or absent)"


def test_rdma_plan_skips_a_pair_without_devices_and_the_verdict_is_against_the_slower_port():
    facts = {"n01": HCA, "n02": {}}
    ports, rec = rdma.plan(PreflightSpec(), _node("n01"), _node("n02"), facts)
    assert ports is None and rec.status == "skipped" and "n02 has no RDMA device" in rec.reason
    assert rdma.plan(PreflightSpec(rdma=RdmaMode.OFF), _node("n01"), _node("n02"), facts) == (None, None)
    ports, rec = rdma.plan(PreflightSpec(), _node("n01"), _node("n02"), {"n01": HCA, "n02": HCA})
    assert rec is None and [p["device"] for p in ports] == ["mlx5_0", "mlx5_0"]
    good = RdmaTest("error", nominal_gbit=200.0, gbit=190.85)
    rdma.judge(good, 0.9)
    assert good.status == "pass" and good.ratio == pytest.approx(0.9543, abs=1e-4)
    slow = RdmaTest("error", nominal_gbit=200.0, gbit=120.0)
    rdma.judge(slow, 0.9)
    assert slow.status == "fail" and "below the threshold 90%" in slow.reason


def test_nic_facts_are_checked_and_judged_against_the_inventory():
    raw = checks.parse_facts("nic_if=eth0\nnic_speed=100000\nnic_mtu=1500\nnic_driver=mlx5_core\n")
    assert checks.nic_facts(raw) == {"interface": "eth0", "speed_mbit": 100000, "mtu": 1500, "driver": "mlx5_core"}
    hostile = checks.parse_facts("nic_if=eth0; reboot\nnic_speed=-1\nnic_mtu=99999999\nnic_driver=$(id)\n")
    assert checks.nic_facts(hostile) == {"interface": None, "speed_mbit": None, "mtu": None, "driver": None}
    mtu = checks._nic(_node("n01", mtu=9000), raw, "10.0.0.1")
    assert mtu.status == "fail" and "MTU 1500 on eth0, the inventory says 9000" in mtu.detail
    slow = checks._nic(_node("n01"), raw, "10.0.0.1")  # 100 GbE negotiated on a 200 GbE node
    assert slow.status == "warn" and "negotiated 100000 Mb/s" in slow.detail
    assert checks._nic(_node("n01"), {}, "10.0.0.1").status == "warn"
    assert checks._rdma(_node("n01"), {}, PreflightSpec()).status == "pass"
    assert checks._rdma(_node("n01"), {}, PreflightSpec(rdma=RdmaMode.REQUIRE)).status == "fail"
    assert checks._rdma(_node("n01", rdma_device="mlx5_0"), {}, PreflightSpec()).status == "fail"
    assert checks._rdma(_node("n01"), {}, PreflightSpec(rdma=RdmaMode.OFF)) is None


def test_the_fabric_enters_the_cluster_identity_and_two_fabrics_are_two_series():
    from deploybench.store.identity import identity_of

    nic = checks.parse_facts("nic_if=eth0\nnic_speed=100000\nnic_mtu=9000\nnic_driver=mlx5_core\n")
    fab = checks.fabric_identity({**nic, **HCA})
    assert fab == {"speed_mbit": 100000, "mtu": 9000, "driver": "mlx5_core",
                   "rdma": ["mlx5_0/1 200.0G InfiniBand", "mlx5_1/1 100.0G Ethernet"]}
    inv = {"name": "c", "nodes": [{"name": "n01", "link_mbit": 100000}]}
    cfg = {"inventory": "c"}
    before = identity_of(cfg, ["n01"], inv)  # a run before preflight read the fabric keeps its identity
    assert identity_of(cfg, ["n01"], inv, fabric={}).cluster.hash == before.cluster.hash
    a = identity_of(cfg, ["n01"], inv, fabric={"n01": fab})
    b = identity_of(cfg, ["n01"], inv, fabric={"n01": {**fab, "mtu": 1500}})
    assert len({before.cluster.hash, a.cluster.hash, b.cluster.hash}) == 3 and a.differences(b) == ["cluster"]


def test_the_lab_shapes_each_flow_of_the_iperf3_ports_into_its_own_capped_class():
    text = commands.shape_batch("eth0", 200, flow_cap_mbit=50, icmp_kbit=16)
    lines = text.splitlines()
    caps = [line for line in lines if line.startswith("class add") and "ceil 50000kbit" in line]
    assert len(caps) == commands.FLOW_BUCKETS
    flows = [line for line in lines if line.startswith("filter add") and "protocol 6" in line]
    assert len(flows) == 2 * commands.FLOW_BUCKETS  # to the iperf3 ports, and from them
    assert all("0x1450 0xfff0" in f and "0x3e" in f for f in flows)
    assert any("match ip protocol 1 0xff flowid 1:20" in line for line in lines)
    assert "htb default 10" in lines[0]
    assert "1:20" not in commands.shape_batch("eth0", 200, flow_cap_mbit=50)


def test_pings_are_bounded_and_the_stage_budget_grows_with_what_a_link_test_does():
    from deploybench.config import RunConfig
    from deploybench.timeouts import stage_budget_s

    with pytest.raises(ValueError, match="ping_count 1000 x ping_interval_s 1 = 1000 s of pings per link"):
        PreflightSpec(ping_count=1000, ping_interval_s=1)
    base = RunConfig(inventory="lab", preflight=PreflightSpec(rdma=RdmaMode.OFF, ping_count=0))
    longer = RunConfig(inventory="lab", preflight=PreflightSpec(rdma=RdmaMode.OFF, ping_count=0, omit_s=3))
    pinged = RunConfig(inventory="lab", preflight=PreflightSpec(rdma=RdmaMode.OFF, ping_count=50))
    rdma_on = RunConfig(inventory="lab", preflight=PreflightSpec(ping_count=0))
    b = stage_budget_s(base, "preflight", 4)
    assert stage_budget_s(longer, "preflight", 4) == b + 3 * 3  # 3 rounds (ring) x 3 s omitted
    assert stage_budget_s(pinged, "preflight", 4) == pytest.approx(b + 3 * 50 * 0.2)
    assert stage_budget_s(rdma_on, "preflight", 4) > b


def test_a_matrix_cell_on_a_reused_deployment_keeps_the_owners_fabric_in_its_identity():
    from deploybench.matrix.deployment import reused_record
    from deploybench.records import ReusedPreflight

    facts = {**checks.parse_facts("nic_if=eth0\nnic_speed=100000\nnic_mtu=9000\nnic_driver=mlx5_core\n"), **HCA}
    owner = {"healthy": ["n01"], "nodes": [{"node": "n01", "ok": True, "facts": facts}, "not a node"]}
    got = {"records": {"preflight": {"result": owner, "summary": "ok", "finished_at": "2026-12-06T10:00:00+00:00"}},
           "owner": "run-a", "giver": "run-a",
           "max_reuse_s": 900, "endpoints": [], "nodes": ["n01"]}
    result, _ = reused_record(got, "preflight")
    reused = ReusedPreflight.model_validate(result)
    assert reused.fabric == {"n01": checks.fabric_identity(facts)} and reused.healthy == ["n01"]
