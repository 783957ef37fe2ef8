"""GPU utilisation beside the throughput, against the simulated engine's closed form (issue 17).

The engine has no GPU: it exports DCGM's gauges from its batch occupancy (deploybench.sim.metrics).
With ``decode_per_seq_ms = 0`` and no prefill cost every iteration lasts ``decode_base_ms`` whatever the
batch, so a request is in the batch for exactly ``O`` iterations and, below saturation, the mean number
running is ``rate x O x decode_base_ms`` (Little's law): the utilisation gauge must read
``100 x rate x O x d / B`` %. Memory: the model's MiB at idle, plus ``KV_MIB_PER_TOKEN`` x the tokens
the running sequences hold, on average ``rate x d x (O x P + O (O - 1) / 2)``. (Every probe step's figures:
test_load_accuracy.)
"""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from deploybench.config import SLO, EngineSpec, LoadSpec, SimKnobs
from deploybench.load import gpu, phases
from deploybench.load.results import GpuFigures
from deploybench.load.scrape import read_series
from deploybench.manifest import seed_model
from deploybench.sim import metrics as em
from deploybench.sim.local import LocalEngines

pytestmark = [pytest.mark.integration, pytest.mark.quiet]  # utilisation against the closed form

B, D_MS, P, O = 8, 10.0, 16, 20  # in service 200 ms per request; saturation 40 req/s
RATE = 20.0  # half of it
ENGINE = EngineSpec(max_num_seqs=B, sim=SimKnobs(decode_base_ms=D_MS, decode_per_seq_ms=0.0,
                                                 prefill_per_token_ms=0.0, queue_limit=32))


@pytest.fixture
def engine(tmp_path):
    manifest = seed_model(tmp_path / "model", total_mb=8, shards=2)
    with LocalEngines(tmp_path / "model", tmp_path) as local:
        yield local.start(1, engine=ENGINE), manifest.total_bytes / 2**20


def test_sustained_utilisation_and_memory_match_the_closed_form_and_the_objective_is_judged(engine, tmp_path):
    eps, model_mib = engine
    spec = LoadSpec(rate=RATE, phases=["sustained"], duration_s=4, warmup_s=1,
                    prompt_tokens=P, output_tokens=O, request_timeout_s=5, ttft_sample_rps=1,
                    scrape_interval_s=0.5)  # 8 samples, not 4: one taken between requests moved a 4-sample mean by 27 %
    slo = SLO(p99_latency_ms=2000, min_gpu_util_pct=80)  # half busy: the objective must fail, alone
    out = phases.run_phase("sustained", eps, spec, slo, tmp_path / "load")
    res = out["result"]
    g = res["gpu"]["n1"]
    want = 100 * RATE * O * D_MS / 1000 / B
    print(f"\nGPU utilisation {g['util_mean_pct']} % (closed form {want:.1f} %), {g['samples']} samples; "
          f"memory {g['mem_used_mib_mean']} MiB (model {model_mib:.2f})")
    assert g["source"] == "dcgm" and g["gpus"] == 1 and g["samples"] >= 3
    assert g["util_mean_pct"] == pytest.approx(want, rel=0.08)
    # energy (issue 29, part): the engine's counter gives the power of the window, IDLE + (BUSY - IDLE) x the
    # utilisation; per output token that is the power over the output tokens per second (RATE x O)
    watts = em.IDLE_W + (em.BUSY_W - em.IDLE_W) * want / 100
    print(f"GPU power {g['power_mean_w']} W (closed form {watts:.1f} W), {res['energy_per_output_token_j']} J per "
          f"output token (closed form {watts / (RATE * O):.3f} J)")
    assert g["power_source"] == "energy counter" and g["power_mean_w"] == pytest.approx(watts, rel=0.05)
    assert res["energy_j"] == pytest.approx(g["energy_j"]) and res["energy_per_output_token_j"] == pytest.approx(
        watts / (RATE * O), rel=0.1)  # the achieved output rate is within a few % of the offered one
    # the exact integral the engine keeps, over the measured window, agrees with the gauge
    pts = read_series(res["metrics_path"])
    start = datetime.fromisoformat(res["started_at"])
    end = start + timedelta(seconds=res["duration_s"])
    busy = sorted((p["ts"], p["value"]) for p in pts if p["metric"] == "deploybench_sim_busy_slot_seconds_total"
                  and start <= datetime.fromisoformat(p["ts"]) <= end)
    (t0, a0), (t1, a1) = busy[0], busy[-1]
    exact = 100 * (a1 - a0) / (B * (datetime.fromisoformat(t1) - datetime.fromisoformat(t0)).total_seconds())
    assert exact == pytest.approx(want, rel=0.05) and g["util_mean_pct"] == pytest.approx(exact, rel=0.08)
    # memory: the model, plus the KV of what runs
    kv = em.KV_MIB_PER_TOKEN * RATE * D_MS / 1000 * (O * P + O * (O - 1) / 2)
    assert g["mem_used_mib_mean"] - model_mib == pytest.approx(kv, rel=0.25, abs=1.0)
    assert g["mem_total_mib"] == em.GPU_MEMORY_MIB and g["mem_used_mib_max"] <= model_mib + 0.5 + (
        em.KV_MIB_PER_TOKEN * B * (P * 1.5 + O))
    idle = [p["value"] for p in pts if p["metric"] == gpu.FB_USED][-1]  # the scrape after the load
    assert idle == round(model_mib)
    # beside the throughput, per node and for the cluster
    node = res["nodes"][0]
    assert node["gpu_util_pct"] == g["util_mean_pct"] == res["gpu_util_pct"] and node["achieved_rps"] > 0
    assert res["sources"]["gpu"].startswith("node: dcgm")
    # the objective: only it broke, and it names the node, the value and the target
    assert not res["slo_ok"] and len(res["slo"]["reasons"]) == 1, res["slo"]
    assert res["slo"]["reasons"][0].startswith(f"node n1: GPU utilisation {g['util_mean_pct']:.1f} %")
    assert "SLO's 80 %" in res["slo"]["reasons"][0]
    assert f"GPU {g['util_mean_pct']:.0f} %" in phases.summary(phases.assemble(tmp_path / "load", spec))
    # the same figures against a target they reach, or none: met
    figs = {"n1": GpuFigures(**g)}
    assert gpu.gpu_verdict(figs, SLO(min_gpu_util_pct=want * 0.8)) == gpu.gpu_verdict(figs, SLO()) == []
