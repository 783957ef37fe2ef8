"""Workloads through the real k6 against the simulated engine on 127.0.0.1: a timed plan is sent on its own clock.

The distributions themselves are tests/unit/test_workloads.py's; here: what k6 does with a plan. Each test bounds
its own time (run_load bounds k6; the engines must answer /health within LocalEngines' start timeout).
"""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
from scipy import stats

from deploybench import workloads
from deploybench.config import SLO, LoadSpec
from deploybench.load import load_samples, run_load

pytestmark = [pytest.mark.integration]  # the two that time sends are quiet (run alone)

SEND_LAG_P99_MS = 25  # on a loaded 2-core CI machine; bench/workloads.py measures the lag at 2,000 req/s


@pytest.fixture
def workload_dir(tmp_path, monkeypatch):
    folder = tmp_path / "workloads"
    folder.mkdir()
    monkeypatch.setenv(workloads.WORKLOAD_ENV, str(folder))
    return folder


@pytest.mark.quiet
def test_poisson_arrivals_are_sent_at_the_plans_times_and_fit_the_exponential(local_engines, workload_dir, tmp_path):
    (workload_dir / "poisson-short.toml").write_text(
        'name = "poisson-short"\n[arrival]\nprocess = "poisson"\n'
        '[input]\ndist = "uniform"\nmin = 8\nmax = 24\n[output]\ndist = "fixed"\nvalue = 2\n')
    eps = local_engines.start(2)
    rate, secs = 20.0, 15.0
    spec = LoadSpec(workload="poisson-short", rate=rate, duration_s=secs, warmup_s=0, ttft_sample_rps=0,
                    request_timeout_s=10)
    res = run_load(eps, spec, SLO(p99_latency_ms=2000), tmp_path / "out", phase="sustained")

    plan = json.loads((tmp_path / "out" / "sustained.plan.json").read_text())
    due = np.array([r[0] for r in plan["requests"]])
    assert plan["timed"] and due[0] == 0 and (np.diff(due) >= 0).all()
    df = load_samples(res.samples_path)
    assert res.errors == 0 and res.dropped_iterations == 0
    assert len(df) == len(due) == res.requests  # every planned request was sent, none twice
    sent = (df["ts"] - df["ts"].min()).dt.total_seconds().to_numpy() * 1000
    lag = np.sort(sent) - due  # each request's send time against its planned time (k6's clock starts at the first)
    assert np.percentile(np.abs(lag - np.median(lag)), 99) < SEND_LAG_P99_MS, np.percentile(lag, [50, 99])
    # the gaps k6 sent at, in whole ms as k6 stamps them, fit the exponential of the rate (and not an even rate)
    gaps = np.diff(np.sort(sent)) / 1000
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 0.01
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.2)
    # the lengths are the plan's: each request's own tokens, its answer's; and the result says so beside the asked
    assert sorted(df["prompt_tokens"]) == sorted(r[1] for r in plan["requests"])
    assert (df["output_tokens"] == 2).all()
    asked, served = res.lengths["prompt"]["asked"], res.lengths["prompt"]["served"]
    assert asked == served and asked["n"] == len(due) and 8 <= asked["p50"] <= 24
    assert res.lengths["output"]["served"]["max"] == res.lengths["output"]["asked"]["max"] == 2


def _k6_points(path):
    import gzip

    with gzip.open(path, "rt") as fh:
        for line in fh:
            if '"metric":"db_request"' in line and '"type":"Point"' in line:
                yield json.loads(line)["data"]


