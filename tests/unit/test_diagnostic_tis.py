"""The token TIS diagnostics of the testbed: ``token_tis_floor1`` and ``token_tis_cap1`` each keep
one half of token TIS's weight, ``token_tis_shuffled`` keeps all of it on other tokens,
``token_tis_group_mean`` keeps only its variation between GRPO groups, ``token_tis_group_permuted``
gives each group another group's mean (a placebo: the same weights, independent of the group's
samples), ``token_tis_balanced`` restores the advantages' zero sum on each group's shared
first-token context and ``token_tis_unit`` weighs every token 1 (the null arm), so a study can tell
what of the weight moves the outcome (docs/study.md, "What of the token TIS weight costs reward at
T = 1.5").

Hand-derived: with ratios r = pi_old / pi_rollout of 0.25, 0.8, 1, 1.3 and 3, token TIS weighs
min(r, 2) = 0.25, 0.8, 1, 1.3, 2; the floor weighs clamp(r, 1, 2) = 1, 1, 1, 1.3, 2 (no token
discounted) and the cap min(r, 1) = 0.25, 0.8, 1, 1, 1 (no token raised).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mis.config.base import ConfigError
from megatron_mis.core.engine import compute_mis
from megatron_mis.testbed.demo.config import (
    BUILTIN_CORRECTIONS,
    DIAGNOSTIC_TIS,
    REWRITE_EXPONENT,
    REWRITTEN_TIS,
    DemoConfig,
)
from megatron_mis.testbed.demo.train import (
    arm_spec,
    balanced_first_token_weights,
    group_mean_weights,
    permuted_group_mean_weights,
    powered_weights,
    random_derangement,
    rollout_log_probs_for_weights,
    shuffle_log_ratios,
)
from megatron_mis.testbed.study.config import ARMS, DEFAULT_ARMS, SWEEPS, StudyConfig, run_config

_RATIOS = [0.25, 0.8, 1.0, 1.3, 3.0]
_EXPECTED = {
    "token_tis": [0.25, 0.8, 1.0, 1.3, 2.0],
    # the engine's weights; the trainer rewrites the inputs of these
    "token_tis_shuffled": [0.25, 0.8, 1.0, 1.3, 2.0],
    "token_tis_group_mean": [0.25, 0.8, 1.0, 1.3, 2.0],
    "token_tis_group_permuted": [0.25, 0.8, 1.0, 1.3, 2.0],
    "token_tis_group_permuted_half": [0.25, 0.8, 1.0, 1.3, 2.0],
    "token_tis_group_permuted_double": [0.25, 0.8, 1.0, 1.3, 2.0],
    "token_tis_group_permuted_wide": [0.25, 0.8, 1.0, 1.3, 2.0],
    "token_tis_group_permuted_wider": [0.25, 0.8, 1.0, 1.3, 2.0],
    "token_tis_shuffled_tenth": [0.25, 0.8, 1.0, 1.3, 2.0],
    "token_tis_shuffled_quarter": [0.25, 0.8, 1.0, 1.3, 2.0],
    "token_tis_shuffled_half": [0.25, 0.8, 1.0, 1.3, 2.0],
    "token_tis_shuffled_double": [0.25, 0.8, 1.0, 1.3, 2.0],
    "token_tis_unit": [0.25, 0.8, 1.0, 1.3, 2.0],
    "token_tis_balanced": [0.25, 0.8, 1.0, 1.3, 2.0],
    "token_tis_floor1": [1.0, 1.0, 1.0, 1.3, 2.0],
    "token_tis_cap1": [0.25, 0.8, 1.0, 1.0, 1.0],
}


def _weights(correction: str) -> list[float]:
    spec = arm_spec(correction, DemoConfig())
    rollout = torch.full((len(_RATIOS),), -1.0)
    train = rollout + torch.tensor([math.log(r) for r in _RATIOS])
    res = compute_mis(train, rollout, torch.ones(len(_RATIOS)), [0, 2, len(_RATIOS)], spec.mis)
    assert res.keep_mask.all()  # a weight, never a rejection
    return res.weights.tolist()


@pytest.mark.parametrize("correction", sorted(_EXPECTED))
def test_each_diagnostic_keeps_one_half_of_token_tis_s_weight(correction):
    assert _weights(correction) == pytest.approx(_EXPECTED[correction], rel=1e-6)


def test_the_halves_recombine_into_token_tis():
    """floor = max(token TIS, 1) and cap = min(token TIS, 1): together they are token TIS's weight."""
    tis, floor, cap = (torch.tensor(_weights(c)) for c in ("token_tis", "token_tis_floor1", "token_tis_cap1"))
    torch.testing.assert_close(floor, tis.clamp(min=1.0))
    torch.testing.assert_close(cap, tis.clamp(max=1.0))
    torch.testing.assert_close(floor * cap, tis)


