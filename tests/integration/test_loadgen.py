"""Several load generators, one phase (issue 31): what the split offers, against one generator (quiet: it compares
per-second rates of two runs; the generators' failures and the lab's flag are in test_loadgen_faults.py, in the
parallel part). A netns lab with three load-generator namespaces (g01..g03, each
its own sshd), real k6 in each, simulated engines on the lab's bridge address (the only address the generators and
the controller share). Every wait is bounded: run_load bounds each generator by the phase's budget, the lab's sshd
waits by SSHD_WAIT_S, the kill helper by its own deadline."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from deploybench.config import SLO, LoadSpec
from deploybench.lab import cluster
from deploybench.load import load_samples, loadgen, run_load
from deploybench.load.samples import read_k6_json
from deploybench.sim.local import LocalEngines
from deploybench.transport import Cluster

pytestmark = [
    pytest.mark.integration,
    pytest.mark.quiet,  # compares per-second rates of two runs: alone, not beside other tests
    pytest.mark.skipif(os.geteuid() != 0, reason="the netns lab needs root"),
]

LAB = "tlgen"
SLO_ = SLO(p99_latency_ms=2000, max_error_rate=0.01)


@pytest.fixture(scope="module")
def lab(sim_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """(inventory, endpoints): 1 node (unused), 3 load generators, 2 simulated engines on the bridge address."""
    inv = cluster.up(LAB, nodes=1, loadgens=3, mode="netns", model_mb=1, link_mbit=500)
    try:
        assert inv.loadgen_names == ["g01", "g02", "g03"]
        assert inv.controller_address
        with LocalEngines(sim_model_dir, tmp_path_factory.mktemp("engines"), host=inv.controller_address) as eng:
            yield inv, eng.start(2)
    finally:
        cluster.down(LAB)


def _iterations(out_dir: Path, stem: str, names: list[str]) -> dict[str, list[int]]:
    """Each generator's k6 iteration indexes (every sample, warm-up included), from its fetched JSON output."""
    got = {}
    for name in names:
        df, _ = read_k6_json(out_dir / f"{stem}.{name}.k6.json.gz")
        got[name] = [int(i) for i in df["iteration"].dropna()]
    return got


def _per_second(samples: pd.DataFrame, start: pd.Timestamp) -> Counter:
    return Counter(((samples["ts"] - start).dt.total_seconds() // 1).astype(int))


def test_three_generators_offer_one_generators_schedule(lab, tmp_path):
    inv, eps = lab
    spec = LoadSpec(rate=40, duration_s=6, warmup_s=1, prompt_tokens=32, output_tokens=8, request_timeout_s=10,
                    ttft_sample_rps=0, scrape_interval_s=0, workload="bursty")
    one = run_load(eps, spec, SLO_, tmp_path / "one", phase="sustained", seed=7)
    with Cluster(inv) as c:
        gens = loadgen.Generators(c, inv.loadgen_names)
        three = run_load(eps, spec, SLO_, tmp_path / "three", phase="sustained", seed=7, generators=gens)

    # the same plan (same seed): each row sent exactly once, by one generator, each generator a share of them
    planned = len(json.loads((tmp_path / "three" / "sustained.plan.json").read_text())["requests"])
    its = _iterations(tmp_path / "three", "sustained", inv.loadgen_names)
    sent = [i for v in its.values() for i in v]
    assert len(sent) == len(set(sent)), "an iteration was sent twice"
    assert sorted(sent) == list(range(planned))
    for name, mine in its.items():
        assert len(mine) == pytest.approx(planned / 3, rel=0.25), (name, len(mine), planned)
    assert not set(its["g01"]) & set(its["g02"])

    # the same schedule: as many requests in the window, second by second within noise, and the same figures
    assert one.generators == [] and [g.name for g in three.generators] == ["g01", "g02", "g03"]
    assert three.requests == one.requests and three.dropped_iterations == one.dropped_iterations == 0
    assert sum(g.requests for g in three.generators) == three.requests
    assert all(g.requests > 0 and g.k6_exit_code == 0 and abs(g.clock_offset_ms or 0) < 50 for g in three.generators)
    assert all(g.lag_p99_ms is not None and g.lag_p99_ms < 100 for g in three.generators)
    assert three.offered_rps == pytest.approx(one.offered_rps)
    sec1 = _per_second(load_samples(one.samples_path), pd.Timestamp(one.started_at))
    sec3 = _per_second(load_samples(three.samples_path), pd.Timestamp(three.started_at))
    for sec in range(6):
        assert abs(sec1[sec] - sec3[sec]) <= max(2, 0.1 * sec1[sec]), (sec, sec1, sec3)
    assert three.errors == one.errors == 0
    assert three.achieved_rps == pytest.approx(one.achieved_rps, rel=0.1)
    assert three.latency_p50_ms == pytest.approx(one.latency_p50_ms, rel=0.3)
    assert any("split across 3 load generators" in n for n in three.notes)


def test_constant_arrivals_split_by_segments(lab, tmp_path):
    """The arrival-rate executor (the default workload): each generator starts its segment's iterations at the
    whole schedule's times, so the merged phase offers the rate once, with no iteration index twice."""
    inv, eps = lab
    spec = LoadSpec(rate=30, duration_s=5, warmup_s=1, prompt_tokens=32, output_tokens=8, request_timeout_s=10,
                    ttft_sample_rps=0, scrape_interval_s=0)
    with Cluster(inv) as c:
        res = run_load(eps, spec, SLO_, tmp_path / "out", phase="probe", step=1,
                       generators=loadgen.Generators(c, inv.loadgen_names))
    its = _iterations(tmp_path / "out", "probe.step01", inv.loadgen_names)
    sent = sorted(i for v in its.values() for i in v)
    assert len(sent) == len(set(sent)) and sent == list(range(len(sent)))
    assert len(sent) == pytest.approx(30 * 6, abs=3)
    assert res.requests == pytest.approx(30 * 5, abs=3) and res.dropped_iterations == 0
    assert all(g.requests == pytest.approx(res.requests / 3, abs=2) for g in res.generators)
