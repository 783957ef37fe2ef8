"""The sim engine's prefix cache: vLLM v1's rules (chained block hashes, hits capped at the prompt less one
token, LRU eviction), and its closed form against a discrete-event run of the scheduler that uses it."""

from __future__ import annotations

import hashlib
import re

import pytest

from deploybench.errors import ConfigError
from deploybench.sim.service_model import (
    BLOCK_TOKENS,
    BatchScheduler,
    PrefixCache,
    Sequence,
    ServiceParams,
    block_hashes,
    capacity,
    count_tokens,
    shared_prefix_cached_tokens,
    simulate,
)


def words(n: int, tag: str) -> str:
    """``n`` distinct one-token words, marked with ``tag``."""
    return " ".join(f"{tag}w{i}" for i in range(n))


def params(**kw) -> ServiceParams:
    base = dict(
        max_num_seqs=8,
        decode_base_ms=20.0,
        decode_per_seq_ms=4.0,
        prefill_per_token_ms=0.5,
        queue_limit=10**6,
    )
    return ServiceParams(**{**base, **kw})


# -- block hashes ----------------------------------------------------------------------------------


def test_block_hashes_are_a_chain_over_full_blocks():
    text = words(40, "a")  # 2 full blocks and 8 tokens that are not hashed
    chain = block_hashes(text)
    assert len(chain) == 2 and len(set(chain)) == 2
    # block 0 by hand: an 8-byte blake2b of the parent (8 zero bytes) and the block's space-joined tokens
    first = hashlib.blake2b(bytes(8) + words(16, "a").encode(), digest_size=8).digest()
    assert chain[0] == int.from_bytes(first, "little")
    second = hashlib.blake2b(first + " ".join(text.split()[16:32]).encode(), digest_size=8).digest()
    assert chain[1] == int.from_bytes(second, "little")
    # the same prefix gives the same leading hashes, whatever follows
    assert block_hashes(words(32, "a") + " other words")[:2] == chain
    assert block_hashes(words(64, "a"))[:2] == chain
    # one changed token changes its block and every block after it, not those before
    tokens = words(64, "a").split()
    tokens[20] = "changed"
    changed, original = block_hashes(" ".join(tokens)), block_hashes(words(64, "a"))
    assert changed[0] == original[0] and all(c != o for c, o in zip(changed[1:], original[1:]))
    # a block's hash depends on its parent: the same 16 tokens after another first block hash differently
    moved = block_hashes(words(16, "b") + " " + " ".join(words(64, "a").split()[16:32]))
    assert moved[1] != original[1]
    assert block_hashes(words(15, "a")) == () and block_hashes("") == ()


def test_block_hashes_use_the_tokens_count_tokens_counts():
    # punctuation is a token of its own; whitespace of any kind and amount separates tokens
    assert block_hashes("a, b. " * 4) == block_hashes("a ,  b\t.\n" * 4)
    assert len(block_hashes("a, b. " * 4)) == count_tokens("a, b. " * 4) // BLOCK_TOKENS == 1
    # text without punctuation is split on whitespace: the same tokens as the regular expression's
    for text in ("naïve café\u00a0crème x_y 2025", "tab\tnew\nline\u2003em\u3000ideographic", "é" * 3 + " ü"):
        assert count_tokens(text) == len(re.findall(r"\w+|[^\w\s]", text)), text
    assert count_tokens("it's 2025, ok?") == 7


# -- the cache -------------------------------------------------------------------------------------


def test_a_whole_cached_prompt_still_computes_its_last_block():
    cache = PrefixCache(1000)
    chain = block_hashes(words(32, "a"))  # exactly 2 full blocks
    assert cache.lookup(chain, 32) == 0 and len(cache) == 2
    # all 32 tokens are cached, but at most 31 may hit: whole blocks only, so 16
    assert cache.lookup(chain, 32) == 16
    assert cache.lookup(block_hashes(words(33, "a")), 33) == 32  # one token more: both blocks hit
    assert (cache.queries, cache.hits) == (32 + 32 + 33, 16 + 32)


def test_partial_blocks_never_hit():
    cache = PrefixCache(1000)
    short = words(15, "s")
    assert block_hashes(short) == ()
    assert cache.lookup((), 15) == 0 and cache.lookup((), 15) == 0  # the same 15 tokens twice: nothing cached
    twenty = block_hashes(words(20, "t"))
    assert cache.lookup(twenty, 20) == 0 and cache.lookup(twenty, 20) == 16  # the 4-token tail never hits
    assert (cache.queries, cache.hits) == (70, 16)


