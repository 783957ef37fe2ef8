"""A real third-party OpenAI-compatible server, installed from PyPI: llama.cpp's server as packaged by
llama-cpp-python (``python -m llama_cpp.server``), running real llama.cpp compute on a tiny random-weight
Llama GGUF written here (tiny_gguf.py, no download).

It is deployed through a profile file of our own ($DEPLOYBENCH_ENGINE_PROFILES; the library is not
touched) on a 1-node loopback lab: preflight, fan-out of the model, rollout (readiness by /v1/models:
this server has no /health), smoke and gate; then probe (the capacity search) and sustained, streamed.
The server has the quirks of issue 17: no /health, no /metrics, no usage in its streams, one request
at a time.

Checked against the server's own timings, measured independently here: requests sent one at a time
with a plain HTTP client give its service time S (and its own usage counts), and its log gives its own
model time per request. The model serves one request at a time, so the capacity cannot pass what the
model time allows, and must not fall far below 1/S (measured 0.61 x 1/S on a busy shared 2-core
machine: k6, the TTFT sampler and the server share the cores); sustained must keep up with its offered
rate, every streamed answer must have max_tokens tokens counted from the stream, and no answer may be
faster than the server's fastest.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import time
import urllib.request
from pathlib import Path

import pytest

from deploybench import paths, pipeline
from deploybench.lab.state import LabFiles

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(420),
              pytest.mark.skipif(shutil.which("k6") is None, reason="k6 not on PATH")]

LAB = "lx3p"
MODEL = "tiny-llama"
PORT = 8060
OUT_TOKENS = 16
PROMPT_TOKENS = 16
PROFILE = """# llama.cpp's server from llama-cpp-python, one thread (the other core is the load generator's); by default
# a new request interrupts the stream in progress (short answers ending in [DONE]): queue them instead
name = "llamacpp-lab"
api = "openai"
command = ["{python}", "-m", "llama_cpp.server", "--model", "{model_dir}/model.gguf", "--model_alias", "{model_name}",
           "--host", "{host}", "--port", "{port}", "--n_ctx", "{max_model_len}", "--n_threads", "1",
           "--n_threads_batch", "1", "--interrupt_requests", "False", "{extra_args}"]
[readiness]
kind = "models"
path = "/v1/models"
timeout_s = 10.0
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    import sys

    from deploybench.lab import cluster

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_gguf import write_tiny_llama

    inv = cluster.up(LAB, nodes=1, link_mbit=1000, mode="loopback", model_mb=1)
    write_tiny_llama(LabFiles(LAB).models(inv.nodes[0].name) / MODEL / "model.gguf")
    folder = tmp_path_factory.mktemp("profiles")
    (folder / "llamacpp-lab.toml").write_text(PROFILE)
    try:
        yield inv, folder
    finally:
        cluster.down(LAB)


def _post(url: str, body: dict, timeout: float = 60) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def service_times_s(base: str, n: int = 12) -> tuple[list[float], list[int]]:
    """The server's time per request, one request at a time: the wall times of ``n`` plain completions of
    PROMPT_TOKENS words and OUT_TOKENS tokens (the first two, warming up, left out), and the completion
    tokens its own usage reported."""
    words = "the of and to in is it you that he was for on are as with".split()
    times, counts = [], []
    for i in range(n):
        prompt = " ".join(words[(i + j) % len(words)] for j in range(PROMPT_TOKENS))
        t0 = time.perf_counter()
        body = _post(f"{base}/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": OUT_TOKENS,
                                                "temperature": 0})
        times.append(time.perf_counter() - t0)
        counts.append(body["usage"]["completion_tokens"])
    return times[2:], counts


def server_compute_ms(inv, node: str) -> list[float]:
    """The server's own timing of the model's work for each request it logged: llama.cpp's ``prompt eval
    time`` + ``eval time`` lines in its log (the engine's log under <run_root>/<node>, where the ssh deployer
    keeps it). The model is one, on one thread: this part of a request never overlaps another's."""
    folder = Path(inv.run_root) / node
    logs = sorted(folder.glob("engine*.log"))
    assert logs, f"no engine log in {folder}"
    text = "".join(p.read_text(errors="replace") for p in logs)
    prompt = re.findall(r"llama_perf_context_print:\s+prompt eval time =\s+([0-9.]+) ms", text)
    decode = re.findall(r"llama_perf_context_print:\s+eval time =\s+([0-9.]+) ms", text)
    return [float(a) + float(b) for a, b in zip(prompt, decode)]


