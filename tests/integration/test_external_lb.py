"""The external backend's load-balanced case: two simulated engines started outside deploybench (the
``external_engines`` fixture, conftest.py) behind a real HAProxy (roundrobin, http mode, on 127.0.0.1, started
here as a plain process), measured by the deploybench_run DAG through Airflow's dag.test() with
``target_url`` = the load balancer and ``external_endpoints`` = the engines (scraped, never loaded directly).

Asserted: the load went through the load balancer (HAProxy's own counters, read on its stats socket, count
the requests k6 sent; each engine's own request counter grew by about half of them, as HAProxy's per-server
counters say); the client-side figures are the load balancer's alone while the server figures (the engines'
histograms) and the GPU gauges are there for both nodes; the capacity found is about twice one engine's
closed-form capacity; run, phases, samples and both nodes' server-metric series are stored; the engines and
HAProxy still run afterwards (deploybench did not start them, so it must not stop them). A load-balanced URL
outside the operator's allow-list is refused at validate time.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from deploybench import http, paths
from deploybench.errors import ConfigError
from tests.support import lab_names

HAPROXY = shutil.which("haproxy") or shutil.which("/usr/sbin/haproxy")
pytestmark = [pytest.mark.integration, pytest.mark.time_limit(420)]  # a loopback lab: no root needed

LAB = lab_names.unique("lxlb")
PORT = 8044  # the engines' port on each node's address (the external_engines fixture)
LB_PORT = 8045  # HAProxy's, on 127.0.0.1
LB_URL = f"http://127.0.0.1:{LB_PORT}"
KNOBS = {"max_num_seqs": 4, "sim_decode_base_ms": 8, "sim_decode_per_seq_ms": 1, "sim_prefill_per_token_ms": 0.01}
COUNTERS = ("vllm:request_success_total", "deploybench_sim_requests_refused_total",
            "deploybench_sim_requests_failed_total")


@pytest.fixture(scope="module")
def lb(external_engines, tmp_path_factory):
    """(HAProxy's process, its stats socket) in front of the two engines; stopped after the module."""
    inv, urls, _ = external_engines
    d = tmp_path_factory.mktemp("haproxy")
    sock = d / "stats.sock"
    servers = "\n".join(f"  server {node} {url.split('://', 1)[1]}" for node, url in urls.items())
    (d / "haproxy.cfg").write_text(f"""global
  stats socket {sock} mode 600 level user
defaults
  mode http
  timeout connect 2s
  timeout client 60s
  timeout server 60s
frontend engines_lb
  bind 127.0.0.1:{LB_PORT}
  default_backend engines
backend engines
  balance roundrobin
{servers}
""")
    assert HAPROXY, "haproxy is not installed: .ci/bootstrap installs it (the Debian package haproxy)"
    with open(d / "haproxy.log", "wb") as log:
        proc = subprocess.Popen([HAPROXY, "-f", str(d / "haproxy.cfg"), "-db"], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while not (sock.exists() and http.is_up(LB_URL + "/health")):
            assert proc.poll() is None, (d / "haproxy.log").read_text()
            assert time.monotonic() < deadline, "HAProxy did not answer within 15 s"
            time.sleep(0.1)
        yield proc, sock
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _lb_stats(sock: Path) -> dict[tuple[str, str], int]:
    """HAProxy's ``show stat``: (proxy, server) -> HTTP requests counted (req_tot)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(sock))
        s.sendall(b"show stat\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, *rows = data.decode().splitlines()
    cols = head.lstrip("# ").split(",")
    out = {}
    for row in filter(None, rows):
        r = dict(zip(cols, row.split(",")))
        out[(r["pxname"], r["svname"])] = int(r["req_tot"] or 0)
    return out


def _answered(url: str) -> int:
    """The requests an engine has answered (succeeded, refused or failed), from its own /metrics."""
    from deploybench.load.scrape import parse_metrics

    status, text = http.request(url + "/metrics", timeout=5)
    assert status == 200, (url, status)
    return int(sum(v for _, _, v in parse_metrics(text, COUNTERS)))


def _conf(inv, urls: dict[str, str], **extra) -> dict:
    return {"inventory": str(paths.lab_dir(LAB) / "inventory.json"), "nodes": 2, "rollout_backend": "external",
            "external_endpoints": [f"{n}={u}" for n, u in urls.items()], "external_preflight": False,
            "target_url": LB_URL, "prompt_tokens": 32, "output_tokens": 8, **KNOBS,
            "load_phases": ["probe", "sustained"], "probe_start_rps": 30, "probe_step_s": 2, "probe_tolerance": 0.3,
            "warmup_s": 1, "load_duration_s": 3, "window_s": 1.5, "slo_p99_latency_ms": 2000,
            # no client-side TTFT sampler: every request through the LB is then one k6 sent
            "ttft_sample_rps": 0, "scrape_interval_s": 1, **extra}


def test_a_load_balancer_outside_the_allow_list_is_refused_at_validate(external_engines, monkeypatch):
    from deploybench import pipeline

    inv, urls, _ = external_engines
    monkeypatch.setenv("DEPLOYBENCH_TARGET_URLS", " ".join(urls.values()))  # the engines, not the LB
    with pytest.raises(ConfigError, match=r"target_url 'http://127.0.0.1:8045' is neither one of this run's"):
        pipeline.validate("lx-lb-bad1", _conf(inv, urls))
    assert not (paths.run_dir("lx-lb-bad1") / "run.json").exists()


def test_load_through_a_real_load_balancer_with_the_nodes_scraped(external_engines, lb, dag_test_run, monkeypatch,
                                                                   record_property):
    from sqlalchemy import text

    from deploybench import params as form
    from deploybench.sim.service_model import ServiceParams, capacity
    from deploybench.store import count_samples, load_run
    from deploybench.store.db import open_store

    inv, urls, procs = external_engines
    haproxy, sock = lb
    nodes = sorted(urls)
    monkeypatch.setenv("DEPLOYBENCH_TARGET_URLS", ",".join([*urls.values(), LB_URL]))
    lb_before, eng_before = _lb_stats(sock), {n: _answered(u) for n, u in urls.items()}

    conf = _conf(inv, urls)
    _, key, stages = dag_test_run(conf)

    # deploybench started neither the engines nor the load balancer, so it stopped neither
    assert all(p.poll() is None for p in procs) and haproxy.poll() is None
    assert all(http.is_up(u + "/health") for u in urls.values()) and http.is_up(LB_URL + "/health")

    # the load went through HAProxy: its counters hold every request k6 sent, split between the two engines
    lb_after, eng_after = _lb_stats(sock), {n: _answered(u) for n, u in urls.items()}
    through = lb_after[("engines_lb", "FRONTEND")] - lb_before[("engines_lb", "FRONTEND")]
    per_server = {n: lb_after[("engines", n)] - lb_before[("engines", n)] for n in nodes}
    per_engine = {n: eng_after[n] - eng_before[n] for n in nodes}
    summaries = sorted(paths.run_dir(key).rglob("*.k6-summary.json"))
    k6_sent = sum(int(json.loads(p.read_text())["metrics"]["http_reqs"]["count"]) for p in summaries)
    for name, value in (("k6_sent", k6_sent), ("through_lb", through), ("per_server", per_server),
                        ("per_engine", per_engine)):
        record_property(name, value)  # the measured figures, in --junitxml
    assert len(summaries) >= 3 and k6_sent > 100, (summaries, k6_sent)
    assert k6_sent <= through <= k6_sent + max(10, 0.02 * k6_sent), (through, k6_sent)
    assert sum(per_server.values()) == through, (per_server, through)
    for n in nodes:
        # HAProxy's server n is engine n; a request k6 cut off at the end of a run reached the engine but was
        # abandoned there (measured: 2-3 per engine over a run), so the engine counts at most what HAProxy forwarded
        assert 0 <= per_server[n] - per_engine[n] <= 0.02 * per_server[n] + 2, (per_engine, per_server)
        assert abs(per_engine[n] - through / 2) <= 0.05 * through + 2, (per_engine, through)

    res = stages["load"]["result"]
    # the client saw one endpoint, the load balancer; the servers' own figures and GPU gauges are per node
    assert [f["node"] for f in res["nodes"]] == ["lb"]
    for phase in ("probe", "sustained"):
        ph = res["phases"][phase]["result"]
        assert sorted(ph["engine"]) == nodes, ph["engine"]
        for n in nodes:
            assert ph["engine"][n]["scrapes"] >= 2 and ph["engine"][n]["e2e_count"] > 0, (phase, n, ph["engine"][n])
            g = ph["gpu"][n]
            assert g["source"] == "dcgm" and g["samples"] > 0 and g["util_max_pct"] > 0, (phase, n, g)
        assert "lb" not in ph["gpu"] and "lb" not in ph["engine"]

    cfg = form.to_config(conf)
    truth = capacity(ServiceParams.from_config(cfg.engine), 32, 8).requests_per_s * 2
    cap = res["capacity"]["capacity_rps"]
    record_property("capacity_over_2x_closed_form", round(cap / truth, 3))
    assert 0.6 * truth <= cap <= 1.1 * truth, (cap, truth)
    assert res["phase"] == "sustained" and res["offered_rps"] == pytest.approx(0.8 * cap)

    stored = load_run(None, key)
    assert stored.run.status == "success"
    assert {p.phase for p in stored.phases if p.node == "*"} == {"probe", "sustained"}
    assert {p.node for p in stored.phases if p.node != "*"} == {"lb"}
    for phase in ("probe", "sustained"):
        assert count_samples(None, key, phase) > 0
    with open_store(None).connect() as conn:
        scraped = set(conn.execute(text(
            "SELECT DISTINCT node FROM server_metrics WHERE run_key = :k AND metric = 'DCGM_FI_DEV_GPU_UTIL'"),
            {"k": key}).scalars())
    assert scraped == set(nodes), scraped
