"""The simulated engine's fault knobs (deploybench.sim.faults): each against its closed form in service_model, the
series a clean engine exports with their clean values, and a fault reaching exactly the node the inventory names."""

from __future__ import annotations

import re

import pytest

from deploybench import engines
from deploybench.cli.engine import options_from_args, parse_serve_args
from deploybench.config import EngineSpec
from deploybench.errors import ConfigError
from deploybench.inventory import Inventory
from deploybench.sim import faults
from deploybench.sim.metrics import SM_CLOCK_MHZ, EngineMetrics
from deploybench.sim.service_model import (
    BatchScheduler,
    Sequence,
    ServiceParams,
    capacity,
    kv_concurrency,
    kv_limited_capacity,
    leaked_bytes,
    simulate,
)


def params(**kw) -> ServiceParams:
    base = dict(max_num_seqs=8, decode_base_ms=10.0, decode_per_seq_ms=1.0, prefill_per_token_ms=0.1,
                queue_limit=10**6)
    return ServiceParams(**{**base, **kw})


def saturated(p: ServiceParams, prompt: int, output: int, rate_per_s: float, n: int = 2000, **kw):
    gap = 1000.0 / rate_per_s
    return simulate(p, [(i * gap, prompt, output) for i in range(n)], **kw)


def test_a_throttled_clock_slows_every_step_by_its_fraction_in_the_closed_form_and_the_scheduler():
    clean, hot = params(), params(clock_fraction=0.5)
    assert capacity(hot, 40, 16).requests_per_s == pytest.approx(capacity(clean, 40, 16).requests_per_s / 2)
    cap = capacity(hot, 40, 16)
    got = saturated(hot, 40, 16, 2 * cap.requests_per_s).throughput_per_s(skip=32)
    assert got == pytest.approx(cap.requests_per_s, rel=0.01)
    with pytest.raises(ConfigError, match="clock_fraction=0"):
        params(clock_fraction=0.0)
    with pytest.raises(ConfigError, match="clock_fraction=1.5"):
        params(clock_fraction=1.5)


def test_without_batching_one_sequence_runs_per_step_and_the_capacity_is_a_batch_of_one():
    p = params(no_batching=True)
    cap = capacity(p, 40, 16)
    # per request: O x (base + per_seq) + prefill x P = 16 x 11 + 4 = 180 ms
    assert cap.requests_per_s == pytest.approx(1000 / 180) and cap.max_num_seqs == 1
    assert cap.requests_per_s < capacity(params(), 40, 16).requests_per_s / 4
    got = saturated(p, 40, 16, 2 * cap.requests_per_s, n=400).throughput_per_s(skip=4)
    assert got == pytest.approx(cap.requests_per_s, rel=0.01)
    sched = BatchScheduler(p)
    for _ in range(5):
        sched.submit(Sequence(40, 16))
    it = sched.start_iteration()
    assert it is not None and len(it.running) == 1 and len(sched.waiting) == 4


@pytest.mark.parametrize("b, prompt, output, kv_blocks", [(8, 16, 20, 6), (16, 100, 50, 40), (8, 24, 16, 5),
                                                          (16, 64, 32, 20)])
def test_a_small_kv_cache_preempts_and_the_throughput_lands_in_its_closed_form_bracket(b, prompt, output, kv_blocks):
    p = params(max_num_seqs=b)
    low, high = kv_limited_capacity(p, prompt, output, kv_blocks)
    full = capacity(p, prompt, output).requests_per_s
    assert low <= high < full  # the cache, not the batch slots, is the limit
    res = saturated(p, prompt, output, 3 * full, n=3000, kv_blocks=kv_blocks)
    got = res.throughput_per_s(skip=50)
    print(f"B={b} P={prompt} O={output} kv={kv_blocks}: {low:.2f} <= {got:.2f} <= {high:.2f} req/s, "
          f"{res.preemptions} preemptions")
    assert low * 0.99 <= got <= high * 1.01
    assert res.completed == 3000  # a preempted sequence is finished all the same
    small, large = kv_concurrency(prompt, output, kv_blocks)
    if small < large:  # sequences admitted side by side outgrow the cache: preempted
        assert res.preemptions > 0


def test_a_kv_cache_large_enough_preempts_nothing_and_changes_nothing():
    p = params()
    cap = capacity(p, 40, 16).requests_per_s
    roomy = saturated(p, 40, 16, 2 * cap, kv_blocks=8 * 4)  # 8 sequences of 56 tokens: 4 blocks each
    assert roomy.preemptions == 0 and kv_limited_capacity(p, 40, 16, 32) == (pytest.approx(cap),) * 2
    assert roomy.throughput_per_s(skip=32) == pytest.approx(cap, rel=0.01)


