"""The sim engine's service model: the closed form against a discrete-event run of the same scheduler."""

from __future__ import annotations

import random

import pytest

from deploybench.config import EngineSpec
from deploybench.errors import ConfigError
from deploybench.sim.service_model import (
    VOCABULARY,
    BatchScheduler,
    Sequence,
    ServiceParams,
    capacity,
    chat_prompt,
    count_tokens,
    expected_completion,
    simulate,
)


def params(**kw) -> ServiceParams:
    base = dict(max_num_seqs=8, decode_base_ms=20.0, decode_per_seq_ms=4.0, prefill_per_token_ms=0.1, queue_limit=64)
    return ServiceParams(**{**base, **kw})


def test_closed_form_by_hand():
    # per request: O*(base/B + per_seq) + prefill*P = 64*(2.5 + 4) + 0.1*200 = 436 ms
    cap = capacity(params(), prompt_tokens=200, output_tokens=64)
    assert cap.requests_per_s == pytest.approx(1000 / 436)
    assert cap.output_tokens_per_s == pytest.approx(64 * 1000 / 436)
    assert cap.single_ttft_ms == pytest.approx(20 + 24)
    assert cap.single_itl_ms == pytest.approx(24)
    assert cap.single_e2e_ms == pytest.approx(20 + 64 * 24)
    assert cap.full_e2e_ms == pytest.approx(8 * 436)
    assert cap.full_queue_wait_ms == pytest.approx(64 * 436)
    slow = capacity(params(slowdown=2.0), 200, 64)
    assert slow.requests_per_s == pytest.approx(cap.requests_per_s / 2)


@pytest.mark.parametrize(
    "knobs, prompt, output",
    [
        (dict(), 200, 64),
        (dict(max_num_seqs=4, decode_base_ms=5.0, decode_per_seq_ms=1.0, prefill_per_token_ms=0.02), 50, 16),
        (dict(max_num_seqs=32, decode_base_ms=15.0, decode_per_seq_ms=2.0, prefill_per_token_ms=0.5), 1000, 8),
        (dict(max_num_seqs=1, slowdown=3.0), 10, 100),
    ],
)
def test_saturation_throughput_matches_the_scheduler(knobs, prompt, output):
    p = params(queue_limit=10**6, **knobs)
    cap = capacity(p, prompt, output)
    gap = 1000 / (2 * cap.requests_per_s)  # offered at twice the capacity: the batch is always full
    n = 2000
    result = simulate(p, [(i * gap, prompt, output) for i in range(n)])
    assert result.completed == n and result.refused == 0
    assert result.throughput_per_s(skip=4 * p.max_num_seqs) == pytest.approx(cap.requests_per_s, rel=0.01)


def test_saturation_throughput_with_mixed_requests_uses_the_means():
    rng = random.Random(3)
    p = params(queue_limit=10**6)
    reqs = [(rng.randint(50, 350), rng.randint(16, 112)) for _ in range(4000)]
    mean_p = sum(r[0] for r in reqs) / len(reqs)
    mean_o = sum(r[1] for r in reqs) / len(reqs)
    cap = capacity(p, mean_p, mean_o)
    # all queued at t=0: the batch stays full until the queue drains
    result = simulate(p, [(0.0, pp, oo) for pp, oo in reqs])
    assert 1000 * result.completed / result.last_completion_ms == pytest.approx(cap.requests_per_s, rel=0.02)


def test_the_naive_formula_without_batching_would_not_match():
    """Guards the test itself: a capacity that ignores batching is far off the simulated one."""
    p = params(queue_limit=10**6)
    result = simulate(p, [(0.0, 200, 64) for _ in range(500)])
    naive = 1000 / (64 * (p.decode_base_ms + p.decode_per_seq_ms) + 0.1 * 200)
    assert abs(1000 * result.completed / result.last_completion_ms - naive) / naive > 0.5


