"""GPU figures of the load stage (deploybench.load.gpu) and the simulated engine's DCGM gauges
(deploybench.sim.metrics): nvidia-smi's output read strictly, absent figures absent, the
utilisation objective, the occupancy integral against its closed form, and the three sources for
real (a DCGM exporter page over loopback HTTP, nvidia-smi run through the local transport)."""

from __future__ import annotations

import http.server
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from deploybench.config import SLO
from deploybench.inventory import Node
from deploybench.load import Endpoint, gpu
from deploybench.load.results import GpuFigures
from deploybench.sim import metrics as em
from deploybench.sim.service_model import Sequence
from deploybench.transport import LocalTransport

T0 = datetime(2026, 1, 1, tzinfo=UTC)


# -- nvidia-smi, read strictly ------------------------------------------------------------------------
def test_parse_smi_reads_every_gpu_and_keeps_na_absent():
    rows = gpu.parse_smi("87, 61234, 81559, 243.17\n 3 ,512,81559,71.5\n\n[N/A], [N/A], [N/A], [N/A]\n"
                         "40, [N/A], [N/A], [Not Supported]\n")
    assert rows == [(87.0, 61234.0, 81559.0, 243.17), (3.0, 512.0, 81559.0, 71.5), (None, None, None, None),
                    (40.0, None, None, None)]
    pts = gpu.smi_points("50, 100, 400, 99.5\n", {"ts": T0.isoformat(), "node": "n1", "phase": "p", "step": 0})
    assert {(p["metric"], p["value"]) for p in pts} == {(gpu.UTIL, 50.0), (gpu.FB_USED, 100.0), (gpu.FB_FREE, 300.0),
                                                        (gpu.POWER, 99.5)}
    assert all(p["labels"] == {"gpu": "0", "source": "nvidia-smi"} for p in pts)
    # power not available: no power point, not a 0 W one
    pts = gpu.smi_points("50, 100, 400, [N/A]\n", {"ts": T0.isoformat(), "node": "n1", "phase": "p", "step": 0})
    assert gpu.POWER not in {p["metric"] for p in pts} and len(pts) == 3
    assert gpu.SMI_COMMAND[1] == "--query-gpu=utilization.gpu,memory.used,memory.total,power.draw"


@pytest.mark.parametrize("text, words", [
    ("", "no GPU"),
    ("87, 100\n", "2 columns"),
    ("87, 100, 200\n", "3 columns, expected 4"),  # an nvidia-smi that ignored the power column
    ("87, 100, 200, 5, 6\n", "5 columns"),
    ("87 %, 100, 200, 5\n", "not a number"),
    ("101, 100, 200, 5\n", r"outside \[0, 100\]"),
    ("-1, 100, 200, 5\n", "outside"),
    ("nan, 100, 200, 5\n", "outside"),
    ("50, 300, 200, 5\n", "above memory.total"),
    ("50, 100, 200, 5; rm -rf /\n", "not a number"),
    ("50, 1e30, 2e30, 5\n", "outside"),
    ("1, 1, 1, 1\n" * 65, "more than 64 GPUs"),
    # the power column, hostile: units left in, negative, past any GPU, NaN, infinity, a number in hex
    ("50, 100, 200, 243.17 W\n", "power.draw '243.17 W' is not a number"),
    ("50, 100, 200, -3\n", r"power.draw '-3' is outside \[0, 5000\]"),
    ("50, 100, 200, 1e9\n", r"power.draw '1e9' is outside \[0, 5000\]"),
    ("50, 100, 200, NaN\n", "power.draw 'NaN' is outside"),
    ("50, 100, 200, inf\n", "power.draw 'inf' is outside"),
    ("50, 100, 200, 0x40\n", "power.draw '0x40' is not a number"),
])
def test_parse_smi_refuses_what_was_not_asked_for(text, words):
    with pytest.raises(gpu.GpuReadError, match=words):
        gpu.parse_smi(text)


