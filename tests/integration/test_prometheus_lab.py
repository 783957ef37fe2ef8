"""Prometheus as a source, on a netns lab with the real Prometheus and node exporters (Debian's packages).

A whole run (``run_inline``: preflight, fan-out, rollout of two simulated engines, a short sustained phase,
teardown, store, report) with the lab's Prometheus as the run's source, remote write allowed. What the store then
holds per node for the window is checked against what the node exporter and the engine served:

- GPU power against the simulated engine's closed form of its own utilisation, series by series as Prometheus
  scraped them (power = IDLE_W + (BUSY_W - IDLE_W) x util: the same page, the same scrape), the SM clock against
  its constant, and utilisation against deploybench's own scrape of the same page (within what one scrape
  interval of offset can move a mean);
- the network receive rate against the node exporter's own counter, read raw from Prometheus (first and last
  sample of the window: the rate over the window within a scrape interval at each end);
- k6's own series (k6_http_reqs_total) arrived in Prometheus by remote write.

Then Prometheus is stopped while a second run's load phase runs: the run completes, and each Prometheus figure is
absent with the reason, beside the scraped ones, in the store, the report and the run page.
"""

from __future__ import annotations

import shutil
import threading
import time
from datetime import timedelta

import pytest

from deploybench import http, paths
from deploybench.store import db
from tests.support import lab_names

pytestmark = [pytest.mark.integration, pytest.mark.netns, pytest.mark.time_limit(170)]

LAB = lab_names.unique("lprom")
NODES = 2
B, D_MS, OUT = 4, 10.0, 8  # every request 80 ms in the batch
RATE = 20.0  # 10 req/s per node: 100 x 10 x 0.08 / 4 = 20 % of the slots busy (the engine's closed form)


def _prom_installed() -> bool:
    exporter = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    return bool(shutil.which("prometheus") and exporter)


@pytest.fixture(scope="module")
def lab():
    import os

    from deploybench.lab import cluster

    if os.geteuid() != 0:
        pytest.skip("netns lab needs root")
    if not _prom_installed():
        pytest.skip("apt-get install prometheus prometheus-node-exporter (.ci/bootstrap test)")
    inv = cluster.up(LAB, nodes=NODES, link_mbit=200, mode="netns", model_mb=1)
    yield inv
    cluster.down(LAB)
    from deploybench.lab import netns
    from deploybench.lab.state import LabFiles

    # nothing of the lab's telemetry is left running
    assert not netns.pids_mentioning(f"{LabFiles(LAB).root}/")


@pytest.fixture
def results_db(monkeypatch):
    from tests.support import store_fixtures as fx

    dsn, _ = fx.make_database()
    monkeypatch.setenv(db.ENV_DSN, dsn)
    yield dsn
    fx.drop_database(dsn)


def _conf(rate: float = RATE) -> dict:
    return {"inventory": str(paths.lab_dir(LAB) / "inventory.json"), "nodes": NODES, "canary_nodes": 1,
            "iperf_seconds": 1, "link_threshold": 0.1, "max_num_seqs": B, "sim_decode_base_ms": D_MS,
            "sim_decode_per_seq_ms": 0, "sim_prefill_per_token_ms": 0, "prompt_tokens": 16, "output_tokens": OUT,
            "load_phases": ["sustained"], "load_rate": rate, "warmup_s": 1, "load_duration_s": 6, "window_s": 3,
            "ttft_sample_rps": 1, "scrape_interval_s": 1, "slo_p99_latency_ms": 3000}


def _rows(stored, node: str, source: str) -> dict:
    return {w.metric: w for w in stored.node_windows if w.node == node and w.source == source}


def _raw(url: str, query: str, start: float, end: float) -> list[tuple[float, float]]:
    from urllib.parse import urlencode

    got = http.get_json(f"{url}/api/v1/query_range?" + urlencode(
        {"query": query, "start": start, "end": end, "step": "1s"}), timeout=5)
    result = got["data"]["result"]
    assert len(result) == 1, (query, result)
    return [(float(t), float(v)) for t, v in result[0]["values"]]