def test_the_longest_cached_prefix_hits_and_stops_at_the_first_miss():
    cache = PrefixCache(1000)
    a = block_hashes(words(64, "a"))
    cache.insert(a[:1] + a[2:])  # blocks 0, 2 and 3 cached, block 1 not: only block 0 is a prefix
    assert cache.lookup(a, 65) == 16


def test_lru_eviction_drops_the_least_recently_used_first():
    cache = PrefixCache(3)
    a, b, c, d = (block_hashes(words(16, t)) for t in "abcd")
    for chain in (a, b, c):
        cache.lookup(chain, 17)
    assert cache.lookup(a, 17) == 16  # a is now the most recently used; b the least
    cache.lookup(d, 17)
    assert len(cache) == 3 and b[0] not in cache and all(x[0] in cache for x in (a, c, d))
    cache.lookup(b, 17)  # b comes back and c, now the least recently used, goes
    assert c[0] not in cache and all(x[0] in cache for x in (a, b, d))


def test_a_chain_is_evicted_tail_first():
    cache = PrefixCache(2)
    chain = block_hashes(words(48, "a"))
    cache.lookup(chain, 49)  # 3 blocks into 2: the last block goes, the first two stay
    assert chain[0] in cache and chain[1] in cache and chain[2] not in cache
    assert cache.lookup(chain, 49) == 32
    assert PrefixCache(0).lookup(chain, 49) == 0
    with pytest.raises(ConfigError, match="-1 blocks"):
        PrefixCache(-1)


def test_requests_admitted_in_one_iteration_share_what_the_first_caches():
    p = params(max_num_seqs=4, decode_base_ms=10, decode_per_seq_ms=3, prefill_per_token_ms=0.5)
    sched = BatchScheduler(p, cache=PrefixCache(1000))
    system = words(48, "sys")
    seqs = [Sequence(52, 2, blocks=block_hashes(f"{system} {words(4, u)}")) for u in "xyz"]
    for s in seqs:
        sched.submit(s)
    it = sched.start_iteration()
    assert [s.cached_tokens for s in seqs] == [0, 48, 48]
    assert it.duration_ms == pytest.approx(0.5 * (52 + 4 + 4) + 10 + 3 * 3)
    without = BatchScheduler(p)  # no cache: every prompt token is prefilled, as before
    for s in [Sequence(52, 2, blocks=x.blocks) for x in seqs]:
        without.submit(s)
    assert without.start_iteration().duration_ms == pytest.approx(0.5 * 3 * 52 + 10 + 3 * 3)


# -- closed form -----------------------------------------------------------------------------------


def test_capacity_with_cached_tokens_by_hand():
    p = params(prefill_per_token_ms=0.1, queue_limit=64)
    # per request: O*(base/B + per_seq) + prefill*(P - C) = 64*(2.5 + 4) + 0.1*(200 - 150) = 421 ms
    cap = capacity(p, prompt_tokens=200, output_tokens=64, cached_tokens=150)
    assert cap.requests_per_s == pytest.approx(1000 / 421) and cap.cached_tokens == 150
    assert cap.single_ttft_ms == pytest.approx(0.1 * 50 + 24) and cap.prompt_tokens == 200
    assert capacity(p, 200, 64, 0.0) == capacity(p, 200, 64)
    with pytest.raises(ConfigError, match="cached_tokens=201"):
        capacity(p, 200, 64, cached_tokens=201)


def test_shared_prefix_cached_tokens_by_hand():
    assert shared_prefix_cached_tokens(100, 64, 4) == pytest.approx(64 * 3 / 4)
    assert shared_prefix_cached_tokens(100, 70, 4) == pytest.approx(64 * 3 / 4)  # whole blocks only
    # a prefix that is the whole prompt: its last block is always computed
    assert shared_prefix_cached_tokens(64, 64, 2) == pytest.approx(48 / 2)
    assert shared_prefix_cached_tokens(100, 15, 10) == 0.0 and shared_prefix_cached_tokens(100, 64, 1) == 0.0
    with pytest.raises(ConfigError, match="requests_per_prefix=0"):
        shared_prefix_cached_tokens(100, 64, 0)


