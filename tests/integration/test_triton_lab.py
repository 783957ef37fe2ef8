"""The triton profile end to end on a 2-node lab (issue 28): preflight, fan-out, rollout (canary, then both),
a sustained load phase, teardown.

The lab's nodes have no Triton: the lab's ``tritonserver`` stand-in (deploybench.sim.stand_in,
deploybench.sim.triton) reads the model repository deploybench generated, checks it as Triton's vLLM backend
would (a config the backend refuses never becomes ready), and serves the simulated engine in Triton's shape:
KServe v2 health, the generate extension with the vLLM backend's inputs, and its metrics on port 8002 only. So
this run proves that deploybench speaks Triton as Triton's source says, not as the OpenAI engines do: the load
asks for the answer without the prompt and counts the backend's own tokens, and the engine's figures come
from Triton's metrics port (the serving port has no /metrics there).

Checked against the simulated engine's closed form (decode step 15 + 2 x batch ms, prefill 0.1 ms per prompt
token: the sim's defaults): per node, Triton's mean compute time per request is 16 decode steps of a batch
between 1 and 4 (about 2 requests in flight per node at most at 2 req/s), its mean TTFT one prefill and one
step, its average batch size (inferences / executions) exactly 1 (a model with max_batch_size 0 is one
Triton does not batch: the vLLM engine behind it does).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from deploybench import paths, pipeline
from deploybench.load.scrape import read_series
from tests.support import lab_names

pytestmark = [pytest.mark.integration, pytest.mark.netns, pytest.mark.time_limit(240)]

LAB = lab_names.unique("lxtr")
P, OUT = 64, 16  # prompt and output tokens
BASE_MS, PER_SEQ_MS, PREFILL_MS = 15.0, 2.0, 0.1  # the simulated engine's defaults (config.SimKnobs)


@pytest.fixture(scope="module")
def lab():
    from deploybench.lab import cluster

    inv = cluster.up(LAB, nodes=2, link_mbit=1000)
    try:
        yield inv
    finally:
        cluster.down(LAB)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_triton_run_deploys_loads_and_reads_tritons_own_metrics(lab):
    key = f"{LAB}-triton"
    conf = {"inventory": str(paths.lab_dir(LAB) / "inventory.json"), "nodes": 2, "canary_nodes": 1,
            "engine_profile": "triton", "iperf_seconds": 1, "link_threshold": 0.5, "load_rate": 4,
            "load_duration_s": 5, "warmup_s": 1, "output_tokens": OUT, "output_spread": 0, "prompt_tokens": P,
            "stream": False, "scrape_interval_s": 1, "gate_min_requests": 2}
    pipeline.validate(key, conf)
    try:
        for stage in ("preflight", "fanout", "rollout"):
            pipeline.run_stage(stage, key)
        eps = json.loads((paths.run_dir(key) / "stages" / "rollout.json").read_text())["result"]["endpoints"]
        base = eps[0]["url"]
        # Triton's shape: readiness and the model's own, no OpenAI routes, metrics on 8002 only
        assert _status(f"{base}/v2/health/ready") == _status(f"{base}/v2/models/{eps[0]['model']}/ready") == 200
        assert _status(f"{base}/v1/models") == _status(f"{base}/metrics") == 404
        host = base.rsplit(":", 1)[0]
        assert _status(f"{host}:8002/metrics") == 200
        pipeline.run_stage("load", key, phase="sustained")
    finally:
        pipeline.run_stage("teardown", key)

    ro = json.loads((paths.run_dir(key) / "stages" / "rollout.json").read_text())["result"]
    assert ro["profile"] == "triton" and all(s["gate"]["passed"] for s in ro["steps"]), ro["steps"]
    res = json.loads((paths.run_dir(key) / "stages" / "load.json").read_text())["result"]
    assert res["requests"] >= 15 and res["errors"] == 0, res
    # the backend's own token counts (return_num_output_tokens), not the words of prompt + answer
    assert "the server's usage" in res["sources"]["output_tokens"] and "words" not in res["sources"]["output_tokens"]
    assert res["output_tps"] == pytest.approx(OUT * res["achieved_rps"], rel=0.1)

    series = read_series(res["metrics_path"])
    assert {p["metric"] for p in series} >= {"nv_inference_request_success", "vllm:time_to_first_token_seconds_sum"}
    for node in ("n01", "n02"):
        fig = res["engine"][node]
        print(f"{node}: {json.dumps(fig)}")
        assert fig["scrape_errors"] == 0 and fig["success"] >= 5 and fig["failure"] == 0, fig
        assert fig["batch_mean"] == 1.0 and fig["inferences"] == fig["executions"] == fig["success"], fig
        low, high = OUT * (BASE_MS + PER_SEQ_MS), OUT * (BASE_MS + 4 * PER_SEQ_MS) + 1.5 * P * PREFILL_MS
        assert low * 0.97 <= fig["compute_mean_ms"] <= high, (low, high, fig)
        assert 0 <= fig["queue_mean_ms"] < 0.2 * fig["compute_mean_ms"], fig  # far below capacity: little wait
        assert fig["request_mean_ms"] == pytest.approx(fig["queue_mean_ms"] + fig["compute_mean_ms"], rel=0.01)
        # the vLLM backend's own histograms (REPORT_CUSTOM_METRICS in the generated config.pbtxt)
        assert BASE_MS + PER_SEQ_MS <= fig["ttft_mean_ms"] <= BASE_MS + 4 * PER_SEQ_MS + 1.5 * P * PREFILL_MS + 15
        assert fig["e2e_mean_ms"] == pytest.approx(fig["request_mean_ms"], rel=0.05)
        # tokens made in the window against requests finished in it: apart by the few in flight at its start
        assert abs(fig["generation_tokens"] - OUT * fig["success"]) <= 2 * OUT, fig
        assert "running_max" not in fig  # the triton profile maps no running gauge: absent, not 0
