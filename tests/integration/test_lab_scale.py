"""A 48-node netns lab brought up as a new user would (no --link-mbit), then a whole run through deploybench's own
run path (tests/support/fault_runs.lab_run: validate, lease, preflight, fan-out, rollout, the sustained phase,
teardown, store).

Before issue 31 such a lab shaped every link to 500 Mbit/s, and preflight's rounds of 24 pairs, which this 2-core
host cannot carry at that speed, read 60-86 % of it: every ring link failed the 90 % threshold. Now ``lab up``
measures what the host carries for that round (lab.capacity) and gives the links that: preflight must pass at its
default threshold, and the run must go on to serve requests from every node.

Kept short for CI: a 1 MB model, one rollout step of all 48 nodes with a 1-second gate, a
5-second phase.
"""

from __future__ import annotations

import ipaddress
import threading
from pathlib import Path

import pytest

from deploybench import paths
from deploybench.lab import capacity
from deploybench.lab import cluster as lab_cluster
from deploybench.run import Run
from tests.support import fault_runs, lab_names

# quiet: `lab up` measures what this host carries and preflight then holds the links to 90 % of it; beside the
# parallel part's other workers the host carried less at preflight than at lab up (seen: 8 of 48 nodes at 88-90 %)
pytestmark = [pytest.mark.integration, pytest.mark.time_limit(400), pytest.mark.netns, pytest.mark.quiet]

LAB = lab_names.unique("sc48")
NODES = 48


@pytest.fixture(scope="module")
def lab():
    inv = lab_cluster.up(LAB, nodes=NODES, mode="netns", model_mb=1)
    try:
        yield inv
    finally:
        lab_cluster.down(LAB)


def test_a_48_node_lab_gets_links_its_host_carries_and_runs_end_to_end(lab, dsn):
    st = lab_cluster.status(LAB)
    assert st.healthy, [n for n in st.nodes if not n.ok]
    # the speed was measured, is within the ceiling, and is what both the inventory and the run's preflight use
    assert st.link_note and "pairs at once" in st.link_note, st.link_note
    assert 0 < st.link_mbit <= capacity.DEFAULT_LINK_MBIT
    assert {n.link_mbit for n in lab.nodes} == {st.link_mbit}

    # the controller's threads and its SSH connections to the lab's nodes, sampled through the run
    sampler = _Sampler(st.subnet)
    sampler.start()
    key = "deploybench_run/scale48"
    # preflight as it ships: its 90 % threshold and its 2-second tests (fault_runs' 1-second tests read the
    # rounds' start, while 48 iperf3 clients are being started over SSH on the host's 2 cores: 75-89 % on some
    # links of one round at 60 Mbit/s, with the same links at 90-93 % in the next)
    params = {"canary_nodes": NODES, "link_threshold": 0.9, "iperf_seconds": 2, "load_rate": 2 * NODES,
              "ready_timeout_s": 120, "k6_max_vus": 200}
    try:
        out = fault_runs.lab_run(key, paths.lab_dir(LAB) / "inventory.json", dsn, params=params)
    finally:
        sampler.stop()
    assert out.stopped is None, (st.link_note, out.stopped)

    run = Run.open(key)
    pre = run.stage("preflight")
    assert pre is not None and pre.status == "success", pre and pre.error
    links = pre.result["links"]
    assert len(links) == NODES  # the ring: every node to the next, the last to the first
    low = [(x["src"], x["dst"], x.get("ratio")) for x in links if not x.get("ok")]
    assert not low, f"links below the 90 % threshold at {st.link_mbit:g} Mbit/s: {low}"
    assert all(x["nominal_mbit"] == st.link_mbit for x in links)

    fan = run.stage("fanout")
    assert fan is not None and fan.status == "success"
    assert len([n for n in fan.result["nodes"] if n["verified"]]) == NODES

    load = run.stage("load")
    assert load is not None and load.status == "success", load and load.error
    served = {n["node"]: n["requests"] for n in load.result["phases"]["sustained"]["result"]["nodes"]}
    assert set(served) == {n.name for n in lab.nodes}
    assert all(r > 0 for r in served.values()), {n: r for n, r in served.items() if r <= 0}

    # what the run left in the store, table by table (README, "How it scales": the store's rows per run)
    from sqlalchemy import inspect, text

    from deploybench.store import db

    engine = db.get_engine(dsn)
    with engine.connect() as conn:
        rows = {t: conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar_one()
                for t in inspect(engine).get_table_names() if t != "alembic_version"}
    assert rows["preflight_nodes"] == NODES and rows["preflight_links"] == NODES
    assert rows["fanout_nodes"] == NODES  # the source and every copy
    assert rows["request_samples"] >= sum(served.values())
    # one SSH connection per node and open Cluster (each command is a channel on it), however many threads use it:
    # a connection per command would count in the hundreds; two Clusters may be open at a moment
    assert NODES <= sampler.ssh_max <= 2 * NODES, sampler.ssh_max
    print(f"48-node run: {out.seconds:.1f} s; stages {out.stages}; links {st.link_mbit:g} Mbit/s; controller: at most "
          f"{sampler.threads_max} threads, {sampler.ssh_max} SSH connections; store rows "
          f"{ {t: n for t, n in sorted(rows.items()) if n} }")


class _Sampler(threading.Thread):
    """Every 50 ms: this process's threads, and the established TCP connections from this machine to port 22 of
    an address in ``subnet`` (the lab's nodes; the subnet is this lab's alone)."""

    def __init__(self, subnet: str):
        super().__init__(daemon=True)
        self.net = ipaddress.IPv4Network(subnet)
        self.threads_max = self.ssh_max = 0
        self.done = threading.Event()

    def ssh(self) -> int:
        count = 0
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            parts = line.split()
            addr, port = parts[2].split(":")
            if parts[3] == "01" and int(port, 16) == 22 and \
                    ipaddress.IPv4Address(bytes.fromhex(addr)[::-1]) in self.net:
                count += 1
        return count

    def run(self) -> None:
        while not self.done.wait(0.05):
            self.threads_max = max(self.threads_max, threading.active_count())
            self.ssh_max = max(self.ssh_max, self.ssh())

    def stop(self) -> None:
        self.done.set()
        self.join(5)