def test_conversations_send_each_turn_after_the_last_with_the_whole_history(local_engines, workload_dir, tmp_path):
    (workload_dir / "talk.toml").write_text(
        'name = "talk"\n[arrival]\nprocess = "poisson"\n[session]\nturns = { dist = "uniform", min = 2, max = 4 }\n'
        'think = { dist = "fixed", mean_s = 0.2 }\n'
        '[input]\ndist = "uniform"\nmin = 8\nmax = 40\n[output]\ndist = "uniform"\nmin = 2\nmax = 6\n')
    eps = local_engines.start(2)
    spec = LoadSpec(workload="talk", rate=12, duration_s=8, warmup_s=0, ttft_sample_rps=0, request_timeout_s=10,
                    api="chat")
    res = run_load(eps, spec, SLO(p99_latency_ms=2000), tmp_path / "out", phase="sustained")
    plan = json.loads((tmp_path / "out" / "sustained.plan.json").read_text())
    assert res.errors == 0
    assert res.offered_rps == 12  # requests/s, every turn counted (the plan's times are the conversations')
    talk = next(n for n in res.notes if n.startswith("conversations of"))
    turns, per_s = re.search(r"of ([\d.]+) turns on average arrived at ([\d.]+) per s", talk).groups()  # type: ignore
    assert float(turns) == pytest.approx(3, abs=0.05) and float(turns) * float(per_s) == pytest.approx(12, rel=0.01)

    convs: dict[int, list[dict]] = {}
    for p in _k6_points(tmp_path / "out" / "sustained.k6.json.gz"):
        md = p["metadata"]
        convs.setdefault(int(md["conv"]), []).append(
            {"turn": int(md["turn"]), "t0": int(md["t0"]), "node": p["tags"]["node"], "ms": p["value"],
             "prompt": int(md["prompt_tokens"]), "output": int(md["output_tokens"])})
    assert len(convs) == len(plan["requests"])
    finished = 0
    for k, turns in convs.items():
        row = plan["requests"][k]
        planned = [(row[1], row[2])] + [(t[0], t[1]) for t in row[7] or []]
        turns.sort(key=lambda t: t["t0"])
        assert [t["turn"] for t in turns] == list(range(len(turns)))  # in order, none twice
        assert len({t["node"] for t in turns}) == 1  # a conversation stays on its endpoint
        finished += len(turns) == len(planned)
        for a, b in zip(turns, turns[1:]):
            assert b["t0"] >= a["t0"] + a["ms"] + 200 - 5  # after the answer and the think time
        for t, (own, out) in zip(turns, planned):
            # the engine counts the prompt it was sent: every earlier turn and answer, then this turn's words
            before = sum(o + a for o, a in planned[: t["turn"]])
            assert (t["prompt"], t["output"]) == (before + own, out), (k, t)
    assert finished >= 0.8 * len(convs)  # those cut short began near the end of the window
    # the result's figures by turn: every turn index there was, the prompt growing with the conversation
    by_turn = {t.turn: t for t in res.turns}
    assert set(by_turn) == {t["turn"] for ts in convs.values() for t in ts} and len(by_turn) >= 2
    assert sum(t.requests for t in res.turns) == res.requests
    assert by_turn[0].prompt_tokens_mean < by_turn[1].prompt_tokens_mean < by_turn[max(by_turn)].prompt_tokens_mean


TALK = ('name = "talk"\n[arrival]\nprocess = "poisson"\n[session]\nturns = { dist = "uniform", min = 2, max = 4 }\n'
        'think = { dist = "fixed", mean_s = 0.2 }\n'
        '[input]\ndist = "uniform"\nmin = 8\nmax = 40\n[output]\ndist = "uniform"\nmin = 2\nmax = 6\n')


def test_the_streaming_sampler_sends_whole_conversations_with_their_history(local_engines, workload_dir):
    """TTFT by turn index: the sampler sends each conversation's turns in order on one endpoint, after the think
    time, with every earlier turn and the answer it streamed (the engine counts the prompt it was sent)."""
    from deploybench.load.ttft import TtftSampler

    (workload_dir / "talk.toml").write_text(TALK)
    eps = local_engines.start(1)
    plan = workloads.make_plan(workloads.workload("talk"), rate=6, duration_s=4, warmup_s=0, seed=3)
    spec = LoadSpec(workload="talk", request_timeout_s=10, api="chat")
    sampler = TtftSampler(eps, spec, "chat", rate=6, duration_s=4, plan=plan)
    t0 = time.monotonic()
    sampler.start()
    time.sleep(4)
    rows = sampler.stop()
    assert time.monotonic() - t0 < 20
    convs: dict[int, list[dict]] = {}
    for r in rows:
        convs.setdefault(r["conv"], []).append(r)
    # conversations started at the rate over the mean turns, from the plan's end backwards (k6 takes its start)
    per = plan.requests() / len(plan)
    assert len(convs) == pytest.approx(4 * 6 / per, abs=1.5)
    assert set(convs) == {len(plan) - 1 - k for k in range(len(convs))}
    later = 0
    for i, turns in convs.items():
        turns.sort(key=lambda r: r["ts"])
        assert [r["turn"] for r in turns] == list(range(len(turns)))
        assert all(r["error_kind"] is None and r["ttft_ms"] is not None for r in turns)
        planned = [(plan.own[i], plan.output[i])] + [(int(a), int(b)) for a, b, _, _ in plan.more[i]]
        assert len(turns) <= len(planned)
        for a, b in zip(turns, turns[1:]):
            assert b["ts"] >= a["ts"] + a["latency_ms"] + 200 - 5  # after the answer and the think time
        for r, (own, out) in zip(turns, planned):
            before = sum(o + a for o, a in planned[: r["turn"]])
            assert (r["prompt_tokens"], r["output_tokens"]) == (before + own, out), (i, r)
        later += len(turns) - 1
    assert later >= len(convs)  # most conversations got past their first turn within the 4 s


