"""Plans: one k6 run's requests, compiled from a workload (``make_plan``), and what a prefix cache must count over
them (``Plan.expected_prefix_hits``). Pure and deterministic; see the package's doc for the workload files."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploybench.errors import ConfigError
from deploybench.workloads import MAX_PLAN_REQUESTS, MAX_TOKENS, WORDS, Lengths, Think, Workload


# -- plans ----------------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """One k6 run's requests (a request: one conversation of one turn or more).

    ``arrivals_ms``: send times from the run's start, the first at 0, when the workload is timed (poisson, gamma,
    sessions, a trace); None for constant arrivals, which k6 spaces itself, taking request i mod len. Per request:
    ``own``/``output`` its first turn's own prompt tokens and answer tokens, ``group`` its shared prefix (-1: none),
    ``text`` its first turn's words from ``texts`` (a dataset's; -1: words made from the seed), ``system`` its
    system prompt in ``texts`` (-1: none), ``blocks`` its trace blocks (dense ids, ``block_tokens`` tokens each, the
    last one partial), ``more`` its later turns [own tokens, answer tokens, think ms, text] (sessions)."""

    workload: str
    seed: int
    prefixes: list[str]
    prefix_tokens: int
    own: list[int]
    output: list[int]
    group: list[int]
    arrivals_ms: list[float] | None = None
    texts: list[str] = field(default_factory=list)
    text_tokens: list[int] = field(default_factory=list)
    text: list[int] | None = None
    system: list[int] | None = None
    blocks: list[list[int]] | None = None
    block_tokens: int = 512
    more: list[list[list[float]]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # the words' salt: the run's own (runner.run_load), so that the words made from the seed differ between runs
    # while the lengths, groups and times stay the seed's (two runs of a workload offer the same shape)
    salt: int = 0

    def __len__(self) -> int:
        return len(self.own)

    def prompt_tokens(self, i: int) -> int:
        """The first turn's prompt tokens of request ``i``: its prefix, system prompt and own words."""
        sys_i = self.system[i] if self.system else -1
        return (self.own[i] + (self.prefix_tokens if self.group[i] >= 0 else 0)
                + (self.text_tokens[sys_i] if sys_i >= 0 else 0))

    def turns(self, i: int) -> int:
        return 1 + (len(self.more[i]) if self.more else 0)

    def asked(self) -> tuple[list[int], list[int]]:
        """(prompt tokens, answer tokens) the plan asks for, every turn: a later turn's prompt is the conversation
        so far, counted with the answers asked for before it."""
        prompts, outputs = [], []
        for i in range(len(self)):
            before = self.prompt_tokens(i)
            prompts.append(before)
            outputs.append(self.output[i])
            before += self.output[i]
            for own, out, _think, _text in self.more[i] if self.more else []:
                prompts.append(before + int(own))
                outputs.append(int(out))
                before += int(own) + int(out)
        return prompts, outputs

    def requests(self) -> int:
        """Requests (turns) the plan sends in all."""
        return len(self) + (sum(len(m) for m in self.more) if self.more else 0)

    def write(self, path: Path) -> Path:
        """The plan as k6/run.js reads it: ``requests`` [[send ms or -1, own tokens, output tokens, group, text,
        system, blocks or 0, later turns or 0], ...] and the pools they point into."""
        n = len(self)
        at = self.arrivals_ms or [-1.0] * n
        text, system = self.text or [-1] * n, self.system or [-1] * n
        rows = [[round(at[i], 6), self.own[i], self.output[i], self.group[i], text[i], system[i],
                 self.blocks[i] if self.blocks else 0,
                 [[int(a), int(b), round(c, 1), int(d)] for a, b, c, d in self.more[i]] if self.more and self.more[i]
                 else 0] for i in range(n)]
        doc = {"workload": self.workload, "seed": self.seed, "salt": self.salt, "prefixes": self.prefixes,
               "prefix_tokens": self.prefix_tokens, "timed": self.arrivals_ms is not None, "texts": self.texts,
               "text_tokens": self.text_tokens, "block_tokens": self.block_tokens, "requests": rows}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc, separators=(",", ":")))
        tmp.replace(path)
        return path

    def prompt(self, i: int, rng: Any) -> tuple[str, str, int, int]:
        """Request ``i``'s first turn (``i`` mod len) for a client that makes its own words: (system text or "",
        user text, prompt tokens, max_tokens); ``rng`` a random.Random for words made from nothing."""
        i %= len(self)
        sys_parts = [self.prefixes[self.group[i]]] if self.group[i] >= 0 else []
        if self.system and self.system[i] >= 0:
            sys_parts.append(self.texts[self.system[i]])
        if self.text and self.text[i] >= 0:
            user = self.texts[self.text[i]]
        elif self.blocks:
            user = block_text(self.blocks[i], self.own[i], self.block_tokens, self.salt)
        else:
            user = " ".join(WORDS[int(rng.random() * len(WORDS))] for _ in range(self.own[i]))
        return " ".join(sys_parts), user, self.prompt_tokens(i), self.output[i]

    def expected_prefix_hits(self, block_tokens: int = 16, cache_answers: bool = True) -> tuple[int, int]:
        """(hit tokens, queried tokens) an automatic prefix cache with room for everything (vLLM's, the simulated
        engine's) counts over this plan, with each shared prefix already cached: every turn's prompt is looked up
        as a chain of ``block_tokens``-token blocks, the longest cached run of whole blocks hits (at least one
        token is computed: a whole-cached prompt recomputes its last block), and its blocks are cached, with the
        answer's when ``cache_answers``. Tokens are told apart by where they come from (a prefix's, a text's, a
        trace block's, or a request's own), as the engine tells them apart by their words. For the tests and the
        benchmark: it walks every token."""
        seen: set[int] = set()
        for g in range(len(self.prefixes)):  # the workload's prefixes, cached before the run
            _insert(seen, [("p", g, j) for j in range(self.prefix_tokens)], block_tokens)
        hits = queries = 0
        for i in range(len(self)):
            keys: list[tuple] = ([("p", self.group[i], j) for j in range(self.prefix_tokens)]
                                 if self.group[i] >= 0 else [])
            if self.system and self.system[i] >= 0:
                keys += [("x", self.system[i], j) for j in range(self.text_tokens[self.system[i]])]
            turns = [(self.own[i], self.output[i], 0.0, self.text[i] if self.text else -1)] + list(
                self.more[i] if self.more else [])
            for k, (own, out, _think, txt) in enumerate(turns):
                own, out, txt = int(own), int(out), int(txt)
                if txt >= 0:
                    keys += [("x", txt, j) for j in range(own)]
                elif self.blocks:
                    keys += [("b", self.blocks[i][j // self.block_tokens], j % self.block_tokens)
                             for j in range(own)]
                else:
                    keys += [("r", i, k, j) for j in range(own)]
                hit = _lookup(seen, keys, block_tokens)
                hits += hit
                queries += len(keys)
                answer = [("a", i, k, j) for j in range(out)]
                _insert(seen, keys + answer if cache_answers else keys, block_tokens)
                keys = keys + answer
        return hits, queries


def _chain(keys: list, block_tokens: int) -> list[int]:
    out, h = [], 0
    for b in range(len(keys) // block_tokens):
        h = hash((h, tuple(keys[b * block_tokens:(b + 1) * block_tokens])))
        out.append(h)
    return out


def _insert(seen: set[int], keys: list, block_tokens: int) -> None:
    seen.update(_chain(keys, block_tokens))


def _lookup(seen: set[int], keys: list, block_tokens: int) -> int:
    n = 0
    for h in _chain(keys[: max(0, len(keys) - 1)], block_tokens):  # at least one token is computed
        if h not in seen:
            break
        n += block_tokens
    return n


def _mulberry32(seed: int) -> Any:
    """k6/lib/prompts.js's rng: the same seed gives the same numbers in both."""
    a = seed & 0xFFFFFFFF

    def nxt() -> float:
        nonlocal a
        a = (a + 0x6D2B79F5) & 0xFFFFFFFF
        t = a
        t = ((t ^ (t >> 15)) * (t | 1)) & 0xFFFFFFFF
        t ^= (t + (((t ^ (t >> 7)) * (t | 61)) & 0xFFFFFFFF)) & 0xFFFFFFFF
        return ((t ^ (t >> 14)) & 0xFFFFFFFF) / 4294967296

    return nxt


def block_text(blocks: list[int], tokens: int, block_tokens: int, salt: int = 0) -> str:
    """A trace request's prompt: block ``d`` is ``block_tokens`` words from a stream seeded by ``d`` and the run's
    ``salt`` (so one id is one text wherever it appears in a run); the last block is cut to make ``tokens`` in all.
    As k6/lib/prompts.js makes it."""
    words: list[str] = []
    for j, d in enumerate(blocks):
        n = min(block_tokens, tokens - j * block_tokens)
        nxt = _mulberry32(((d * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF) ^ (salt & 0xFFFFFFFF))
        words += [WORDS[int(nxt() * len(WORDS))] for _ in range(max(0, n))]
    return " ".join(words)


def _rng(seed: int) -> Any:
    import numpy as np

    return np.random.Generator(np.random.PCG64(seed))


def _draw(rng: Any, d: Lengths, n: int, form_tokens: int, spread: float, *, prompt: bool) -> Any:
    import numpy as np

    if d.dist == "form":
        if prompt:  # today's prompts: uniform over [0.5, 1.5] x the mean
            x = np.maximum(1, np.rint(form_tokens * (0.5 + rng.random(n))))
        else:
            x = np.maximum(1, np.rint(form_tokens * (1 - spread + 2 * spread * rng.random(n))))
    elif d.dist == "fixed":
        x = np.full(n, d.value)
    elif d.dist == "uniform":
        x = rng.integers(d.min, d.max, n, endpoint=True)
    elif d.dist == "normal":
        x = np.rint(rng.normal(d.mean, d.sigma, n))
    elif d.dist == "lognormal":
        assert d.mean is not None and d.sigma is not None
        mu = math.log(d.mean) - d.sigma**2 / 2  # so that the mean is ``mean`` before the clip
        x = np.rint(rng.lognormal(mu, d.sigma, n))
    else:
        bins = np.array([[lo, hi, w] for lo, hi, w in d.bins or []], dtype=float)
        pick = rng.choice(len(bins), n, p=bins[:, 2] / bins[:, 2].sum())
        x = np.floor(bins[pick, 0] + rng.random(n) * (bins[pick, 1] - bins[pick, 0] + 1))
    lo, hi = (d.min or 1), (d.max or MAX_TOKENS)
    return np.clip(x, max(1, lo), hi).astype(np.int64)


def _mean_of(d: Lengths) -> float:
    """The mean of a turn-count distribution, from a large draw (clips included)."""
    return float(_draw(_rng(1), d, 20_000, 1, 0.0, prompt=True).mean())


def rate_profile(rate: float, stages: list[tuple[float, float]] | None, warmup_s: float,
                 duration_s: float) -> list[tuple[float, float, float]]:
    """The offered rate as linear segments (rate at start, rate at end, seconds): the warm-up at ``rate``, then the
    stages ramping from it (k6's ramping-arrival-rate), else ``rate`` for ``duration_s``."""
    segs = [(rate, rate, warmup_s)] if warmup_s > 0 else []
    if stages:
        frm = rate
        for target, secs in stages:
            segs.append((frm, target, secs))
            frm = target
    else:
        segs.append((rate, rate, duration_s))
    return segs


def invert_rate(counts: Any, segs: list[tuple[float, float, float]]) -> Any:
    """The times (s) at which the integral of the rate reaches each of ``counts`` (sorted; operational time);
    past the last segment: NaN."""
    import numpy as np

    counts = np.asarray(counts, dtype=float)
    out = np.full(len(counts), np.nan)
    t0, c0 = 0.0, 0.0
    for a, b, d in segs:
        n = (a + b) / 2 * d
        sel = (counts >= c0) & (counts < c0 + n) & np.isnan(out)
        left = counts[sel] - c0
        k = (b - a) / d
        if abs(k) < 1e-12:
            out[sel] = t0 + (left / a if a > 0 else 0.0)
        else:
            out[sel] = t0 + (-a + np.sqrt(np.maximum(0.0, a * a + 2 * k * left))) / k
        t0, c0 = t0 + d, c0 + n
    return out


def _too_many(w: Workload, n: float) -> ConfigError:
    return ConfigError(f"workload {w.name!r}: a phase of about {n:.0f} requests is more than a plan holds "
                       f"({MAX_PLAN_REQUESTS}); shorten the phase or lower the rate")


def _arrivals(w: Workload, rng: Any, segs: list[tuple[float, float, float]], per_session: float) -> tuple[Any, float]:
    """(send times in s or None for k6's own spacing, expected count) of the sessions of a synthetic or dataset
    workload: the rate is in requests/s, so sessions of ``per_session`` turns arrive at rate / per_session."""
    import numpy as np

    s = w.spec
    segs = [(a / per_session, b / per_session, d) for a, b, d in segs]
    expected = sum((a + b) / 2 * d for a, b, d in segs)
    if expected > MAX_PLAN_REQUESTS:
        raise _too_many(w, expected)
    if s.arrival.process == "constant":
        if not w.timed:
            return None, expected
        ops = np.arange(0, math.ceil(expected), dtype=float)
    else:
        # exactly the expected number of requests (a phase offers its rate, not a random draw around it: a probe
        # step of 6 s at 13/s would otherwise offer 13 +- 11 % and be judged on what it did not offer), their gaps
        # the process's, scaled to fill the phase: for Poisson, the process given its count (uniform order
        # statistics); the first request at the start, as k6's executors have it
        n = max(1, round(expected))
        if s.arrival.process == "poisson":
            gaps = rng.exponential(1.0, n)
        else:
            cv = float(s.arrival.cv or 1.0)
            gaps = rng.gamma(1.0 / cv**2, cv**2, n)
        ops = np.concatenate([[0.0], np.cumsum(gaps[1:])]) * (expected / float(gaps.sum()))
    times = invert_rate(ops, segs)
    return times[~np.isnan(times)], expected


def make_plan(w: Workload, *, rate: float, duration_s: float, warmup_s: float, seed: int,
              stages: list[tuple[float, float]] | None = None, prompt_tokens: int = 200, output_tokens: int = 64,
              output_spread: float = 0.0, max_model_len: int = MAX_TOKENS) -> Plan:
    """The requests of one k6 run of ``w`` at ``rate`` requests/s (or along ``stages`` after the warm-up), drawn
    from ``seed``. A session's turns stop before the one whose conversation would no longer fit
    ``max_model_len``."""
    s = w.spec
    segs = rate_profile(rate, stages, warmup_s, duration_s)
    rng = _rng(seed)
    if s.source.kind == "trace":
        return _trace_plan(w, segs, warmup_s + duration_s, seed)
    convs = w.conversations() if s.source.kind == "dataset" else None
    per_session = w.turns_per_session()
    times, expected = _arrivals(w, rng, segs, per_session)
    n = max(1, len(times) if times is not None else math.ceil(expected) + 1)
    plan = Plan(w.name, seed, prefix_texts(w), s.prefix.tokens if s.prefix else 0, [], [], [],
                [float(t) * 1000.0 for t in times] if times is not None else None,
                meta={"expected_requests": expected * per_session, "process": s.arrival.process,
                      "turns_per_session": per_session})
    own = _draw(rng, s.input, n, prompt_tokens, output_spread, prompt=True)
    out = _draw(rng, s.output, n, output_tokens, output_spread, prompt=False)
    group = [-1] * n
    if s.prefix:
        shared = rng.random(n) < s.prefix.fraction
        picks = rng.integers(0, s.prefix.groups, n)
        group = [int(p) if sh else -1 for sh, p in zip(shared, picks)]
    plan.group = group
    if convs is not None:
        _dataset_rows(plan, w, convs, rng, n, out, max_model_len)
    else:
        plan.own, plan.output = own.tolist(), out.tolist()
        if s.session is not None:
            _synthetic_turns(plan, w, rng, prompt_tokens, output_tokens, output_spread, max_model_len)
    return plan


def _think_ms(w: Workload, rng: Any, n: int) -> list[float]:
    t = w.spec.session.think if w.spec.session else Think()
    if t.mean_s <= 0:
        return [0.0] * n
    draws = rng.exponential(t.mean_s, n) if t.dist == "exponential" else [t.mean_s] * n
    return [1000.0 * float(x) for x in draws]


def _synthetic_turns(plan: Plan, w: Workload, rng: Any, prompt_tokens: int, output_tokens: int, spread: float,
                     max_model_len: int) -> None:
    s = w.spec
    assert s.session is not None and s.session.turns is not None
    counts = _draw(rng, s.session.turns, len(plan), 1, 0.0, prompt=True)
    total = int(counts.sum()) - len(plan)
    own = _draw(rng, s.input, total, prompt_tokens, spread, prompt=True).tolist()
    out = _draw(rng, s.output, total, output_tokens, spread, prompt=False).tolist()
    think = _think_ms(w, rng, total)
    more: list[list[list[float]]] = []
    k = 0
    for i, c in enumerate(counts):
        used = plan.prompt_tokens(i) + plan.output[i]
        turns: list[list[float]] = []
        for _ in range(int(c) - 1):
            used += own[k] + out[k]
            if used <= max_model_len:
                turns.append([own[k], out[k], think[k], -1])
            k += 1
        more.append(turns)
    plan.more = more


def _dataset_rows(plan: Plan, w: Workload, convs: list[Any], rng: Any, n: int, fallback_out: Any,
                  max_model_len: int) -> None:
    """Requests from the sampled conversations: taken in a shuffled order (each once before any twice), with their
    own words; an answer's length is the dataset's where it has one, else the workload's [output]. A record whose
    first turn does not fit the context is left out (counted in ``meta``)."""
    from deploybench.workloads.sources import approx_tokens

    s = w.spec
    index: dict[str, int] = {}

    def pool(text: str) -> int:
        if text not in index:
            index[text] = len(plan.texts)
            plan.texts.append(text)
            plan.text_tokens.append(approx_tokens(text))
        return index[text]

    prefix = s.prefix.tokens if s.prefix else 0
    fits = [c for c in convs if prefix + approx_tokens(c.system) + approx_tokens(c.turns[0].user)
            + (c.turns[0].answer_tokens or int(fallback_out.max())) <= max_model_len]
    plan.meta.update(dataset_records=len(convs), dataset_records_too_long=len(convs) - len(fits))
    if not fits:
        raise ConfigError(f"workload {w.name!r}: none of the {len(convs)} sampled records fits max_model_len="
                          f"{max_model_len} (prompt + answer); raise max_model_len or use shorter records")
    order: list[int] = []
    while len(order) < n:
        order += rng.permutation(len(fits)).tolist()
    plan.text, plan.system, plan.more = [], [], [] if s.session else None
    think = _think_ms(w, rng, sum(len(fits[j].turns) for j in order[:n]))
    k = 0
    for i, j in enumerate(order[:n]):
        c = fits[j]
        first = c.turns[0]
        plan.text.append(pool(first.user))
        plan.system.append(pool(c.system) if c.system else -1)
        plan.own.append(plan.text_tokens[plan.text[-1]])
        plan.output.append(int(first.answer_tokens or fallback_out[i]))
        if plan.more is not None:
            used = plan.prompt_tokens(i) + plan.output[-1]
            turns: list[list[float]] = []
            for t in c.turns[1:]:
                x = pool(t.user)
                a = int(t.answer_tokens or fallback_out[i])
                used += plan.text_tokens[x] + a
                if used > max_model_len:
                    break
                turns.append([plan.text_tokens[x], a, think[k], x])
                k += 1
            plan.more.append(turns)


def _trace_plan(w: Workload, segs: list[tuple[float, float, float]], window_s: float, seed: int) -> Plan:
    """A trace's rows in the phase's window: from ``start_s``, at ``speed`` (its own clock), or - ``follow_rate`` -
    its shape mapped onto the phase's rate profile (the trace's mean rate becomes the phase's). Hash ids become
    dense ids (the same id, the same words)."""
    import numpy as np

    src = w.spec.source
    rows = w.trace()
    at = np.array([r.at_ms for r in rows], dtype=float) / 1000.0 - src.start_s
    keep = at >= 0
    if src.follow_rate:
        span = max(1e-9, float(at[keep].max()) if keep.any() else 1e-9)
        mean_rate = max(1, int(keep.sum()) - 1) / span
        times = invert_rate(at[keep] * mean_rate, segs)
        idx = np.flatnonzero(keep)[~np.isnan(times)]
        sent = times[~np.isnan(times)]
    else:
        t = at / src.speed
        sel = keep & (t < window_s)
        idx, sent = np.flatnonzero(sel), t[sel]
    if len(idx) == 0:
        raise ConfigError(f"workload {w.name!r}: its trace has no request in the replayed window (from start_s = "
                          f"{src.start_s:g} s for {window_s:g} s at speed {src.speed:g}); lower start_s")
    if len(idx) > MAX_PLAN_REQUESTS:
        raise _too_many(w, len(idx))
    dense: dict[int, int] = {}
    blocks = [[dense.setdefault(h, len(dense)) for h in rows[i].hash_ids] for i in idx]
    own = [rows[i].input_tokens for i in idx]
    for i, b in zip(idx, blocks):
        if not b:  # a trace without shared blocks (Azure's): each request its own ids
            b.extend(dense.setdefault(-1 - int(i) * 4096 - j, len(dense))
                     for j in range(math.ceil(rows[i].input_tokens / src.block_tokens)))
    first = float(sent[0])
    return Plan(w.name, seed, [], 0, own, [rows[i].output_tokens for i in idx], [-1] * len(idx),
                [1000.0 * (float(x) - first) for x in sent], blocks=blocks, block_tokens=src.block_tokens,
                meta={"process": "trace", "trace_rows": len(rows), "first_row": int(idx[0]),
                      "offered_rps": len(idx) / window_s if not src.follow_rate else None})


def vu_scale(plan: Plan, w: Workload, p99_ms: float) -> float:
    """How many more VUs than rate x P99 a timed plan needs: its busiest second against its mean (bursts), times
    (P99 + think time) / P99 for conversations (a VU holds a conversation through its pauses)."""
    import numpy as np

    scale = 1.0
    if plan.arrivals_ms:
        at = np.asarray(plan.arrivals_ms) / 1000.0
        span = max(1.0, float(at[-1]))
        per_s = np.bincount(at.astype(np.int64))
        scale = max(1.0, float(per_s.max()) / (len(at) / span))
    if w.spec.session is not None:
        scale *= 1.0 + 1000.0 * w.spec.session.think.mean_s / p99_ms
    return scale


def prefix_texts(w: Workload) -> list[str]:
    """The workload's shared prefixes: from its own seed only, the same in every phase and run. Each starts with
    its group's number so that two groups differ from their first block on."""
    s = w.spec
    if not s.prefix:
        return []
    rng = _rng(s.seed ^ 0x5EED)
    out = []
    for g in range(s.prefix.groups):
        idx = rng.integers(0, len(WORDS), s.prefix.tokens - 1)
        out.append(" ".join([f"g{g}", *(WORDS[i] for i in idx)]))
    return out
