"""Workloads through the real k6 against the simulated engine on 127.0.0.1: a timed plan is sent on its own clock.

The distributions themselves are tests/unit/test_workloads.py's; here: what k6 does with a plan. Each test bounds
its own time (run_load bounds k6; the engines must answer /health within LocalEngines' start timeout).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats

from deploybench import workloads
from deploybench.config import SLO, LoadSpec
from deploybench.load import load_samples, run_load

pytestmark = [pytest.mark.integration, pytest.mark.quiet]

SEND_LAG_P99_MS = 25  # on a loaded 2-core CI machine; bench/workloads.py measures the lag at 2,000 req/s


@pytest.fixture
def workload_dir(tmp_path, monkeypatch):
    folder = tmp_path / "workloads"
    folder.mkdir()
    monkeypatch.setenv(workloads.WORKLOAD_ENV, str(folder))
    return folder


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
    # the lengths are the plan's: each request's own tokens, its answer's
    assert sorted(df["prompt_tokens"]) == sorted(r[1] for r in plan["requests"])
    assert (df["output_tokens"] == 2).all()


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
