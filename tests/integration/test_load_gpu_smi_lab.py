"""Energy per token through nvidia-smi (issue 29): a whole run on a 2-node netns lab whose inventory says its nodes
have no DCGM (``sim_dcgm: false``), so the engines' /metrics carry no DCGM gauge, no exporter listens on 9400, and
the GPU sampler runs ``nvidia-smi --query-gpu=utilization.gpu,memory.used,memory.total,power.draw`` over the run's
SSH transport on each node: the lab's stand-in (deploybench.sim.nvidia_smi) prints what the node's simulated GPU
reads. Its power against the engine's closed form (tests/integration/test_load_gpu.py): every iteration lasts
``decode_base_ms`` whatever the batch, so a node offered ``r`` req/s of ``O`` tokens runs ``r x O x d / B`` of its
slots, draws ``IDLE_W + (BUSY_W - IDLE_W) x`` that, and spends that power over ``r x O`` output tokens a second."""

from __future__ import annotations

import json

import pytest

from deploybench import paths
from deploybench.lab import cluster as lab_cluster
from deploybench.run import Run
from deploybench.sim import metrics as em
from tests.support import fault_runs, lab_names

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(120), pytest.mark.netns]

LAB = lab_names.unique("smi")
B, D_MS, O, RATE = 8, 10.0, 20, 20.0  # noqa: E741 - 10 req/s a node: 10 x 20 x 10 ms / 8 = 25 % of the slots


@pytest.fixture(scope="module")
def lab():
    inv = lab_cluster.up(LAB, nodes=2, link_mbit=500, mode="netns", model_mb=2)
    try:
        path = paths.lab_dir(LAB) / "inventory.json"
        data = json.loads(path.read_text())
        for n in data["nodes"]:
            n["sim_dcgm"] = False
        nodcgm = path.with_name("inventory-nodcgm.json")
        nodcgm.write_text(json.dumps(data, indent=1))
        yield str(nodcgm), [n.name for n in inv.nodes]
    finally:
        lab_cluster.down(LAB)


def test_a_node_without_dcgm_gets_power_and_energy_per_token_from_nvidia_smi(lab, dsn):
    inventory, nodes = lab
    key = "deploybench_run/smi_energy"
    out = fault_runs.lab_run(key, inventory, dsn, params={
        "canary_nodes": 2, "load_rate": RATE, "max_num_seqs": B, "sim_decode_base_ms": D_MS,
        "sim_decode_per_seq_ms": 0, "sim_prefill_per_token_ms": 0, "output_tokens": O, "prompt_tokens": 16,
        "load_duration_s": 5, "warmup_s": 1, "scrape_interval_s": 0.5})
    assert out.stopped is None and out.findings == [], (out.stopped, [f.line() for f in out.findings])
    res = Run.open(key).load_result().phases["sustained"].result
    util = 100 * (RATE / len(nodes)) * O * D_MS / 1000 / B
    watts = em.IDLE_W + (em.BUSY_W - em.IDLE_W) * util / 100
    per_token = len(nodes) * watts / (RATE * O)
    for node in nodes:
        g = res.gpu[node]
        print(f"\n{node}: {g.source}, {g.samples} samples, utilisation {g.util_mean_pct} % (closed form {util:.1f}), "
              f"power {g.power_mean_w} W (closed form {watts:.2f} W, {g.power_source})")
        # nothing but nvidia-smi could have given it: the engine's page has no DCGM gauge
        assert g.source == "nvidia-smi" and g.samples >= 5 and g.power_source == "power gauge", g
        assert g.util_mean_pct == pytest.approx(util, rel=0.15) and g.power_mean_w == pytest.approx(watts, rel=0.08)
        assert g.mem_total_mib == em.GPU_MEMORY_MIB
    print(f"energy per output token {res.energy_per_output_token_j} J (closed form {per_token:.4f} J); "
          f"{res.sources['energy']}")
    assert res.energy_per_output_token_j == pytest.approx(per_token, rel=0.1)
    assert "power gauge" in res.sources["energy"] and res.sources["gpu"].startswith("node: nvidia-smi")