def test_out_of_range_gpu_readings_are_left_out_of_the_figures_with_a_warning(caplog):
    """Whatever the source, a reading outside its range is never averaged in: NaN and infinities do not even
    become points (the parser keeps finite values only), 250 % and -5 MiB are left out by gpu_figures."""
    page = ('DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="x"} 42\nDCGM_FI_DEV_GPU_UTIL{gpu="1"} 250\n'
            'DCGM_FI_DEV_GPU_UTIL{gpu="2"} NaN\nDCGM_FI_DEV_FB_USED{gpu="0"} -5\nDCGM_FI_DEV_FB_USED{gpu="1"} +Inf\n'
            'DCGM_FI_DEV_FB_FREE{gpu="0"} 1000\nDCGM_FI_DEV_SM_CLOCK 1500\n')
    base = {"ts": (T0 + timedelta(seconds=1)).isoformat(), "node": "n1", "phase": "p", "step": 0}
    pts = gpu.dcgm_points(page, base, "dcgm-exporter")
    assert [(p["metric"], p["labels"]["gpu"], p["value"]) for p in pts] == [
        (gpu.UTIL, "0", 42.0), (gpu.UTIL, "1", 250.0), (gpu.FB_USED, "0", -5.0), (gpu.FB_FREE, "0", 1000.0),
        (gpu.SM_CLOCK, "0", 1500.0)]  # the SM clock is kept too since the findings (issue 29)
    bad = [{**base, "node": "n2", "metric": gpu.UTIL, "labels": {"gpu": "0"}, "value": v} for v in (1e9, -1.0)]
    with caplog.at_level("WARNING", "deploybench"):
        figs = gpu.gpu_figures(pts + bad, ["n1", "n2"], T0, T0 + timedelta(seconds=2))
    assert figs["n1"].util_mean_pct == 42.0 and figs["n1"].gpus == 1  # GPU 1's 250 % left out, not averaged in
    assert figs["n1"].mem_used_mib_mean is None and figs["n1"].mem_total_mib is None  # -5 MiB: absent, not 0
    assert figs["n1"].sm_clock_mhz_mean == 1500.0 and figs["n1"].throttle_reasons is None  # reasons not reported
    assert figs["n2"].source is None and figs["n2"].util_mean_pct is None
    assert "outside their range" in figs["n2"].reason and "e.g. 1e+09" in figs["n2"].reason
    assert "not measured" in gpu.gpu_verdict(figs, SLO(min_gpu_util_pct=10))[0]  # n2: not measured, not met
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "node n1: GPU readings outside their range" in warned and "1 of DCGM_FI_DEV_FB_USED (e.g. -5)" in warned


def test_a_utilisation_that_is_no_number_never_meets_the_objective():
    for util in (float("nan"), float("inf"), 1e9, -3.0):
        reasons = gpu.gpu_verdict({"n1": GpuFigures(source="dcgm", samples=3, util_mean_pct=util)},
                                  SLO(min_gpu_util_pct=50))
        assert len(reasons) == 1 and "node n1: GPU utilisation not measured" in reasons[0], util


# -- figures and verdict ----------------------------------------------------------------------------------
def _pt(t: float, node: str, metric: str, value: float, g: str = "0", **labels) -> dict:
    return {"ts": (T0 + timedelta(seconds=t)).isoformat(), "node": node, "phase": "p", "step": 0, "metric": metric,
            "labels": {"gpu": g, **labels}, "value": value}


def test_gpu_figures_per_node_in_the_window_and_absent_nodes_absent():
    pts = [_pt(0.5, "n1", gpu.UTIL, 99.0)]  # before the window: left out
    for t, (u0, u1) in enumerate([(60, 80), (70, 90), (80, 100)], start=1):
        pts += [_pt(t, "n1", gpu.UTIL, u0, "0"), _pt(t, "n1", gpu.UTIL, u1, "1"),
                _pt(t, "n1", gpu.FB_USED, 100 * t, "0"), _pt(t, "n1", gpu.FB_USED, 100, "1"),
                _pt(t, "n1", gpu.FB_FREE, 1000 - 100 * t, "0"), _pt(t, "n1", gpu.FB_FREE, 900, "1")]
    figs = gpu.gpu_figures(pts, ["n1", "n2"], T0 + timedelta(seconds=0.9), T0 + timedelta(seconds=3),
                           {"n2": "no DCGM_FI_DEV_GPU_UTIL in its /metrics"})
    n1, n2 = figs["n1"], figs["n2"]
    assert n1.source == "dcgm" and n1.gpus == 2 and n1.samples == 3
    assert n1.util_mean_pct == 80.0 and n1.util_min_pct == 70.0 and n1.util_max_pct == 90.0  # per-sample GPU means
    assert n1.mem_used_mib_mean == 300.0 and n1.mem_used_mib_max == 400.0 and n1.mem_total_mib == 2000.0
    assert n2.source is None and n2.util_mean_pct is None and "no DCGM" in n2.reason  # absent, not 0


