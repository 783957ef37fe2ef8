"""Pure parts of the analysis: the Pareto front, change points on given series, identities."""

from __future__ import annotations

import numpy as np
import pytest

from deploybench.analyse.history import Params, change_points
from deploybench.analyse.pareto import pareto_front
from deploybench.store.identity import identity_of


def test_pareto_front_keeps_only_undominated_points():
    pts = [("a", 10, 500), ("b", 20, 800), ("c", 15, 900), ("d", 20, 700), ("e", 5, 400), ("f", None, 100)]
    assert pareto_front(pts) == ["e", "a", "d"]  # c is beaten by d on both; b by d on latency; f has no value
    assert pareto_front([]) == []
    assert pareto_front([("x", 1, 1), ("y", 1, 1)]) == ["x", "y"]  # equal points do not dominate each other


def test_a_step_is_found_where_it_is_and_a_flat_series_has_none():
    rng = np.random.default_rng(3)
    step = np.r_[rng.normal(100, 1.5, 6), rng.normal(110, 1.5, 6)]
    found = change_points(step, Params())
    assert [f[0] for f in found] == [6]
    idx, before, after, p = found[0]
    assert after / before == pytest.approx(1.1, abs=0.03) and p < 0.01
    assert change_points(rng.normal(100, 1.5, 12), Params()) == []
    assert change_points(np.full(12, 100.0), Params()) == []  # perfectly steady: the noise floor applies
    assert change_points(step[:5], Params()) == []  # too short for two segments of min_size


def test_a_change_below_min_change_is_not_reported_even_when_significant():
    x = np.r_[np.full(6, 100.0), np.full(6, 101.0)] + np.tile([0.0, 0.01], 6)
    assert change_points(x, Params(min_change=0.03)) == []
    assert [f[0] for f in change_points(x, Params(min_change=0.005, noise_floor=0.001))] == [6]


CFG = {"inventory": "lab", "model": {"name": "m"},
       "engine": {"profile": "sim", "max_num_seqs": 8, "sim": {"decode_base_ms": 15, "slowdown": 1.0}},
       "load": {"rate": 8, "duration_s": 30, "prompt_tokens": 200, "output_tokens": 64, "api": "completions"},
       "slo": {"p99_latency_ms": 2000}}


def _with(section: str, **kw) -> dict:
    return {**CFG, section: {**CFG[section], **kw}}


def test_identity_parts_change_with_what_they_describe():
    base = identity_of(CFG, ["n1", "n2"])
    assert base.differences(identity_of(_with("engine", max_num_seqs=16), ["n1", "n2"])) == ["serving"]
    assert base.differences(identity_of(_with("load", output_tokens=128), ["n1", "n2"])) == ["workload"]
    assert base.differences(identity_of(_with("slo", p99_latency_ms=1000), ["n1", "n2"])) == ["workload"]
    assert base.differences(identity_of(CFG, ["n1", "n3"])) == ["cluster"]
    assert base.differences(identity_of(CFG, ["n1", "n2"], fanout={"manifest_digest": "x"})) == ["model"]
    assert base.differences(identity_of(CFG, ["n1", "n2"], rollout={"version": "0.9"})) == ["software"]
    # run length and the fault knob change nothing; the offered rate changes the series, not the workload
    assert identity_of(_with("load", duration_s=300), ["n1", "n2"]).fingerprint == base.fingerprint
    slowed = {**CFG, "engine": {**CFG["engine"], "sim": {"decode_base_ms": 15, "slowdown": 1.1}}}
    assert identity_of(slowed, ["n1", "n2"]).fingerprint == base.fingerprint
    faster = identity_of(_with("load", rate=16), ["n1", "n2"])
    assert faster.differences(base) == [] and faster.fingerprint != base.fingerprint
    assert identity_of(CFG, ["n2", "n1"]).fingerprint == base.fingerprint  # node order does not matter


def test_the_sims_prefix_cache_knobs_at_their_defaults_keep_the_series_of_runs_stored_before_them():
    def sim(**kw) -> dict:
        return {**CFG, "engine": {**CFG["engine"], "sim": {**CFG["engine"]["sim"], **kw}}}

    before = identity_of(CFG, ["n1", "n2"])  # a run stored before the knobs existed
    assert identity_of(sim(prefix_caching=True, kv_cache_tokens=0), ["n1", "n2"]).fingerprint == before.fingerprint
    assert identity_of(sim(prefix_caching=False), ["n1", "n2"]).differences(before) == ["serving"]
    assert identity_of(sim(kv_cache_tokens=4096), ["n1", "n2"]).differences(before) == ["serving"]
