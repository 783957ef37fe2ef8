"""Several load generators (issue 31), what goes wrong: a generator killed or crashed mid-phase fails the phase by its
name and nothing is left running; a skewed clock is refused before anything starts; `lab up --loadgens` and `lab
down`. A netns lab with three load-generator namespaces (g01..g03, each its own sshd), real k6 in each, simulated
engines on the lab's bridge address. Nothing here measures speed (the split's figures are test_loadgen.py's, in the
quiet part). Every wait is bounded: run_load bounds each generator by the phase's budget, the lab's sshd waits by
SSHD_WAIT_S, the kill helpers by their own deadlines."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest

from deploybench.config import SLO, LoadSpec
from deploybench.lab import cluster
from deploybench.lab.naming import NetnsNames
from deploybench.load import loadgen, run_load
from deploybench.sim.local import LocalEngines
from deploybench.transport import Cluster
from tests.support import lab_names

pytestmark = [
    pytest.mark.integration,
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="the netns lab needs root"),
]

LAB = lab_names.unique("tlgf")
SLO_ = SLO(p99_latency_ms=2000, max_error_rate=0.01)


@pytest.fixture(scope="module")
def lab(sim_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """(inventory, endpoints): 1 node (unused), 3 load generators, 2 simulated engines on the bridge address."""
    inv = cluster.up(LAB, nodes=1, loadgens=3, mode="netns", model_mb=1, link_mbit=500)
    try:
        assert inv.loadgen_names == ["g01", "g02", "g03"]
        with LocalEngines(sim_model_dir, tmp_path_factory.mktemp("engines"), host=inv.controller_address) as eng:
            yield inv, eng.start(2)
    finally:
        cluster.down(LAB)


def _k6_pids(ns: str) -> list[tuple[int, str]]:
    """Processes inside namespace ``ns`` whose command is k6 (or the shell that waits for it)."""
    from deploybench.lab import netns

    found = []
    for pid in netns.namespace_pids(ns):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv if a]
        if any(Path(w).name == "k6" for w in words[:8]) or "deploybench-k6" in words:
            found.append((pid, " ".join(words)[:200]))
    return found



def test_a_generator_killed_mid_phase_fails_the_phase_and_nothing_runs(lab, tmp_path):
    inv, eps = lab
    names = NetnsNames.of(LAB)
    spec = LoadSpec(rate=20, duration_s=30, warmup_s=0, prompt_tokens=16, output_tokens=4, request_timeout_s=10,
                    ttft_sample_rps=0, scrape_interval_s=0)
    killed: list[str] = []

    def kill_k6_on_g02() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            k6 = [(p, cmd) for p, cmd in _k6_pids(names.namespace("g02")) if cmd.split()[0].endswith("k6")]
            if k6:
                # mid-phase: past the barrier (set when k6 was started) and its first requests
                time.sleep(loadgen.BARRIER_LEAD_S + loadgen.BARRIER_PER_ENDPOINT_S * len(eps) + 2.0)
                for pid, cmd in k6:
                    os.kill(pid, 9)
                    killed.append(cmd)
                return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_k6_on_g02, daemon=True)
    killer.start()
    with Cluster(inv) as c, pytest.raises(loadgen.GeneratorFailed, match=r"load generator g02 .*k6 exited with code"):
        run_load(eps, spec, SLO_, tmp_path / "out", phase="sustained",
                 generators=loadgen.Generators(c, inv.loadgen_names))
    killer.join(timeout=35)
    assert killed, "k6 never started on g02"
    assert list((tmp_path / "out").glob("sustained.g0*")) == []  # no output of a failed phase was fetched
    for g in inv.loadgen_names:
        assert _k6_pids(names.namespace(g)) == [], f"{g} still runs k6"


def test_a_generator_with_a_skewed_clock_is_refused_before_anything_starts(lab, tmp_path):
    """The clock check's bound, with a bound below what the lab's one clock can show (a round trip's error)."""
    inv, eps = lab
    with Cluster(inv) as c:
        offsets = loadgen.check_clocks(loadgen.Generators(c, inv.loadgen_names))
        assert set(offsets) == {"g01", "g02", "g03"}
        assert all(abs(off) < 50 and rtt > 0 for off, rtt in offsets.values())  # one clock in the lab
        tight = loadgen.Generators(c, inv.loadgen_names, clock_bound_ms=-1.0)  # every offset is beyond it
        with pytest.raises(loadgen.GeneratorFailed, match=r"load generator g01: its clock is [+-][0-9.]+ ms off"):
            run_load(eps, LoadSpec(rate=5, duration_s=2, warmup_s=0, ttft_sample_rps=0, scrape_interval_s=0),
                     SLO_, tmp_path / "out", phase="skew", generators=tight)
        for g in inv.loadgen_names:
            assert _k6_pids(NetnsNames.of(LAB).namespace(g)) == []
            assert not c[g].run(["test", "-e", f"{c.run_dir(g)}/load/skew"]).ok  # nothing was copied either


def test_a_generator_whose_machine_dies_fails_the_phase_by_its_dropped_session(lab, tmp_path):
    """g03 crashes (every process of its namespace killed, its link down): its session drops, the phase fails naming
    it, and the two others are stopped. Last in the module: g03 is brought back for nothing after it."""
    inv, eps = lab
    names = NetnsNames.of(LAB)
    spec = LoadSpec(rate=20, duration_s=30, warmup_s=0, prompt_tokens=16, output_tokens=4, request_timeout_s=10,
                    ttft_sample_rps=0, scrape_interval_s=0)
    crashed: list[bool] = []

    def crash_g03() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if _k6_pids(names.namespace("g03")):
                time.sleep(loadgen.BARRIER_LEAD_S + loadgen.BARRIER_PER_ENDPOINT_S * len(eps) + 2.0)
                cluster.kill_node(LAB, "g03")
                crashed.append(True)
                return
            time.sleep(0.1)

    killer = threading.Thread(target=crash_g03, daemon=True)
    killer.start()
    with Cluster(inv) as c, pytest.raises(loadgen.GeneratorFailed, match=r"load generator g03 ") as failed:
        run_load(eps, spec, SLO_, tmp_path / "out", phase="sustained",
                 generators=loadgen.Generators(c, inv.loadgen_names))
    killer.join(timeout=35)
    assert crashed, "k6 never started on g03"
    # seen as a dropped session, or, when a poll came between the kill and the link going down, as k6's end
    assert re.search(r"session dropped|k6 is gone without an exit code|k6 exited with code", str(failed.value))
    for g in inv.loadgen_names:
        assert _k6_pids(names.namespace(g)) == [], f"{g} still runs k6"


def test_lab_up_makes_load_generator_machines_and_down_removes_them():
    from deploybench.inventory import Inventory
    from deploybench.lab import netns
    from deploybench.lab.state import LabFiles

    lab = lab_names.unique("tlgud")
    names = NetnsNames.of(lab)
    try:
        inv = cluster.up(lab, nodes=1, loadgens=2, mode="netns", model_mb=1, link_mbit=100)
        assert Inventory.load(LabFiles(lab).inventory).loadgen_names == ["g01", "g02"] == inv.loadgen_names
        nss, _ = netns.lab_objects(names)
        assert sorted(nss) == [names.namespace(m) for m in ("g01", "g02", "n01")]
        st = cluster.status(lab)
        assert [n.name for n in st.nodes] == ["n01", "g01", "g02"] and st.healthy
        with Cluster(inv) as c:  # each answers through the inventory's transport, from its own address
            assert c["g02"].run(["ip", "-4", "-o", "addr", "show", "eth0"]).stdout.count(inv.machine("g02").address)
    finally:
        cluster.down(lab)
    assert netns.lab_objects(names) == ([], [])
