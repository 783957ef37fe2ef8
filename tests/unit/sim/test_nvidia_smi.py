"""The lab's nvidia-smi (deploybench.sim.nvidia_smi): it prints what NVIDIA's prints for the simulated GPUs a node's
engines list, in the format the GPU sampler parses (deploybench.load.gpu.parse_smi); it refuses what it does not
know as nvidia-smi does, and a GPU's hostile or missing figures become [N/A], never a number."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from deploybench.load import gpu
from deploybench.sim import metrics as em
from deploybench.sim import nvidia_smi
from deploybench.sim.service_model import Sequence


def smi(folder: Path | None, *args: str) -> subprocess.CompletedProcess[str]:
    """The stand-in as a lab node runs it (deploybench.sim.stand_in), with ``folder`` as the node's GPU list."""
    env = {"PATH": "/usr/bin:/bin"} | ({nvidia_smi.GPU_DIR_ENV: str(folder)} if folder is not None else {})
    return subprocess.run([sys.executable, "-I", "-m", "deploybench.sim.stand_in", "nvidia-smi", *args], env=env,
                          capture_output=True, text=True, timeout=30)


@pytest.fixture
def gpus(tmp_path):
    """A node's GPU folder, and a way to list a GPU in it served by a loopback HTTP server answering ``body``."""
    import http.server

    servers = []

    def add(name: str, body: bytes) -> None:
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        (tmp_path / f"gpu-{name}.json").write_text(json.dumps(
            {"url": f"http://127.0.0.1:{srv.server_address[1]}/sim/gpu", "pid": 1}))

    yield tmp_path, add
    for s in servers:
        s.shutdown()


def test_it_prints_each_listed_gpu_as_the_sampler_asks_and_the_sampler_reads_it(gpus):
    folder, add = gpus
    m = em.EngineMetrics("m", slots=4, model_bytes=64 * 2**20)
    t = m.occupancy.t0
    m.batch([Sequence(10, 5)], waiting=0, now=t)  # one of four slots for the whole window: 25 %
    add("1", json.dumps(m.smi_values(now=t + 2.0)).encode())
    add("2", json.dumps({"utilization.gpu": 90, "memory.used": 100, "memory.total": 400,
                         "power.draw": 243.17}).encode())
    out = smi(folder, *gpu.SMI_COMMAND[1:])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    watts = em.IDLE_W + (em.BUSY_W - em.IDLE_W) * 0.25
    used = round(64 + em.KV_MIB_PER_TOKEN * 10)  # the model, and the KV of the running sequence's 10 tokens
    assert lines == [f"25, {used}, {em.GPU_MEMORY_MIB}, {watts:.2f}", "90, 100, 400, 243.17"]
    assert gpu.parse_smi(out.stdout) == [(25.0, used, float(em.GPU_MEMORY_MIB), watts), (90.0, 100.0, 400.0, 243.17)]
    # with the header and the units, as nvidia-smi prints them
    full = smi(folder, "--query-gpu=power.draw,utilization.gpu", "--format=csv")
    assert full.stdout.splitlines() == ["power.draw [W], utilization.gpu [%]", f"{watts:.2f} W, 25 %",
                                        "243.17 W, 90 %"]
    # what preflight's GPU check asks (deploybench.preflight.checks.GPU_QUERY): a name and a driver, or [N/A]
    from deploybench.preflight.checks import GPU_QUERY

    pre = smi(folder, *GPU_QUERY[1:])
    assert pre.stdout.splitlines() == [f"deploybench-sim, deploybench-sim, {em.GPU_MEMORY_MIB}", "[N/A], [N/A], 400"]


