"""The token TIS diagnostics of the testbed: ``token_tis_floor1`` and ``token_tis_cap1`` each keep
one half of token TIS's weight, and ``token_tis_shuffled`` keeps all of it on other tokens, so a
study can tell what of the weight moves the outcome (docs/study.md, "What of the token TIS weight
costs reward at T = 1.5").

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
from megatron_mis.testbed.demo.config import BUILTIN_CORRECTIONS, DIAGNOSTIC_TIS, SHUFFLED_TIS, DemoConfig
from megatron_mis.testbed.demo.train import arm_spec, shuffle_log_ratios
from megatron_mis.testbed.study.config import ARMS, DEFAULT_ARMS, SWEEPS, StudyConfig, run_config

_RATIOS = [0.25, 0.8, 1.0, 1.3, 3.0]
_EXPECTED = {
    "token_tis": [0.25, 0.8, 1.0, 1.3, 2.0],
    "token_tis_shuffled": [0.25, 0.8, 1.0, 1.3, 2.0],  # the engine's weights; the trainer shuffles the inputs
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
    assert spec.shuffle_log_ratios == (correction in SHUFFLED_TIS)
    assert not arm_spec("token_tis", cfg).shuffle_log_ratios


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