@pytest.mark.parametrize("correction", sorted(DIAGNOSTIC_TIS))
def test_a_diagnostic_trains_with_decoupled_ppo_at_the_trainer_s_temperature(correction):
    cfg = DemoConfig(temperature=1.5, trainer_temperature=1.0, entropy_coef=0.01)
    spec = arm_spec(correction, cfg)
    assert spec.label == correction and spec.correction == correction
    assert spec.loss.policy_loss == "decoupled_ppo" and spec.mis.use_tis and not spec.mis.use_rs
    assert spec.loss.rollout_temperature == 1.0 and spec.loss.entropy_coef == 0.01
    assert spec.mis.tis_level == "token"
    assert correction in BUILTIN_CORRECTIONS
    assert spec.rewrite == REWRITTEN_TIS.get(correction)
    assert spec.rewrite_exponent == REWRITE_EXPONENT.get(correction, 1.0)
    assert arm_spec("token_tis", cfg).rewrite is None and arm_spec("token_tis", cfg).rewrite_exponent == 1.0


def test_the_noise_doses_are_the_placebo_s_or_the_shuffled_weights_raised_to_a_power():
    """The placebo's doses rewrite as the placebo does, the shuffled weights' as the shuffled arm does;
    then each raises every weight to its power (the placebo's 1/2, 2, 3.5 and 6, the shuffled
    weights' 1/10, 1/4, 1/2 and 2)."""
    assert {n: (REWRITTEN_TIS[n], p) for n, p in REWRITE_EXPONENT.items()} == {
        "token_tis_group_permuted_half": ("group_mean_permuted", 0.5),
        "token_tis_group_permuted_double": ("group_mean_permuted", 2.0),
        "token_tis_group_permuted_wide": ("group_mean_permuted", 3.5),
        "token_tis_group_permuted_wider": ("group_mean_permuted", 6.0),
        "token_tis_shuffled_tenth": ("shuffle", 0.1),
        "token_tis_shuffled_quarter": ("shuffle", 0.25),
        "token_tis_shuffled_half": ("shuffle", 0.5),
        "token_tis_shuffled_double": ("shuffle", 2.0),
    }
    for dose in ("half", "double", "wide", "wider"):
        assert DIAGNOSTIC_TIS[f"token_tis_group_permuted_{dose}"] == DIAGNOSTIC_TIS["token_tis_group_permuted"]
    for dose in ("tenth", "quarter", "half", "double"):
        assert DIAGNOSTIC_TIS[f"token_tis_shuffled_{dose}"] == DIAGNOSTIC_TIS["token_tis_shuffled"]


def test_powered_weights_scale_each_loss_token_s_log_weight_hand_derived():
    """Weights 0.81, 1.21, 4 (masked), 1 and 0.5: to the power 1/2 they are 0.9, 1.1, 4, 1, 0.5 ** 0.5;
    to the power 2, 0.6561, 1.4641, 4, 1, 0.25; to the power 0 every loss token weighs 1. The
    masked token keeps its weight; in log space every loss token moves by the power's factor."""
    w = torch.tensor([0.81, 1.21, 4.0, 1.0, 0.5])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    torch.testing.assert_close(powered_weights(w, mask, 0.5), torch.tensor([0.9, 1.1, 4.0, 1.0, math.sqrt(0.5)]))
    torch.testing.assert_close(powered_weights(w, mask, 2.0), torch.tensor([0.6561, 1.4641, 4.0, 1.0, 0.25]))
    assert powered_weights(w, mask, 0.0).tolist() == [1.0, 1.0, 4.0, 1.0, 1.0]
    torch.testing.assert_close(torch.log(powered_weights(w, mask, 2.0))[mask > 0], 2 * torch.log(w)[mask > 0])
    with pytest.raises(ValueError, match="exponent=nan: expected a finite power"):
        powered_weights(w, mask, float("nan"))
    with pytest.raises(ValueError, match="weight must be > 0 to be raised to a power.*smallest 0"):
        powered_weights(torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0]), mask, 2.0)