def test_light_load_latency_is_exact():
    p = params()
    cap = capacity(p, 200, 64)
    result = simulate(p, [(0.0, 200, 64), (10_000.0, 200, 64)])  # far apart: each alone
    assert result.ttft_ms == pytest.approx([cap.single_ttft_ms] * 2)
    assert result.e2e_ms == pytest.approx([cap.single_e2e_ms] * 2)


def test_full_batch_latency_when_admitted_together():
    p = params()
    cap = capacity(p, 200, 64)
    result = simulate(p, [(0.0, 200, 64)] * 8)
    assert result.ttft_ms == pytest.approx([cap.full_ttft_max_ms] * 8)
    assert result.e2e_ms == pytest.approx([cap.full_e2e_ms] * 8)  # = B / lambda_max (Little)


def test_full_batch_mean_iteration_in_steady_state():
    p = params(queue_limit=10**6)
    cap = capacity(p, 200, 64)
    result = simulate(p, [(0.0, 200, 64)] * 800)
    iterations = 800 * 64 / 8
    assert result.last_completion_ms / iterations == pytest.approx(cap.full_iteration_ms, rel=1e-9)


def test_queue_limit_refuses_beyond_slots_plus_queue():
    p = params(max_num_seqs=4, queue_limit=3)
    result = simulate(p, [(0.0, 10, 5)] * 10)
    assert (result.completed, result.refused) == (7, 3)
    sched = BatchScheduler(params(max_num_seqs=2, queue_limit=0))
    assert sched.submit(Sequence(1, 1)) and sched.submit(Sequence(1, 1))
    assert not sched.submit(Sequence(1, 1))


def test_iteration_time_counts_admitted_prefill_and_running_sequences():
    sched = BatchScheduler(params(max_num_seqs=2, decode_base_ms=10, decode_per_seq_ms=3, prefill_per_token_ms=0.5))
    a, b, c = Sequence(100, 2), Sequence(40, 1), Sequence(20, 1)
    for s in (a, b, c):
        sched.submit(s)
    it = sched.start_iteration()
    assert it.admitted == [a, b] and it.duration_ms == pytest.approx(0.5 * 140 + 10 + 3 * 2)
    assert sched.finish_iteration(it) == [b]
    it = sched.start_iteration()  # c takes b's slot
    assert it.admitted == [c] and it.duration_ms == pytest.approx(0.5 * 20 + 10 + 3 * 2)
    assert sched.finish_iteration(it) == [a, c]
    assert sched.start_iteration() is None and not sched.busy


def test_params_come_from_config_and_are_validated():
    spec = EngineSpec()
    p = ServiceParams.from_config(spec)
    assert (p.max_num_seqs, p.decode_base_ms, p.queue_limit) == (
        spec.max_num_seqs, spec.sim.decode_base_ms, spec.sim.queue_limit)
    with pytest.raises(ConfigError, match="max_num_seqs=0"):
        params(max_num_seqs=0)
    with pytest.raises(ConfigError, match="output_tokens=0"):
        capacity(params(), 10, 0)


def test_token_count_approximation():
    assert count_tokens("hello world") == 2
    assert count_tokens("Hello, world! It's 2025.") == 9  # Hello , world ! It ' s 2025 .
    assert count_tokens("") == 0
    assert count_tokens(" ".join(["word"] * 200)) == 200
    assert chat_prompt([{"role": "system", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": "hi there"}]}]) == "be brief\nhi there"


def test_expected_completion_is_deterministic_and_exact_in_length():
    text = expected_completion("The capital of France is", 32, seed=7)
    assert text == expected_completion("The capital of France is", 32, seed=7)
    assert text != expected_completion("The capital of France is", 32, seed=8)
    assert text != expected_completion("The capital of Spain is", 32, seed=7)
    assert count_tokens(text) == 32 and text.startswith(" ")
    assert expected_completion("The capital of France is", 40, seed=7).startswith(text)
    assert set(text.split()) <= set(VOCABULARY)
    assert len(set(text.split())) > 8  # not one word repeated
