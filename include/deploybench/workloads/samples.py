"""The sample dataset and trace shipped in ``data/``, made here from a seed rather than downloaded.

``python -m deploybench.workloads.samples`` writes them; ``--check`` makes them again in memory and fails if the
committed files differ (tests/unit/test_workload_sources.py runs it), so the files and this module cannot drift.

* ``sharegpt-sample.jsonl``: 200 ShareGPT-format conversations of 1-6 turns (fewer turns more often, as in ShareGPT);
  each human turn log-normal around 40 words (at most 400), each answer around 120 (at most 600), sentences of the
  workloads' own words (deploybench.workloads.WORDS). A conversation stops adding turns before its whole text
  would pass 4,096 tokens, so a replay that resends its history fits the simulated engine's default max_model_len.
* ``trace-sample.jsonl``: a Mooncake-format trace of about 600 requests over 60 s: Poisson arrivals at 8.5/s with
  two bursts of 50 requests within 1.5 s; prompts of 128-3,000 tokens, answers of 16-300 (every request within
  4,096 tokens of context); hash ids of 512-token blocks, where about 30 % of the requests start with 1-4 blocks of
  one of 8 "conversations" (whole blocks: the shared part ends on a block boundary) and the rest are fresh.

Only the standard library's random.Random draws here: its streams for a given seed have not changed in a decade,
numpy's Generator methods promise no such thing.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
from pathlib import Path

from deploybench.workloads import WORDS
from deploybench.workloads.sources import approx_tokens

log = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parent / "data"
SHAREGPT_SAMPLE = "sharegpt-sample.jsonl"
TRACE_SAMPLE = "trace-sample.jsonl"
SEED = 27
CONTEXT_TOKENS = 4096  # the simulated engine's default max_model_len (deploybench.sim.engine)
BLOCK_TOKENS = 512  # a Mooncake hash id's block

# the conversations: how many, turns 1..6 by weight, words per human turn and per answer (median, sigma of the log,
# cap)
CONVERSATIONS = 200
TURN_WEIGHTS = (40, 25, 14, 9, 7, 5)
HUMAN_WORDS = (40, 0.7, 400)
ANSWER_WORDS = (120, 0.6, 600)

# the trace
DURATION_MS = 60_000
RATE_PER_S = 8.5
BURSTS_MS = (17_000, 41_000)  # each: BURST_REQUESTS more within BURST_SPAN_MS
BURST_REQUESTS = 50
BURST_SPAN_MS = 1_500
INPUT_TOKENS = (700, 0.7, 128, 3000)  # median, sigma of the log, min, max
OUTPUT_TOKENS = (90, 0.6, 16, 300)
SHARED_FRACTION = 0.3
SHARED_POOL = 8  # conversations whose leading blocks requests share
SHARED_BLOCKS = 4  # at most, per conversation


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


def _text(rng: random.Random, words: int, last_mark: str) -> str:
    """``words`` words in sentences of 4-16: capitalised, a comma now and then, the last ending in ``last_mark``."""
    out: list[str] = []
    left = 0
    for i in range(words):
        word = rng.choice(WORDS)
        if left == 0:
            left = rng.randint(4, 16)
            word = word.capitalize()
        left -= 1
        if i == words - 1:
            word += last_mark
        elif left == 0:
            word += "." if rng.random() < 0.8 else "?"
        elif rng.random() < 0.06:
            word += ","
        out.append(word)
    return " ".join(out)


def sharegpt_sample(seed: int = SEED) -> bytes:
    """The sample conversations, one ShareGPT record per line."""
    rng = random.Random(seed)
    lines = []
    for i in range(CONVERSATIONS):
        turns = rng.choices(range(1, len(TURN_WEIGHTS) + 1), TURN_WEIGHTS)[0]
        messages: list[dict[str, str]] = []
        tokens = 0
        for _ in range(turns):
            human = _text(rng, _lognormal(rng, *HUMAN_WORDS[:2], 3, HUMAN_WORDS[2]), "?")
            answer = _text(rng, _lognormal(rng, *ANSWER_WORDS[:2], 5, ANSWER_WORDS[2]), ".")
            more = approx_tokens(human) + approx_tokens(answer)
            if messages and tokens + more > CONTEXT_TOKENS:
                break
            tokens += more
            messages += [{"from": "human", "value": human}, {"from": "gpt", "value": answer}]
        lines.append(json.dumps({"id": f"sample{i:03d}_0", "conversations": messages}))
    return ("\n".join(lines) + "\n").encode()


def trace_sample(seed: int = SEED) -> bytes:
    """The sample trace, one Mooncake row per line."""
    rng = random.Random(seed + 1)
    times: list[float] = []
    t = rng.expovariate(RATE_PER_S / 1000)
    while t < DURATION_MS:
        times.append(t)
        t += rng.expovariate(RATE_PER_S / 1000)
    for at in BURSTS_MS:
        times += [at + rng.uniform(0, BURST_SPAN_MS) for _ in range(BURST_REQUESTS)]
    times.sort()
    pool = [list(range(c * SHARED_BLOCKS, (c + 1) * SHARED_BLOCKS)) for c in range(SHARED_POOL)]
    fresh = SHARED_POOL * SHARED_BLOCKS
    lines = []
    for t in times:
        n_out = _lognormal(rng, *OUTPUT_TOKENS)
        if rng.random() < SHARED_FRACTION:
            shared = pool[rng.randrange(SHARED_POOL)][: rng.randint(1, SHARED_BLOCKS)]
            n_in = rng.randint(len(shared) * BLOCK_TOKENS + 1, INPUT_TOKENS[3])
        else:
            shared = []
            n_in = _lognormal(rng, *INPUT_TOKENS)
        own = math.ceil(n_in / BLOCK_TOKENS) - len(shared)
        ids = shared + list(range(fresh, fresh + own))
        fresh += own
        row = {
            "timestamp": round(t - times[0]),
            "input_length": n_in,
            "output_length": n_out,
            "hash_ids": ids,
        }
        lines.append(json.dumps(row))
    return ("\n".join(lines) + "\n").encode()


def render() -> dict[str, bytes]:
    """Each sample file's name and content."""
    return {SHAREGPT_SAMPLE: sharegpt_sample(), TRACE_SAMPLE: trace_sample()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploybench.workloads.samples", description="Write (or --check) the shipped samples."
    )
    parser.add_argument("--check", action="store_true", help="fail if the files differ from what this makes")
    parser.add_argument(
        "--dir", type=Path, default=DATA_DIR, help="the folder (default: the package's data/)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    files = render()
    if args.check:
        stale = [
            n
            for n, data in files.items()
            if not (args.dir / n).is_file() or (args.dir / n).read_bytes() != data
        ]
        if stale:
            log.error(
                "%s in %s differ from what %s makes; run it to write them",
                ", ".join(stale),
                args.dir,
                __name__,
            )
            return 1
        log.info("%s in %s are up to date", ", ".join(files), args.dir)
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        tmp = args.dir / f".{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(args.dir / name)
        log.info("wrote %s (%d bytes)", args.dir / name, len(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