def test_shuffled_log_ratios_are_a_permutation_over_the_loss_tokens_only():
    """Hand-derived: log-ratios old - rollout of 0.1, 0.2, 0.3, 0.4, 0.5 with the middle token out of
    the loss mask; the four loss tokens' log-ratios come back in the generator's order, the masked
    token's unchanged, and the old log-probs are untouched (the result is a rollout log-prob)."""
    old = torch.tensor([-1.0, -2.0, -3.0, -0.5, -1.5])
    d = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    out = shuffle_log_ratios(old, old - d, mask, torch.Generator().manual_seed(0))
    perm = torch.randperm(4, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 1, 3, 4])
    expected = d.clone()
    expected[pos] = d[pos[perm]]
    assert not torch.equal(perm, torch.arange(4))  # this seed moves them
    torch.testing.assert_close(old - out, expected)
    assert float(old[2] - out[2]) == pytest.approx(0.3)
    assert sorted((old - out)[pos].tolist()) == pytest.approx(sorted(d[pos].tolist()))
    # the same generator state, the same permutation: every TP / CP rank of a micro-batch agrees
    torch.testing.assert_close(out, shuffle_log_ratios(old, old - d, mask, torch.Generator().manual_seed(0)))


def test_the_demo_and_the_study_accept_the_diagnostics_and_name_them_in_errors():
    for name in DIAGNOSTIC_TIS:
        assert DemoConfig(correction=name).correction == name
        assert ARMS[name].overrides == {"correction": name}
        assert name not in DEFAULT_ARMS  # a default-arm study runs the arms its archived report ran
    study = StudyConfig(sweep="temperature", doses=["t1.5"], arms=["none", *DIAGNOSTIC_TIS], seeds=2)
    assert run_config(study.for_dose("t1.5"), "token_tis_floor1", 1).correction == "token_tis_floor1"
    assert "token_tis_floor1" not in SWEEPS["temperature"].arms
    with pytest.raises(ConfigError, match="correction='token_tis_floor2'.*unknown preset"):
        DemoConfig(correction="token_tis_floor2")


def test_group_mean_weights_average_each_group_s_loss_tokens_hand_derived():
    """Groups of 2: sequences of 2, 1, 1 and 2 tokens, the second token out of the loss mask. Group 0
    (tokens 0-2) has loss tokens of weight 0.5 and 1.0: both become 0.75, the masked token keeps 1.5;
    group 1 (tokens 3-5) weighs 2.0, 0.2, 0.4: each becomes 2.6 / 3."""
    w = torch.tensor([0.5, 1.5, 1.0, 2.0, 0.2, 0.4])
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    out = group_mean_weights(w, mask, torch.tensor([2, 1, 1, 2]), 2)
    torch.testing.assert_close(out, torch.tensor([0.75, 1.5, 0.75, 2.6 / 3, 2.6 / 3, 2.6 / 3]))
    with pytest.raises(ValueError, match="3 sequences do not split into whole GRPO groups of group_size=2"):
        group_mean_weights(w[:4], mask[:4], torch.tensor([2, 1, 1]), 2)


def test_a_derangement_moves_every_element_and_repeats_with_its_generator():
    for n in (2, 3, 8):
        seen = set()
        for seed in range(40):
            perm = random_derangement(n, torch.Generator().manual_seed(seed))
            assert sorted(perm) == list(range(n)) and all(p != i for i, p in enumerate(perm))
            assert perm == random_derangement(n, torch.Generator().manual_seed(seed))
            seen.add(tuple(perm))
        # n = 2 has one derangement, n = 3 two; n = 8 has 14,833, and 40 draws repeat rarely
        assert len(seen) == {2: 1, 3: 2}.get(n, len(seen)) and (n < 8 or len(seen) > 30)
    with pytest.raises(ValueError, match="n=1: a derangement needs at least 2 elements"):
        random_derangement(1, torch.Generator())


