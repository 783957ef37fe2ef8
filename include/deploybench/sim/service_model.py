"""The simulated engine's service model: continuous batching, its closed-form capacity, its text.

Pure code (no I/O, no clock): the HTTP server in ``deploybench.sim.engine`` drives
``BatchScheduler`` with real asyncio deadlines, and ``simulate`` drives the very same object
with a virtual clock, so the closed form below is tested against the scheduler that serves.

The scheduler (one engine, ``B = max_num_seqs`` batch slots), like vLLM's continuous batching:

* An arriving request joins a FIFO waiting queue. It is refused at once (HTTP 429) when the
  engine already holds ``B + queue_limit`` requests (running + waiting): ``queue_limit`` is the
  number that may wait beyond the batch slots.
* An iteration starts when the previous one ends (or, when idle, when a request arrives). At its
  start, waiting requests are admitted FIFO into free slots. Its duration is
  ``slowdown x (prefill_per_token_ms x sum(prompt tokens of the newly admitted)
  + decode_base_ms + decode_per_seq_ms x running)``, where ``running`` counts the admitted too.
* At its end every running sequence has one more token (the admitted get their first), and the
  tokens are delivered to the clients then. A sequence that reached its output length leaves,
  freeing its slot for the next iteration.

Closed form, with P and O the mean prompt and output tokens and the batch always full: a
request occupies one of B slots for O iterations, so O/B iterations are spent per request, and
its prefill is paid once; hence the time per completed request is
``slowdown x (O x (decode_base_ms/B + decode_per_seq_ms) + prefill_per_token_ms x P)`` and
``lambda_max`` is its inverse.

Prefix caching, as vLLM v1's automatic prefix caching (on by default there, and here): the KV cache is
made of ``BLOCK_TOKENS``-token blocks, and a prompt's full blocks are named by a chain of hashes
(``block_hashes``: block i's hash is a hash of block i-1's and of its own tokens, so equal hashes mean
equal prompts up to the end of that block). When a request is admitted, ``PrefixCache.lookup`` finds
the longest prefix of its chain already cached, at most its prompt less one token (the last token is
always computed), and the iteration's prefill counts only the ``prompt - cached`` tokens; its blocks
are then cached, so a request admitted after it, even in the same iteration, finds them. The cache
holds ``capacity_blocks`` blocks and evicts the least recently used. Closed form: with C the mean
cached tokens per request, P becomes P - C above (``capacity(..., cached_tokens=C)``); for prompts
that share a prefix of S tokens in groups of k requests, C = (1 - 1/k) x 16 x floor(S/16)
(``shared_prefix_cached_tokens``), and the hit rate hits/queries is C/P.

Tokens: a prompt's token count is the number of ``\\w+|[^\\w\\s]`` matches (words, and each
punctuation mark on its own), a deterministic stand-in for a real tokenizer; a prompt of N
space-separated plain words is N tokens. Generated token i is `` <word>`` from a fixed
vocabulary picked by a hash of (seed, prompt, i), so the text can be predicted from outside
(``expected_completion``) and re-tokenizes to exactly the number of tokens generated.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from deploybench.errors import ConfigError

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
_PLAIN_RE = re.compile(r"[\w\s]*")  # no punctuation: the tokens are the whitespace-separated words

VOCABULARY: tuple[str, ...] = tuple(
    """the of and to in is was for on that with as by at from this are be it an or which were
    have has not had but been one their also more they its new first all two other can time
    after into would about there during only most some over such may when these than then many
    model token batch node cluster engine request latency throughput queue slot prefill decode
    rollout canary stage fanout shard weight memory network link switch server client stream
    river mountain forest garden window harbor signal lantern compass meadow valley orchard
    copper silver marble granite cedar maple willow falcon heron otter badger sparrow""".split()
)
_MASK64 = (1 << 64) - 1


def tokenize(text: str) -> list[str]:
    """The sim's tokens of ``text``: words and single punctuation marks (see module doc).

    Text without punctuation (a benchmark's prompt, mostly) is split on whitespace, which gives the
    same tokens (``\\s`` and ``str.split`` share Unicode's whitespace) in a third of the time."""
    return text.split() if _PLAIN_RE.fullmatch(text) else _TOKEN_RE.findall(text)


def count_tokens(text: str) -> int:
    """The sim's token count of ``text``: words and single punctuation marks (see module doc)."""
    return len(tokenize(text))


def chat_prompt(messages: Iterable[dict]) -> str:
    """The string a chat request is generated from: its messages' contents, one per line.

    The chat template is free: a chat request's prompt tokens are the tokens of its contents.
    ``content`` may be a string or a list of OpenAI content parts (their ``text`` is used).
    """
    lines = []
    for msg in messages:
        content = msg.get("content") or ""
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        lines.append(str(content))
    return "\n".join(lines)


def _prompt_key(prompt: str, seed: int) -> int:
    digest = hashlib.blake2b(prompt.encode("utf-8", "surrogatepass"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little")


def _mix(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class TokenStream:
    """The generated tokens of one (prompt, seed): token i is a function of (seed, prompt, i) only."""

    __slots__ = ("_key",)

    def __init__(self, prompt: str, seed: int) -> None:
        self._key = _prompt_key(prompt, seed)

    def token(self, i: int) -> str:
        return " " + VOCABULARY[_mix(self._key + i) % len(VOCABULARY)]


def expected_completion(prompt: str, max_tokens: int, seed: int = 0) -> str:
    """The exact text the sim answers to ``prompt`` with ``max_tokens`` (below max_model_len).

    For a chat request pass ``chat_prompt(messages)`` as the prompt. The smoke check of the
    rollout compares an engine's answer with this.
    """
    stream = TokenStream(prompt, seed)
    return "".join(stream.token(i) for i in range(max_tokens))


# -- the prefix cache ------------------------------------------------------------------------------
# The rules are vLLM v1's (vllm-project/vllm): vllm/v1/core/kv_cache_utils.py (hash_block_tokens: a full
# block's hash is a hash of its parent's hash and its own tokens; only full blocks are hashed) and
# vllm/v1/core/kv_cache_manager.py (get_computed_blocks: the longest cached prefix of the chain, capped at
# max_cache_hit_length = num_tokens - 1; PrefixCacheStats count queries and hits in tokens).

BLOCK_TOKENS = 16  # vLLM's default KV block size on a GPU
_NONE_HASH = bytes(8)  # the parent of the first block


def block_hashes(text: str, block_tokens: int = BLOCK_TOKENS) -> tuple[int, ...]:
    """The chained hashes of the full blocks of ``text``'s tokens (the tokens ``count_tokens`` counts)."""
    return chain_hashes(tokenize(text), block_tokens)


def chain_hashes(tokens: list[str], block_tokens: int = BLOCK_TOKENS) -> tuple[int, ...]:
    """The chained hashes of the full blocks of ``tokens`` (a server that has them hashes without tokenizing again).

    Block i's hash is an 8-byte blake2b of block i-1's hash and of its own tokens: two prompts share
    their first n hashes exactly when they share their first n x ``block_tokens`` tokens, and the
    hashes are the same in every process, so a test can compute what an engine caches. About 0.1 ms
    for a prompt of 2,000 tokens (125 blocks).
    """
    out = []
    parent = _NONE_HASH
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        # no token holds whitespace: the space-joined block reads back as its tokens
        data = parent + " ".join(tokens[start : start + block_tokens]).encode("utf-8", "surrogatepass")
        parent = hashlib.blake2b(data, digest_size=8).digest()
        out.append(int.from_bytes(parent, "little"))
    return tuple(out)


class PrefixCache:
    """The KV blocks an engine has computed, by hash: what a later prompt with the same prefix need not prefill.

    ``capacity_blocks`` blocks at most; inserting past it evicts the least recently used. A request's
    blocks are inserted tail first, so that its first blocks, the likeliest to be shared, are evicted
    last (as vLLM frees a request's blocks in reverse order). Simplification: vLLM evicts only blocks
    that no running request holds and orders them when a request finishes; here every cached block may
    go, in the order of admission. ``queries`` and ``hits`` count tokens, as vLLM's PrefixCacheStats do.
    """

    __slots__ = ("capacity_blocks", "block_tokens", "queries", "hits", "_blocks")

    def __init__(self, capacity_blocks: int, block_tokens: int = BLOCK_TOKENS) -> None:
        if capacity_blocks < 0 or block_tokens < 1:
            raise ConfigError(
                f"prefix cache of {capacity_blocks} blocks of {block_tokens} tokens: needs >= 0 blocks of >= 1 token"
            )
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens
        self.queries = 0  # prompt tokens of every request looked up
        self.hits = 0  # of those, the tokens found cached
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def lookup(self, blocks: tuple[int, ...], prompt_tokens: int) -> int:
        """The cached tokens of a request of ``prompt_tokens`` tokens whose full blocks are ``blocks``; then
        caches its blocks (most recently used). Counts the query and the hit."""
        limit = min(len(blocks), (prompt_tokens - 1) // self.block_tokens) if prompt_tokens > 0 else 0
        cached, hit = self._blocks, 0
        while hit < limit and blocks[hit] in cached:
            hit += 1
        self.queries += prompt_tokens
        self.hits += hit * self.block_tokens
        self.insert(blocks)
        return hit * self.block_tokens

    def insert(self, blocks: tuple[int, ...]) -> None:
        """Cache ``blocks`` (a chain), its first block the most recently used; evict past the capacity."""
        cached = self._blocks
        for h in reversed(blocks):
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > self.capacity_blocks:
            cached.popitem(last=False)


def shared_prefix_cached_tokens(
    prompt_tokens: int, prefix_tokens: int, requests_per_prefix: float, block_tokens: int = BLOCK_TOKENS
) -> float:
    """Mean cached tokens per request when prompts of ``prompt_tokens`` tokens share a prefix of
    ``prefix_tokens`` tokens in groups of ``requests_per_prefix`` (differing right after it), and nothing
    is evicted: the first request of a group computes the prefix, each later one finds its full blocks,
    at most the prompt less one token. The hit rate (hits / queries) is this over ``prompt_tokens``."""
    if requests_per_prefix < 1 or not 0 <= prefix_tokens <= prompt_tokens:
        raise ConfigError(
            f"requests_per_prefix={requests_per_prefix} must be >= 1 and prefix_tokens={prefix_tokens} "
            f"within 0..prompt_tokens={prompt_tokens}"
        )
    full = min(prefix_tokens // block_tokens, max(0, prompt_tokens - 1) // block_tokens) * block_tokens
    return full * (1.0 - 1.0 / requests_per_prefix)


# -- the scheduler ---------------------------------------------------------------------------------


MAX_DRIFT_FACTOR = 1e6  # the drift fault's slowdown stops growing here: a step of 10 ms then lasts ~3 hours


@dataclass(frozen=True)
class ServiceParams:
    """The knobs that decide timing (milliseconds). No defaults here: they live in deploybench.config
    (EngineSpec, SimKnobs); ``from_config(EngineSpec())`` gives them."""

    max_num_seqs: int
    decode_base_ms: float
    decode_per_seq_ms: float
    prefill_per_token_ms: float
    queue_limit: int
    slowdown: float = 1.0
    # faults (deploybench.sim.faults): the SM clock's fraction of nominal (every time / it), one request per step
    clock_fraction: float = 1.0
    no_batching: bool = False
    # the drift fault: every step of the engine that has answered n requests lasts (1 + drift_per_request) ** n
    # times longer (``drift_factor``): its throughput falls over a phase, as a leak or a fragmenting cache makes it
    drift_per_request: float = 0.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs={self.max_num_seqs}: needs at least 1 batch slot")
        if self.decode_base_ms <= 0 or self.decode_per_seq_ms < 0 or self.prefill_per_token_ms < 0:
            raise ConfigError(
                f"decode_base_ms={self.decode_base_ms} must be > 0, decode_per_seq_ms={self.decode_per_seq_ms} "
                f"and prefill_per_token_ms={self.prefill_per_token_ms} >= 0"
            )
        if self.queue_limit < 0 or self.slowdown <= 0:
            raise ConfigError(f"queue_limit={self.queue_limit} must be >= 0 and slowdown={self.slowdown} > 0")
        if not 0 < self.clock_fraction <= 1:
            raise ConfigError(f"clock_fraction={self.clock_fraction} must be in (0, 1]: the share of the nominal SM "
                              "clock a throttled GPU keeps (1 = not throttled)")
        if not 0 <= self.drift_per_request <= 1:
            raise ConfigError(f"drift_per_request={self.drift_per_request} must be in [0, 1]: the fraction every "
                              "answered request adds to each later step's time (0 = no drift)")

    @property
    def time_factor(self) -> float:
        """What every service time is multiplied by: the slowdown, and a throttled clock's 1 / fraction."""
        return self.slowdown / self.clock_fraction

    def drift_factor(self, answered: int) -> float:
        """What the drift fault multiplies a step by once ``answered`` requests were answered (1 without it)."""
        if not self.drift_per_request:
            return 1.0
        return math.exp(min(math.log(MAX_DRIFT_FACTOR), answered * math.log1p(self.drift_per_request)))

    @property
    def batch_limit(self) -> int:
        """Sequences that may run in one step: the batch slots, or 1 without batching."""
        return 1 if self.no_batching else self.max_num_seqs

    @classmethod
    def from_config(cls, engine: object) -> ServiceParams:
        """From a deploybench.config.EngineSpec (its ``max_num_seqs`` and ``sim`` knobs)."""
        sim = engine.sim  # type: ignore[attr-defined]
        return cls(
            max_num_seqs=engine.max_num_seqs,  # type: ignore[attr-defined]
            decode_base_ms=sim.decode_base_ms,
            decode_per_seq_ms=sim.decode_per_seq_ms,
            prefill_per_token_ms=sim.prefill_per_token_ms,
            queue_limit=sim.queue_limit,
            slowdown=sim.slowdown,
            clock_fraction=getattr(sim, "clock_fraction", 1.0),
            no_batching=getattr(sim, "no_batching", False),
            drift_per_request=getattr(sim, "drift_per_request", 0.0),
        )


@dataclass(eq=False)
class Sequence:
    """One request inside the scheduler. ``handle`` is the server's (or the simulation's) own state."""

    prompt_tokens: int
    output_tokens: int
    handle: object = None
    generated: int = 0
    blocks: tuple[int, ...] = ()  # its prompt's full blocks (block_hashes), for the prefix cache
    cached_tokens: int = 0  # of its prompt, found in the prefix cache at admission
    preempted: int = 0  # times it was preempted (a small KV cache); re-admitted, it prefills prompt + generated again

    def kv_blocks_next(self) -> int:
        """The KV blocks it holds once the next step gave it one more token."""
        return -(-(self.prompt_tokens + self.generated + 1) // BLOCK_TOKENS)


@dataclass
class Iteration:
    duration_ms: float
    admitted: list[Sequence]
    running: list[Sequence]


@dataclass
class BatchScheduler:
    """Continuous batching as a state machine; whoever owns it keeps the clock (see module doc).

    With a ``cache``, each admitted sequence is looked up in it and prefills only its uncached tokens.

    With ``kv_blocks`` (the KV cache's size for the running sequences, in ``BLOCK_TOKENS`` blocks; None: never
    short), as vLLM V1's scheduler (vllm/v1/core/sched/scheduler.py, ``schedule``: when ``allocate_slots`` fails
    the lowest-priority running request, the last one admitted, is preempted, its blocks freed, and it goes back
    to the front of the waiting queue, ``num_preemptions`` counted; it keeps its output tokens and computes its
    prompt and those again when admitted anew): a step first preempts the newest running sequences until what the
    others hold after it fits, and admits a waiting one only when it fits beside them. A sequence that alone does
    not fit runs alone (vLLM would refuse it at once; a lab fault keeps it served). Simplification: a prompt block
    shared through the prefix cache is counted once per sequence here."""

    params: ServiceParams
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    cache: PrefixCache | None = None
    kv_blocks: int | None = None
    preemptions: int = 0
    answered: int = 0  # sequences completed (the drift fault's count)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def submit(self, seq: Sequence) -> bool:
        """Queue ``seq``; False (refuse it) when B + queue_limit requests are already in the engine."""
        if len(self.running) + len(self.waiting) >= self.params.max_num_seqs + self.params.queue_limit:
            return False
        self.waiting.append(seq)
        return True

    def cancel(self, seq: Sequence) -> None:
        """Drop a waiting sequence (its client went away); a running one finishes its iteration first."""
        try:
            self.waiting.remove(seq)
        except ValueError:
            if seq in self.running:
                seq.output_tokens = seq.generated + 1

    def start_iteration(self) -> Iteration | None:
        """Admit into free slots and return the iteration to run, or None when there is nothing to do."""
        p, cache, kv = self.params, self.cache, self.kv_blocks
        used = 0
        if kv is not None:
            used = sum(s.kv_blocks_next() for s in self.running)
            while used > kv and len(self.running) > 1:
                seq = self.running.pop()  # the newest: vLLM's lowest priority under FCFS
                used -= seq.kv_blocks_next()
                seq.preempted += 1
                self.preemptions += 1
                self.waiting.appendleft(seq)
        admitted = []
        uncached = 0
        limit = p.batch_limit
        while self.waiting and len(self.running) < limit:
            if kv is not None and self.running and used + self.waiting[0].kv_blocks_next() > kv:
                break
            seq = self.waiting.popleft()
            if kv is not None:
                used += seq.kv_blocks_next()
            if cache is not None:
                seq.cached_tokens = cache.lookup(seq.blocks, seq.prompt_tokens)
            # a preempted sequence computes its prompt and what it generated again (recompute)
            uncached += seq.prompt_tokens - seq.cached_tokens + (seq.generated if seq.preempted else 0)
            self.running.append(seq)
            admitted.append(seq)
        if not self.running:
            return None
        prefill = p.prefill_per_token_ms * uncached
        duration = p.time_factor * p.drift_factor(self.answered) * (
            prefill + p.decode_base_ms + p.decode_per_seq_ms * len(self.running))
        return Iteration(duration, admitted, list(self.running))

    def finish_iteration(self, it: Iteration) -> list[Sequence]:
        """Give every sequence of ``it`` one token; return those that are now complete (and leave)."""
        done = []
        for seq in it.running:
            seq.generated += 1
            if seq.generated >= seq.output_tokens:
                done.append(seq)
        if done:
            self.answered += len(done)
            gone = set(map(id, done))
            self.running = [s for s in self.running if id(s) not in gone]
        return done


# -- closed form -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Capacity:
    """Closed-form figures for one engine and one workload (times in ms, rates per second)."""

    max_num_seqs: int
    prompt_tokens: float
    output_tokens: float
    cached_tokens: float  # of the prompt, found in the prefix cache (mean)
    requests_per_s: float  # lambda_max: saturation throughput with the batch always full
    output_tokens_per_s: float
    single_ttft_ms: float  # one request alone
    single_itl_ms: float
    single_e2e_ms: float
    full_iteration_ms: float  # mean iteration with the batch full (also the mean inter-token latency)
    full_ttft_min_ms: float  # in service, queueing excluded: admitted alone ...
    full_ttft_max_ms: float  # ... or with a whole batch of prefills
    full_e2e_ms: float  # mean in service, queueing excluded (Little: B / lambda_max)
    full_queue_wait_ms: float  # extra wait when the queue is full (queue_limit / lambda_max)

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def capacity(
    params: ServiceParams, prompt_tokens: float, output_tokens: float, cached_tokens: float = 0.0
) -> Capacity:
    """The engine's saturation throughput and its latencies at light load and at full batch.

    ``cached_tokens``: the mean prompt tokens found in the prefix cache (see ``shared_prefix_cached_tokens``);
    only the other ``prompt_tokens - cached_tokens`` are prefilled."""
    if output_tokens < 1 or prompt_tokens < 0 or not 0 <= cached_tokens <= prompt_tokens:
        raise ConfigError(
            f"output_tokens={output_tokens} must be >= 1, prompt_tokens={prompt_tokens} >= 0 and "
            f"cached_tokens={cached_tokens} within 0..prompt_tokens"
        )
    p, b, s = params, params.batch_limit, params.time_factor
    P, O = float(prompt_tokens) - float(cached_tokens), float(output_tokens)
    per_request_ms = s * (O * (p.decode_base_ms / b + p.decode_per_seq_ms) + p.prefill_per_token_ms * P)
    lam_per_ms = 1.0 / per_request_ms
    step1 = s * (p.decode_base_ms + p.decode_per_seq_ms)
    stepb = s * (p.decode_base_ms + p.decode_per_seq_ms * b)
    prefill = s * p.prefill_per_token_ms * P
    return Capacity(
        max_num_seqs=b,
        prompt_tokens=float(prompt_tokens),
        output_tokens=O,
        cached_tokens=float(cached_tokens),
        requests_per_s=1000.0 * lam_per_ms,
        output_tokens_per_s=1000.0 * lam_per_ms * O,
        single_ttft_ms=prefill + step1,
        single_itl_ms=step1,
        single_e2e_ms=prefill + O * step1,
        full_iteration_ms=stepb + prefill * b / O,
        full_ttft_min_ms=stepb + prefill,
        full_ttft_max_ms=stepb + prefill * b,
        full_e2e_ms=b * per_request_ms,
        full_queue_wait_ms=p.queue_limit * per_request_ms,
    )


def kv_concurrency(prompt_tokens: float, output_tokens: float, kv_blocks: int,
                   block_tokens: int = BLOCK_TOKENS) -> tuple[int, int]:
    """How many sequences of ``prompt_tokens`` + ``output_tokens`` a KV cache of ``kv_blocks`` blocks holds: (at
    their largest, just admitted). At least 1 each: a sequence that does not fit runs alone."""
    largest = -(-int(prompt_tokens + output_tokens) // block_tokens)
    admitted = -(-int(prompt_tokens + 1) // block_tokens)
    return max(1, kv_blocks // largest), max(1, kv_blocks // admitted)


def kv_limited_capacity(params: ServiceParams, prompt_tokens: float, output_tokens: float, kv_blocks: int
                        ) -> tuple[float, float]:
    """The saturation throughput (requests/s) of an engine whose KV cache holds ``kv_blocks`` blocks, as a bracket
    (low, high): the KV cache, not the batch slots, bounds the sequences that run together.

    High: as many run as fit just admitted (``kv_concurrency``'s second), none ever preempted. Low: only as many as
    fit at their largest, each also prefilling once more what a preemption makes it compute again (its prompt and,
    on average, half its output: a sequence is preempted at most once per step it grows into a new block, and the
    newest, preempted first, holds the fewest tokens). Exact figures depend on the order of arrivals; the scheduler
    that serves, on a virtual clock, lands inside (tests/unit/sim/test_faults.py). Without a shortage (the
    cache holds ``batch_limit`` sequences at their largest) both are ``capacity``'s."""
    from dataclasses import replace

    low_n, high_n = kv_concurrency(prompt_tokens, output_tokens, kv_blocks)
    b = params.batch_limit
    high = capacity(replace(params, max_num_seqs=min(b, high_n)), prompt_tokens, output_tokens).requests_per_s
    if low_n >= b:
        return high, high
    redo = params.time_factor * params.prefill_per_token_ms * (prompt_tokens + output_tokens / 2.0)
    per_request_ms = 1000.0 / capacity(replace(params, max_num_seqs=low_n), prompt_tokens,
                                       output_tokens).requests_per_s + redo
    return 1000.0 / per_request_ms, high


def drift_completion_ms(params: ServiceParams, prompt_tokens: float, output_tokens: float, k: int) -> float:
    """The drift fault's closed form, one request at a time (a batch of one, all queued at 0): when the ``k``-th
    (from 0) completes. Request j runs after j answered, each of its steps ``drift_factor(j)`` longer, so it takes
    ``single_e2e_ms x g ** j`` (g = 1 + drift_per_request), and the sum is geometric."""
    one = capacity(params, prompt_tokens, output_tokens).single_e2e_ms
    g = 1.0 + params.drift_per_request
    return one * (k + 1) if g == 1.0 else one * (g ** (k + 1) - 1) / (g - 1)


def leaked_bytes(leak_bytes_per_request: int, answered: int) -> int:
    """The leak fault's closed form: resident memory grows by this over ``answered`` requests (and the throughput is
    ``capacity``'s: a leak costs memory, not time, until the process runs out)."""
    return leak_bytes_per_request * answered


# -- discrete-event simulation (virtual clock) -----------------------------------------------------


@dataclass
class SimResult:
    completed: int
    refused: int
    first_completion_ms: float
    last_completion_ms: float
    completions_ms: list[float]
    ttft_ms: list[float]
    e2e_ms: list[float]
    preemptions: int = 0

    def throughput_per_s(self, skip: int = 0) -> float:
        """Completion rate with ``skip`` completions dropped at each end (the fill-up and the drain)."""
        done = sorted(self.completions_ms)[skip : len(self.completions_ms) - skip]
        if len(done) < 2:
            raise ValueError("fewer than two completions to measure a rate over")
        return 1000.0 * (len(done) - 1) / (done[-1] - done[0])


def simulate(params: ServiceParams, arrivals: Iterable[tuple], cache: PrefixCache | None = None,
             kv_blocks: int | None = None) -> SimResult:
    """Run ``BatchScheduler`` on a virtual clock: ``arrivals`` are (time_ms, prompt, output tokens), or
    (time_ms, prompt, output tokens, the prompt's ``block_hashes``) for the prefix ``cache``.

    Same rules as the server: an idle engine starts an iteration at an arrival, a busy one
    admits at the next iteration start.
    """
    sched = BatchScheduler(params, cache=cache, kv_blocks=kv_blocks)
    events = sorted(arrivals)
    i, now, refused = 0, 0.0, 0
    completions, ttft, e2e = [], [], []
    arrival_of: dict[int, float] = {}

    def arrive(event: tuple) -> None:
        nonlocal refused
        t, prompt, out, *blocks = event
        seq = Sequence(prompt, out, blocks=tuple(blocks[0]) if blocks else ())
        if sched.submit(seq):
            arrival_of[id(seq)] = t
        else:
            refused += 1

    while i < len(events) or sched.busy:
        if not sched.busy:
            now = max(now, events[i][0])
        # arrivals up to the iteration start join the queue
        while i < len(events) and events[i][0] <= now:
            arrive(events[i])
            i += 1
        it = sched.start_iteration()
        if it is None:
            continue
        end = now + it.duration_ms
        # arrivals during the iteration are queued (or refused) when they come
        while i < len(events) and events[i][0] < end:
            arrive(events[i])
            i += 1
        for seq in it.running:
            if seq.generated == 0:
                ttft.append(end - arrival_of[id(seq)])
        for seq in sched.finish_iteration(it):
            completions.append(end)
            e2e.append(end - arrival_of.pop(id(seq)))
        now = end
    return SimResult(
        completed=len(completions),
        refused=refused,
        first_completion_ms=min(completions, default=0.0),
        last_completion_ms=max(completions, default=0.0),
        completions_ms=completions,
        ttft_ms=ttft,
        e2e_ms=e2e,
        preemptions=sched.preemptions,
    )


# -- the spike's closed form -----------------------------------------------------------------------


@dataclass(frozen=True)
class SpikeForm:
    """What a spike does to ``engines`` engines that share its requests evenly (times in s, rates per second)."""

    capacity_rps: float  # the cluster's: engines x lambda_max
    queue: float  # requests waiting at the spike's end (the cluster's)
    drain_s: float  # until the queue is empty again, at capacity - base
    in_service_ms: float  # a request's time in a full batch, once admitted (B / lambda_max per engine)
    recovery_s: float  # after the spike's end, until a request sent then is answered within the SLO
    refused: bool  # a queue past queue_limit per engine: the engine refused some (HTTP 429)


def spike_recovery(params: ServiceParams, prompt_tokens: float, output_tokens: float, engines: int,
                   base_rps: float, peak_rps: float, hold_s: float, slo_ms: float) -> SpikeForm:
    """The recovery time of a spike from ``base_rps`` to ``peak_rps`` (the cluster's) held ``hold_s``, for the
    sliding-window measure of deploybench.load.spike (a window is healthy about when its first request is answered
    within ``slo_ms``).

    The engines serve at most mu = engines x lambda_max (``capacity``). Above it a queue builds at
    (peak - mu) req/s: Q = (peak - mu) x hold at the spike's end (the batch fills within one iteration, which this
    neglects); after it the queue drains at (mu - base), Q(t) = Q - (mu - base) t. A request sent at t waits until
    Q(t) requests ahead of it have left their slots (at mu), then runs O iterations of a full batch,
    ``full_e2e_ms`` (= B / lambda_max): latency(t) = Q(t) / mu + full_e2e. It is within the SLO once
    Q(t) <= mu x (slo - full_e2e), hence the recovery time

        t_rec = max(0, (Q - mu x (slo - full_e2e)) / (mu - base))

    (0 when the spike stays within the capacity, or its queue is short enough to be served within the SLO; the
    queue itself is empty after Q / (mu - base), ``drain_s``). ``refused`` warns when Q / engines passes the
    engine's queue_limit: then the engines refused requests and the measure holds errors this form leaves out."""
    if engines < 1 or base_rps < 0 or peak_rps < base_rps or hold_s < 0 or slo_ms <= 0:
        raise ConfigError(f"engines={engines} must be >= 1, 0 <= base_rps={base_rps} <= peak_rps={peak_rps}, "
                          f"hold_s={hold_s} >= 0 and slo_ms={slo_ms} > 0")
    cap = capacity(params, prompt_tokens, output_tokens)
    mu = engines * cap.requests_per_s
    if base_rps >= mu:
        raise ConfigError(f"base_rps={base_rps:g} is at or above the capacity {mu:.2f} req/s: the queue never drains")
    queue = max(0.0, peak_rps - mu) * hold_s
    service_s = cap.full_e2e_ms / 1000.0
    t_rec = max(0.0, (queue - mu * (slo_ms / 1000.0 - service_s)) / (mu - base_rps))
    return SpikeForm(capacity_rps=mu, queue=queue, drain_s=queue / (mu - base_rps), in_service_ms=cap.full_e2e_ms,
                     recovery_s=t_rec, refused=queue / engines > params.queue_limit)
