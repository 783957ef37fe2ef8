"""The lab's ``tritonserver`` (deploybench.sim.stand_in, deploybench.sim.triton) against what Triton and its vLLM
backend do (triton-inference-server/vllm_backend src/model.py, src/utils/request.py; server docs
user_guide/metrics.md and protocol/extension_generate.md), as a process on loopback ports, the way the lab's
nodes start it.

- A repository the vLLM backend would refuse (max_batch_size > 0, KIND_GPU with tensor parallel, no model.json)
  never serves: the process exits non-zero naming what is wrong; an unknown option is refused as tritonserver
  refuses it.
- Its command line reads ``tritonserver ...`` (what the rollout checks before it stops a process).
- generate: the prompt in front of the answer unless ``exclude_input_in_output``; ``stream`` among the sampling
  parameters fails the request; a stream refuses ``exclude_input_in_output: false``; the token counts when asked.
- Its metrics are on the metrics port, not the serving port.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from deploybench import engines, manifest
from deploybench.config import TritonKnobs
from deploybench.sim.local import free_port

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(60)]


def _repo(root: Path, knobs: TritonKnobs, tp: int = 1, model_json: bool = True) -> Path:
    weights = root / "weights"
    if not weights.exists():
        manifest.seed_model(weights, total_mb=1)
    folder = root / "repo" / "m"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(engines.triton_config("m", knobs))
    if model_json:
        (folder / "1" / "model.json").write_text(json.dumps({"model": str(weights), "tensor_parallel_size": tp,
                                                             "max_num_seqs": 4, "max_model_len": 512}))
    return root / "repo"


def _start(repo: Path, *extra: str) -> tuple[subprocess.Popen, int, int]:
    port, mport = free_port(), free_port()
    argv = ["tritonserver", f"--model-repository={repo}", "--http-address=127.0.0.1", f"--http-port={port}",
            f"--metrics-port={mport}", "--allow-metrics=true", "--allow-grpc=false", *extra]
    proc = subprocess.Popen([sys.executable, "-I", "-m", "deploybench.sim.stand_in", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, port, mport


def _call(url: str, body: dict | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, None if body is None else json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, port, mport = _start(_repo(tmp_path_factory.mktemp("triton"), TritonKnobs()))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if _call(f"{base}/v2/health/ready")[0] == 200:
                break
        except OSError:
            time.sleep(0.1)
    try:
        yield proc, base, f"http://127.0.0.1:{mport}/metrics"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("knobs, tp, model_json, words", [
    (TritonKnobs(max_batch_size=8), 1, True, "refuses max_batch_size=8"),
    (TritonKnobs(instance_kind="KIND_GPU"), 2, True, "refuses KIND_GPU for a model on 2 GPUs"),
    (TritonKnobs(), 1, False, "model.json"),
])
def test_a_repository_the_vllm_backend_refuses_never_serves(tmp_path, knobs, tp, model_json, words):
    proc, _, _ = _start(_repo(tmp_path, knobs, tp, model_json))
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode != 0 and words in out, out


def test_an_option_tritonserver_does_not_have_is_refused(tmp_path):
    proc, _, _ = _start(_repo(tmp_path, TritonKnobs()), "--max-num-seqs=4")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "unrecognized option '--max-num-seqs'" in out, out


def test_the_simulated_engines_own_options_pass_through_switches_included():
    from deploybench.sim.triton import parse_args

    opts, sim = parse_args(["--model-repository=/r", "--sim-no-enable-prefix-caching", "--sim-seed", "3",
                            "--sim-kv-cache-tokens=4096", "--http-port=9"])
    assert opts == {"model-repository": "/r", "http-port": "9"}
    assert sim == ["--no-enable-prefix-caching", "--seed", "3", "--kv-cache-tokens", "4096"]


def test_its_command_line_is_tritonservers(server):
    proc, base, _ = server
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    assert cmdline[0] == b"tritonserver" and cmdline[1].startswith(b"--model-repository="), cmdline


def test_generate_answers_as_the_vllm_backend_does(server):
    _, base, _ = server
    url = f"{base}/v2/models/m/generate"
    status, body = _call(url, {"text_input": "one two three", "parameters": {"max_tokens": 4}})
    assert status == 200 and json.loads(body)["text_output"].startswith("one two three")  # prompt prepended
    status, body = _call(url, {"text_input": "one two three", "exclude_input_in_output": True,
                               "return_num_output_tokens": True, "return_num_input_tokens": True,
                               "parameters": {"max_tokens": 4, "temperature": 0}})
    got = json.loads(body)
    assert status == 200 and not got["text_output"].startswith("one two three") and len(got["text_output"].split()) == 4
    assert got["num_output_tokens"] == [4] and got["num_input_tokens"] == 3
    status, body = _call(url, {"text_input": "x", "parameters": {"max_tokens": 4, "stream": True}})
    assert status == 400 and "`stream` is an input" in body  # TritonSamplingParams.from_dict fails on it
    status, body = _call(f"{base}/v2/models/m/generate_stream", {"text_input": "x", "stream": True,
                                                                 "exclude_input_in_output": False})
    assert status == 400 and "When streaming, `exclude_input_in_output` = False is not allowed." in body
    status, body = _call(f"{base}/v2/models/m/generate_stream", {"text_input": "x", "stream": True,
                                                                 "return_num_output_tokens": True,
                                                                 "parameters": {"max_tokens": 3}})
    events = [json.loads(line[5:]) for line in body.splitlines() if line.startswith("data:")]
    assert status == 200 and len(events) == 3 and sum(e["num_output_tokens"][0] for e in events) == 3
    assert _call(f"{base}/v2/models/other/generate", {"text_input": "x"})[0] == 404


def test_metrics_are_on_the_metrics_port_with_tritons_and_the_backends_names(server):
    _, base, page = server
    assert _call(f"{base}/metrics")[0] == 404
    status, text = _call(page)
    names = {line.split("{")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert status == 200 and {"nv_inference_request_success", "nv_inference_exec_count",
                              "nv_inference_queue_duration_us", "vllm:time_to_first_token_seconds_count"} <= names
    assert 'nv_inference_request_success{model="m",version="1"}' in text