def test_a_run_reads_each_nodes_figures_from_the_labs_prometheus(lab, results_db, tmp_path):
    from deploybench.cli.run import run_inline
    from deploybench.load.prom import PromSource
    from deploybench.run import Run
    from deploybench.sim.metrics import BUSY_W, IDLE_W, SM_CLOCK_MHZ
    from deploybench.store import load_run
    from deploybench.web.markup import render_run_page

    url = lab.lab["prometheus"]
    key = f"lprom__{tmp_path.name[-12:]}"
    run_inline(key, _conf(), prometheus=PromSource(url=url, remote_write=True))

    stored = load_run(results_db, key)
    assert stored is not None and stored.run.status == "success", stored.run.status if stored else None
    res = Run.open(key).load_result().headline()
    start = res.started_at.timestamp()
    end = (res.started_at + timedelta(seconds=res.duration_s)).timestamp()
    for node in lab.nodes:
        got, scraped = _rows(stored, node.name, "prometheus"), _rows(stored, node.name, "scrape")
        print(f"\n{node.name}: " + ", ".join(f"{k} {w.mean} (n={w.samples})" for k, w in sorted(got.items()))
              + "; scraped: " + ", ".join(f"{k} {w.mean} (n={w.samples})" for k, w in sorted(scraped.items())))
        for k in ("cpu_busy_pct", "mem_used_bytes", "net_rx_bytes_per_s", "net_tx_bytes_per_s", "gpu_util_pct",
                  "gpu_power_w", "gpu_sm_clock_mhz", "gpu_temp_c", "engine_running", "engine_kv_usage"):
            assert got[k].mean is not None and got[k].samples >= 4, (k, got[k])
        # a clean engine exports its throttle reasons as 0 (no fault knob on this lab): read as 0, every sample
        assert got["gpu_throttle_reasons"].max == 0 and got["gpu_throttle_reasons"].samples >= 4
        assert 0 <= got["cpu_busy_pct"].mean <= 100 and got["mem_used_bytes"].mean > 0
        # power is the engine's closed form of its utilisation, sample by sample (3 decimals exported)
        want_w = IDLE_W + (BUSY_W - IDLE_W) * got["gpu_util_pct"].mean / 100
        assert got["gpu_power_w"].mean == pytest.approx(want_w, abs=0.01)
        assert got["gpu_sm_clock_mhz"].mean == SM_CLOCK_MHZ == got["gpu_sm_clock_mhz"].max
        # the same page, scraped by deploybench and by Prometheus at offsets of up to one interval: each sample of
        # a mean over ~6 may differ by what one interval moves the (windowed) gauge
        util_p, util_s = got["gpu_util_pct"].mean, scraped["gpu_util_pct"].mean
        assert util_s is not None
        assert util_p == pytest.approx(util_s, rel=0.2), (node.name, util_p, util_s)
        # under load (the closed form: 20 %; not compared here: a busy machine stretches the batches, which is the
        # speed test_load_gpu_run compares, alone)
        assert util_p > 5, (node.name, util_p)
        # the network: the node exporter's own counter of the node's eth0, raw from Prometheus, first to last
        raw = _raw(url, f'node_network_receive_bytes_total{{device="eth0",instance="{node.address}:9100"}}',
                   start, end)
        (t0, b0), (t1, b1) = raw[0], raw[-1]
        counted = (b1 - b0) / (t1 - t0)
        assert counted > 0
        # rate() over 4 s ranges reaches back up to 4 s before the window: within a few intervals' traffic
        assert got["net_rx_bytes_per_s"].mean == pytest.approx(counted, rel=0.5), (got["net_rx_bytes_per_s"], counted)
    # k6's own metrics arrived by remote write
    k6 = http.get_json(f"{url}/api/v1/query?query=k6_http_reqs_total", timeout=5)["data"]["result"]
    assert k6 and sum(float(s["value"][1]) for s in k6) > 0, k6
    html = render_run_page(stored, "/deploybench", None)
    report = (paths.run_dir(key) / "report.html").read_text()
    for text in (html, report):
        assert "Node figures per window, by source" in text and "prometheus" in text and "scrape" in text


def test_prometheus_stopped_mid_run_leaves_its_figures_absent_with_the_reason(lab, results_db, tmp_path):
    from deploybench.cli.run import run_inline
    from deploybench.lab import cluster
    from deploybench.store import load_run
    from deploybench.web.markup import render_run_page

    url = lab.lab["prometheus"]
    key = f"lprom__{tmp_path.name[-12:]}"
    log = paths.run_dir(key) / "load" / "sustained.k6.log"
    stopped = threading.Event()

    def stop_when_loading() -> None:
        deadline = time.monotonic() + 120
        while not log.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        cluster.stop_prometheus(LAB)
        stopped.set()

    t = threading.Thread(target=stop_when_loading, daemon=True)
    t.start()
    run_inline(key, _conf(), prometheus=url)
    t.join(10)
    assert stopped.is_set() and not http.is_up(f"{url}/-/ready")
    stored = load_run(results_db, key)
    assert stored is not None and stored.run.status == "success"
    for node in lab.nodes:
        got, scraped = _rows(stored, node.name, "prometheus"), _rows(stored, node.name, "scrape")
        assert got and all(w.mean is None and w.max is None and w.samples == 0 for w in got.values()), got
        assert all(f"prometheus at {url} did not answer" in (w.reason or "") for w in got.values())
        # deploybench's own scrape went on: its figures are there
        assert scraped["gpu_util_pct"].mean is not None and scraped["engine_running"].max is not None
    html = render_run_page(stored, "/deploybench", None)
    report = (paths.run_dir(key) / "report.html").read_text()
    for text in (html, report):
        assert "did not answer" in text and "absent" in text
