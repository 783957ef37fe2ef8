"""The lab cluster for real: namespaces, sshd with checked host keys, private model roots, tc shaping.

Each lab here has a unique name (lab_name, netns_lab in tests/support/fixtures.py) and its own DEPLOYBENCH_HOME,
so these tests run beside the demo lab and other people's tests. Traffic only goes to addresses of
namespaces the test created. Every test is bounded in time (time_limit).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from deploybench import paths
from deploybench.errors import LabError, NodeUnreachable
from deploybench.inventory import TransportKind
from deploybench.lab import cluster, netns
from deploybench.lab.naming import NetnsNames
from deploybench.lab.state import LabFiles
from deploybench.manifest import MANIFEST_NAME
from deploybench.transport import Cluster, LocalTransport, SSHTransport, connect

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(90)]
NOMINAL = 200.0


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEPLOYBENCH_HOME", str(tmp_path_factory.mktemp("dbhome")))
        yield


@pytest.fixture(scope="module")
def lab(netns_lab):
    return netns_lab("it", nodes=3, link_mbit=NOMINAL, model_mb=4)


def leftovers(name: str) -> list[str]:
    names = NetnsNames.of(name)
    found = [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
             if ns.startswith(names.ns_prefix)]
    links = json.loads(subprocess.run(["ip", "-j", "link"], capture_output=True, text=True).stdout)
    found += [entry["ifname"] for entry in links if names.owns_link(entry["ifname"])]
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    found += [line for line in ps.splitlines() if "sshd" in line and f"/lab/{name}/" in line]
    with open("/proc/self/mountinfo") as f:
        found += [line.split()[4] for line in f if f"/deploybench/{name}/" in line]
    return found


def iperf_mbit(c: Cluster, server: str, client: str, address: str, seconds: float = 2, reverse: bool = False) -> float:
    c[server].run(["iperf3", "-s", "-1", "-D", "-B", address], timeout=10).check()
    _wait_for_listener(c[server], address)
    argv = ["iperf3", "-c", address, "-t", str(seconds), "-J"] + (["-R"] if reverse else [])
    out = json.loads(c[client].run(argv, timeout=seconds + 15).check().stdout)
    return out["end"]["sum_received"]["bits_per_second"] / 1e6


def _wait_for_listener(t, address: str, port: int = 5201, timeout_s: float = 10) -> None:
    """iperf3 -D returns before its server listens: wait until the port is in the node's listen table."""
    deadline = time.monotonic() + timeout_s
    while f"{address}:{port} " not in t.run(["ss", "-Hltn"], timeout=10).stdout:
        if time.monotonic() > deadline:
            raise AssertionError(f"iperf3 -s did not listen on {address}:{port} within {timeout_s:g} s")
        time.sleep(0.05)


