"""``deploybench engine check`` (issue 28), run as a person runs it, against engines started by hand:

- the simulated engine with the sim profile: every check passes, exit 0; with the vllm profile the metric vLLM
  has and the sim does not (preemptions) is named absent, exit 1;
- a profile whose metric was renamed (a new engine version's): absent, with the nearest name the page has;
- the lab's tritonserver with the triton profile (its metrics on their own port);
- the real llama.cpp server (llama-cpp-python, a tiny random-weight GGUF written here): completions, chat, a
  stream without usage (tokens counted from its events) and token counts that agree; it has no /metrics, so a
  metric its profile names is absent and the check fails.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from deploybench import engines, manifest
from deploybench.config import TritonKnobs
from deploybench.sim.local import free_port

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(120)]

DEPLOYBENCH = [sys.executable, "-m", "deploybench.cli"]


def _wait(url: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} not up in {timeout_s} s")


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("weights") / "sim-model"
    manifest.seed_model(d, total_mb=1)
    return d


@pytest.fixture(scope="module")
def sim(weights):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "deploybench.sim.engine", "--model-dir", str(weights),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(f"http://127.0.0.1:{port}/health", proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def check(*args: str) -> tuple[int, str]:
    got = subprocess.run([*DEPLOYBENCH, "engine", "check", *args], capture_output=True, text=True, timeout=90)
    print(got.stdout, got.stderr)
    return got.returncode, got.stdout


def rows(out: str) -> dict[str, tuple[str, str]]:
    """check -> (result, detail) of the printed table (columns apart by two spaces or more)."""
    got = {}
    for line in out.splitlines()[1:-1]:
        parts = re.split(r"\s{2,}", line.strip(), maxsplit=2)
        if len(parts) >= 2:
            got[parts[0]] = (parts[1], parts[2] if len(parts) > 2 else "")
    return got


def test_the_simulated_engine_passes_its_own_profile_and_the_vllm_profile(sim):
    rc, out = check("--profile", "sim", "--url", sim)
    got = rows(out)
    assert rc == 0 and out.rstrip().endswith("0 mismatches"), out
    assert got["token counts agree"][0] == "ok" and got["metric itl"] == ("ok", "vllm:inter_token_latency_seconds")
    rc, out = check("--profile", "vllm", "--url", sim)
    got = rows(out)
    absent = {k for k, (r, _) in got.items() if r == "absent"}
    # the sim has every figure of vLLM's profile since it preempts (issue 29: vllm:num_preemptions_total, 0 here)
    assert rc == 0 and absent == set() and got["metric preemptions"] == ("ok", "vllm:num_preemptions"), out


def test_a_renamed_metric_is_absent_with_the_nearest_name_on_the_page(sim, tmp_path):
    text = engines.PROFILE_DIR.joinpath("sim.toml").read_text().replace('name = "sim"', 'name = "renamed"')
    text = text.replace('itl = "vllm:inter_token_latency_seconds"', 'itl = "vllm:inter_token_latency_secs"')
    (tmp_path / "renamed.toml").write_text(text)
    rc, out = check("--profile", str(tmp_path / "renamed.toml"), "--url", sim)
    assert rc == 1 and "nearest there: vllm:inter_token_latency_seconds" in rows(out)["metric itl"][1], out


def test_the_lab_tritonserver_passes_the_triton_profile(weights, tmp_path):
    folder = tmp_path / "repo" / "sim-model"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(engines.triton_config("sim-model", TritonKnobs()))
    (folder / "1" / "model.json").write_text(json.dumps({"model": str(weights)}))
    port, mport = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-I", "-m", "deploybench.sim.stand_in", "tritonserver",
                             f"--model-repository={tmp_path / 'repo'}", "--http-address=127.0.0.1",
                             f"--http-port={port}", f"--metrics-port={mport}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(f"http://127.0.0.1:{port}/v2/health/ready", proc)
        rc, out = check("--profile", "triton", "--url", f"http://127.0.0.1:{port}")
        assert rc == 1 and rows(out)["metrics page"][0] == "FAIL"  # the profile's 8002: not where it listens
        rc, out = check("--profile", "triton", "--url", f"http://127.0.0.1:{port}", "--metrics-port", str(mport))
        got = rows(out)
        assert rc == 0 and got["generate"][0] == "ok" and "8 output" in got["generate"][1], out
        assert got["metric executions"] == ("ok", "nv_inference_exec_count"), out
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_real_llamacpp_server_and_a_metric_it_does_not_have(tmp_path):
    from tests.support.tiny_gguf import write_tiny_llama

    gguf = write_tiny_llama(tmp_path / "model.gguf")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "tiny",
                             "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "256", "--n_threads", "1",
                             "--interrupt_requests", "False"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    profile = engines.PROFILE_DIR.joinpath("llamacpp.toml").read_text().replace('name = "llamacpp"',
                                                                                 'name = "llamacpp-metrics"')
    (tmp_path / "llamacpp-metrics.toml").write_text(profile + '\n[metrics]\nrunning = "llamacpp:requests_processing"\n')
    try:
        _wait(f"http://127.0.0.1:{port}/v1/models", proc, timeout_s=90)
        rc, out = check("--profile", str(tmp_path / "llamacpp-metrics.toml"), "--url", f"http://127.0.0.1:{port}",
                        "--model", "tiny")
        got = rows(out)
        assert got["readiness"][0] == got["completion"][0] == got["chat completion"][0] == "ok", out
        assert got["stream"][0] == "ok" and "from the events (no usage sent)" in got["stream"][1], out
        assert got["token counts agree"][0] == "ok", out  # usage of the plain answer = the stream's events
        assert rc == 1 and got["metrics page"][0] == "FAIL" and got["metric running"][0] == "absent", out
    finally:
        proc.terminate()
        proc.wait(10)