def test_permuted_group_means_give_each_group_another_group_s_mean_hand_derived():
    """Groups of 2, sequences of 1 token except the second (2 tokens, its second out of the loss mask).
    Group means: group 0 (weights 0.5, 1.0; 3.0 masked) 0.75, group 1 (2.0, 0.4) 1.2, group 2 (0.6,
    1.0) 0.8. The generator's derangement of the three groups decides which mean each group takes;
    the masked token keeps 3.0, and the micro-batch holds the same three means as under the group
    mean, each on another group."""
    w = torch.tensor([0.5, 1.0, 3.0, 2.0, 0.4, 0.6, 1.0])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    lengths = torch.tensor([1, 2, 1, 1, 1, 1])
    means = [0.75, 1.2, 0.8]
    perm = random_derangement(3, torch.Generator().manual_seed(5))
    out = permuted_group_mean_weights(w, mask, lengths, 2, torch.Generator().manual_seed(5))
    gid = [0, 0, 0, 1, 1, 2, 2]
    expected = torch.tensor([3.0 if i == 2 else means[perm[g]] for i, g in enumerate(gid)])
    torch.testing.assert_close(out, expected)
    own = group_mean_weights(w, mask, lengths, 2)
    assert sorted(set(out[mask > 0].tolist())) == pytest.approx(sorted(set(own[mask > 0].tolist())))
    assert not torch.isclose(out, own)[mask > 0].any()  # no group keeps its own mean


def test_permuted_group_means_skip_a_group_without_loss_tokens_and_need_two_groups_that_have_them():
    """Group 1's tokens are all out of the loss mask: it has no mean to give or take, so groups 0 and 2
    swap theirs (the only derangement of two) and group 1's tokens keep their weights."""
    w = torch.tensor([0.5, 1.5, 2.0, 4.0, 1.0, 1.2])
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    lengths = torch.ones(6, dtype=torch.long)
    out = permuted_group_mean_weights(w, mask, lengths, 2, torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, torch.tensor([1.1, 1.1, 2.0, 4.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="1 of 3 GRPO groups have loss tokens: the permuted group mean needs "
                                         "at least 2"):
        permuted_group_mean_weights(w, torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0]), lengths, 2, torch.Generator())
    with pytest.raises(ValueError, match="6 sequences do not split into whole GRPO groups of group_size=4"):
        permuted_group_mean_weights(w, mask, lengths, 4, torch.Generator())


def _first_token_sums(w, adv, lengths, group_size):
    first = torch.cumsum(lengths, 0) - lengths
    return (w[first] * adv[first] / lengths).view(-1, group_size).sum(1)


def test_balanced_weights_scale_down_the_heavier_side_of_each_group_s_first_tokens_hand_derived():
    """Groups of 4, responses of 2 tokens (second tokens weigh 1.3), advantages summing to 0:

    - group 0: A = (1.5, 0.5, -1, -1), first-token weights (1, 1, 0.5, 1); the shares w A / 2 are
      (0.75, 0.25, -0.25, -0.5): the positive side weighs 1 against 0.75 and is scaled by 3/4, so the
      first weights become (0.75, 0.75, 0.5, 1);
    - group 1: A = (1, 1, -1, -1), first weights (0.5, 0.5, 1, 2): shares (0.25, 0.25, -0.5, -1), the
      negative side (1.5) is scaled by 1/3 to (1/3, 2/3);
    - group 2: every advantage 0 (a group whose samples all scored the same): nothing to balance.
    """
    lengths = torch.full((12,), 2)
    adv_seq = torch.tensor([1.5, 0.5, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 0.0, 0.0, 0.0, 0.0])
    first = torch.tensor([1.0, 1.0, 0.5, 1.0, 0.5, 0.5, 1.0, 2.0, 0.3, 1.7, 1.0, 0.9])
    w = torch.stack([first, torch.full((12,), 1.3)], 1).reshape(-1)
    adv = torch.repeat_interleave(adv_seq, lengths)
    out = balanced_first_token_weights(w, torch.ones(24), lengths, adv, 4)
    expected_first = torch.tensor([0.75, 0.75, 0.5, 1.0, 0.5, 0.5, 1 / 3, 2 / 3, 0.3, 1.7, 1.0, 0.9])
    torch.testing.assert_close(out.view(12, 2)[:, 0], expected_first)
    torch.testing.assert_close(out.view(12, 2)[:, 1], torch.full((12,), 1.3))  # later tokens untouched
    torch.testing.assert_close(_first_token_sums(out, adv, lengths, 4), torch.zeros(3))
    assert _first_token_sums(w, adv, lengths, 4)[:2].abs().min() > 0.2  # token TIS's were not 0


