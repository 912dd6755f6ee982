"""Policy losses: hand-computed values and gradients for every registered loss, clip fractions,
dual-clip, the equivalences between the three PPO forms, OPSM, the KL / entropy terms, split
invariance and bad input."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from megatron_mis.config.base import ConfigError
from megatron_mis.config.loss import LossConfig
from megatron_mis.core.aggregation import Denominators, denominator_mask, local_denominators
from megatron_mis.core.kl import kl_estimate
from megatron_mis.core.losses import (
    POLICY_LOSSES,
    compute_rl_loss,
    finalize_metrics,
    opsm_keep_mask,
    opsm_sequence_stats,
    ppo_clip_terms,
)

# Five tokens in one sequence. r = pi_theta / pi_old and A chosen to hit every branch.
RATIOS = [1.5, 0.5, 0.5, 3.0, 1.1]
ADV = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0], dtype=torch.float64)
OLD = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5], dtype=torch.float64)
LP = OLD + torch.log(torch.tensor(RATIOS, dtype=torch.float64))
CU = torch.tensor([0, 5])
ONES = torch.ones(5, dtype=torch.bool)
DEN = Denominators(5, 1)

# eps_low 0.2, eps_high 0.28, c = 2:
#  t0 r=1.5 A=+1: max(-1.5, -1.28) = -1.28 (clipped high)
#  t1 r=0.5 A=-1: max(0.5, 0.8) = 0.8 (clipped low; below the dual cap 2)
#  t2 r=0.5 A=+1: max(-0.5, -0.8) = -0.5
#  t3 r=3.0 A=-1: max(3, 1.28) = 3 -> dual-clip cap min(3, 2) = 2
#  t4 r=1.1 A=+2: -2.2
PPO_LOSS = [-1.28, 0.8, -0.5, 3.0, -2.2]
PPO_DUAL_LOSS = [-1.28, 0.8, -0.5, 2.0, -2.2]
# d loss / d log pi_theta = -r A on unclipped tokens, 0 on clipped ones
PPO_GRAD = [0.0, 0.0, -0.5, 3.0, -2.2]
PPO_DUAL_GRAD = [0.0, 0.0, -0.5, 0.0, -2.2]
CFG = LossConfig(policy_loss="ppo", eps_clip=0.2, eps_clip_high=0.28)


def _loss(cfg, lp=LP, **kw):
    lp = lp.clone().requires_grad_()
    kw.setdefault("old_log_probs", OLD)
    out = compute_rl_loss(lp, kw.pop("advantages", ADV), kw.pop("loss_mask", ONES), kw.pop("cu", CU), cfg, kw.pop("den", DEN), **kw)
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out, grad


def test_registry():
    assert POLICY_LOSSES.names() == ["bypass_ppo", "cispo", "decoupled_ppo", "gspo", "ppo", "reinforce"]
    with pytest.raises(KeyError, match=r"unknown policy loss 'ppo_clip'.*valid: bypass_ppo, cispo, decoupled_ppo, gspo, ppo, reinforce"):
        POLICY_LOSSES.get("ppo_clip")
    with pytest.raises(ValueError, match="already registered"):
        POLICY_LOSSES.register("ppo", POLICY_LOSSES.get("ppo"))


def test_ppo_clip_terms_hand_values():
    t = ppo_clip_terms(LP - OLD, ADV, 0.2, 0.28)
    torch.testing.assert_close(t.loss, torch.tensor(PPO_LOSS, dtype=torch.float64))
    assert t.clipped_high.tolist() == [True, False, False, False, False]
    assert t.clipped_low.tolist() == [False, True, False, False, False]
    assert not t.dual_clipped.any()
    t = ppo_clip_terms(LP - OLD, ADV, 0.2, 0.28, eps_c=2.0)
    torch.testing.assert_close(t.loss, torch.tensor(PPO_DUAL_LOSS, dtype=torch.float64))
    assert t.dual_clipped.tolist() == [False, False, False, True, False]


def test_symmetric_clip_default():
    t = ppo_clip_terms(LP - OLD, ADV, 0.2, 0.2)
    assert t.loss[0].item() == pytest.approx(-1.2)


@pytest.mark.parametrize("dual", [False, True])
def test_ppo_loss_value_gradient_and_clip_fractions(dual):
    cfg = CFG.replace(eps_clip_c=2.0 if dual else None)
    out, grad = _loss(cfg)
    want = PPO_DUAL_LOSS if dual else PPO_LOSS
    assert out.loss.item() == pytest.approx(sum(want) / 5)
    torch.testing.assert_close(grad, torch.tensor(PPO_DUAL_GRAD if dual else PPO_GRAD, dtype=torch.float64) / 5)
    m = finalize_metrics({k: float(v) for k, v in out.flat_metrics().items()})
    assert m["pg_clipfrac"] == pytest.approx(2 / 5)
    assert m["pg_clipfrac_low"] == pytest.approx(1 / 5) and m["pg_clipfrac_high"] == pytest.approx(1 / 5)
    assert m["pg_dualclip_frac"] == pytest.approx(1 / 5 if dual else 0.0)
    assert m["ppo_kl"] == pytest.approx(-sum(math.log(r) for r in RATIOS) / 5)
    assert m["ratio"] == pytest.approx(sum(RATIOS) / 5)
    assert m["loss"] == pytest.approx(out.loss.item()) and m["num_valid_tokens"] == 5


def test_decoupled_hand_values():
    w = torch.tensor([0.5, 1.0, 2.0, 1.0, 0.0], dtype=torch.float64)
    out, grad = _loss(CFG.replace(policy_loss="decoupled_ppo"), is_weights=w)
    assert out.loss.item() == pytest.approx(sum(a * b for a, b in zip(w.tolist(), PPO_LOSS)) / 5)
    torch.testing.assert_close(grad, w * torch.tensor(PPO_GRAD, dtype=torch.float64) / 5)


def test_bypass_uses_rollout_as_old_and_no_weights():
    rollout = OLD
    other_old = OLD - 0.3  # ignored by bypass
    out, grad = _loss(CFG.replace(policy_loss="bypass_ppo"), rollout_log_probs=rollout, old_log_probs=other_old)
    assert out.loss.item() == pytest.approx(sum(PPO_LOSS) / 5)
    torch.testing.assert_close(grad, torch.tensor(PPO_GRAD, dtype=torch.float64) / 5)
    with pytest.raises(ValueError, match="takes no is_weights: its ratio pi_theta/pi_rollout already is the IS ratio"):
        _loss(CFG.replace(policy_loss="bypass_ppo"), rollout_log_probs=rollout, is_weights=torch.ones(5))
    with pytest.raises(ValueError, match="needs rollout_log_probs"):
        _loss(CFG.replace(policy_loss="bypass_ppo"))


def test_reinforce_hand_values():
    w = torch.tensor([0.5, 1.0, 2.0, 1.0, 0.0], dtype=torch.float64)
    out, grad = _loss(LossConfig(policy_loss="reinforce"), is_weights=w)
    assert out.loss.item() == pytest.approx(float((-w * ADV * LP).sum()) / 5)
    torch.testing.assert_close(grad, -w * ADV / 5)
    assert not out.terms.clipped.any()


def test_is_weights_required_or_forbidden():
    with pytest.raises(ValueError, match="'decoupled_ppo' needs is_weights"):
        _loss(CFG.replace(policy_loss="decoupled_ppo"))
    with pytest.raises(ValueError, match="'reinforce' needs is_weights"):
        _loss(LossConfig(policy_loss="reinforce"))
    with pytest.raises(ValueError, match="'ppo' takes no is_weights: it is the uncorrected baseline"):
        _loss(CFG, is_weights=torch.ones(5))


def test_weights_one_decoupled_equals_ppo_and_bypass_equals_decoupled():
    out_ppo, g_ppo = _loss(CFG.replace(eps_clip_c=3.0))
    ones = torch.ones(5, dtype=torch.float64)
    out_dec, g_dec = _loss(CFG.replace(policy_loss="decoupled_ppo", eps_clip_c=3.0), is_weights=ones)
    out_byp, g_byp = _loss(CFG.replace(policy_loss="bypass_ppo", eps_clip_c=3.0), rollout_log_probs=OLD)
    # pi_old == pi_rollout gives weights exactly 1: identical arithmetic, exact equality.
    assert out_dec.loss.item() == out_ppo.loss.item() == out_byp.loss.item()
    assert torch.equal(g_dec, g_ppo) and torch.equal(g_byp, g_ppo)


def test_missing_old_log_probs_means_on_policy_ratio_one():
    out, grad = _loss(CFG, old_log_probs=None)
    assert out.loss.item() == pytest.approx(float(-ADV.sum()) / 5)
    torch.testing.assert_close(grad, -ADV / 5)


def test_keep_mask_removes_tokens_and_denominator_option():
    keep = torch.tensor([True, True, False, True, True])
    for rej, den_tokens in ((True, 5), (False, 4)):
        cfg = CFG.replace(rejected_in_denominator=rej)
        den = local_denominators(denominator_mask(ONES, keep, rej), CU)
        assert den.num_tokens == den_tokens
        out, grad = _loss(cfg, keep_mask=keep, den=den)
        assert out.loss.item() == pytest.approx((sum(PPO_LOSS) - PPO_LOSS[2]) / den_tokens)
        assert grad[2].item() == 0.0
        assert out.counts["num_rejected_tokens"].item() == 1
        assert out.counts["num_denominator_tokens"].item() == den_tokens


# --------------------------------------------------------------------------------------- OPSM
def test_opsm_hand_values():
    # three sequences of two tokens; mean log(pi_old / pi_theta) = [0.2, 0.2, 0.01]
    lp = torch.zeros(6, dtype=torch.float64)
    old = torch.tensor([0.1, 0.3, 0.2, 0.2, 0.0, 0.02], dtype=torch.float64)
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    cu = torch.tensor([0, 2, 4, 6])
    sums, counts = opsm_sequence_stats(lp, old, torch.ones(6, dtype=torch.bool), cu)
    torch.testing.assert_close(sums, torch.tensor([0.4, 0.4, 0.02]))
    keep, off = opsm_keep_mask(adv, cu, sums, counts, delta=0.1)
    assert off.tolist() == [True, True, False]
    assert keep.tolist() == [False, False, True, True, True, True]

    cfg = LossConfig(policy_loss="ppo", use_opsm=True, opsm_delta=0.1)
    out = compute_rl_loss(lp.clone().requires_grad_(), adv, torch.ones(6), cu, cfg, Denominators(6, 3), old_log_probs=old)
    assert out.pg_mask.tolist() == keep.tolist()
    assert out.counts["num_opsm_tokens"].item() == 2 and out.counts["num_opsm_sequences"].item() == 1
    # OPSM-masked tokens stay in the denominators (decided from pi_theta, unknown before the step).
    assert out.counts["num_denominator_tokens"].item() == 6


def test_opsm_decided_once_per_sequence_from_reduced_statistics():
    """A sequence split over two ranks: each half alone would decide differently; with the summed
    per-sequence statistics (what the CP adapter supplies) both halves decide the same."""
    lp = torch.zeros(4, dtype=torch.float64)
    old = torch.tensor([0.5, 0.5, 0.0, -0.6], dtype=torch.float64)  # mean 0.1 > delta 0.05
    adv = -torch.ones(4, dtype=torch.float64)
    halves = [slice(0, 2), slice(2, 4)]
    local = [opsm_sequence_stats(lp[h], old[h], torch.ones(2, dtype=torch.bool), torch.tensor([0, 2])) for h in halves]
    assert [bool(s / c > 0.05) for s, c in local] == [True, False]  # local decisions disagree
    sums = local[0][0] + local[1][0]
    counts = local[0][1] + local[1][1]
    for h in halves:
        keep, off = opsm_keep_mask(adv[h], torch.tensor([0, 2]), sums, counts, delta=0.05)
        assert off.tolist() == [True] and keep.tolist() == [False, False]


def test_opsm_shape_error():
    with pytest.raises(ValueError, match=r"OPSM statistics must have shape \[2\]"):
        opsm_keep_mask(torch.zeros(4), torch.tensor([0, 2, 4]), torch.zeros(3), torch.zeros(3), 0.1)


# -------------------------------------------------------------------------------- KL / entropy
def test_kl_and_entropy_terms():
    ref = OLD - 0.2
    ent = torch.tensor([1.0, 2.0, 0.5, 0.0, 3.0], dtype=torch.float64, requires_grad=True)
    cfg = CFG.replace(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3", use_unbiased_kl=True, entropy_coef=0.01)
    out, grad = _loss(cfg, ref_log_probs=ref, entropy=ent)
    kl = kl_estimate(LP, ref, "k3", old_log_probs=OLD, unbiased=True)
    want = sum(PPO_LOSS) / 5 + 0.1 * float(kl.sum()) / 5 - 0.01 * float(ent.detach().sum()) / 5
    assert out.loss.item() == pytest.approx(want)
    assert out.shares["kl_loss"].item() == pytest.approx(float(kl.sum()) / 5)
    assert out.shares["entropy_loss"].item() == pytest.approx(float(ent.detach().sum()) / 5)
    (g_ent,) = torch.autograd.grad(compute_rl_loss(LP, ADV, ONES, CU, cfg, DEN, old_log_probs=OLD, ref_log_probs=ref, entropy=ent).loss, ent)
    torch.testing.assert_close(g_ent, torch.full((5,), -0.01 / 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="ref_log_probs is None"):
        _loss(cfg, entropy=ent)
    with pytest.raises(ValueError, match="entropy is None"):
        _loss(cfg, ref_log_probs=ref)


def test_opsm_does_not_mask_kl_or_entropy():
    cfg = CFG.replace(use_opsm=True, opsm_delta=0.0, use_kl_loss=True, kl_loss_coef=1.0)
    old = LP + 1.0  # every sequence strongly off-policy
    out, _ = _loss(cfg, old_log_probs=old, ref_log_probs=OLD)
    assert out.pg_mask.tolist() == (ADV >= 0).tolist()
    assert out.valid_mask.all()
    assert out.shares["kl_loss"].item() == pytest.approx(float(kl_estimate(LP, OLD, "k3").sum()) / 5)


# ---------------------------------------------------------------------------- split invariance
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("rej", [True, False])
def test_micro_batch_split_does_not_change_loss_or_gradient(mode, rej):
    g = torch.Generator().manual_seed(3)
    lengths = [3, 5, 2, 4]
    total = sum(lengths)
    cu = torch.tensor([0, 3, 8, 10, 14])
    lp = (-torch.rand(total, generator=g, dtype=torch.float64)).requires_grad_()
    old = lp.detach() + 0.3 * torch.randn(total, generator=g, dtype=torch.float64)
    adv = torch.randn(total, generator=g, dtype=torch.float64)
    mask = torch.rand(total, generator=g) < 0.85
    keep = mask & (torch.rand(total, generator=g) < 0.8)
    w = torch.rand(total, generator=g, dtype=torch.float64) * 2
    cfg = LossConfig(policy_loss="decoupled_ppo", loss_aggregation=mode, rejected_in_denominator=rej, eps_clip_c=3.0)
    dmask = denominator_mask(mask, keep, rej)
    den = local_denominators(dmask, cu)
    whole = compute_rl_loss(lp, adv, mask, cu, cfg, den, old_log_probs=old, is_weights=w, keep_mask=keep).loss
    parts = []
    for a, b in ((0, 1), (1, 3), (3, 4)):
        t0, t1 = int(cu[a]), int(cu[b])
        s = slice(t0, t1)
        parts.append(
            compute_rl_loss(lp[s], adv[s], mask[s], cu[a : b + 1] - t0, cfg, den, old_log_probs=old[s], is_weights=w[s], keep_mask=keep[s]).loss
        )
    split = sum(parts)
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-12)
    (g1,) = torch.autograd.grad(whole, lp)
    (g2,) = torch.autograd.grad(split, lp)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------- bad input
def test_length_mismatches():
    for name, bad in (
        ("advantages", ADV[:4]),
        ("loss_mask", ONES[:4]),
        ("old_log_probs", OLD[:3]),
        ("is_weights", torch.ones(6)),
        ("keep_mask", ONES[:2]),
        ("rollout_log_probs", OLD[:1]),
    ):
        kw = {"advantages": ADV, "loss_mask": ONES, "old_log_probs": OLD}
        kw[name] = bad
        cfg = CFG.replace(policy_loss="decoupled_ppo") if name == "is_weights" else CFG
        with pytest.raises(ValueError, match=rf"{name} has shape .*expected \[5\]"):
            compute_rl_loss(LP, kw.pop("advantages"), kw.pop("loss_mask"), CU, cfg, DEN, **kw)
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        compute_rl_loss(LP, ADV, ONES, torch.tensor([0, 4]), CFG, DEN)
    with pytest.raises(ValueError, match="1-D"):
        compute_rl_loss(LP[None], ADV, ONES, CU, CFG, DEN)


def test_unknown_names_are_config_errors():
    with pytest.raises(ConfigError) as exc:
        LossConfig(policy_loss="ppo_clip", kl_loss_type="kl", advantage_estimator="gae", loss_aggregation="mean",
                   replay_entropy="support")
    text = str(exc.value)
    assert "5 problem(s)" in text
    assert "replay_entropy='support' is not one of 'full', 'kept'" in text
    assert "unknown policy loss 'ppo_clip'" in text and "valid: bypass_ppo, cispo, decoupled_ppo, gspo, ppo, reinforce" in text
    assert "unknown KL estimator 'kl'" in text and "valid: k1, k2, k3, low_var_kl" in text
    assert "unknown advantage estimator 'gae'" in text
    assert "loss_aggregation='mean' is not one of 'token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum'" in text


def test_config_checks_and_warnings():
    with pytest.raises(ConfigError) as exc:
        LossConfig(eps_clip=1.5, eps_clip_c=1.0, kl_loss_coef=-1, ratio_log_bound=100, log_probs_chunk_size=0)
    assert "5 problem(s)" in str(exc.value)
    with pytest.warns(UserWarning, match="kl_loss_coef=0.1 has no effect because use_kl_loss is false"):
        LossConfig(kl_loss_coef=0.1)
    with pytest.warns(UserWarning, match="not an unbiased"):
        LossConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k2", use_unbiased_kl=True)
    with pytest.warns(UserWarning, match="does not clip"):
        LossConfig(policy_loss="reinforce", eps_clip_c=3.0)
    with pytest.raises(ConfigError, match="unknown key 'tis_clip'"):
        LossConfig.from_dict({"tis_clip": 2.0})
    assert not any(n.startswith(("tis_", "rs_", "mis_")) for n in LossConfig.field_names())
    assert LossConfig(eps_clip=0.2).eps_high == 0.2 and LossConfig(eps_clip_high=0.28).eps_high == 0.28


def test_nan_advantages_are_counted_and_neutralised():
    adv = ADV.clone()
    adv[1] = float("nan")
    adv[3] = float("inf")
    with pytest.warns(RuntimeWarning, match=r"2 loss token\(s\) with a non-finite input \(advantages: 2\)"):
        out, grad = _loss(CFG, advantages=adv)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert out.loss.item() == pytest.approx((PPO_LOSS[0] + PPO_LOSS[2] + PPO_LOSS[4]) / 5)
    assert grad[1].item() == 0.0 and grad[3].item() == 0.0
    assert out.counts["num_nonfinite_inputs"].item() == 2
    with pytest.raises(ValueError, match=r"2 loss token\(s\) with a non-finite input \(advantages: 2\)"):
        _loss(CFG.replace(nonfinite_input_policy="error"), advantages=adv)


def test_nonfinite_inputs_outside_the_mask_never_reach_gradients():
    old = OLD.clone()
    old[2] = float("nan")
    ref = OLD.clone()
    ref[0] = float("-inf")
    mask = torch.tensor([False, True, False, True, True])
    cfg = CFG.replace(use_kl_loss=True, kl_loss_coef=1.0, use_unbiased_kl=True, nonfinite_input_policy="error")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, grad = _loss(cfg, old_log_probs=old, ref_log_probs=ref, loss_mask=mask)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert grad[0].item() == 0.0 and grad[2].item() == 0.0


def test_nan_log_probs_and_weights_on_loss_tokens_are_neutralised():
    lp = LP.clone()
    lp[4] = float("nan")
    w = torch.ones(5, dtype=torch.float64)
    w[0] = float("nan")
    with pytest.warns(RuntimeWarning, match=r"log_probs: 1.*is_weights: 1"):
        out, grad = _loss(CFG.replace(policy_loss="decoupled_ppo"), lp=lp, is_weights=w)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert out.valid_mask.tolist() == [False, True, True, True, False]


def test_empty_micro_batch_keeps_the_graph():
    lp = torch.zeros(0, requires_grad=True)
    out = compute_rl_loss(lp, torch.zeros(0), torch.zeros(0), torch.tensor([0]), CFG, Denominators(3, 1))
    assert out.loss.item() == 0.0 and out.loss.requires_grad


# ------------------------------------------------------------------- with the MIS engine (main)
ENGINE_CONFIGS = [
    dict(use_tis=True),
    dict(use_tis=True, tis_mode="clip", tis_batch_normalize=True),
    dict(use_tis=True, tis_level="sequence", tis_mode="mask", use_rs=True),
    dict(use_tis=True, tis_level="geometric", tis_batch_normalize=True, rs_veto_threshold=1e-4),
]


@pytest.mark.parametrize("mis", ENGINE_CONFIGS)
def test_engine_weights_are_one_when_rollout_equals_old_and_losses_coincide(mis):
    from megatron_mis.config.mis import MISConfig
    from megatron_mis.core.engine import compute_mis

    g = torch.Generator().manual_seed(7)
    cu = torch.tensor([0, 4, 9, 12])
    old = -torch.rand(12, generator=g, dtype=torch.float64) * 3
    lp = old + 0.5 * torch.randn(12, generator=g, dtype=torch.float64)
    adv = torch.randn(12, generator=g, dtype=torch.float64)
    mask = torch.ones(12, dtype=torch.bool)
    mask[[2, 7]] = False
    res = compute_mis(old, old, mask, cu, MISConfig(**mis))
    assert torch.equal(res.weights[mask], torch.ones(10)) and torch.equal(res.keep_mask, mask)
    den = local_denominators(mask, cu)
    base = LossConfig(eps_clip_high=0.28, eps_clip_c=3.0, loss_aggregation="seq_mean_token_mean")

    def run(cfg, **kw):
        x = lp.clone().requires_grad_()
        out = compute_rl_loss(x, adv, mask, cu, cfg, den, **kw)
        return out.loss, torch.autograd.grad(out.loss, x)[0]

    w = res.weights.to(torch.float64)
    l_ppo, g_ppo = run(base.replace(policy_loss="ppo"), old_log_probs=old, keep_mask=res.keep_mask)
    l_dec, g_dec = run(base.replace(policy_loss="decoupled_ppo"), old_log_probs=old, is_weights=w, keep_mask=res.keep_mask)
    l_byp, g_byp = run(base.replace(policy_loss="bypass_ppo"), rollout_log_probs=old, keep_mask=res.keep_mask)
    # weights exactly 1 -> identical arithmetic -> exact equality
    assert l_dec.item() == l_ppo.item() == l_byp.item()
    assert torch.equal(g_dec, g_ppo) and torch.equal(g_byp, g_ppo)


def test_decoupled_with_engine_weights_hand_check():
    """decoupled = w_t x PPO_t with w from the engine (truncated token TIS, U = 1.5)."""
    from megatron_mis.config.mis import MISConfig
    from megatron_mis.core.engine import compute_mis

    rollout = OLD - torch.log(torch.tensor([0.5, 1.0, 2.0, 1.25, 4.0], dtype=torch.float64))  # pi_old/pi_rollout
    res = compute_mis(OLD, rollout, ONES, CU, MISConfig(use_tis=True, tis_upper_bound=1.5))
    torch.testing.assert_close(res.weights, torch.tensor([0.5, 1.0, 1.5, 1.25, 1.5]))
    out, grad = _loss(CFG.replace(policy_loss="decoupled_ppo"), is_weights=res.weights.double(), keep_mask=res.keep_mask)
    w = [0.5, 1.0, 1.5, 1.25, 1.5]
    assert out.loss.item() == pytest.approx(sum(a * b for a, b in zip(w, PPO_LOSS)) / 5, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([a * b for a, b in zip(w, PPO_GRAD)], dtype=torch.float64) / 5)


def test_config_from_slime_like_namespace():
    import argparse

    ns = argparse.Namespace(
        eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None, kl_loss_type="k1", use_kl_loss=True, kl_loss_coef=0.01,
        use_unbiased_kl=True, entropy_coef=0.0, use_opsm=True, opsm_delta=1e-4, advantage_estimator="grpo",
        grpo_std_normalization=False, rollout_temperature=0.7, log_probs_chunk_size=-1, lr=1e-6, use_tis=True,
    )
    cfg = LossConfig.from_namespace(ns)
    assert (cfg.eps_high, cfg.kl_loss_type, cfg.use_opsm, cfg.rollout_temperature) == (0.28, "k1", True, 0.7)
    assert cfg.log_probs_chunk_size == -1 and cfg.grpo_std_normalization is False


def test_config_knows_the_builtin_names_without_importing_the_math():
    """config/loss.py validates names from BUILTIN_NAMES and its registries, never importing core
    (no config <-> core import cycle); the built-in names must equal what core registers."""
    import subprocess
    import sys

    from megatron_mis.config.loss import BUILTIN_NAMES
    from megatron_mis.core.advantages import ADVANTAGE_ESTIMATORS
    from megatron_mis.core.kl import KL_ESTIMATORS
    from megatron_mis.core.losses import POLICY_LOSSES

    assert BUILTIN_NAMES == {
        "policy_loss": tuple(POLICY_LOSSES.names()),
        "kl_loss_type": tuple(KL_ESTIMATORS.names()),
        "advantage_estimator": tuple(ADVANTAGE_ESTIMATORS.names()),
    }
    code = (
        "import sys\nfrom megatron_mis.config.loss import LossConfig\n"
        "LossConfig(policy_loss='reinforce', kl_loss_type='low_var_kl', advantage_estimator='rloo')\n"
        "print(sorted(m for m in sys.modules if m.startswith('megatron_mis.core')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------- bad input names the parameter
@pytest.mark.parametrize(
    "override, exc, match",
    [
        (dict(cfg=None), TypeError, r"config must be a LossConfig, got NoneType"),
        (dict(cfg={"policy_loss": "ppo"}), TypeError, r"config must be a LossConfig, got dict"),
        (dict(den=5), TypeError, r"denominators must be a Denominators.*got int"),
        (dict(den=(1.0, 1.0)), TypeError, r"denominators must be a Denominators.*got tuple"),
        (dict(cu=[0, 5]), TypeError, r"cu_seqlens must be an integer torch.Tensor.*list"),
        (dict(cu=None), TypeError, r"cu_seqlens must be an integer torch.Tensor.*NoneType"),
        (dict(cu=torch.tensor([0.0, 5.0])), TypeError, r"cu_seqlens must be an integer torch.Tensor.*float32"),
        (dict(cu=torch.tensor([], dtype=torch.long)), ValueError, r"cu_seqlens must be \[N\+1\]"),
        (dict(advantages=[1.0] * 5), TypeError, r"advantages must be a torch.Tensor, got list"),
    ],
)
def test_rl_loss_bad_arguments_are_named(override, exc, match):
    args = dict(cfg=CFG, den=DEN, cu=CU, advantages=ADV)
    args.update(override)
    with pytest.raises(exc, match=match):
        compute_rl_loss(LP, args["advantages"], ONES, args["cu"], args["cfg"], args["den"], old_log_probs=OLD)


def test_rl_loss_log_probs_must_be_a_tensor():
    with pytest.raises(TypeError, match=r"log_probs must be a torch.Tensor, got list"):
        compute_rl_loss([0.0] * 5, ADV, ONES, CU, CFG, DEN, old_log_probs=OLD)


def test_rl_loss_overflow_is_an_error_not_inf():
    # ratio e^20 (the default ratio_log_bound) times A = -1e30 exceeds float32: a clear error, not inf.
    lp, old = torch.tensor([0.0]), torch.tensor([-20.0])
    with pytest.raises(ValueError, match=r"policy loss overflows torch.float32 on 1 token.*\|A\| = 1e\+30.*ratio_log_bound"):
        compute_rl_loss(lp, torch.tensor([-1e30]), torch.ones(1), torch.tensor([0, 1]), CFG, Denominators(1, 1), old_log_probs=old)
    # The same advantage on a token outside the loss mask is not an input to the loss: no error.
    out = compute_rl_loss(
        lp, torch.tensor([-1e30]), torch.zeros(1), torch.tensor([0, 1]), CFG, Denominators(1, 1), old_log_probs=old
    )
    assert torch.isfinite(out.loss)
    # Large but representable: r = e^20 > 1 + eps_high and A > 0, so the clipped branch wins:
    # max(-e^20 * A, -1.28 * A) = -1.28e20, finite.
    out = compute_rl_loss(lp, torch.tensor([1e20]), torch.ones(1), torch.tensor([0, 1]), CFG, Denominators(1, 1), old_log_probs=old)
    assert torch.isfinite(out.loss) and out.loss.item() == pytest.approx(-1.28e20, rel=1e-6)


def test_decoupled_gradient_overflow_is_an_error_not_inf():
    """Found by the public-API fuzz: with a dual clip and a ratio far below 1, IS weight * r * A fits
    float32 (the loss is finite) while IS weight * A does not, and the backward forms exactly that
    product before multiplying by r, so the gradient came out inf. Now a clear error naming the
    advantages and the IS weights; just inside the range, loss and gradient are finite."""
    cfg = CFG.replace(policy_loss="decoupled_ppo", eps_clip=1.0, eps_clip_high=0.28, eps_clip_c=3.0)
    old = torch.tensor([-22.6])  # r = e^-6.12, about 2.2e-3

    def run(weight: float):
        lp = torch.tensor([-28.72], requires_grad=True)
        out = compute_rl_loss(lp, torch.tensor([-1e30]), torch.ones(1), torch.tensor([0, 1]), cfg, Denominators(1, 1),
                              old_log_probs=old, is_weights=torch.tensor([weight]))
        (grad,) = torch.autograd.grad(out.loss, lp)
        return out.loss, grad

    with pytest.raises(ValueError, match=r"gradient overflows torch.float32 on 1 token.*\|A\| = 1e\+30.*IS weights reach 4.9e\+08"):
        run(4.9e8)  # IS weight * A = 4.9e38 > 3.4e38
    loss, grad = run(3.0e8)  # 3e38: inside; loss = w * r * |A| (the dual clip 3 |A| is not reached)
    r = math.exp(-28.72 + 22.6)
    assert loss.item() == pytest.approx(3.0e8 * r * 1e30, rel=1e-5)
    assert torch.isfinite(grad).all() and grad.item() == pytest.approx(3.0e8 * r * 1e30, rel=1e-5)


def test_ppo_kl_metric_is_clamped_like_the_ratio():
    # log(pi_old / pi_theta) = -3e38 - (-1e16) per token: two of them overflow a float32 sum; the
    # metric takes the log-ratio clamped to ratio_log_bound (20), as the policy ratio does.
    lp = torch.tensor([-1e16, -1e16])
    old = torch.tensor([-3e38, -3e38])
    out = compute_rl_loss(lp, torch.zeros(2), torch.ones(2), torch.tensor([0, 2]), CFG, Denominators(2, 1), old_log_probs=old)
    assert out.token_sums["ppo_kl"].item() == -40.0


@pytest.mark.parametrize("policy_loss", ["ppo", "decoupled_ppo", "reinforce"])
def test_huge_advantage_on_a_rejected_token_gives_no_nan_gradient(policy_loss):
    # token 1 is outside keep_mask; its advantage 3.4e38 times its log-prob / ratio is inf in the
    # forward, and 0 * inf = NaN in the backward unless the policy term never sees it.
    lp = torch.tensor([-1.0, -4.0], requires_grad=True)
    adv = torch.tensor([1.0, 3.4e38])
    kw = dict(old_log_probs=torch.tensor([-1.0, -30.0]), keep_mask=torch.tensor([True, False]))
    if policy_loss != "ppo":
        kw["is_weights"] = torch.ones(2)
    out = compute_rl_loss(lp, adv, torch.ones(2), torch.tensor([0, 2]), CFG.replace(policy_loss=policy_loss),
                          Denominators(2, 1), **kw)
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert grad[1].item() == 0.0
