"""GPU utilisation from end to end: a whole run (``runner.run_inline``: preflight, fan-out, rollout of two
simulated engines on a loopback lab, the sustained phase, teardown, store, report) with the utilisation
objective set, then the stored run read back from PostgreSQL and its results page and report rendered.

The engines' iterations all last ``decode_base_ms`` (no per-sequence or prefill cost), so each request
is in the batch for ``O x d`` and a node offered ``r`` req/s runs ``r x O x d / B`` of its slots: the
utilisation shown beside each node's throughput must be that, on the page as in the report.
"""

from __future__ import annotations

import re

import pytest

from deploybench import paths
from deploybench.store import db
from deploybench.store.models import ServerMetric
from tests.support import lab_names

pytestmark = [pytest.mark.integration, pytest.mark.quiet]

LAB = lab_names.unique("lgrun")
B, D_MS, O = 4, 10.0, 8  # 80 ms in the batch per request, 50 req/s per node at saturation
RATE = 32.0  # the cluster's load rate, offered as typed (no probe): 16 req/s per node -> 32 % of the slots


@pytest.fixture(scope="module")
def lab():
    from deploybench.lab import cluster

    inv = cluster.up(LAB, nodes=2, link_mbit=200, mode="loopback", model_mb=1)
    yield inv
    cluster.down(LAB)


@pytest.fixture
def results_db(monkeypatch):
    from tests.support import store_fixtures as fx

    dsn, _ = fx.make_database()
    monkeypatch.setenv(db.ENV_DSN, dsn)
    yield dsn
    fx.drop_database(dsn)


def test_a_run_shows_each_nodes_gpu_utilisation_beside_its_throughput(lab, results_db, tmp_path):
    from deploybench.cli.run import run_inline
    from deploybench.store import load_run
    from deploybench.store.query import table as rows_of
    from deploybench.web.markup import PHASE_COLUMNS, render_run_page

    key = f"lgrun__{tmp_path.name[-12:]}"
    conf = {"inventory": str(paths.lab_dir(LAB) / "inventory.json"), "nodes": 2, "canary_nodes": 1,
            "iperf_seconds": 1, "link_threshold": 0.1, "max_num_seqs": B, "sim_decode_base_ms": D_MS,
            "sim_decode_per_seq_ms": 0, "sim_prefill_per_token_ms": 0, "prompt_tokens": 16, "output_tokens": O,
            "load_phases": ["sustained"], "load_rate": RATE, "warmup_s": 1,
            "load_duration_s": 4, "window_s": 2, "ttft_sample_rps": 1, "scrape_interval_s": 1,
            "slo_p99_latency_ms": 2000, "slo_min_gpu_util_pct": 90}
    run_inline(key, conf)
    want = 100 * RATE / 2 * O * D_MS / 1000 / B

    stored = load_run(results_db, key)
    assert stored is not None
    load = next(s for s in stored.stages if s.stage == "load").summary["result"]
    reasons = load["phases"]["sustained"]["result"]["slo"]["reasons"]
    # the 90 % objective is not met: one reason per node, in the sustained phase's verdict
    assert not load["phases"]["sustained"]["result"]["slo_ok"]
    assert len(reasons) == 2 and all("is under the SLO's 90 %" in r for r in reasons), reasons
    html = render_run_page(stored, "/deploybench", None)
    col = PHASE_COLUMNS.index("GPU util %")
    shown = {}
    for row in re.findall(r"<tr>(.*?)</tr>", html):
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
        if cells and cells[0] == "sustained":
            shown[re.sub("<[^>]+>", "", cells[1])] = cells[col]
    print(f"\nGPU util % on the run page (sustained): {shown}; closed form {want:.1f}")
    assert set(shown) == {"cluster", *(n.name for n in lab.nodes)}, shown
    for node, text in shown.items():
        assert float(text) == pytest.approx(want, rel=0.15), (node, text, want)
    # the GPU series are in the store beside the engine's other metrics, per node
    metrics = rows_of(results_db, ServerMetric, key)
    gauges = metrics[metrics["metric"] == "DCGM_FI_DEV_GPU_UTIL"]
    assert set(gauges["node"]) == {n.name for n in lab.nodes} and set(gauges["phase"]) == {"sustained"}
    report = (paths.run_dir(key) / "report.html").read_text()
    assert "GPU utilisation per node, every phase" in report and "GPU util %" in report