def test_utilisation_objective_is_optional_and_names_each_node():
    figs = {"n1": GpuFigures(source="dcgm", samples=5, util_mean_pct=85.0),
            "n2": GpuFigures(source="dcgm", samples=5, util_mean_pct=62.5),
            "n3": GpuFigures(reason="no transport to run nvidia-smi over")}
    assert gpu.gpu_verdict(figs, SLO()) == []  # null: not judged
    reasons = gpu.gpu_verdict(figs, SLO(min_gpu_util_pct=80))
    assert len(reasons) == 2 and "node n2: GPU utilisation 62.5 %" in reasons[0] and "80 %" in reasons[0]
    assert "node n3: GPU utilisation not measured (no transport" in reasons[1]
    assert gpu.gpu_verdict({k: v for k, v in figs.items() if k == "n1"}, SLO(min_gpu_util_pct=80)) == []
    assert "not measured" in gpu.gpu_verdict({}, SLO(min_gpu_util_pct=10))[0]


# -- the simulated engine's gauges: the closed form ----------------------------------------------------------
def test_occupancy_is_the_time_average_of_running_over_the_window():
    occ = em.Occupancy(100.0)
    for t, n in [(100.0, 2), (100.4, 4), (100.9, 0), (101.2, 8)]:
        occ.set(n, t)
    # slot-seconds: 2 x 0.4 + 4 x 0.5 + 0 x 0.3 + 8 x 0.3 at t = 101.5
    assert occ.area(101.5) == pytest.approx(0.8 + 2.0 + 2.4)
    assert occ.mean(101.5, 1.0) == pytest.approx((4 * 0.4 + 0 + 8 * 0.3) / 1.0)  # over [100.5, 101.5]
    assert occ.mean(100.2, 1.0) == pytest.approx(2.0)  # younger than the window: since the start


def test_sim_gauges_follow_batch_occupancy_and_kv_tokens():
    m = em.EngineMetrics("m", slots=4, model_bytes=64 * 2**20)
    t = m.occupancy.t0
    running = [Sequence(100, 10), Sequence(60, 10)]
    running[1].generated = 20
    m.batch(running, waiting=0, now=t + 0.5)  # idle for half a second, then 2 of 4 slots
    text = "\n".join(m.gpu_lines(now=t + 1.5))
    pts = {p["metric"]: p["value"] for p in gpu.dcgm_points(text, {"ts": "", "node": "n", "phase": "", "step": 0})}
    assert pts[gpu.UTIL] == pytest.approx(100 * 2 / 4, abs=0.01)  # the last second: 2 running all along
    used = round(64 + em.KV_MIB_PER_TOKEN * (100 + 60 + 20))
    assert pts[gpu.FB_USED] == used and pts[gpu.FB_FREE] == em.GPU_MEMORY_MIB - used
    assert f"deploybench_sim_busy_slot_seconds_total{{{m.labels}}} 2.000000" in text
    m.batch([], waiting=0, now=t + 1.5)
    idle = {p["metric"]: p["value"] for p in gpu.dcgm_points("\n".join(m.gpu_lines(now=t + 3.0)),
                                                            {"ts": "", "node": "n", "phase": "", "step": 0})}
    assert idle[gpu.UTIL] == 0.0 and idle[gpu.FB_USED] == 64  # the model alone
    # power follows the same utilisation; the energy counter is its exact integral (mJ): idle for 0.5 s, 2 of 4
    # slots for 1 s, idle for 1.5 s
    assert pts[gpu.POWER] == pytest.approx(em.IDLE_W + (em.BUSY_W - em.IDLE_W) * 0.5, abs=0.01)
    assert idle[gpu.POWER] == em.IDLE_W
    want_mj = 1000 * (em.IDLE_W * 3.0 + (em.BUSY_W - em.IDLE_W) * 2.0 / 4)
    assert idle[gpu.ENERGY] == pytest.approx(want_mj, abs=1)


