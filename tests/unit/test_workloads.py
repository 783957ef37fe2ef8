"""Workloads as data (deploybench.workloads): the files, their refusals, and the plans they compile to.

The distributions and arrival processes are checked with goodness-of-fit tests (scipy's KS test) on the plan's own
draws; what k6 makes of a plan against a real engine is tests/integration/test_workloads.py's.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
from scipy import stats

from deploybench import workloads as W
from deploybench.config import RunConfig
from deploybench.errors import ConfigError


def _file(tmp_path, name: str, text: str):
    folder = tmp_path / "wl"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.toml").write_text(text)
    return folder


def test_the_shipped_workloads_load_and_synthetic_is_todays_shape():
    known = W.workloads()
    assert {"synthetic", "chat-lognormal", "shared-prefix", "bursty"} <= set(known)
    syn = known["synthetic"].spec
    assert syn.arrival.process == "constant" and syn.input.dist == "form" and syn.output.dist == "form"
    assert syn.prefix is None


def test_an_operator_folder_adds_workloads_and_a_name_twice_is_refused(tmp_path, monkeypatch):
    folder = _file(tmp_path, "mine", 'name = "mine"\n[arrival]\nprocess = "poisson"\n')
    monkeypatch.setenv(W.WORKLOAD_ENV, str(folder))
    assert W.workload("mine").spec.arrival.process == "poisson"
    _file(tmp_path, "bursty", 'name = "bursty"\n')
    with pytest.raises(ConfigError, match="'bursty' is defined twice"):
        W.workloads()


@pytest.mark.parametrize(("text", "message"), [
    ('name = "x"\nrate = 5\n', "rate: unknown key"),
    ('name = "x"\n[input]\ndist = "lognormal"\nmean = 100\n', "needs sigma"),
    ('name = "x"\n[input]\ndist = "fixed"\nvalue = 10\nmean = 3\n', "takes value, not mean"),
    ('name = "x"\n[input]\ndist = "uniform"\nmin = 10\nmax = 5\n', "min = 10 is above max = 5"),
    ('name = "x"\n[input]\ndist = "zipf"\n', "input.dist"),
    ('name = "x"\n[arrival]\nprocess = "gamma"\n', "cv"),
    ('name = "x"\n[arrival]\nprocess = "poisson"\ncv = 2\n', "cv"),
    ('name = "x"\n[input]\ndist = "empirical"\nbins = [[10, 5, 1]]\n', "low <= high"),
    ('name = "y"\n', "must be the file's name"),
    ('name = "x"\n[prefix]\ngroups = 0\ntokens = 10\n', "prefix.groups"),
    ("name = \n", "cannot read it as TOML"),
])
def test_a_bad_workload_file_is_refused_naming_the_key(tmp_path, monkeypatch, text, message):
    folder = _file(tmp_path, "x", text)
    monkeypatch.setenv(W.WORKLOAD_ENV, str(folder))
    with pytest.raises(ConfigError, match=message) as err:
        W.workload("x")
    assert "x.toml" in str(err.value)


def test_an_unknown_name_lists_the_known_ones_and_a_huge_file_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"unknown workload 'nope'; choose one of: bursty, chat-lognormal"):
        W.workload("nope")
    folder = _file(tmp_path, "big", 'name = "big"\n' + "#" * (W.MAX_FILE_BYTES + 1))
    monkeypatch.setenv(W.WORKLOAD_ENV, str(folder))
    with pytest.raises(ConfigError, match="over 1048576 bytes"):
        W.workload("big")


def test_a_workload_whose_longest_request_does_not_fit_the_context_is_refused():
    w = W.workload("chat-lognormal")  # 2,048 + 1,024 at most
    w.check_fits(200, 64, 0.0, 4096)
    with pytest.raises(ConfigError, match=r"longest request \(3072 tokens.*max_model_len=2048"):
        w.check_fits(200, 64, 0.0, 2048)
    syn = W.workload("synthetic")  # the form's lengths: 1.5 x the prompt + (1 + spread) x the output
    with pytest.raises(ConfigError, match=r"\(1500 tokens"):
        syn.check_fits(800, 250, 0.2, 1024)


def test_the_default_workload_keeps_earlier_series_and_another_is_a_series_of_its_own():
    base = RunConfig(inventory="demo")
    assert "workload" not in base.performance_identity()["workload"]
    other = RunConfig(inventory="demo", load={"workload": "shared-prefix"})
    assert other.performance_identity()["workload"]["workload"] == "shared-prefix"
    assert other.fingerprint() != base.fingerprint()


def test_seeds_differ_per_phase_and_step_unless_the_workload_keeps_one(tmp_path, monkeypatch):
    w = W.workload("synthetic")
    seeds = {w.seed_for(p, s, 0) for p, s in [("probe", 0), ("probe", 1), ("sustained", 0), ("overload", 0)]}
    assert len(seeds) == 4
    assert w.seed_for("sustained", 0, 0) == w.seed_for("sustained", 0, 0)
    folder = _file(tmp_path, "fixed-seed", 'name = "fixed-seed"\nseed_per_phase = false\n')
    monkeypatch.setenv(W.WORKLOAD_ENV, str(folder))
    assert W.workload("fixed-seed").seed_for("sustained", 0, 7) == 7


def test_a_plan_is_deterministic_from_its_seed():
    w = W.workload("shared-prefix")
    a = W.make_plan(w, rate=20, duration_s=10, warmup_s=1, seed=5)
    b = W.make_plan(w, rate=20, duration_s=10, warmup_s=1, seed=5)
    c = W.make_plan(w, rate=20, duration_s=10, warmup_s=1, seed=6)
    assert (a.own, a.group, a.arrivals_ms) == (b.own, b.group, b.arrivals_ms)
    assert a.own != c.own and a.prefixes == c.prefixes  # the prefixes are the workload's, the same in every phase


def _interarrivals(plan: W.Plan) -> np.ndarray:
    return np.diff(np.asarray(plan.arrivals_ms)) / 1000.0


def test_poisson_gaps_fit_the_exponential_and_constant_ones_do_not():
    rate = 50.0
    plan = W.make_plan(W.workload("chat-lognormal"), rate=rate, duration_s=60, warmup_s=0, seed=11)
    gaps = _interarrivals(plan)
    assert len(plan) == rate * 60  # a phase offers its rate: exactly its count, at Poisson times
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 0.01
    even = np.full(len(gaps), 1 / rate)  # what the constant process sends (k6's own spacing)
    assert stats.kstest(even, "expon", args=(0, 1 / rate)).pvalue < 1e-6


def test_gamma_gaps_fit_their_distribution_and_have_the_workloads_cv():
    rate, cv = 50.0, 3.0
    plan = W.make_plan(W.workload("bursty"), rate=rate, duration_s=120, warmup_s=0, seed=3)
    gaps = _interarrivals(plan)
    law = stats.gamma(1 / cv**2, 0, cv**2 / rate)
    # a chi-square test on bins of equal probability from the 30th percentile up: gamma with shape 1/9 puts a
    # tenth of its gaps below a nanosecond, where float times (and any clock) cannot tell them apart
    edges = np.concatenate([[0.0], law.ppf(np.linspace(0.3, 0.95, 14)), [np.inf]])
    counts, _ = np.histogram(gaps, edges)
    expected = np.diff(law.cdf(edges)) * len(gaps)
    assert stats.chisquare(counts, expected).pvalue > 0.01
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue < 1e-6  # bursts are not Poisson
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(cv, rel=0.15)


def test_timed_arrivals_follow_a_ramp_as_k6_ramps_its_rate():
    # warm-up 2 s at 10/s, then 10 -> 50/s over 8 s: 20 + 240 requests, the later half-ramp busier
    plan = W.make_plan(W.workload("chat-lognormal"), rate=10, duration_s=8, warmup_s=2, seed=9,
                       stages=[(50, 8)])
    t = np.asarray(plan.arrivals_ms) / 1000.0
    assert t[0] == 0 and t[-1] < 10
    assert len(t) == pytest.approx(260, abs=4 * math.sqrt(260))
    first, second = ((t >= 2) & (t < 6)).sum(), ((t >= 6) & (t < 10)).sum()
    assert first == pytest.approx(4 * 20, abs=4 * math.sqrt(80))  # the mean rate over 2-6 s is 20/s
    assert second == pytest.approx(4 * 40, abs=4 * math.sqrt(160))


def test_constant_plans_carry_lengths_only_and_enough_of_them_for_the_phase():
    plan = W.make_plan(W.workload("synthetic"), rate=10, duration_s=10, warmup_s=2, seed=1, stages=[(30, 4)],
                       prompt_tokens=100, output_tokens=20, output_spread=0.5)
    assert plan.arrivals_ms is None and len(plan) == 20 + 80 + 1
    own, out = np.asarray(plan.own), np.asarray(plan.output)
    assert own.min() >= 50 and own.max() <= 150 and own.mean() == pytest.approx(100, rel=0.1)
    assert out.min() >= 10 and out.max() <= 30 and len(set(out)) > 5


def test_lognormal_lengths_have_the_mean_asked_for_and_stay_in_bounds(tmp_path, monkeypatch):
    folder = _file(tmp_path, "ln", 'name = "ln"\n[input]\ndist = "lognormal"\nmean = 300\nsigma = 0.5\n'
                                    'min = 1\nmax = 100000\n[output]\ndist = "empirical"\n'
                                    'bins = [[1, 10, 3], [100, 100, 1]]\n')
    monkeypatch.setenv(W.WORKLOAD_ENV, str(folder))
    plan = W.make_plan(W.workload("ln"), rate=100, duration_s=100, warmup_s=0, seed=2)
    own, out = np.asarray(plan.own), np.asarray(plan.output)
    assert own.mean() == pytest.approx(300, rel=0.03)
    assert stats.kstest(np.log(own), "norm", args=(math.log(300) - 0.125, 0.5)).pvalue > 0.001
    assert set(np.unique(out)) <= set(range(1, 11)) | {100}
    assert (out == 100).mean() == pytest.approx(0.25, abs=0.03)
    clipped = W.make_plan(W.workload("chat-lognormal"), rate=100, duration_s=100, warmup_s=0, seed=2)
    assert min(clipped.own) >= 8 and max(clipped.own) <= 2048 and max(clipped.output) <= 1024


def test_shared_prefixes_go_to_the_fraction_asked_for_and_their_hits_have_a_closed_form():
    w = W.workload("shared-prefix")  # 8 groups of 512 tokens on 90 % of the requests, then 64-192 of their own
    plan = W.make_plan(w, rate=50, duration_s=60, warmup_s=0, seed=4)
    group = np.asarray(plan.group)
    assert (group >= 0).mean() == pytest.approx(0.9, abs=0.02)
    assert set(group[group >= 0]) == set(range(8))
    assert len(plan.prefixes) == 8 and len(set(plan.prefixes)) == 8
    assert all(len(p.split()) == 512 for p in plan.prefixes)
    hits, queries = plan.expected_prefix_hits()
    assert hits == 512 * int((group >= 0).sum())
    assert hits / queries == pytest.approx(0.9 * 512 / (0.9 * 512 + 128), rel=0.02)
    pre, own, tokens, out = plan.prompt(0, __import__("random").Random(1))
    assert tokens == len(pre.split()) + len(own.split()) == plan.prompt_tokens(0)


def test_the_form_has_one_workload_field():
    from deploybench import params

    assert "workload" in params.BY_NAME and params.BY_NAME["workload"].section == "Workload"
    assert [n for n in params.BY_NAME if "workload" in n] == ["workload"]


def test_a_dataset_with_no_record_that_fits_the_context_is_refused_not_looped_on(tmp_path, monkeypatch):
    folder = _file(tmp_path, "long", 'name = "long"\n[source]\nkind = "dataset"\npath = "d.jsonl"\nformat = "jsonl"\n')
    (folder / "d.jsonl").write_text('{"prompt": "' + "word " * 300 + '", "output_tokens": 10}\n')
    monkeypatch.setenv(W.WORKLOAD_ENV, str(folder))
    with pytest.raises(ConfigError, match="none of the 1 sampled records fits max_model_len=100"):
        W.make_plan(W.workload("long"), rate=5, duration_s=2, warmup_s=0, seed=1, max_model_len=100)
    plan = W.make_plan(W.workload("long"), rate=5, duration_s=2, warmup_s=0, seed=1, max_model_len=4096)
    assert len(plan) == 11 and set(plan.text) == {0} and plan.own[0] == 300 and plan.output[0] == 10


def test_the_series_holds_the_traffic_its_file_and_its_data_and_the_default_keeps_earlier_series(tmp_path, monkeypatch):
    from deploybench.store.identity import identity_of

    cfg = RunConfig(inventory="demo").model_dump(mode="json")
    before = identity_of(cfg, ["n1"]).workload.hash  # a run stored before workloads had names
    assert identity_of(cfg, ["n1"], traffic=W.workload("synthetic").summary()).workload.hash == before
    other = RunConfig(inventory="demo", load={"workload": "shared-prefix"}).model_dump(mode="json")
    shared = identity_of(other, ["n1"], traffic=W.workload("shared-prefix").summary()).workload
    assert shared.hash != before and shared.attrs["traffic"]["prefix"]["tokens"] == 512

    folder = _file(tmp_path, "mine", 'name = "mine"\n[source]\nkind = "dataset"\npath = "d.jsonl"\nformat = "jsonl"\n')
    monkeypatch.setenv(W.WORKLOAD_ENV, str(folder))
    mine = RunConfig(inventory="demo", load={"workload": "mine"}).model_dump(mode="json")
    hashes = []
    for text in ("hello there", "hello there!"):  # the same file name, other data: another series
        (folder / "d.jsonl").write_text(json.dumps({"prompt": text}) + "\n")
        summary = W.workload("mine").summary()
        assert summary["data_sha256"] == hashlib.sha256((json.dumps({"prompt": text}) + "\n").encode()).hexdigest()
        hashes.append(identity_of(mine, ["n1"], traffic=summary).workload.hash)
    assert hashes[0] != hashes[1]


def test_a_conversation_workload_counts_its_rates_in_sessions_unless_its_file_says_requests(tmp_path, monkeypatch):
    """The run's rates (load, probe bounds, the SLO's minimum) are conversations/s for sessions: run_phase turns them
    into requests/s (x the mean turns) once; a file with ``rate = "requests"`` and single-turn workloads keep them."""
    from deploybench.config import SLO, LoadSpec
    from deploybench.load.phases import in_requests

    talk = '[session]\nturns = { dist = "fixed", value = 3 }\n'
    folder = _file(tmp_path, "talk", f'name = "talk"\n{talk}')
    _file(tmp_path, "talk-req", f'name = "talk-req"\n{talk}rate = "requests"\n')
    monkeypatch.setenv(W.WORKLOAD_ENV, str(folder))
    assert W.workload("talk").rate_scale() == 3.0 and W.workload("talk-req").rate_scale() == 1.0
    assert W.workload("synthetic").rate_scale() == 1.0
    assert W.workload("multi-turn").rate_scale() == pytest.approx(4.0, abs=0.05)  # uniform 2-6 turns

    spec = LoadSpec(workload="talk", rate=5, probe_start_rps=2, probe_max_rps=40)
    got, slo, scale = in_requests(spec, SLO(min_rps=4))
    assert scale == 3.0 and (got.rate, got.probe_start_rps, got.probe_max_rps) == (15, 6, 120)
    assert slo is not None and slo.min_rps == 12
    same, slo2, one = in_requests(spec.model_copy(update={"workload": "talk-req"}), SLO(min_rps=4))
    assert one == 1.0 and same.rate == 5 and slo2 is not None and slo2.min_rps == 4


def test_the_bounds_of_the_forms_rates_hold_for_what_a_sessions_rated_workload_offers():
    """Validate checks the k6 VUs and the rates' maximum on rate x mean turns, not only on the rate typed."""
    from types import SimpleNamespace

    from deploybench.config import SLO, LoadSpec
    from deploybench.stages import _check_session_rates

    def cfg(**load):
        return SimpleNamespace(load=LoadSpec(workload="multi-turn", **load), slo=SLO(p99_latency_ms=2000))

    _check_session_rates(cfg(rate=200), 4.0)  # 800 req/s x 2 s x 4 = 6,400 VUs: within 10,000
    with pytest.raises(ConfigError, match=r"load_rate=400 sessions/s .* 1600 requests/s.* 12800 virtual users"):
        _check_session_rates(cfg(rate=400), 4.0)  # typed 400: alone it would size 3,200 VUs and pass
    _check_session_rates(cfg(rate=400, max_vus=5000), 4.0)  # capped VUs: the operator's cap holds
    with pytest.raises(ConfigError, match=r"offers 120000 requests/s, past the 100000"):
        _check_session_rates(cfg(rate=30000, max_vus=5000), 4.0)
    _check_session_rates(cfg(rate=400), 1.0)  # not rated in sessions: config's own check is the one


@pytest.mark.parametrize("phase", ["probe", "spike", "overload"])
def test_a_trace_on_its_own_clock_is_refused_for_a_phase_that_varies_the_rate(phase):
    w = W.workload("trace-sample")
    w.check_fits(200, 64, 0.0, 32768, ["sustained"])
    with pytest.raises(ConfigError, match=rf"own clock.*load_phases has {phase}.*follow_rate = true"):
        w.check_fits(200, 64, 0.0, 32768, ["sustained", phase])