def test_a_preempted_sequence_goes_back_first_and_computes_its_prompt_and_output_again():
    p = params(max_num_seqs=4, prefill_per_token_ms=1.0, decode_base_ms=10.0, decode_per_seq_ms=0.0)
    sched = BatchScheduler(p, kv_blocks=3)
    a, b = Sequence(16, 40), Sequence(15, 40)  # a: 2 blocks once it has a token; b: 1 block (16 tokens)
    sched.submit(a)
    sched.submit(b)
    it = sched.start_iteration()
    assert it is not None and it.running == [a, b]
    sched.finish_iteration(it)  # b holds 16 tokens: its next one needs a second block, 4 > 3
    it = sched.start_iteration()
    assert it is not None and it.running == [a] and list(sched.waiting) == [b] and sched.preemptions == 1
    assert b.preempted == 1 and b.generated == 1  # its output so far is kept
    while a.generated < a.output_tokens:
        sched.finish_iteration(it)
        it = sched.start_iteration()
        assert it is not None
    assert b in it.admitted and it.duration_ms == pytest.approx(10.0 + 1.0 * (15 + 1))  # prompt + its 1 token


def test_the_leak_grows_the_resident_memory_by_its_bytes_per_answer_and_a_clean_engine_exports_the_clean_values():
    leaky = EngineMetrics("m", 8, leak_bytes_per_request=faults.LEAK_BYTES_PER_REQUEST)
    clean = EngineMetrics("m", 8)
    before = leaky.resident_bytes()
    leaky.answered = clean.answered = 37
    assert leaky.resident_bytes() - before == leaked_bytes(faults.LEAK_BYTES_PER_REQUEST, 37) == 37 * (2 << 20)
    page = clean.render()
    rss = float(re.search(r"^process_resident_memory_bytes (\S+)$", page, re.M).group(1))  # type: ignore[union-attr]
    assert rss == clean.base_rss > 0
    assert re.search(r'^vllm:num_preemptions_total\{model_name="m"\} 0$', page, re.M)
    assert re.search(r"^DCGM_FI_DEV_CLOCK_THROTTLE_REASONS\{.*\} 0$", page, re.M)
    assert re.search(rf"^DCGM_FI_DEV_SM_CLOCK\{{.*\}} {SM_CLOCK_MHZ}$", page, re.M)
    hot = EngineMetrics("m", 8, clock_fraction=faults.THROTTLE_FRACTION).render()
    assert re.search(rf"^DCGM_FI_DEV_SM_CLOCK\{{.*\}} {round(SM_CLOCK_MHZ * faults.THROTTLE_FRACTION)}$", hot, re.M)
    assert re.search(rf"^DCGM_FI_DEV_CLOCK_THROTTLE_REASONS\{{.*\}} {faults.THROTTLE_REASON_SW_THERMAL}$", hot, re.M)


def test_the_engines_flags_reach_its_options_and_a_bad_value_is_refused_naming_it():
    base = ["--model-dir", "/m"]
    opts = options_from_args(parse_serve_args([*base, *faults.fault_args("throttle"), "--no-batching",
                                               *faults.fault_args("leak")]))
    assert opts.params.clock_fraction == faults.THROTTLE_FRACTION and opts.params.no_batching
    assert opts.leak_bytes_per_request == faults.LEAK_BYTES_PER_REQUEST
    clean = options_from_args(parse_serve_args(base))
    assert (clean.params.clock_fraction, clean.params.no_batching, clean.leak_bytes_per_request) == (1.0, False, 0)
    with pytest.raises(ConfigError, match="clock_fraction=2"):
        options_from_args(parse_serve_args([*base, "--throttle", "2"]))
    with pytest.raises(ConfigError, match="--leak-bytes-per-request -1"):
        options_from_args(parse_serve_args([*base, "--leak-bytes-per-request", "-1"]))


def _inventory(fault: str | None = "small_kv") -> Inventory:
    return Inventory.model_validate({"name": "t", "transport": "local", "nodes": [
        {"name": "n1", "address": "10.0.0.11", "link_mbit": 1000},
        {"name": "n2", "address": "10.0.0.12", "link_mbit": 1000, "sim_fault": fault}]})


def test_the_inventory_puts_a_fault_on_one_node_only_and_its_flags_win_over_the_runs_knobs():
    inv = _inventory("errors")
    spec = EngineSpec(profile="sim")
    argv = {n.name: engines.profile("sim").command(engines.LaunchContext(inv, n, "/m", "m", 8000, spec))
            for n in inv.nodes}
    assert "--error-rate" in argv["n1"] and argv["n1"][argv["n1"].index("--error-rate") + 1] == "0"
    assert argv["n2"][:len(argv["n1"])] != argv["n2"]  # n2 has more
    served = options_from_args(parse_serve_args(argv["n2"][argv["n2"].index("--host"):]))
    assert served.error_rate == faults.ERROR_RATE  # the fault comes last: it wins
    assert options_from_args(parse_serve_args(argv["n1"][argv["n1"].index("--host"):])).error_rate == 0.0
    for name in faults.FAULTS:
        assert faults.fault_args(name)  # every fault has its flags