def test_the_streaming_sampler_sends_the_workloads_shared_prefix(local_engines):
    """The sampler's requests are the workload's: each with its group's system prompt (the engine counts prefix +
    own words), not the endpoint's URL path in its place."""
    from deploybench.load.ttft import TtftSampler

    eps = local_engines.start(1)
    plan = workloads.make_plan(workloads.workload("shared-prefix"), rate=8, duration_s=2, warmup_s=0, seed=5,
                               output_tokens=4)
    assert any(g >= 0 for g in plan.group)
    sampler = TtftSampler(eps, LoadSpec(workload="shared-prefix", request_timeout_s=10), "chat", rate=4,
                          duration_s=2, plan=plan)
    sampler.start()
    time.sleep(2)
    rows = sampler.stop()
    assert rows and all(r["error_kind"] is None for r in rows)
    want = sorted(plan.prompt_tokens(len(plan) - 1 - k) for k in range(len(rows)))
    assert sorted(r["prompt_tokens"] for r in rows) == want  # prefix (512 tokens where a group has one) + own


def test_the_sampler_takes_enough_of_the_rate_to_quote_its_p99_and_reports_ttft_by_turn(local_engines, workload_dir,
                                                                                          tmp_path):
    """Left to itself (``ttft_sample_rps`` unset) the sampler sends 100 requests over the measured window, at least
    1/s and at most a quarter of the rate: 8 s at 12 req/s -> 3 req/s (not 12.5); its turns give TTFT by turn."""
    (workload_dir / "talk.toml").write_text(TALK)
    eps = local_engines.start(2)
    spec = LoadSpec(workload="talk", rate=12, duration_s=8, warmup_s=0, request_timeout_s=10, api="chat")
    assert spec.ttft_sample_rps is None
    res = run_load(eps, spec, SLO(p99_latency_ms=2000), tmp_path / "out", phase="sustained")
    assert res.errors == 0
    assert (res.ttft_sample_rps, res.k6_rps, res.offered_rps) == (3.0, 9.0, 12.0)
    df = load_samples(res.samples_path)
    streamed = df[df["ttft_ms"].notna()]
    assert res.ttft_samples == len(streamed) and 15 <= len(streamed) <= 30  # 3/s over 8 s, cut at the window's end
    by_turn = {t.turn: t for t in res.turns}
    assert by_turn[0].ttft_samples > 0 and by_turn[1].ttft_samples > 0 and by_turn[1].ttft_p99_ms is not None
    assert sum(t.ttft_samples for t in res.turns) == len(streamed)  # every streamed request is counted by its turn
    # later turns carry the conversation so far: their prompt grows (k6's and the sampler's requests together)
    assert by_turn[0].prompt_tokens_mean < by_turn[1].prompt_tokens_mean


def _engine_counters(ep) -> dict[str, float]:
    from deploybench.load.scrape import get_page, parse_metrics

    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    return {n: v for n, _, v in parse_metrics(get_page(f"{ep.url}/metrics", 2.0), names)}


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_the_shared_prefix_workloads_hit_rate_is_its_closed_form(local_engines, tmp_path, api):
    eps = local_engines.start(1)
    spec = LoadSpec(workload="shared-prefix", rate=10, duration_s=6, warmup_s=0, ttft_sample_rps=0, output_tokens=4,
                    request_timeout_s=10, api=api)
    before = _engine_counters(eps[0])
    res = run_load(eps, spec, SLO(p99_latency_ms=5000), tmp_path / "out", phase="sustained")
    after = _engine_counters(eps[0])
    assert res.errors == 0
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    plan = workloads.make_plan(workloads.workload("shared-prefix"), rate=10, duration_s=6, warmup_s=0,
                               seed=workloads.workload("shared-prefix").seed_for("sustained", 0, 0), output_tokens=4)
    want_hits, want_queries = plan.expected_prefix_hits()
    # a fresh engine: each group's first request computes its prefix; every later prefixed request hits its 512
    # tokens, and nothing else hits (each request's own words differ)
    first = len({g for g in plan.group if g >= 0})
    assert queries == want_queries
    assert hits == want_hits - first * 512
    assert len(plan) > 40 and hits / queries > 0.5