def test_power_and_energy_of_the_engines_gpus_from_the_counter_else_the_gauge():
    """Issue 29 (part): the energy counter's increase over its samples in the window is the power (exact whatever
    happened between samples); a counter that went down (a driver reload) is no reading and the power gauge is
    used; only the engine's GPUs count; the energy of the window is that power x the window."""
    def page(t: float, energy: dict[int, float], power: float) -> list[dict]:
        base = {"ts": (T0 + timedelta(seconds=t)).isoformat(), "node": "n1", "phase": "p", "step": 0}
        text = "".join(f'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{gpu="{g}"}} {mj}\nDCGM_FI_DEV_POWER_USAGE{{gpu="{g}"}} '
                       f'{power}\nDCGM_FI_DEV_GPU_UTIL{{gpu="{g}"}} 50\n' for g, mj in energy.items())
        return gpu.dcgm_points(text, base, "dcgm-exporter")

    pts = page(1, {0: 1_000_000, 1: 5_000_000}, 300) + page(3, {0: 2_000_000, 1: 5_200_000}, 310)
    figs = gpu.gpu_figures(pts, ["n1"], T0, T0 + timedelta(seconds=10))
    # GPU 0: 1000 J in 2 s = 500 W; GPU 1: 200 J in 2 s = 100 W
    assert figs["n1"].power_mean_w == 600.0 and figs["n1"].power_source == "energy counter"
    assert figs["n1"].energy_j == 6000.0  # 600 W x the 10 s window
    one = gpu.gpu_figures(pts, ["n1"], T0, T0 + timedelta(seconds=10),
                          engines={"n1": Endpoint("n1", "http://h:1", "m", gpus=("1",))})
    assert one["n1"].power_mean_w == 100.0
    reset = page(1, {0: 9_000_000}, 300) + page(3, {0: 1_000}, 320)
    figs = gpu.gpu_figures(reset, ["n1"], T0, T0 + timedelta(seconds=10))
    assert figs["n1"].power_mean_w == 310.0 and figs["n1"].power_source == "power gauge"
    none = gpu.gpu_figures(page(1, {}, 0) + [], ["n1"], T0, T0 + timedelta(seconds=10))
    assert none["n1"].power_mean_w is None and none["n1"].energy_j is None


# -- the sources, for real: an exporter over HTTP, nvidia-smi through the transport ----------------------------
@pytest.fixture
def exporter():
    """A DCGM exporter stand-in on loopback serving a fixed page (its port)."""
    page = b'DCGM_FI_DEV_GPU_UTIL{gpu="0"} 73\nDCGM_FI_DEV_FB_USED{gpu="0"} 2048\nDCGM_FI_DEV_FB_FREE{gpu="0"} 6144\n'

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(page if self.path == "/metrics" else b"")

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


def _closed_port() -> int:
    from deploybench.sim.local import free_port

    return free_port()