def test_balanced_weights_count_each_sequence_s_loss_tokens_and_skip_a_masked_first_token():
    """The loss takes each sequence's token mean, so a first token's share is w A / n. Group 0:
    sequences of 1 and 3 tokens, A = (+1, -1), first weights 1: shares 1 and -1/3, the positive side
    is scaled by 1/3. Group 1: the first sequence's first token is out of the loss mask: its share
    is 0, only the negative side carries weight and nothing is scaled (no weight rises)."""
    lengths = torch.tensor([1, 3, 2, 2])
    adv = torch.repeat_interleave(torch.tensor([1.0, -1.0, 1.0, -1.0]), lengths)
    w = torch.ones(8)
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    out = balanced_first_token_weights(w, mask, lengths, adv, 2)
    torch.testing.assert_close(out, torch.tensor([1 / 3, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="4 sequences do not split into whole GRPO groups of group_size=3"):
        balanced_first_token_weights(w, mask, lengths, adv, 3)


def test_rewritten_rollout_log_probs_make_the_engine_compute_the_given_weights():
    """old - log(w) on the loss tokens, the recorded log-prob elsewhere; token TIS's engine then
    weighs each loss token by w (all below its bound of 2). A weight of 0 has no log-ratio."""
    old = torch.tensor([-1.0, -2.5, -0.3, -4.0, -1.2])
    rollout = torch.tensor([-1.1, -2.0, -0.2, -3.0, -1.0])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    w = torch.tensor([0.2, 1.9, 5.0, 1.0, 0.75])
    out = rollout_log_probs_for_weights(old, rollout, mask, w)
    assert float(out[2]) == pytest.approx(-0.2)
    torch.testing.assert_close(torch.exp(old - out)[mask > 0], w[mask > 0])
    res = compute_mis(old, out, mask, [0, 2, 5], arm_spec("token_tis_balanced", DemoConfig()).mis)
    torch.testing.assert_close(res.weights[mask > 0], w[mask > 0], rtol=1e-6, atol=0)
    # the null arm's weights of exactly 1 give back pi_old itself: a log-ratio of exactly 0
    assert torch.equal(rollout_log_probs_for_weights(old, rollout, mask, torch.ones(5))[mask > 0], old[mask > 0])
    with pytest.raises(ValueError, match="weight must be > 0.*smallest 0"):
        rollout_log_probs_for_weights(old, rollout, mask, torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0]))


def test_the_group_diagnostics_need_whole_groups_in_every_micro_batch():
    for name in ("token_tis_group_mean", "token_tis_group_permuted", "token_tis_group_permuted_double",
                 "token_tis_group_permuted_wider", "token_tis_balanced"):
        with pytest.raises(ConfigError, match=f"correction='{name}' rewrites each GRPO group's weights.*"
                                              "micro_batch_size=8 must be a multiple of samples_per_prompt=3"):
            DemoConfig(correction=name, prompts_per_step=8, samples_per_prompt=3, micro_batch_size=8)
        whole = DemoConfig(correction=name, prompts_per_step=8, samples_per_prompt=4, micro_batch_size=8)
        assert whole.correction == name
    assert DemoConfig(correction="token_tis_shuffled", prompts_per_step=8, samples_per_prompt=3,
                      micro_batch_size=8).correction == "token_tis_shuffled"  # a micro-batch permutation: any split


def test_the_group_placebo_needs_two_groups_in_every_micro_batch():
    with pytest.raises(ConfigError, match="correction='token_tis_group_permuted' gives each GRPO group another "
                                          "group's mean weight.*micro_batch_size=4 must be >= 2 x "
                                          "samples_per_prompt=4"):
        DemoConfig(correction="token_tis_group_permuted", prompts_per_step=8, samples_per_prompt=4, micro_batch_size=4)
    # the group mean itself takes one group per micro-batch
    assert DemoConfig(correction="token_tis_group_mean", prompts_per_step=8, samples_per_prompt=4,
                      micro_batch_size=4).micro_batch_size == 4
    # both problems at once: 6 is not a multiple of 4, and fewer than 2 groups fit
    with pytest.raises(ConfigError) as err:
        DemoConfig(correction="token_tis_group_permuted", prompts_per_step=6, samples_per_prompt=4,
                   micro_batch_size=6)
    assert "must be a multiple of samples_per_prompt=4" in str(err.value) and "must be >= 2 x" in str(err.value)