@pytest.mark.parametrize("prefix", [64, 70, 200])
def test_shared_prefixes_hit_as_the_closed_form_says(prefix):
    """G groups of k requests; a request's prompt is its group's prefix and 8 tokens of its own. Every
    request after the first of its group hits floor(prefix/16) x 16 tokens; the throughput is capacity's
    with that mean cached."""
    p = params()
    groups, k, suffix, out = 5, 80, 8, 16
    prompt = prefix + suffix
    arrivals = []
    for r in range(groups * k):  # the groups interleaved, all queued at t=0 in this order
        g = r % groups
        text = f"{words(prefix, f'g{g}')} {words(suffix, f'r{r}')}"
        assert count_tokens(text) == prompt
        arrivals.append((r * 1e-6, prompt, out, block_hashes(text)))
    cache = PrefixCache(10**6)
    result = simulate(p, arrivals, cache=cache)
    assert result.completed == groups * k
    assert cache.queries == groups * k * prompt
    assert cache.hits == groups * (k - 1) * (prefix // 16) * 16
    cached = shared_prefix_cached_tokens(prompt, prefix, k)
    assert cache.hits / cache.queries == pytest.approx(cached / prompt, rel=1e-12)
    cap = capacity(p, prompt, out, cached_tokens=cached)
    measured = 1000 * result.completed / result.last_completion_ms
    assert measured == pytest.approx(cap.requests_per_s, rel=0.02)
    # and without the cache the same arrivals run at the capacity of the whole prompt
    plain = simulate(p, arrivals)
    uncached = capacity(p, prompt, out).requests_per_s
    assert 1000 * plain.completed / plain.last_completion_ms == pytest.approx(uncached, rel=0.02)
    assert measured / uncached > 1.15  # the cache's gain is far above the tolerance


def test_without_a_cache_or_shared_blocks_the_run_is_todays():
    p = params(queue_limit=64)
    plain = [(i * 100.0, 40 + i % 30, 5 + i % 11) for i in range(400)]
    today = simulate(p, plain)
    assert today.refused == 0 and max(today.e2e_ms) > 2 * min(today.e2e_ms)  # batches of varied make-up
    with_blocks = [(t, n, o, block_hashes(words(n, f"u{i}"))) for i, (t, n, o) in enumerate(plain)]
    assert simulate(p, with_blocks) == today  # blocks, no cache
    cache = PrefixCache(10**6)
    assert simulate(p, with_blocks, cache=cache) == today  # a cache, nothing shared: no hit, same times
    assert cache.hits == 0 and cache.queries == sum(n for _, n, _ in plain)


# -- the engine's side: its cache's size, and the KV usage it exports -----------------------------------


def test_the_kv_cache_is_what_memory_leaves_after_the_model_unless_given():
    from deploybench.sim import metrics as em
    from deploybench.sim.engine import kv_cache_blocks

    assert em.GPU_MEMORY_UTILIZATION == 0.9 and em.KV_MIB_PER_TOKEN == 0.125 and em.GPU_MEMORY_MIB == 131072
    assert kv_cache_blocks(0, 0) == int(131072 * 0.9 / 0.125) // 16 == 58982
    assert kv_cache_blocks(0, 64 * 2**20) == int((131072 * 0.9 - 64) / 0.125) // 16 == 58950
    assert kv_cache_blocks(0, 200 * 2**30) == 0  # the model alone fills the memory
    assert kv_cache_blocks(1000, 64 * 2**20) == 62  # given: whole blocks of it


def test_kv_usage_counts_a_shared_prompt_block_once():
    from deploybench.sim.metrics import EngineMetrics

    m = EngineMetrics("m", slots=4, kv_blocks=100)
    assert m.kv_usage() == 0.0
    shared = block_hashes(words(40, "s"))  # 2 full blocks, 8 tokens in a third
    a, b = Sequence(40, 10, blocks=shared), Sequence(40, 10, blocks=shared, generated=9)
    m.batch([a, b], waiting=0)
    # the 2 shared blocks once; a: its partial third block; b: 49 tokens, 2 blocks beyond the shared
    assert m.kv_usage() == pytest.approx((2 + 1 + 2) / 100)
    m.batch([Sequence(40, 10), Sequence(40, 10, generated=9)], waiting=0)  # no cache: nothing shared
    assert m.kv_usage() == pytest.approx((3 + 4) / 100)
    assert 'vllm:kv_cache_usage_perc{model_name="m"} 0.070000' in m.render()
    m.kv_blocks = 5
    assert m.kv_usage() == 1.0  # the sim does not preempt: the gauge stops at full
    m.batch([], waiting=0)
    assert m.kv_usage() == 0.0