def test_a_gpu_that_says_nonsense_prints_na_and_the_sampler_keeps_it_absent(gpus):
    folder, add = gpus
    add("1", json.dumps({"utilization.gpu": "87", "memory.used": True, "memory.total": None,
                         "power.draw": float("nan"), "name": "GPU, rm -rf /\n"}).encode())
    add("2", b"<html>pwned</html>")  # not JSON: not a GPU at all
    add("3", json.dumps({"utilization.gpu": 50, "memory.used": 1, "memory.total": 2, "power.draw": 1e308 * 10}
                        ).encode())  # Infinity: [N/A]
    out = smi(folder, *gpu.SMI_COMMAND[1:])
    assert out.returncode == 0 and out.stdout.splitlines() == ["[N/A], [N/A], [N/A], [N/A]", "50, 1, 2, [N/A]"]
    assert gpu.parse_smi(out.stdout) == [(None, None, None, None), (50.0, 1.0, 2.0, None)]
    named = smi(folder, "--query-gpu=name", "--format=csv,noheader")
    assert named.stdout.splitlines() == ["[N/A]", "[N/A]"]  # a name with a comma or a newline is no name


def test_it_refuses_what_nvidia_smi_refuses(gpus, tmp_path):
    folder, add = gpus
    add("1", b'{"utilization.gpu": 1}')
    bad = smi(folder, "--query-gpu=utilization.gpu,fan.speed", "--format=csv")
    assert bad.returncode == 2 and 'Field "fan.speed" is not a valid field to query.' in bad.stderr
    assert smi(folder, "-q").returncode == 2 and smi(folder, "--query-gpu=power.draw", "--format=xml").returncode == 2
    empty = tmp_path / "none"
    empty.mkdir()
    (empty / "gpu-9.json").write_text(json.dumps({"url": "http://127.0.0.1:9/sim/gpu"}))  # an engine gone
    (empty / "gpu-8.json").write_text(json.dumps({"url": "file:///etc/passwd#/sim/gpu"}))  # not http: not asked
    gone = smi(empty, *gpu.SMI_COMMAND[1:])
    assert gone.returncode == nvidia_smi.NO_DEVICES_EXIT and "No devices were found" in gone.stdout
    nodriver = smi(None, *gpu.SMI_COMMAND[1:])
    assert nodriver.returncode == nvidia_smi.NO_DRIVER_EXIT and "couldn't communicate" in nodriver.stderr


def test_an_engine_without_dcgm_lists_its_gpu_and_serves_it_but_not_on_metrics(tmp_path, monkeypatch):
    """``--no-dcgm``: no DCGM gauge on /metrics, the same figures at /sim/gpu, the GPU listed while it serves."""
    from deploybench.http import get_text
    from deploybench.manifest import seed_model
    from deploybench.sim.engine import EngineServer
    from deploybench.sim.service_model import ServiceParams

    seed_model(tmp_path / "model", total_mb=1, shards=1)
    listed = tmp_path / "gpus"
    listed.mkdir()
    monkeypatch.setenv(nvidia_smi.GPU_DIR_ENV, str(listed))
    from deploybench.sim.engine import EngineOptions

    async def main() -> tuple[str, str, list[str]]:
        opts = EngineOptions(model_dir=str(tmp_path / "model"), port=0, dcgm=False,
                             params=ServiceParams(max_num_seqs=4, decode_base_ms=1, decode_per_seq_ms=0,
                                                  prefill_per_token_ms=0, queue_limit=4))
        server = EngineServer(opts)
        await server.start()
        entry = server.register_gpu()
        assert entry is not None
        base = f"http://127.0.0.1:{server.port}"
        page, card = await asyncio.gather(asyncio.to_thread(get_text, f"{base}/metrics", 5),
                                          asyncio.to_thread(get_text, f"{base}/sim/gpu", 5))
        files = sorted(p.name for p in listed.iterdir())
        await server.close()
        return page, card, files

    page, card, files = asyncio.run(main())
    assert "DCGM_FI_DEV" not in page and "deploybench_sim_busy_slot_seconds_total" in page
    got = json.loads(card)
    assert got["power.draw"] == em.IDLE_W and got["utilization.gpu"] == 0 and got["memory.total"] == em.GPU_MEMORY_MIB
    assert len(files) == 1 and files[0].startswith("gpu-") and list(listed.iterdir()) == []  # removed at close