def _fake_smi(tmp_path: Path, monkeypatch, body: str) -> None:
    """An ``nvidia-smi`` (a shell script printing ``body``'s output) first on PATH: this machine has no GPU."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n" + body)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")


def test_sampler_takes_the_exporter_then_nvidia_smi_else_absent(exporter, tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, "[ \"$1\" = --query-gpu=utilization.gpu,memory.used,memory.total,power.draw ] "
                                     "|| exit 9\necho '41, 1000, 4000, 60.25'\necho '59, 3000, 4000, [N/A]'\n")
    dead = f"http://127.0.0.1:{_closed_port()}"
    eps = [Endpoint("a", dead, "m"), Endpoint("b", dead, "m"), Endpoint("c", dead, "m")]
    local_b = {"b": LocalTransport(Node(name="b", address="127.0.0.1", link_mbit=1000))}
    sampler = gpu.GpuSampler(eps, 0.2, "sustained", transports=local_b, dcgm_port=exporter)
    t0 = datetime.now(UTC)
    sampler.start()
    assert sampler.plan == {"a": "dcgm-exporter", "b": "dcgm-exporter", "c": "dcgm-exporter"}  # one exporter for all
    sampler.stop()
    local_b = {"b": LocalTransport(Node(name="b", address="127.0.0.1", link_mbit=1000))}
    sampler = gpu.GpuSampler(eps, 0.2, "sustained", transports=local_b, dcgm_port=_closed_port())
    sampler.start()
    import time

    time.sleep(0.5)
    pts = sampler.stop()
    assert sampler.plan == {"a": "absent", "b": "nvidia-smi", "c": "absent"}
    figs = gpu.gpu_figures(pts, ["a", "b", "c"], t0, datetime.now(UTC), sampler.why)
    assert figs["b"].source == "nvidia-smi" and figs["b"].gpus == 2 and figs["b"].util_mean_pct == 50.0
    assert figs["b"].mem_used_mib_mean == 4000.0 and figs["b"].mem_total_mib == 8000.0 and figs["b"].samples >= 2
    # power: only GPU 0 has it (GPU 1 printed [N/A]): the node's power is absent, not GPU 0's with 0 W for GPU 1
    assert figs["b"].power_mean_w is None and figs["b"].energy_j is None and figs["b"].power_source is None
    assert figs["a"].source is None and "no transport to run nvidia-smi" in figs["a"].reason
    # a plan made before (the first step of a probe) is kept: no node is asked again
    again = gpu.GpuSampler(eps[:1], 0.2, "probe", 2, dcgm_port=exporter, plan={"a": "absent"},
                           why={"a": "chosen at step 1"}).start()
    assert again.stop() == [] and again.plan == {"a": "absent"} and again.why == {"a": "chosen at step 1"}


def test_a_page_past_the_bound_is_refused_and_the_node_absent(exporter, monkeypatch, caplog):
    """The exporter's page (100 bytes here) over the scraper's bound: not a GPU source, with a warning."""
    from deploybench.load import scrape

    monkeypatch.setattr(scrape, "MAX_PAGE_BYTES", 64)
    with pytest.raises(scrape.MetricsPageError, match="over the 64-byte bound"):
        scrape.get_page(f"http://127.0.0.1:{exporter}/metrics", 2.0)
    ep = Endpoint("a", f"http://127.0.0.1:{_closed_port()}", "m")
    with caplog.at_level("WARNING", "deploybench"):
        sampler = gpu.GpuSampler([ep], 0.2, "p", dcgm_port=exporter).start()
    assert sampler.stop() == [] and sampler.plan == {"a": "absent"}
    assert any(f"127.0.0.1:{exporter}/metrics: not taken as a GPU source" in r.getMessage() for r in caplog.records)


def test_sampler_reports_hostile_nvidia_smi_output_as_absent(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, "echo '<html>pwned</html>'\n")
    ep = Endpoint("b", f"http://127.0.0.1:{_closed_port()}", "m")
    t0 = datetime.now(UTC)
    sampler = gpu.GpuSampler([ep], 0.2, "p",
                             transports={"b": LocalTransport(Node(name="b", address="127.0.0.1", link_mbit=1000))},
                             dcgm_port=None).start()
    pts = sampler.stop()
    figs = gpu.gpu_figures(pts, ["b"], t0, datetime.now(UTC), sampler.why)
    assert pts == [] and figs["b"].source is None
    assert figs["b"].util_mean_pct is None and "nvidia-smi" in figs["b"].reason and "columns" in figs["b"].reason


def test_a_node_without_nvidia_smi_is_absent_from_the_start_and_not_polled(tmp_path, monkeypatch):
    """The run's transports reach every node; one without a GPU (or nvidia-smi) is chosen absent once,
    with the reason, instead of being asked again every interval."""
    empty = tmp_path / "nobin"
    empty.mkdir()
    monkeypatch.setenv("PATH", f"{empty}:/usr/bin:/bin")
    ep = Endpoint("b", f"http://127.0.0.1:{_closed_port()}", "m")
    sampler = gpu.GpuSampler([ep], 0.2, "p", transports={"b": LocalTransport(Node(name="b", address="127.0.0.1",
                                                                                   link_mbit=1000))},
                             dcgm_port=None).start()
    assert sampler.plan == {"b": "absent"} and sampler._thread is None
    assert sampler.stop() == [] and "nvidia-smi exited 127" in sampler.why["b"]


class _BarrierSmi:
    """A node's transport whose nvidia-smi answers only once every node of the poll has asked (a barrier of all of
    them): polled one after the other, the first would wait alone and break it."""

    def __init__(self, barrier: threading.Barrier):
        self.barrier = barrier

    def run(self, argv, timeout=None):
        from types import SimpleNamespace

        self.barrier.wait()
        return SimpleNamespace(rc=0, stdout="41, 1000, 4000, 60.25\n", stderr="")


def test_the_nodes_of_one_poll_are_asked_at_once():
    """16 nodes over SSH asked one after the other would stretch a 1-s interval by 16 sessions: each poll asks
    every node at once, so one slow node delays none of the others."""
    nodes = ["a", "b", "c", "d"]
    barrier = threading.Barrier(len(nodes), timeout=10)
    eps = [Endpoint(n, f"http://127.0.0.1:{_closed_port()}", "m") for n in nodes]
    sampler = gpu.GpuSampler(eps, 60.0, "p", transports={n: _BarrierSmi(barrier) for n in nodes}, dcgm_port=None,
                             plan=dict.fromkeys(nodes, "nvidia-smi"))
    pts = sampler.start().stop()  # the first poll, and the last one at stop
    assert sampler.why == {} and not barrier.broken
    assert sorted(p["node"] for p in pts if p["metric"] == gpu.UTIL) == sorted(nodes * 2)


@pytest.mark.parametrize(("poll_s", "asked", "after_start"), [
    (0.125, [0.5, 1.0, 1.5, 2.0], [0.5, 1.0, 1.5, 2.0]),
    (0.75, [0.5, 1.5, 2.5, 3.5], [1.0, 2.0, 3.0, 4.0])])  # start()'s own poll overran 0.5: the loop's first is at 1.0
def test_the_sampler_polls_on_a_fixed_cadence_whatever_a_poll_takes(monkeypatch, poll_s, asked, after_start):
    """Polls at k x interval from the start, as Prometheus scrapes, on a clock the test moves: a poll of 0.125 s
    does not push the next one 0.125 s later (waiting the interval after each poll gave 0.5, 1.125, 1.75, ...), and
    one that overran its 0.5-s interval skips the tick it missed instead of bunching the next polls behind it."""
    from types import SimpleNamespace

    clock = [0.0]
    monkeypatch.setattr(gpu, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    sampler = gpu.GpuSampler([Endpoint("a", "http://127.0.0.1:1", "m")], 0.5, "p", plan={"a": "nvidia-smi"})
    got: list[float] = []

    class Stop:  # the sampler's stop event: each wait moves the clock by its timeout; stopped after 4 polls
        def wait(self, timeout):
            assert timeout >= 0
            clock[0] += timeout
            return len(got) >= len(asked)

    def poll():
        got.append(clock[0])
        clock[0] += poll_s

    monkeypatch.setattr(sampler, "_stop", Stop())
    monkeypatch.setattr(sampler, "poll_once", poll)
    sampler._loop()
    assert got == asked
    # counted from the first poll's start (start() polls once before the loop): that poll's length is not added
    got.clear()
    clock[0] = 10.0
    sampler._t0 = 10.0 - poll_s  # start() began its first poll poll_s ago
    sampler._loop()
    assert got == [10.0 - poll_s + t for t in after_start]


# -- shown beside the throughput: the run report and the results pages ------------------------------------------
def _load_stage(tmp_path: Path) -> dict:
    """The load stage's result as the pipeline writes it, with GPU figures: n1 measured, n2 absent (and why)."""
    from tests.support.load_records import write_load_stage

    data = write_load_stage(tmp_path / "load", "s.csv")
    sustained = data["phases"]["sustained"]["result"]
    for node, util, mem in zip(sustained["nodes"], (83.5, None), (900.0, None), strict=True):
        node.update(gpu_util_pct=util, gpu_mem_used_mib=mem)
    gpu = {"n1": {"source": "dcgm", "util_mean_pct": 83.5, "mem_used_mib_mean": 900.0, "samples": 5},
           "n2": {"source": None, "reason": "no transport to run nvidia-smi over"}}
    sustained.update(gpu_util_pct=83.5, gpu=gpu)
    data.update(gpu_util_pct=83.5, gpu=gpu, nodes=sustained["nodes"])  # the headline: sustained's LoadResult
    for steps in (data["capacity"]["steps"], data["phases"]["probe"]["analysis"]["steps"]):
        steps[0].update(kind="ramp", rate_from=1.0, passed=False, gpu_util_pct=12.25, reasons=["scout ramp"])
    return data


