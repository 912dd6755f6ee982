"""The study's statistics on known data: bootstrap intervals, paired differences, the per-run
metrics (final reward, collapse, steps to threshold, K3) by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_mis.testbed.study.stats import (
    bootstrap_ci,
    curve_band,
    moving_mean,
    paired_differences,
    run_metrics,
    wilson_interval,
)


def test_bootstrap_ci_of_a_normal_sample_matches_the_normal_interval():
    x = np.random.default_rng(1).normal(2.0, 1.0, size=400)
    mean, low, high = bootstrap_ci(x, resamples=4000)
    assert mean == pytest.approx(x.mean())
    se = x.std(ddof=1) / math.sqrt(x.size)
    # the percentile bootstrap of a mean approaches mean +- 1.96 se
    assert low == pytest.approx(mean - 1.96 * se, abs=0.15 * se * 1.96)
    assert high == pytest.approx(mean + 1.96 * se, abs=0.15 * se * 1.96)
    assert low < 2.0 < high
    # wider confidence, wider interval; the same call is reproducible
    _, low99, high99 = bootstrap_ci(x, confidence=0.99, resamples=4000)
    assert low99 < low and high99 > high
    assert bootstrap_ci(x, resamples=4000) == (mean, low, high)


def test_bootstrap_ci_edge_cases():
    assert bootstrap_ci([3.0, 3.0, 3.0]) == (3.0, 3.0, 3.0)
    assert bootstrap_ci([0.25]) == (0.25, 0.25, 0.25)
    # two values: every resample mean lies in {0, 0.5, 1}
    mean, low, high = bootstrap_ci([0.0, 1.0], resamples=2000)
    assert (mean, low, high) == (0.5, 0.0, 1.0)
    with pytest.raises(ValueError, match="at least one"):
        bootstrap_ci([])
    with pytest.raises(ValueError, match="non-finite"):
        bootstrap_ci([1.0, float("nan")])


def test_paired_differences():
    base = {0: 0.5, 1: 0.6, 2: 0.4, 3: 0.7}
    d = paired_differences({s: v + 0.1 for s, v in base.items()}, base)
    assert d["n"] == 4 and d["mean"] == pytest.approx(0.1)
    assert d["low"] == pytest.approx(0.1) and d["high"] == pytest.approx(0.1) and d["excludes_zero"]
    # only common seeds, None skipped; differences of opposite signs: the CI includes 0
    d = paired_differences({0: 0.6, 1: 0.5, 2: None, 5: 0.9}, base)
    assert d["n"] == 2 and d["diffs"] == pytest.approx({0: 0.1, 1: -0.1})
    assert d["low"] < 0 < d["high"] and not d["excludes_zero"]
    assert paired_differences({9: 1.0}, base) is None
    # a single pair never "excludes zero" (no spread to judge)
    assert not paired_differences({0: 0.9}, base)["excludes_zero"]


def test_moving_mean_and_band():
    assert moving_mean([1, 2, 3, 4], 2).tolist() == [1.5, 2.5, 3.5]
    assert moving_mean([1, 2], 5).tolist() == [1.5]
    mean, low, high = curve_band([[0.0, 1.0], [0.0, 3.0]], resamples=500)
    assert mean.tolist() == [0.0, 2.0] and low[0] == high[0] == 0.0
    assert low[1] == 1.0 and high[1] == 3.0


def _records(rewards, k3=None):
    k3 = k3 if k3 is not None else [1e-4] * len(rewards)
    return [{"reward_mean": r, "mis_k3_kl": k, "mis_k3_kl_max": 10 * k} for r, k in zip(rewards, k3)]


def test_run_metrics_by_hand():
    rewards = [0.1, 0.1, 0.3, 0.5, 0.7, 0.7, 0.6]
    k3 = [1e-4, 1e-4, 2e-4, 2e-4, 4e-4, 4e-4, 4e-4]
    m = run_metrics(_records(rewards, k3), {"evaluation": {"greedy_reward": 0.8, "greedy_exact": 0.5}, "wall_s": 3.0},
                    last_k=2, threshold=0.6, collapse_fraction=0.5)
    assert m["start_reward"] == pytest.approx(0.1) and m["final_reward"] == pytest.approx(0.65)
    assert m["peak_reward"] == pytest.approx(0.7)
    assert not m["collapsed"]
    # moving means of 2: 0.1 0.2 0.4 0.6 0.7 0.65 -> first reaches 0.6 at window index 3, i.e. step 5
    assert m["steps_to_threshold"] == 5
    assert m["k3_mean"] == pytest.approx(sum(k3) / 7) and m["k3_max"] == pytest.approx(4e-4)
    assert m["k3_token_max"] == pytest.approx(4e-3)
    # thirds of 7 steps: 2 steps each -> late 4e-4 / early 1e-4
    assert m["k3_late_early"] == pytest.approx(4.0)
    assert m["greedy_reward"] == 0.8 and m["wall_s"] == 3.0


def test_collapse_definition():
    kw = dict(last_k=2, threshold=0.9, collapse_fraction=0.5)
    end = {"evaluation": {}}
    # gained 0.6 (0.1 -> 0.7), ended at 0.2: kept 0.1 of 0.6 < half -> collapsed; never reached 0.9
    m = run_metrics(_records([0.1, 0.1, 0.7, 0.7, 0.2, 0.2]), end, **kw)
    assert m["collapsed"] and m["steps_to_threshold"] is None
    # kept 0.4 of the 0.6 gain -> not collapsed
    assert not run_metrics(_records([0.1, 0.1, 0.7, 0.7, 0.5, 0.5]), end, **kw)["collapsed"]
    # never learned (gain < 0.1): not a collapse, whatever the end
    assert not run_metrics(_records([0.1, 0.1, 0.15, 0.15, 0.0, 0.0]), end, **kw)["collapsed"]
    with pytest.raises(ValueError, match="no metrics"):
        run_metrics([], end, **kw)


def test_wilson_interval():
    low, high = wilson_interval(0, 8)
    assert low == 0.0 and 0.3 < high < 0.4  # 0/8: upper bound ~0.32
    low, high = wilson_interval(8, 8)
    assert high == 1.0 and 0.6 < low < 0.7
    assert all(math.isnan(v) for v in wilson_interval(0, 0))