@pytest.mark.netns
class TestNetnsLab:

    def test_inventory_and_ssh_with_checked_host_key(self, lab):
        name, inv, _ = lab
        assert inv.transport is TransportKind.SSH and inv.names == ["n01", "n02", "n03"]
        prom = {"prometheus": f"http://{inv.controller_address}:9090"} if shutil.which("prometheus") else {}
        assert inv.lab == {"name": name, "mode": "netns", "subnet": inv.lab["subnet"], "dir": str(paths.lab_dir(name)),
                           **prom}
        for node in inv.nodes:
            with connect(inv, node) as t:
                assert isinstance(t, SSHTransport)
                r = t.run(["ip", "-4", "-o", "addr", "show", "dev", "eth0"], timeout=10).check()
                assert f"{node.address}/24" in r.stdout
                env = t.run("echo $DEPLOYBENCH_NODE; command -v iperf3 rsync sha256sum", timeout=10).check()
                assert env.stdout.split()[0] == node.name and len(env.stdout.split()) == 4

    def test_a_node_with_a_wrong_host_key_is_refused(self, lab, tmp_path):
        name, inv, _ = lab
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
        other = (tmp_path / "other.pub").read_text().split()
        n02 = inv.node("n02")
        lines = [f"{n02.address} {other[0]} {other[1]}" if line.startswith(f"{n02.address} ") else line
                 for line in Path(inv.ssh.known_hosts).read_text().splitlines()]
        (tmp_path / "known_hosts").write_text("\n".join(lines) + "\n")
        bad = inv.model_copy(update={"ssh": inv.ssh.model_copy(update={"known_hosts": str(tmp_path / "known_hosts")})})
        with pytest.raises(NodeUnreachable, match="n02"):
            with connect(bad, n02) as t:
                t.run(["true"], timeout=10)
        with connect(bad, bad.node("n03")) as t:  # the others still pass
            assert t.run(["true"], timeout=10).ok

    def test_each_node_sees_its_own_model_root(self, lab):
        name, inv, _ = lab
        files = LabFiles(name)
        root = inv.model_root
        with Cluster(inv) as c:
            c["n02"].run(["sh", "-c", f"echo n02 > {root}/only-on-n02"], timeout=10).check()
            assert c["n02"].run(["cat", f"{root}/only-on-n02"], timeout=10).check().stdout == "n02\n"
            assert not c["n03"].run(["test", "-e", f"{root}/only-on-n02"], timeout=10).ok
            assert not c["n01"].run(["test", "-e", f"{root}/only-on-n02"], timeout=10).ok
            # the fan-out source holds the seeded model, the others are empty
            assert c["n01"].run(["test", "-f", f"{root}/sim-model/{MANIFEST_NAME}"], timeout=10).ok
            assert c["n03"].run(["ls", "-A", root], timeout=10).check().stdout == ""
            run_root = inv.run_root
            c["n02"].run(["touch", f"{run_root}/n02.pid"], timeout=10).check()
            assert not c["n03"].run(["test", "-e", f"{run_root}/n02.pid"], timeout=10).ok
        assert (files.models("n02") / "only-on-n02").read_text() == "n02\n"

    def test_a_command_s_output_is_read_to_its_end_of_file_not_to_its_exit_status(self, lab):
        """sshd sends a command's exit status when the shell ends, and what its output still carries after it: the
        transport reads to the channel's end of file (here: a line written 50 ms after the shell exited, by a
        process that held its output), and a command that left its output held open for longer ends
        EOF_GRACE_S after its status, not at its timeout (2 s here, against a holder of 30 s)."""
        _, inv, _ = lab
        with Cluster(inv) as c:
            late = c["n02"].run("echo early; (sleep 0.05; echo late) & exit 0", timeout=10).check()
            assert late.stdout == "early\nlate\n", late.stdout
            held = c["n02"].run("echo early; (exec sleep 30) & echo $! >&2; exit 3", timeout=2)
            assert (held.rc, held.stdout) == (3, "early\n")
            c["n02"].run(f"kill {int(held.stderr)}", timeout=10).check()  # that holder only (pids are the host's)

    def test_links_are_shaped_both_ways(self, lab):
        name, inv, _ = lab
        with Cluster(inv) as c:
            up = iperf_mbit(c, "n01", "n02", inv.node("n01").address)
            down = iperf_mbit(c, "n01", "n02", inv.node("n01").address, reverse=True)
        for mbit in (up, down):
            assert 0.5 * NOMINAL <= mbit <= 1.15 * NOMINAL, f"{mbit:.0f} Mbit/s on a {NOMINAL:.0f} Mbit/s link"

    def test_set_link_degrades_and_restores(self, lab):
        name, inv, _ = lab
        address = inv.node("n01").address
        cluster.set_link(name, "n03", mbit=40)
        try:
            with Cluster(inv) as c:
                slow = iperf_mbit(c, "n01", "n03", address)
        finally:
            cluster.set_link(name, "n03")
        with Cluster(inv) as c:
            restored = iperf_mbit(c, "n01", "n03", address)
        assert slow <= 40 * 1.15, slow
        assert restored >= 0.5 * NOMINAL, restored
        with pytest.raises(LabError, match="n09"):
            cluster.set_link(name, "n09", mbit=10)

    def test_delay_and_loss_need_netem(self, lab):
        name, inv, _ = lab
        ns = NetnsNames.of(name).namespace("n03")
        if not netns.check_netem():
            with pytest.raises(LabError, match="CONFIG_NET_SCH_NETEM"):
                cluster.set_link(name, "n03", delay_ms=10, loss_pct=1)
            return
        cluster.set_link(name, "n03", delay_ms=10, loss_pct=1)
        try:
            shown = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", "eth0"], capture_output=True, text=True)
            assert "netem" in shown.stdout and "delay 10ms" in shown.stdout
        finally:
            cluster.set_link(name, "n03")

    def test_a_command_that_ignores_its_input_is_not_an_error(self, lab):
        name, inv, _ = lab
        with Cluster(inv) as c:
            assert c["n02"].run("exit 3", stdin=b"x" * (4 << 20), timeout=20).rc == 3
            assert c["n02"].run("cat | wc -c", stdin=b"y" * 1000, timeout=20).stdout.strip() == "1000"

    def test_kill_and_restart_a_node(self, lab):
        name, inv, _ = lab
        cluster.kill_node(name, "n03")
        st = cluster.status(name, timeout=2)
        assert [n.ok for n in st.nodes] == [True, True, False]
        cluster.start_node(name, "n03")
        assert cluster.status(name, timeout=5).healthy

    def test_up_on_a_running_lab_changes_nothing(self, lab):
        name, inv, _ = lab
        t0 = time.monotonic()
        again = cluster.up(name, nodes=3, link_mbit=NOMINAL, mode="netns", model_mb=4)
        assert again == inv
        assert time.monotonic() - t0 < 10