def test_report_shows_utilisation_per_node_and_phase_and_absent_as_absent(tmp_path):
    from deploybench.records import LoadStageResult
    from deploybench.report.run_html import _load_sections

    html = "".join(_load_sections(LoadStageResult.model_validate(_load_stage(tmp_path)), 2000.0))
    assert "<th>GPU util %</th>" in html and "<td>83.5</td>" in html  # the phase row and node n1
    assert "GPU utilisation per node, every phase" in html
    assert "absent: no transport to run nvidia-smi over" in html  # n2: absent, with the reason
    assert "<td>12.2</td>" in html or "<td>12.3</td>" in html  # the ramp step's utilisation
    assert "<td>0.0</td>" not in html  # nothing absent became a zero
    assert "<th>J per output token</th>" in html and "<th>GPU power W</th>" in html  # absent here: no power


def test_run_page_shows_utilisation_beside_achieved_rate(tmp_path):
    from datetime import datetime

    from deploybench.store.rows import PhaseRecord, StageRow
    from deploybench.web.markup import PHASE_COLUMNS, _phase_rows, gpu_utilisation

    stages = [StageRow(stage="load", status="success", summary={"summary": "", "result": _load_stage(tmp_path)})]
    got = gpu_utilisation(stages)
    assert got == {("probe", "*"): None, ("sustained", "*"): 83.5, ("sustained", "n1"): 83.5,
                   ("sustained", "n2"): None}  # the probe's best step measured no GPU: absent
    common = dict(phase="sustained", offered_rps=10.0, achieved_rps=9.5, output_tps=1.0, requests=10, errors=0,
                  error_rate=0.0, duration_s=5.0, started_at=datetime(2026, 1, 1, tzinfo=UTC))
    rows = _phase_rows([PhaseRecord(node=n, **common) for n in ("*", "n1", "n2")], got)
    col = PHASE_COLUMNS.index("GPU util %")
    assert PHASE_COLUMNS[col - 1] == "achieved req/s"
    assert [r[col] for r in rows] == ["83.5", "83.5", "absent"]
    assert [r[col] for r in _phase_rows([PhaseRecord(node="*", **common)], {})] == ["absent"]  # an older run