def test_an_unknown_fault_or_a_fault_on_a_real_engine_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="sim_fault"):
        _inventory("melt")
    inv = _inventory("throttle")
    with pytest.raises(ConfigError, match="node n2: the inventory puts the simulated fault 'throttle'"):
        engines.profile("vllm").command(engines.LaunchContext(inv, inv.nodes[1], "/m", "m", 8000,
                                                              EngineSpec(profile="vllm")))
    # the other node, without a fault, gets its vllm command
    assert engines.profile("vllm").command(engines.LaunchContext(inv, inv.nodes[0], "/m", "m", 8000,
                                                                 EngineSpec(profile="vllm")))[0] == "vllm"


def test_the_trigger_form_cannot_put_a_fault_on_a_node():
    """The per-node faults are the operator's (the inventory), not the form's: no form field sets one, a conf that
    names one is refused, and the engine's knobs (what a conf's engine section reaches) have none."""
    from deploybench import params
    from deploybench.config import SimKnobs

    new = ("sim_fault", "throttle", "leak", "no_batching")
    assert not [f.name for f in params.FIELDS if any(k in f.name for k in new)]
    for name in ("sim_fault", "sim_throttle", "sim_no_batching"):
        with pytest.raises(ConfigError, match=name):
            params.to_config({"inventory": "demo", name: "throttle"})
    assert not {"throttle", "clock_fraction", "no_batching", "leak_bytes_per_request"} & set(SimKnobs.model_fields)


def test_the_drift_fault_slows_each_request_by_its_closed_form():
    """A batch of one, every request queued at 0: request k completes at single_e2e x (g^(k+1) - 1) / (g - 1)
    (``drift_completion_ms``), g = 1 + drift_per_request; without the fault, at single_e2e x (k + 1)."""
    from dataclasses import replace

    from deploybench.sim.service_model import ServiceParams, capacity, drift_completion_ms, simulate

    base = ServiceParams(max_num_seqs=1, decode_base_ms=10, decode_per_seq_ms=0.5, prefill_per_token_ms=0.1,
                         queue_limit=100)
    drifting = replace(base, drift_per_request=0.1)
    arrivals = [(0.0, 20, 8)] * 30
    for params in (base, drifting):
        done = sorted(simulate(params, arrivals).completions_ms)
        for k in (0, 1, 9, 29):
            assert done[k] == pytest.approx(drift_completion_ms(params, 20, 8, k), rel=1e-9), (params, k)
    one = capacity(base, 20, 8).single_e2e_ms
    assert drift_completion_ms(base, 20, 8, 29) == pytest.approx(30 * one)
    late = sorted(simulate(drifting, arrivals).completions_ms)
    assert late[29] - late[28] == pytest.approx(one * 1.1 ** 29)  # the 30th takes 15.9 x the first's time
    assert drifting.drift_factor(10**9) == pytest.approx(1e6)  # bounded: no overflow on a long-lived engine
    with pytest.raises(ConfigError, match="drift_per_request=1.5"):
        replace(base, drift_per_request=1.5)


def test_a_node_without_dcgm_starts_its_engine_without_the_gauges_and_the_drift_fault_reaches_the_scheduler():
    inv = Inventory.model_validate({"name": "t", "transport": "local", "nodes": [
        {"name": "n1", "address": "10.0.0.11", "link_mbit": 1000},
        {"name": "n2", "address": "10.0.0.12", "link_mbit": 1000, "sim_dcgm": False, "sim_fault": "drift"}]})
    spec = EngineSpec(profile="sim")
    argv = {n.name: engines.profile("sim").command(engines.LaunchContext(inv, n, "/m", "m", 8000, spec))
            for n in inv.nodes}
    assert "--no-dcgm" not in argv["n1"] and "--drift-per-request" not in argv["n1"]
    served = options_from_args(parse_serve_args(argv["n2"][argv["n2"].index("--host"):]))
    assert served.dcgm is False and served.params.drift_per_request == faults.DRIFT_PER_REQUEST
    assert options_from_args(parse_serve_args(argv["n1"][argv["n1"].index("--host"):])).dcgm is True
    with pytest.raises(ValueError, match="sim_dcgm"):
        Inventory.model_validate({"name": "t", "transport": "local", "nodes": [
            {"name": "n1", "address": "10.0.0.11", "link_mbit": 1000, "sim_dcgm": "maybe"}]})