@pytest.mark.netns
def test_stale_lab_is_rebuilt_and_down_leaves_nothing(home, lab_name):
    name = lab_name("st")
    cluster.up(name, nodes=2, link_mbit=NOMINAL, mode="netns", model_mb=1)
    try:
        # a crash that lost the lab folder: namespaces, bridge and sshd remain
        shutil.rmtree(paths.lab_dir(name))
        inv = cluster.up(name, nodes=2, link_mbit=NOMINAL, mode="netns", model_mb=1)
        assert cluster.status(name).healthy
        assert len(inv.nodes) == 2
    finally:
        cluster.down(name)
    assert leftovers(name) == []
    cluster.down(name)  # twice is fine
    assert leftovers(name) == []
    assert not paths.lab_dir(name).joinpath("inventory.json").exists()
    with pytest.raises(LabError, match="lab up"):
        cluster.status(name)


def test_loopback_lab(home, lab_name):
    name = lab_name("lo")
    inv = cluster.up(name, nodes=3, link_mbit=100, mode="loopback", model_mb=1)
    try:
        assert inv.transport is TransportKind.LOCAL
        addresses = [n.address for n in inv.nodes]
        assert len(set(addresses)) == 3 and all(a.startswith("127.") and a != "127.0.0.1" for a in addresses)
        roots = [inv.model_root_of(n) for n in inv.names]
        assert len(set(roots)) == 3
        with Cluster(inv) as c:
            t = c["n02"]
            assert isinstance(t, LocalTransport)
            assert (
                t.run(["sh", "-c", f"echo hi > {roots[1]}/x && cat {roots[1]}/x"], timeout=10).check().stdout
                == "hi\n"
            )
            assert not c["n03"].run(["test", "-e", f"{roots[2]}/x"], timeout=10).ok
            assert c["n01"].run(["test", "-f", f"{roots[0]}/sim-model/{MANIFEST_NAME}"], timeout=10).ok
        assert cluster.status(name).healthy
        assert cluster.up(name, nodes=3, link_mbit=100, mode="loopback", model_mb=1) == inv
        with pytest.raises(LabError, match="netns mode"):
            cluster.kill_node(name, "n01")
    finally:
        cluster.down(name)
    assert not paths.lab_dir(name).joinpath("nodes").exists()
    cluster.down(name)