def test_with_scraping_off_every_node_is_absent_with_the_reason(tmp_path):
    import importlib.util

    from deploybench.config import LoadSpec
    from deploybench.load import phases
    from deploybench.load.results import NodeFigures

    spec = importlib.util.spec_from_file_location("lp", Path(__file__).with_name("test_load_phases.py"))
    lp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lp)
    res = lp._result(10, 10).model_copy(update={"nodes": [NodeFigures(node="n1", **lp._result(5, 5).model_dump(
        include=set(NodeFigures.model_fields) - {"node"}))]})
    got = phases.with_gpu(lambda: res, [Endpoint("n1", "http://127.0.0.1:1", "m")], LoadSpec(scrape_interval_s=0),
                          tmp_path, "sustained")
    assert got.gpu["n1"].source is None and "scrape_interval_s=0" in got.gpu["n1"].reason
    assert got.gpu_util_pct is None and got.nodes[0].gpu_util_pct is None and got.sources["gpu"].startswith("absent")
    assert gpu.gpu_verdict(got.gpu, SLO(min_gpu_util_pct=50))[0].startswith("node n1: GPU utilisation not measured")


# -- issue 28: the engine's GPUs, not the node's -------------------------------------------------------
def _exporter_page(utils: list[float], pods: dict[int, str] | None = None) -> str:
    """A DCGM exporter's page for a node with one GPU per entry of ``utils`` (with pod mapping: ``pods``)."""
    lines = []
    for i, u in enumerate(utils):
        pod = f',pod="{pods[i]}",namespace="ns",container="engine"' if pods and i in pods else ""
        lines += [f'DCGM_FI_DEV_GPU_UTIL{{gpu="{i}",UUID="GPU-{i}"{pod}}} {u}',
                  f'DCGM_FI_DEV_FB_USED{{gpu="{i}"{pod}}} {1000 * (i + 1)}',
                  f'DCGM_FI_DEV_FB_FREE{{gpu="{i}"{pod}}} 100']
    return "\n".join(lines) + "\n"


def test_an_engine_on_one_gpu_of_eight_reads_its_own_gpu_not_the_nodes_average():
    """Issue 28, point 9: averaged over the node's 8 GPUs, an engine busy at 90 % on its one GPU read 11.25 %
    and failed an 80 % objective. With the engine's GPUs (the ssh backend's engine.gpus, here GPU 3) it reads 90."""
    base = {"ts": (T0 + timedelta(seconds=1)).isoformat(), "node": "n1", "phase": "p", "step": 0}
    pts = gpu.dcgm_points(_exporter_page([0, 0, 0, 90, 0, 0, 0, 0]), base, "dcgm-exporter")
    node = gpu.gpu_figures(pts, ["n1"], T0, T0 + timedelta(seconds=2))["n1"]
    assert node.util_mean_pct == pytest.approx(11.25) and node.gpus == 8  # the whole node: what it used to read
    mine = Endpoint("n1", "http://10.0.0.1:8000", "m", gpus=("3",))
    figs = gpu.gpu_figures(pts, ["n1"], T0, T0 + timedelta(seconds=2), engines={"n1": mine})
    assert figs["n1"].util_mean_pct == 90.0 and figs["n1"].gpus == 1 and figs["n1"].mem_used_mib_mean == 4000
    assert gpu.gpu_verdict(figs, SLO(min_gpu_util_pct=80)) == []
    two = Endpoint("n1", "http://10.0.0.1:8000", "m", gpus=("3", "4"))  # tensor parallel 2: the mean of its two
    assert gpu.gpu_figures(pts, ["n1"], T0, T0 + timedelta(seconds=2), engines={"n1": two})["n1"].util_mean_pct == 45


