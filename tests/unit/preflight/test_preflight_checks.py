"""Node checks: the facts script on this machine (local transport), and the verdicts from facts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deploybench.config import PreflightSpec
from deploybench.inventory import Inventory, Node
from deploybench.preflight.checks import (
    Wanted,
    consistency,
    gather,
    judge_node,
    listening,
    parse_facts,
    port_taken,
)
from deploybench.preflight.links import sweep_script
from deploybench.preflight.model import CheckItem, NodeCheck
from deploybench.transport import Cluster

GiB = 2**30


def _node(name="n01", address="127.0.0.1"):
    return Node(name=name, address=address, link_mbit=1000)


def _facts(**over):
    base = {"kernel": "6.1", "cpus": "8", "mem_bytes": 64 * GiB, "free_bytes": str(100 * GiB), "listen": "",
            "bins": {"iperf3": "/usr/bin/iperf3", "rsync": "/usr/bin/rsync"}, "gpu_none": "1", "model_bytes": "0",
            "clock_offset_ms": 3.0, "clock_uncertainty_ms": 2.0}
    return {**base, **over}


def _judged(facts, spec=None, w=None, model_bytes=10 * GiB, name="n02"):
    c = NodeCheck(name, True)
    c.add(CheckItem("ssh", "pass"))
    c.facts = facts
    judge_node(c, _node(name), spec or PreflightSpec(), w or Wanted("/models", "m", 8000, source="n01"), model_bytes)
    return c, {i.name: i for i in c.checks}


def test_facts_script_runs_for_real_on_this_machine(tmp_path):
    root = tmp_path / "models"
    (root / "m").mkdir(parents=True)
    (root / "m" / "w.bin").write_bytes(b"x" * 5000)
    inv = Inventory(name="t", transport="local", model_root=str(root), run_root=str(tmp_path / "run"),
                    nodes=[_node()])
    w = Wanted(str(root), "m", 8000, ("sh", "no-such-binary-xyz", sys.executable), source="n01")
    with Cluster(inv) as c:
        check = gather(c, inv.node("n01"), w, str(tmp_path / "run" / "n01" / "preflight"))
    f = check.facts
    assert check.reachable
    assert f["bins"]["no-such-binary-xyz"] == "missing" and f["bins"]["sh"].endswith("/sh")
    assert f["bins"][sys.executable] == sys.executable
    assert int(f["cpus"]) >= 1 and f["mem_bytes"] > 2**20 and int(f["free_bytes"]) > 0
    assert int(f["model_bytes"]) >= 5000
    assert abs(f["clock_offset_ms"]) <= f["clock_uncertainty_ms"] + 50  # the same clock
    judge_node(check, inv.node("n01"), PreflightSpec(), w, int(f["model_bytes"]))
    assert not check.ok and any("no-such-binary-xyz not installed" in r for r in check.reasons)


def test_binaries_free_space_and_a_healthy_node():
    c, items = _judged(_facts())
    assert c.ok and c.status == "pass", c.reasons
    assert "100.0 GiB free" in items["free_space"].detail and "11.0 GiB" in items["free_space"].detail
    c, items = _judged(_facts(free_bytes=str(10 * GiB)))  # the model fits, its 10 % margin does not
    assert not c.ok and items["free_space"].status == "fail" and "10.0 GiB free" in c.reasons[0]
    c, items = _judged(_facts(free_bytes=str(10 * GiB)), PreflightSpec(free_space_margin=0))
    assert items["free_space"].status == "pass"
    c, items = _judged(_facts(free_bytes="0", model_bytes=str(10 * GiB)))  # holds the model already
    assert items["free_space"].status == "pass" and "already holds" in items["free_space"].detail
    c, _ = _judged(_facts(bins={"iperf3": "missing", "rsync": "/usr/bin/rsync"}))
    assert not c.ok and "iperf3 not installed" in c.reasons[0] and not c.can_run_iperf3()


def test_the_source_must_hold_the_model():
    c, items = _judged(_facts(model_bytes="0"), name="n01")
    assert items["free_space"].status == "fail" and "fan-out source" in items["free_space"].detail


@pytest.mark.parametrize("offset,unc,status", [(3, 2, "pass"), (900, 20, "fail"), (-900, 20, "fail"),
                                                (480, 40, "warn"), (520, 40, "warn")])
def test_clock_offset(offset, unc, status):
    _, items = _judged(_facts(clock_offset_ms=offset, clock_uncertainty_ms=unc))
    assert items["clock"].status == status
    assert f"{offset:+.0f} ms" in items["clock"].detail and "limit 500 ms" in items["clock"].detail


def test_listening_sockets_from_proc_net_tcp():
    got = listening("0100007F:1F40,00000000:0016,00000000000000000000000000000000:1F41,"
                    "0000000000000000FFFF00000A00000A:1F42,")
    assert got == [("127.0.0.1", 8000), ("0.0.0.0", 22), ("::", 8001), ("10.0.0.10", 8002)]
    assert port_taken("0100007F:1F40,", "127.0.0.1", 8000)
    assert not port_taken("0100007F:1F40,", "127.0.0.2", 8000)  # loopback lab: another node's engine
    assert port_taken("00000000:1F40,", "127.0.0.2", 8000)
    assert not port_taken("0100007F:1F41,", "127.0.0.1", 8000)


def test_engine_port_in_use_fails_the_node():
    c, items = _judged(_facts(listen="0100007F:1F40,"))  # the node's own address is 127.0.0.1 here
    assert items["engine_port"].status == "fail" and "port 8000 is already in use" in c.reasons[0]


def test_no_gpu_is_said_plainly_and_fails_only_when_required():
    c, items = _judged(_facts())
    assert c.ok and items["gpu"].status == "pass" and "no GPU" in items["gpu"].detail
    c, items = _judged(_facts(), PreflightSpec(require_gpu=True))
    assert not c.ok and "no GPU" in c.reasons[0] and "require_gpu" in c.reasons[0]
    c, items = _judged(_facts(gpus=[["NVIDIA GB10", "580.95", "122880"]]), PreflightSpec(require_gpu=True))
    assert c.ok and items["gpu"].value["count"] == 1 and "NVIDIA GB10" in items["gpu"].detail


def test_gpu_and_kernel_differences_are_findings():
    gpu = ["NVIDIA GB10", "580.95", "122880"]
    checks = []
    for i in range(4):
        facts = _facts(gpus=[gpu if i != 2 else ["NVIDIA GB10", "570.10", "122880"]], kernel="6.1" if i else "6.8")
        checks.append(_judged(facts, name=f"x{i + 1:02d}")[0])
    findings = consistency(checks, PreflightSpec())
    assert any("driver 570.10" in f and "x03" in f for f in findings)
    assert any("kernel" in f and "x01 has 6.8" in f for f in findings)
    assert [c.status for c in checks] == ["warn", "pass", "warn", "pass"]
    checks = [_judged(_facts(gpus=[gpu if i != 2 else ["NVIDIA H100", "580.95", "81559"]]), name=f"n{i}")[0]
              for i in range(3)]
    consistency(checks, PreflightSpec(require_gpu=True))
    assert [c.ok for c in checks] == [True, True, False] and "NVIDIA H100" in checks[2].reasons[0]


def test_parse_facts_lists_gpus_and_binaries():
    f = parse_facts("gpu=NVIDIA GB10, 580.95, 122880\ngpu=NVIDIA GB10, 580.95, 122880\nbin=rsync=missing\n"
                    "mem_kib=1024\nnoise line\n")
    assert f["gpus"] == [["NVIDIA GB10", "580.95", "122880"]] * 2
    assert f["bins"] == {"rsync": "missing"} and f["mem_bytes"] == 2**20


def test_the_sweep_stops_a_left_iperf3_server_and_nothing_else(tmp_path, wait_for):
    """Pid files of a killed run: the iperf3 server is stopped, a reused pid (here: sleep) is not."""
    server = subprocess.Popen(["timeout", "30", "iperf3", "-s", "-B", "127.0.0.1", "-p", "5299"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    other = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        (tmp_path / "iperf3-a-b.pid").write_text(f"{server.pid}\n")
        (tmp_path / "iperf3-c-d.pid").write_text(f"{other.pid}\n")
        wait_for(lambda: subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True).returncode == 0, 5,
                 "iperf3 started under timeout")
        out = subprocess.run(["sh", "-c", sweep_script(str(tmp_path))], capture_output=True, text=True, timeout=10)
        assert out.stdout.strip() == f"swept={server.pid}"
        assert server.wait(timeout=5) != 0 and other.poll() is None
        assert list(tmp_path.iterdir()) == []
    finally:
        for p in (server, other):
            p.kill()
            p.wait()
