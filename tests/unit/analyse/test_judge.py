"""The verdict on the newest run (deploybench.analyse.judge) on series with known answers."""

import numpy as np
import pytest

from deploybench.analyse.judge import JudgeParams, judge_newest, judge_values, pooled_noise


def _series(n=8, noise=0.005, step_at=None, factor=1.10, seed=3):
    rng = np.random.default_rng(seed)
    x = 100.0 * (1 + noise * rng.standard_normal(n))
    if step_at is not None:
        x[step_at:] *= factor
    return x


def test_a_ten_percent_slowdown_is_a_regression_at_its_first_run_and_never_again():
    got = [j.verdict for j in judge_values("latency_p50_ms", _series(step_at=4))]
    assert got[4] == "regression", got
    assert [v for i, v in enumerate(got) if i != 4] == ["no change"] * 7, got


def test_the_regression_names_magnitude_p_value_and_the_runs_before_it():
    j = judge_values("latency_p50_ms", _series(step_at=4))[4]
    assert j.direction == "worse" and j.how == "single-run test"
    assert j.magnitude == pytest.approx(0.10, abs=0.02)
    assert j.p_value < 0.01 and j.against == [0, 1, 2, 3] and j.change_at == 4


def test_direction_depends_on_the_metric():
    # lower throughput is worse, higher latency is worse
    assert judge_values("output_tps", _series(step_at=4, factor=0.9))[4].verdict == "regression"
    assert judge_values("output_tps", _series(step_at=4, factor=1.1))[4].verdict == "improvement"
    assert judge_values("latency_p99_ms", _series(step_at=4, factor=0.9))[4].verdict == "improvement"


def test_a_steady_series_raises_nothing():
    for seed in range(20):
        got = {j.verdict for j in judge_values("latency_p50_ms", _series(n=10, noise=0.01, seed=seed))}
        assert "regression" not in got and "improvement" not in got, (seed, got)


def test_one_odd_run_on_a_noisy_series_is_suspect_then_confirmed_by_the_change_point_method():
    # noise 1.4 %, a 5 % step: its first run is outside the band (|t| > 3) but not significant (p > 0.01);
    # the runs after it confirm the change
    x = np.array([100, 102, 98, 101, 99, 100.5, 104.9, 105.2, 104.6, 105.1, 104.8])
    got = judge_values("latency_p50_ms", x)
    verdicts = [j.verdict for j in got]
    assert verdicts[6] == "suspect", verdicts
    confirmed = [j for j in got if j.verdict == "regression"]
    assert len(confirmed) == 1 and confirmed[0].how == "change point confirmed", verdicts
    assert confirmed[0].change_at == 6 and confirmed[0].p_value < 0.01
    assert verdicts.index("regression") > 6


def test_too_few_runs_is_no_change():
    got = judge_values("latency_p50_ms", [100, 130])
    assert [j.verdict for j in got] == ["no change", "no change"]
    assert "too few runs" in got[1].how


def test_smaller_than_min_change_is_never_news():
    x = _series(noise=0.0005, step_at=4, factor=1.02)
    assert {j.verdict for j in judge_values("latency_p50_ms", x)} == {"no change"}


def test_pooled_noise_is_within_levels():
    x = np.array([100, 102, 98, 110, 112, 108])
    sd, df = pooled_noise(x, [0, 3], floor=0.001)
    assert df == 4 and sd == pytest.approx(0.019, abs=0.002)  # the step itself is not noise
    assert pooled_noise(np.array([100.0, 100.0, 100.0]), [0], floor=0.005) == (0.005, 2)


def test_judge_newest_replays_a_window_and_maps_indices_back():
    x = list(_series(n=30, step_at=26))
    j = judge_newest("latency_p50_ms", x[:27], JudgeParams(window=10))
    assert j.verdict == "regression" and j.change_at == 26 and j.against[-1] == 25