def test_a_pod_reads_the_gpus_the_exporter_maps_to_it_and_says_when_there_is_no_mapping():
    base = {"ts": (T0 + timedelta(seconds=1)).isoformat(), "node": "n1", "phase": "p", "step": 0}
    pod = Endpoint("n1", "http://10.244.1.7:8000", "m", pod="deploybench-m-1a2b-7f9c", host="10.0.0.1")
    mapped = gpu.dcgm_points(_exporter_page([10, 70, 80], pods={1: pod.pod, 2: pod.pod}), base, "dcgm-exporter")
    figs = gpu.gpu_figures(mapped, ["n1"], T0, T0 + timedelta(seconds=2), engines={"n1": pod})
    assert figs["n1"].util_mean_pct == 75.0 and figs["n1"].gpus == 2
    unmapped = gpu.dcgm_points(_exporter_page([10, 70, 80]), base, "dcgm-exporter")
    figs = gpu.gpu_figures(unmapped, ["n1"], T0, T0 + timedelta(seconds=2), engines={"n1": pod})
    assert figs["n1"].util_mean_pct is None and "pod mapping (-k)" in figs["n1"].reason
    # the node's exporter is asked at the node's address, not the pod's
    assert gpu.GpuSampler([pod], 1.0, "p")._exporter(pod) == f"http://10.0.0.1:{gpu.DCGM_PORT}/metrics"


def test_an_endpoint_record_is_read_within_bounds():
    ep = Endpoint.of({"node": "n1", "url": "http://h:1", "model": "m", "gpus": [0, "1", {"x": 1}], "pod": 7})
    assert ep.gpus == ("0", "1") and ep.pod == ""
    assert Endpoint.of({"node": "n1", "url": "http://h:1", "model": "m", "gpus": "all"}).gpus == ()


def test_report_shows_the_engines_own_figures_by_the_roles_its_profile_maps(tmp_path):
    """Issue 28: Triton's queue and compute time and its average batch, vLLM's running and KV use; a role a node's
    profile maps that its page lacked is 'absent'; a role no profile maps has no column."""
    from deploybench.records import LoadStageResult
    from deploybench.report.run_html import _load_sections

    data = _load_stage(tmp_path)
    data["phases"]["sustained"]["result"]["engine"] = {
        "n1": {"scrapes": 5, "queue_mean_ms": 1.25, "compute_mean_ms": 287.5, "batch_mean": 1.0, "ttft_p99_ms": None},
        "n2": {"scrapes": 5, "queue_mean_ms": 2.5, "compute_mean_ms": 290.0, "batch_mean": 1.0, "ttft_p99_ms": 40.0}}
    html = "".join(_load_sections(LoadStageResult.model_validate(data), 2000.0))
    assert "The engine's own view" in html
    assert "<th>queue mean ms</th>" in html and "<th>batch (mean)</th>" in html and "<td>287.50</td>" in html
    assert "<th>KV cache use max</th>" not in html  # no node's profile maps it
    assert "<td>absent</td>" in html  # n1's TTFT: mapped, not on its page


def test_the_sm_clock_and_the_throttle_reasons_of_a_window_and_a_reason_that_is_no_bitmask_left_out():
    """Issue 29: the SM clock's mean and lowest, and every throttle reason seen (the OR of the samples, under either
    of DCGM's names); a reason that is not a whole number in range is no bitmask: left out, never OR-ed in."""
    pts = []
    for i, (clock, reason, name) in enumerate([(1000, 0x20, gpu.THROTTLE[0]), (2000, 0x8, gpu.THROTTLE[1]),
                                               (1500, 2.5, gpu.THROTTLE[0]), (1500, 2.0**40, gpu.THROTTLE[0])]):
        ts = (T0 + timedelta(seconds=i + 1)).isoformat()
        pts += [{"ts": ts, "node": "n1", "metric": gpu.UTIL, "labels": {"gpu": "0"}, "value": 50.0},
                {"ts": ts, "node": "n1", "metric": gpu.SM_CLOCK, "labels": {"gpu": "0"}, "value": clock},
                {"ts": ts, "node": "n1", "metric": name, "labels": {"gpu": "0"}, "value": reason}]
    figs = gpu.gpu_figures(pts, ["n1"], T0, T0 + timedelta(seconds=10))
    assert figs["n1"].sm_clock_mhz_mean == 1500.0 and figs["n1"].sm_clock_mhz_min == 1000.0
    assert figs["n1"].throttle_reasons == 0x28
    clean = gpu.gpu_figures([{**p, "value": 0.0} if p["metric"] in gpu.THROTTLE else p for p in pts[:3]], ["n1"],
                            T0, T0 + timedelta(seconds=10))
    assert clean["n1"].throttle_reasons == 0  # reported and clear: 0, not absent