def test_llama_cpp_server_deployed_by_profile_file_and_measured(lab, monkeypatch):
    inv, folder = lab
    monkeypatch.setenv("DEPLOYBENCH_ENGINE_PROFILES", str(folder))
    key = "lx3p-llamacpp"
    conf = {"inventory": str(paths.lab_dir(LAB) / "inventory.json"), "nodes": 1, "canary_nodes": 1,
            "model_name": MODEL, "engine_profile": "file", "engine_profile_file": "llamacpp-lab", "max_model_len": 256,
            "port": PORT, "ready_timeout_s": 90, "iperf_seconds": 1, "link_threshold": 0.3,
            "gate_rate_per_node": 2, "gate_duration_s": 3, "gate_min_requests": 4,
            "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUT_TOKENS, "output_spread": 0, "stream": True,
            "load_phases": ["probe", "sustained"], "probe_start_rps": 2, "probe_step_s": 4, "probe_tolerance": 0.15,
            "warmup_s": 1, "load_duration_s": 6, "window_s": 2, "slo_p99_latency_ms": 5000,
            # a server that works one request at a time and does not drop abandoned ones: a short timeout and
            # a ramp capped near 2x its expected capacity keep the probe's overload from leaving a backlog
            "probe_max_rps": 16, "request_timeout_s": 10,
            "ttft_sample_rps": 0.5, "scrape_interval_s": 1}
    names = pipeline.validate(key, conf)["nodes"]
    try:
        healthy = pipeline.preflight(key)["healthy"]
        nodes = pipeline.fanout(key, healthy)["nodes"]
        eps = pipeline.rollout(key, nodes)["endpoints"]
        assert [e["node"] for e in eps] == names
        ro = json.loads((paths.run_dir(key) / "stages" / "rollout.json").read_text())["result"]
        assert ro["profile"] == "llamacpp-lab" and ro["steps"][0]["gate"]["passed"]
        base = eps[0]["url"]
        # the server's own timings, measured here before any load: service time, and its own token counts
        alone, counts = service_times_s(base, n=22)
        assert counts == [OUT_TOKENS] * len(counts)  # greedy decoding never ends early on this model
        for phase in ("probe", "sustained"):
            pipeline.load_phase(key, eps, phase)
        after, _ = service_times_s(base, n=12)
    finally:
        pipeline.teardown(key)

    res = json.loads((paths.run_dir(key) / "stages" / "load.json").read_text())["result"]
    cap = res["capacity"]["capacity_rps"]
    s = statistics.median(alone + after)  # the service time S, measured here one request at a time
    s_min = min(alone + after)
    own = server_compute_ms(inv, names[0])  # the server's own timing of the model's work, from its log
    assert len(own) >= 10  # it logs its timing for the plain requests at least (not for every streamed one)
    print(f"llama.cpp server: service time S = {1000 * s:.1f} ms (median of {len(alone + after)} one at a time; "
          f"fastest {1000 * s_min:.1f} ms; {1000 * statistics.median(alone):.1f} ms before the load, "
          f"{1000 * statistics.median(after):.1f} ms after) -> 1/S = {1 / s:.2f} req/s; its own model time "
          f"median {statistics.median(own):.1f} ms over {len(own)} requests (<= {1000 / statistics.median(own):.2f} "
          f"req/s); probe capacity {cap:.2f} req/s "
          f"({cap * s:.2f} x 1/S) in {len(res['capacity']['steps'])} steps; sustained {res['achieved_rps']:.2f} "
          f"of {res['offered_rps']:.2f} req/s, P50 {res['latency_p50_ms']} ms, TTFT P50 {res['ttft_p50_ms']} ms")
    # the model works on one request at a time: no capacity above what the server's own model time allows,
    # none far below 1/S (the 2 cores are shared with k6, the TTFT sampler and whatever else the machine
    # runs: seen 0.61 x 1/S on a busy machine; a search stuck at its first rate, 2 req/s, would be ~0.2)
    assert 0.3 / s <= cap <= 1.3 * 1000 / statistics.median(own), (cap, s, statistics.median(own))
    assert res["phase"] == "sustained" and res["error_rate"] == 0
    assert res["achieved_rps"] >= 0.85 * res["offered_rps"]
    assert res["latency_p50_ms"] >= 0.9 * 1000 * s_min  # no answer faster than the server ever computed one
    assert res["ttft_samples"] > 0 and 0 < res["ttft_p50_ms"] <= res["latency_p999_ms"]
    assert "counted from the stream (no usage sent)" in res["sources"]["output_tokens"]
    assert "the server's usage" not in res["sources"]["output_tokens"]
    assert res["output_tps"] == pytest.approx(OUT_TOKENS * res["achieved_rps"], rel=0.1)
    # no /metrics on this server: its engine figures are absent, not zero
    assert all("ttft_count" not in fig for fig in (res.get("engine") or {}).values())