def test_later_turns_of_a_conversation_hit_the_blocks_of_the_turns_before(local_engines, workload_dir, tmp_path):
    (workload_dir / "talk2.toml").write_text(
        'name = "talk2"\n[arrival]\nprocess = "poisson"\n[session]\nturns = { dist = "fixed", value = 3 }\n'
        '[input]\ndist = "uniform"\nmin = 20\nmax = 60\n[output]\ndist = "fixed"\nvalue = 20\n')
    eps = local_engines.start(1)
    spec = LoadSpec(workload="talk2", rate=12, duration_s=6, warmup_s=0, ttft_sample_rps=0, request_timeout_s=10,
                    api="chat")
    before = _engine_counters(eps[0])
    res = run_load(eps, spec, SLO(p99_latency_ms=5000), tmp_path / "out", phase="sustained")
    after = _engine_counters(eps[0])
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    doc = json.loads((tmp_path / "out" / "sustained.plan.json").read_text())
    sent = {}
    for p in _k6_points(tmp_path / "out" / "sustained.k6.json.gz"):
        sent.setdefault(int(p["metadata"]["conv"]), set()).add(int(p["metadata"]["turn"]))
    rows = [r for k, r in enumerate(doc["requests"]) if len(sent.get(k, ())) == 1 + len(r[7] or [])]
    assert res.errors == 0 and len(rows) >= 0.7 * len(doc["requests"])
    plan = workloads.Plan("talk2", 0, [], 0, [r[1] for r in rows], [r[2] for r in rows], [-1] * len(rows),
                          more=[r[7] or [] for r in rows])
    # what the cache would hit over the conversations that finished; the cut ones add their first turns only
    want, _ = plan.expected_prefix_hits()
    no_answers, _ = plan.expected_prefix_hits(cache_answers=False)
    assert hits >= want > no_answers  # later turns find the earlier turns' words *and* answers
    assert hits / queries > 0.4


@pytest.mark.quiet
def test_a_trace_replays_on_its_own_clock_and_its_shared_blocks_hit_as_the_closed_form_says(
        local_engines, workload_dir, tmp_path):
    import random

    rng = random.Random(5)
    rows, t, convs = [], 0, [[rng.randrange(10**6) for _ in range(3)] for _ in range(4)]
    for i in range(120):
        t += int(rng.expovariate(1 / 90)) + (0 if i % 30 else 400)  # about 11/s, a pause every 30 rows
        shared = rng.random() < 0.5
        ids = convs[rng.randrange(4)][: rng.randint(1, 3)] if shared else []
        ids = ids + [10**6 + i * 10 + j for j in range(rng.randint(1, 2))]
        n = 32 * (len(ids) - 1) + rng.randint(1, 32)
        rows.append({"timestamp": 5000 + t, "input_length": n, "output_length": 2, "hash_ids": ids})
    (workload_dir / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (workload_dir / "replay.toml").write_text(
        'name = "replay"\n[source]\nkind = "trace"\npath = "trace.jsonl"\nformat = "mooncake"\nblock_tokens = 32\n'
        "speed = 2.0\n")
    eps = local_engines.start(1)
    before = _engine_counters(eps[0])
    span_s = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000 / 2
    spec = LoadSpec(workload="replay", rate=5, duration_s=span_s + 0.5, warmup_s=0, ttft_sample_rps=0,
                    request_timeout_s=10)
    res = run_load(eps, spec, SLO(p99_latency_ms=5000), tmp_path / "out", phase="sustained")
    after = _engine_counters(eps[0])

    df = load_samples(res.samples_path)
    assert res.errors == 0 and len(df) == len(rows)  # every row, once
    due = np.array([(r["timestamp"] - rows[0]["timestamp"]) / 2 for r in rows])  # ms, at twice the speed
    sent = np.sort((df["ts"] - df["ts"].min()).dt.total_seconds().to_numpy() * 1000)
    lag = sent - due
    assert np.percentile(np.abs(lag - np.median(lag)), 99) < SEND_LAG_P99_MS, np.percentile(lag, [50, 99])
    assert sorted(df["prompt_tokens"]) == sorted(r["input_length"] for r in rows)
    assert res.offered_rps == pytest.approx(len(rows) / spec.duration_s, rel=0.05)  # the trace's rate, not 5/s

    plan = workloads.make_plan(workloads.workload("replay"), rate=5, duration_s=spec.duration_s, warmup_s=0, seed=0)
    want_hits, want_queries = plan.expected_prefix_hits()
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    assert (hits, queries) == (want_hits, want_queries) and want_hits > 0.1 * want_queries
