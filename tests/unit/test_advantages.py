"""Advantage estimators: hand values, and what happens to rejected / empty / NaN sequences and to
groups left without a baseline."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from megatron_mis.config.loss import LossConfig
from megatron_mis.core.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    compute_advantages_from_config,
    expand_to_tokens,
    group_ids_from_size,
)


def test_grpo_hand_values():
    res = compute_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0]), group_size=3, estimator="grpo")
    # group 0 = [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3); group 1 = [1, 2, 2]: mean 5/3, std sqrt(1/3)
    s = math.sqrt(1 / 3) + 1e-6
    want = [(1 - 1 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, (1 - 5 / 3) / s, (1 / 3) / s, (1 / 3) / s]
    torch.testing.assert_close(res.advantages, torch.tensor(want))
    assert (res.num_excluded_sequences, res.num_nonfinite_rewards, res.num_degenerate_groups) == (0, 0, 0)


def test_dr_grpo_and_equal_rewards():
    res = compute_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), group_size=2, grpo_std_normalization=False)
    torch.testing.assert_close(res.advantages, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    res = compute_advantages(torch.tensor([3.0, 3.0, 3.0]), group_size=3)
    assert res.advantages.tolist() == [0.0, 0.0, 0.0]


def test_rloo_hand_values():
    res = compute_advantages(torch.tensor([1.0, 0.0, 0.0, 4.0]), group_size=4, estimator="rloo")
    # r_i - mean of the other three
    torch.testing.assert_close(res.advantages, torch.tensor([1 - 4 / 3, 0 - 5 / 3, 0 - 5 / 3, 4 - 1 / 3]))


def test_reinforce_baseline_hand_values():
    res = compute_advantages(torch.tensor([1.0, 0.0, 0.0, 3.0]), group_size=2, estimator="reinforce_baseline")
    torch.testing.assert_close(res.advantages, torch.tensor([0.0, -1.0, -1.0, 2.0]))


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_baseline"])
def test_invalid_sequences_are_excluded_from_group_statistics(estimator):
    rewards = torch.tensor([1.0, 0.0, 5.0, 0.5, 2.0, 1.0])
    valid = torch.tensor([True, True, False, True, True, True])
    res = compute_advantages(rewards, group_size=3, valid=valid, estimator=estimator)
    # Same as computing the groups without the invalid member.
    keep = valid.nonzero().flatten()
    ref = compute_advantages(rewards[keep], group_ids=torch.tensor([0, 0, 1, 1, 1]), estimator=estimator)
    torch.testing.assert_close(res.advantages[keep], ref.advantages)
    assert res.advantages[2].item() == 0.0
    assert res.num_excluded_sequences == 1 and res.valid.tolist() == valid.tolist()


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_groups_without_a_baseline_get_zero_and_are_counted(estimator):
    rewards = torch.tensor([1.0, 0.0, 7.0, 2.0, 3.0, 1.0])
    valid = torch.tensor([True, False, True, False, False, True])  # groups: [1, -], [7, -], [-, 1]
    res = compute_advantages(rewards, group_size=2, valid=valid, estimator=estimator)
    assert res.advantages.tolist() == [0.0] * 6
    assert res.num_degenerate_groups == 3 and res.num_excluded_sequences == 3
    assert torch.isfinite(res.advantages).all()


def test_group_of_one_is_degenerate_not_nan():
    res = compute_advantages(torch.tensor([1.0, 2.0]), group_size=1)
    assert res.advantages.tolist() == [0.0, 0.0] and res.num_degenerate_groups == 2


def test_nonfinite_rewards_neutralised_or_error():
    rewards = torch.tensor([1.0, float("nan"), 0.0, float("inf")])
    with pytest.warns(RuntimeWarning, match="2 non-finite reward"):
        res = compute_advantages(rewards, group_size=2, estimator="rloo")
    assert torch.isfinite(res.advantages).all()
    assert res.num_nonfinite_rewards == 2 and res.num_excluded_sequences == 2 and res.num_degenerate_groups == 2
    assert res.metrics()["adv_num_nonfinite_rewards"] == 2.0
    with pytest.raises(ValueError, match=r"2 non-finite reward\(s\) .* at sequence\(s\) \[1, 3\]"):
        compute_advantages(rewards, group_size=2, nonfinite_policy="error")


def test_group_labels_need_not_be_contiguous():
    rewards = torch.tensor([1.0, 4.0, 0.0, 2.0])
    a = compute_advantages(rewards, group_ids=torch.tensor([7, 3, 7, 3]))
    b = compute_advantages(rewards[[0, 2, 1, 3]], group_size=2)
    torch.testing.assert_close(a.advantages[[0, 2, 1, 3]], b.advantages)


def test_token_expansion_and_config():
    res = compute_advantages_from_config(
        torch.tensor([1.0, 0.0]), LossConfig(advantage_estimator="rloo"), group_size=2
    )
    cu = torch.tensor([0, 3, 3])  # the second sequence is empty
    assert res.token_advantages(cu).tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="N\\+1"):
        expand_to_tokens(res.advantages, torch.tensor([0, 3]))


def test_bad_inputs():
    with pytest.raises(KeyError, match="unknown advantage estimator 'grpoo'.*valid: grpo, reinforce_baseline, rloo"):
        compute_advantages(torch.zeros(2), group_size=2, estimator="grpoo")
    with pytest.raises(ValueError, match="exactly one of"):
        compute_advantages(torch.zeros(2))
    with pytest.raises(ValueError, match="divide the number of sequences"):
        group_ids_from_size(5, 2)
    with pytest.raises(ValueError, match=r"group_ids has shape \(3,\), expected \[2\]"):
        compute_advantages(torch.zeros(2), group_ids=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        compute_advantages(torch.zeros(2), group_ids=torch.zeros(2))
    with pytest.raises(ValueError, match=r"valid has shape"):
        compute_advantages(torch.zeros(2), group_size=1, valid=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="1-D"):
        compute_advantages(torch.zeros(2, 2), group_size=1)
    assert sorted(ADVANTAGE_ESTIMATORS) == ["grpo", "reinforce_baseline", "rloo"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compute_advantages(torch.zeros(0), group_size=1)


# ------------------------------------------------------------------ ties: exactly zero, float64 statistics
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_baseline"])
@pytest.mark.parametrize("value", [7.7, 0.1, -3.3, 1e6 + 0.3, 1 / 3])
@pytest.mark.parametrize("size", [3, 7, 16])
def test_tied_groups_get_exactly_zero(estimator, value, size):
    # Non-dyadic rewards: with float32 statistics 16 x 7.7 gave +0.4805 for every member (GRPO).
    res = compute_advantages(torch.full((size,), value), group_size=size, estimator=estimator)
    assert res.advantages.tolist() == [0.0] * size
    assert res.num_tied_groups == 1 and res.num_degenerate_groups == 0
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        res = compute_advantages(torch.full((size,), value, dtype=dtype), group_size=size, estimator=estimator)
        assert res.advantages.tolist() == [0.0] * size


def test_issue_example_and_tie_next_to_a_live_group():
    res = compute_advantages(torch.full((16,), 7.7), group_size=16)
    assert res.advantages.abs().max().item() == 0.0
    rewards = torch.tensor([7.7, 7.7, 7.7, 0.0, 1.0, 0.5, 9.9, 9.9, 9.9])
    valid = torch.tensor([True, True, True, True, True, True, True, False, True])
    for estimator in ("grpo", "rloo"):
        res = compute_advantages(rewards, group_size=3, valid=valid, estimator=estimator)
        assert res.advantages[[0, 1, 2, 6, 7, 8]].tolist() == [0.0] * 6
        assert res.num_tied_groups == 2 and res.metrics()["adv_num_tied_groups"] == 2.0
        ref = compute_advantages(rewards[3:6], group_size=3, estimator=estimator)
        torch.testing.assert_close(res.advantages[3:6], ref.advantages)
    # a tie among the valid members only: the invalid 5.0 does not break it
    res = compute_advantages(torch.tensor([0.3, 5.0, 0.3]), group_size=3, valid=torch.tensor([True, False, True]))
    assert res.advantages.tolist() == [0.0, 0.0, 0.0] and res.num_tied_groups == 1


def test_statistics_are_float64():
    # Rewards 1e7 + {0, 0.25, 0.5, 0.75} in float64: a float32 mean would lose the offsets.
    r = torch.tensor([1e7, 1e7 + 0.25, 1e7 + 0.5, 1e7 + 0.75], dtype=torch.float64)
    res = compute_advantages(r, group_size=4, grpo_std_normalization=False)
    torch.testing.assert_close(res.advantages, torch.tensor([-0.375, -0.125, 0.125, 0.375]), rtol=0, atol=0)
    res = compute_advantages(r, group_size=4, estimator="rloo")
    torch.testing.assert_close(res.advantages, torch.tensor([-0.5, -1 / 6, 1 / 6, 0.5]), rtol=1e-7, atol=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rewards=[1.0, 2.0], group_size=2), r"rewards must be a torch.Tensor, got list"),
        (dict(rewards=torch.ones(2), group_size=2, valid=[True, True]), r"valid must be a torch.Tensor or None, got list"),
        (dict(rewards=torch.ones(2), group_ids=[0, 0]), r"group_ids must be a torch.Tensor or None, got list"),
        (dict(rewards=torch.ones(2), group_size=True), r"group_size must be an int >= 1, got True"),
        (dict(rewards=torch.ones(2), group_size=2.0), r"group_size must be an int >= 1, got 2.0"),
        (dict(rewards=torch.ones(2, dtype=torch.bool), group_size=2), r"rewards must be a real-valued tensor"),
    ],
)
def test_bad_argument_types_name_the_parameter(kwargs, match):
    with pytest.raises(TypeError, match=match):
        compute_advantages(**kwargs)


@pytest.mark.parametrize("eps", [float("nan"), -1.0, float("inf"), "1e-6"])
def test_grpo_eps_must_be_a_finite_non_negative_number(eps):
    with pytest.raises(ValueError, match=r"grpo_std_eps=.* must be a finite number >= 0"):
        compute_advantages(torch.tensor([1.0, 2.0]), group_size=2, grpo_std_eps=eps)


def test_huge_rewards_give_finite_advantages_or_a_clear_error():
    # float64 statistics: an enormous but representable spread is normalised exactly.
    res = compute_advantages(torch.tensor([1e30, 2e30]), group_size=2)
    assert res.advantages.tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], rel=1e-6)
    tied = compute_advantages(torch.tensor([3e38, 3e38]), group_size=2)
    assert tied.advantages.tolist() == [0.0, 0.0] and tied.num_tied_groups == 1
    # RLOO's r - mean(others) = 6e38 does not fit float32: a clear error naming the rewards.
    with pytest.raises(ValueError, match=r"rewards span .* do not fit float32"):
        compute_advantages(torch.tensor([3e38, -3e38]), group_size=2, estimator="rloo")
