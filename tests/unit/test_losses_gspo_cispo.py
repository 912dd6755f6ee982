"""GSPO and CISPO (issue 32): hand-derived values and gradients, equivalence with naive
per-sequence / per-token reference loops (and, for GSPO, with slime's sequence-level autograd
form), the sequence-level clip counts, CP statistics supplied through ``cp_sum``, the slime
namespace mapping, config warnings and bad input."""

from __future__ import annotations

import argparse
import math
import warnings

import pytest
import torch

from megatron_mis.config.loss import LossConfig
from megatron_mis.core.aggregation import Denominators, denominator_mask, local_denominators
from megatron_mis.core.losses import (
    POLICY_LOSSES,
    compute_rl_loss,
    finalize_metrics,
    sequence_log_ratio,
    sequence_ratio_stats,
)

F64 = torch.float64


def _cfg(policy_loss: str, **kw) -> LossConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the PPO-clip-range advice is tested separately
        return LossConfig(policy_loss=policy_loss, **kw)


def _run(cfg, lp, adv, cu, den, mask=None, **kw):
    x = lp.clone().requires_grad_()
    mask = torch.ones(lp.shape[0]) if mask is None else mask
    kw.setdefault("is_weights", torch.ones(lp.shape[0], dtype=lp.dtype))
    out = compute_rl_loss(x, adv, mask, cu, cfg, den, **kw)
    (grad,) = torch.autograd.grad(out.loss, x)
    return out, grad


# =========================================================================================== GSPO
# Three sequences, per-token log-ratios log pi_theta - log pi_old chosen so each sequence lands on
# a different branch of the clipped objective (eps_low 0.2, eps_high 0.28: range [0.8, 1.28]):
#   S0 (3 tokens): log-ratios [0.3, -0.1, 0.1], mean 0.1  -> s0 = e^0.1  = 1.1051709181, A = +1:
#       inside the range, loss per token -s0 A = -1.1051709181, d/d log pi_t = -A s0 = -1.1051709181
#   S1 (2 tokens): log-ratios [-0.5, -0.3], mean -0.4     -> s1 = e^-0.4 = 0.6703200460, A = -1:
#       max(-s1 A, -0.8 A) = max(0.67032, 0.8) = 0.8: clipped low, gradient 0
#   S2 (2 tokens): log-ratios [0.02, -0.02], mean 0        -> s2 = 1, A = +2:
#       loss -2 per token, gradient -2
# token_mean (D_tok = 7): (3 (-1.1051709181) + 2 (0.8) + 2 (-2)) / 7 = -5.7155127543 / 7
# seq_mean_token_mean (D_seq = 3): (-1.1051709181 + 0.8 - 2) / 3; gradient of a token: its
#   per-token gradient / (n_s D_seq), i.e. S0: -1.1051709181 / 9, S2: -2 / 6.
G_OLD = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5, -0.7, -0.9], dtype=F64)
G_LOGR = torch.tensor([0.3, -0.1, 0.1, -0.5, -0.3, 0.02, -0.02], dtype=F64)
G_LP = G_OLD + G_LOGR
G_ADV = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 2.0, 2.0], dtype=F64)
G_CU = torch.tensor([0, 3, 5, 7])
S0 = 1.1051709180756477  # e^0.1
G_CFG = dict(eps_clip=0.2, eps_clip_high=0.28)


def test_gspo_hand_values_token_mean():
    out, grad = _run(_cfg("gspo", **G_CFG), G_LP, G_ADV, G_CU, Denominators(7, 3), old_log_probs=G_OLD)
    assert out.loss.item() == pytest.approx((3 * -S0 + 2 * 0.8 + 2 * -2.0) / 7, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([-S0] * 3 + [0.0, 0.0] + [-2.0, -2.0], dtype=F64) / 7, rtol=1e-12, atol=0)
    # the ratio reported on every token is its sequence's ratio
    torch.testing.assert_close(out.terms.ratio, torch.tensor([S0] * 3 + [math.exp(-0.4)] * 2 + [1.0] * 2, dtype=F64))
    assert out.terms.clipped_low.tolist() == [False] * 3 + [True, True] + [False] * 2
    assert not out.terms.clipped_high.any()
    c = out.counts
    assert (c["num_seq_ratio_sequences"].item(), c["num_seq_clipped_low"].item(), c["num_seq_clipped_high"].item()) == (3, 1, 0)
    m = finalize_metrics({k: float(v) for k, v in out.flat_metrics().items()})
    assert m["pg_clipfrac"] == pytest.approx(2 / 7)  # token-weighted: S1's two tokens of seven
    assert m["pg_seq_clipfrac"] == pytest.approx(1 / 3) and m["pg_seq_clipfrac_low"] == pytest.approx(1 / 3)
    assert m["pg_seq_clipfrac_high"] == 0.0
    # ppo_kl: the token mean of log(pi_old / pi_theta) = the token-weighted mean of the sequence KLs
    assert m["ppo_kl"] == pytest.approx(-float(G_LOGR.sum()) / 7)


def test_gspo_hand_values_seq_mean_token_mean():
    cfg = _cfg("gspo", loss_aggregation="seq_mean_token_mean", **G_CFG)
    out, grad = _run(cfg, G_LP, G_ADV, G_CU, Denominators(7, 3), old_log_probs=G_OLD)
    assert out.loss.item() == pytest.approx((-S0 + 0.8 - 2.0) / 3, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([-S0 / 9] * 3 + [0.0, 0.0] + [-2.0 / 6] * 2, dtype=F64), rtol=1e-12, atol=0)


def test_gspo_clipped_high_dual_clip_and_is_weights():
    """S0 with A = +1 and s = e^0.4 = 1.4918 > 1.28: clipped high (loss -1.28, gradient 0);
    S1 with A = -1 and s = e^1.5 = 4.4817, dual clip c = 3: max(4.4817, 1.28) = 4.4817 capped
    at 3 (gradient 0); S2 as before (s = 1, A = +2). IS weights multiply each token's term:
    w = [0.5, 1, 2 | 1, 1 | 0.25, 4]."""
    logr = torch.tensor([0.4, 0.4, 0.4, 1.5, 1.5, 0.02, -0.02], dtype=F64)
    w = torch.tensor([0.5, 1.0, 2.0, 1.0, 1.0, 0.25, 4.0], dtype=F64)
    cfg = _cfg("gspo", eps_clip_c=3.0, **G_CFG)
    out, grad = _run(cfg, G_OLD + logr, G_ADV, G_CU, Denominators(7, 3), old_log_probs=G_OLD, is_weights=w)
    per_token = [-1.28 * 0.5, -1.28, -1.28 * 2, 3.0, 3.0, -2.0 * 0.25, -2.0 * 4]
    assert out.loss.item() == pytest.approx(sum(per_token) / 7, rel=1e-12)
    # only S2 is unclipped: d/d log pi_t = w_t (-A s) = w_t (-2)
    torch.testing.assert_close(grad, torch.tensor([0.0] * 5 + [-0.5, -8.0], dtype=F64) / 7, rtol=1e-12, atol=0)
    assert out.terms.clipped_high.tolist() == [True] * 3 + [False] * 4
    assert out.terms.dual_clipped.tolist() == [False] * 3 + [True, True] + [False] * 2
    assert out.counts["num_seq_clipped_high"].item() == 1 and out.counts["num_seq_clipped_low"].item() == 0


def test_gspo_ratio_uses_only_valid_tokens():
    """A rejected (keep_mask) token and a token outside the loss mask neither move the
    sequence ratio nor get a gradient: S0's ratio over tokens 0 and 2 is e^((0.3 + 0.1) / 2)."""
    keep = torch.tensor([True, False, True, True, True, True, True])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    den = local_denominators(denominator_mask(mask, keep, True), G_CU)
    out, grad = _run(_cfg("gspo", **G_CFG), G_LP, G_ADV, G_CU, den, mask=mask, old_log_probs=G_OLD, keep_mask=keep)
    s0 = math.exp(0.2)
    assert out.terms.ratio[0].item() == pytest.approx(s0) and out.terms.ratio[5].item() == pytest.approx(math.exp(0.02))
    assert out.loss.item() == pytest.approx((2 * -s0 + 2 * 0.8 + -2.0 * math.exp(0.02)) / 6, rel=1e-12)
    want = torch.tensor([-s0, 0.0, -s0, 0.0, 0.0, -2.0 * math.exp(0.02), 0.0], dtype=F64) / 6
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=0)


def test_gspo_ratio_beyond_the_log_bound_is_clamped_without_gradient():
    """ratio_log_bound 1: S0's mean 1.5 gives s = e^1 (and no gradient through the clamp); with
    A = -1 and no dual clip the unclipped branch -s A = e is taken."""
    logr = torch.tensor([1.5, 1.5, 1.5, 0.0, 0.0, 0.0, 0.0], dtype=F64)
    adv = torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0], dtype=F64)
    cfg = _cfg("gspo", ratio_log_bound=1.0, **G_CFG)
    out, grad = _run(cfg, G_OLD + logr, adv, G_CU, Denominators(7, 3), old_log_probs=G_OLD)
    assert out.loss.item() == pytest.approx((3 * math.e - 4.0) / 7, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([0.0] * 3 + [-1.0] * 4, dtype=F64) / 7, rtol=1e-12, atol=0)


def test_gspo_one_token_sequences_equal_decoupled_ppo():
    """With one token per sequence the sequence ratio is the token ratio: gspo == decoupled_ppo,
    values and gradients, bit for bit in float64 up to the exp of the same number."""
    g = torch.Generator().manual_seed(0)
    n = 9
    old = -torch.rand(n, generator=g, dtype=F64) * 3
    lp = old + 0.4 * torch.randn(n, generator=g, dtype=F64)
    adv = torch.randn(n, generator=g, dtype=F64)
    w = torch.rand(n, generator=g, dtype=F64) + 0.5
    cu = torch.arange(n + 1)
    kw = dict(old_log_probs=old, is_weights=w)
    a, ga = _run(_cfg("gspo", eps_clip_c=3.0, **G_CFG), lp, adv, cu, Denominators(n, n), **kw)
    b, gb = _run(_cfg("decoupled_ppo", eps_clip_c=3.0, **G_CFG), lp, adv, cu, Denominators(n, n), **kw)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-14, atol=0)
    torch.testing.assert_close(ga, gb, rtol=1e-14, atol=0)


# ========================================================================================== CISPO
# Five tokens, ratios r = [1.5, 0.5, 0.5, 3.0, 1.1], A = [1, -1, 1, -1, 2], log pi_old =
# [-1, -2, -0.5, -3, -1.5], so log pi_theta = old + log r =
# [-0.5945349, -2.6931472, -1.1931472, -1.9013877, -1.4046898].
# eps_low 0.2, eps_high 0.28: clip(r) = [1.28, 0.8, 0.8, 1.28, 1.1] (clipped high: t0, t3; low:
# t1, t2). Per token loss -clip(r) A log pi:
#   t0: -1.28 * 1 * -0.5945349 = 0.7610047     t1: -0.8 * -1 * -2.6931472 = -2.1545177
#   t2: -0.8 * 1 * -1.1931472 = 0.9545177      t3: -1.28 * -1 * -1.9013877 = -2.4337763
#   t4: -1.1 * 2 * -1.4046898 = 3.0903176      sum 0.2175460, token mean / 5
# gradient d/d log pi_t = -clip(r) A = [-1.28, 0.8, -0.8, 1.28, -2.2] (PPO would give 0 at t0-t3)
# eps_clip = 1 (MiniMax-M1: no lower bound): clip(r) = [1.28, 0.5, 0.5, 1.28, 1.1].
C_RATIOS = [1.5, 0.5, 0.5, 3.0, 1.1]
C_OLD = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5], dtype=F64)
C_LP = C_OLD + torch.log(torch.tensor(C_RATIOS, dtype=F64))
C_ADV = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0], dtype=F64)
C_CU = torch.tensor([0, 5])


def test_cispo_hand_values_and_gradients():
    out, grad = _run(_cfg("cispo", **G_CFG), C_LP, C_ADV, C_CU, Denominators(5, 1), old_log_probs=C_OLD)
    assert out.loss.item() == pytest.approx(0.2175460 / 5, abs=5e-8)
    torch.testing.assert_close(grad, torch.tensor([-1.28, 0.8, -0.8, 1.28, -2.2], dtype=F64) / 5, rtol=1e-12, atol=0)
    assert out.terms.clipped_low.tolist() == [False, True, True, False, False]
    assert out.terms.clipped_high.tolist() == [True, False, False, True, False]
    m = finalize_metrics({k: float(v) for k, v in out.flat_metrics().items()})
    assert m["pg_clipfrac"] == pytest.approx(4 / 5)  # slime's clipfrac: clip(r) != r
    assert "pg_seq_clipfrac" not in m  # a token-level loss has no sequence ratio


def test_cispo_without_lower_bound_and_with_is_weights():
    w = torch.tensor([0.5, 1.0, 2.0, 1.0, 0.0], dtype=F64)
    out, grad = _run(_cfg("cispo", eps_clip=1.0, eps_clip_high=0.28), C_LP, C_ADV, C_CU, Denominators(5, 1),
                     old_log_probs=C_OLD, is_weights=w)
    clip = torch.tensor([1.28, 0.5, 0.5, 1.28, 1.1], dtype=F64)
    torch.testing.assert_close(grad, -w * clip * C_ADV / 5, rtol=1e-12, atol=0)
    assert out.loss.item() == pytest.approx(float((-w * clip * C_ADV * C_LP).sum()) / 5, rel=1e-12)
    assert not out.terms.clipped_low.any()


def test_cispo_with_ratio_one_is_reinforce():
    """pi_theta == pi_old: clip(1) = 1, so cispo == reinforce (-w A log pi), values and gradients."""
    w = torch.tensor([0.5, 1.0, 2.0, 1.0, 0.3], dtype=F64)
    a, ga = _run(_cfg("cispo", **G_CFG), C_LP, C_ADV, C_CU, Denominators(5, 1), old_log_probs=C_LP, is_weights=w)
    b, gb = _run(_cfg("reinforce"), C_LP, C_ADV, C_CU, Denominators(5, 1), old_log_probs=C_LP, is_weights=w)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-15, atol=0)
    torch.testing.assert_close(ga, gb, rtol=1e-15, atol=0)


# ================================================================ equivalence with naive loops
def _random_batch(seed: int, per_sequence_adv: bool, per_sequence_w: bool):
    g = torch.Generator().manual_seed(seed)
    lengths = [4, 1, 7, 3, 5, 2]
    t = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    old = -torch.rand(t, generator=g, dtype=F64) * 3
    lp = old + 0.25 * torch.randn(t, generator=g, dtype=F64)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    adv = torch.randn(len(lengths), generator=g, dtype=F64)[seq] if per_sequence_adv else torch.randn(t, generator=g, dtype=F64)
    w = (torch.rand(len(lengths), generator=g, dtype=F64)[seq] if per_sequence_w else torch.rand(t, generator=g, dtype=F64)) * 2
    mask = (torch.rand(t, generator=g) < 0.85).float()
    keep = torch.rand(t, generator=g) < 0.85
    return lengths, cu, old, lp, adv, w, mask, keep


def _aggregate_naive(per_token, used, counted, lengths, mode, den):
    """The loss from per-token python floats / 0-dim tensors, sequence by sequence."""
    total = 0.0
    start = 0
    for n in lengths:
        idx = range(start, start + n)
        s = sum((per_token[i] for i in idx if used[i]), torch.zeros((), dtype=F64))
        n_den = sum(1 for i in idx if counted[i])
        if mode == "token_mean":
            total = total + s / den.num_tokens
        elif mode == "seq_mean_token_sum":
            total = total + s / den.num_sequences
        elif n_den:
            total = total + s / n_den / den.num_sequences
        start += n
    return total


def _gspo_token_reference(lp, old, adv, w, used, lengths, cfg):
    """GSPO-token (arXiv:2507.18071 Eq. 13), written out per sequence and token with explicit
    stop-gradients: s_{i,t} = sg[s_i] * exp(log pi_t - sg[log pi_t])."""
    lo, hi = 1 - cfg.eps_clip, 1 + cfg.eps_high
    out = []
    start = 0
    for n in lengths:
        idx = [i for i in range(start, start + n) if used[i]]
        mean = sum(float(lp[i].detach() - old[i]) for i in idx) / len(idx) if idx else 0.0
        s_seq = math.exp(max(-cfg.ratio_log_bound, min(cfg.ratio_log_bound, mean)))
        for i in range(start, start + n):
            s = s_seq * torch.exp(lp[i] - lp[i].detach())
            a = float(adv[i])
            term = torch.maximum(-s * a, -s.clamp(lo, hi) * a)
            if cfg.eps_clip_c is not None and a < 0:
                term = torch.minimum(term, torch.tensor(-cfg.eps_clip_c * a, dtype=F64))
            out.append(float(w[i]) * term)
        start += n
    return out


def _gspo_sequence_reference(lp, old, adv, w, used, lengths, cfg, counted, mode, den):
    """slime's form (ppo_utils.py compute_gspo_kl + compute_policy_loss, 624b824a): the sequence
    ratio exp(mean log-ratio) with autograd through EVERY token's log-prob, the clipped loss
    repeated on each token of the sequence, then aggregated. Valid when A and w are constant per
    sequence."""
    lo, hi = 1 - cfg.eps_clip, 1 + cfg.eps_high
    per_token = [None] * len(lp)
    start = 0
    for n in lengths:
        idx = [i for i in range(start, start + n) if used[i]]
        if idx:
            mean = sum(lp[i] - old[i] for i in idx) / len(idx)
            s = torch.exp(mean.clamp(-cfg.ratio_log_bound, cfg.ratio_log_bound))
            a = float(adv[idx[0]])
            term = torch.maximum(-s * a, -s.clamp(lo, hi) * a)
            if cfg.eps_clip_c is not None and a < 0:
                term = torch.minimum(term, torch.tensor(-cfg.eps_clip_c * a, dtype=F64))
            for i in range(start, start + n):
                per_token[i] = float(w[i]) * term
        start += n
    per_token = [p if p is not None else torch.zeros((), dtype=F64) for p in per_token]
    return _aggregate_naive(per_token, used, counted, lengths, mode, den)


MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rej", [True, False])
@pytest.mark.parametrize("dual", [None, 3.0])
def test_gspo_equals_naive_token_reference(mode, rej, dual):
    lengths, cu, old, lp, adv, w, mask, keep = _random_batch(11, per_sequence_adv=False, per_sequence_w=False)
    cfg = _cfg("gspo", loss_aggregation=mode, rejected_in_denominator=rej, eps_clip=0.05, eps_clip_high=0.08, eps_clip_c=dual)
    used = (mask.bool() & keep).tolist()
    counted = denominator_mask(mask, keep, rej).tolist()
    den = local_denominators(denominator_mask(mask, keep, rej), cu)
    got, grad = _run(cfg, lp, adv, cu, den, mask=mask, old_log_probs=old, is_weights=w, keep_mask=keep)
    x = lp.clone().requires_grad_()
    want = _aggregate_naive(_gspo_token_reference(x, old, adv, w, used, lengths, cfg), used, counted, lengths, mode, den)
    (want_grad,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(got.loss, want.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-15)
    # the test is not vacuous: some sequences are clipped, some are not
    assert 0 < got.counts["num_seq_clipped_low"].item() + got.counts["num_seq_clipped_high"].item() < len(lengths)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rej", [True, False])
def test_gspo_equals_slime_sequence_form_for_sequence_advantages(mode, rej):
    """With one advantage and one IS weight per sequence (GRPO, sequence / geometric TIS) the
    token form has the same values AND gradients as the sequence form whose ratio carries the
    gradient of every token (slime's all-gather path)."""
    lengths, cu, old, lp, adv, w, mask, keep = _random_batch(5, per_sequence_adv=True, per_sequence_w=True)
    cfg = _cfg("gspo", loss_aggregation=mode, rejected_in_denominator=rej, eps_clip=0.05, eps_clip_high=0.08, eps_clip_c=3.0)
    used = (mask.bool() & keep).tolist()
    counted = denominator_mask(mask, keep, rej).tolist()
    den = local_denominators(denominator_mask(mask, keep, rej), cu)
    got, grad = _run(cfg, lp, adv, cu, den, mask=mask, old_log_probs=old, is_weights=w, keep_mask=keep)
    x = lp.clone().requires_grad_()
    want = _gspo_sequence_reference(x, old, adv, w, used, lengths, cfg, counted, mode, den)
    (want_grad,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(got.loss, want.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-15)
    assert float(grad.abs().max()) > 0


def test_gspo_differs_from_the_sequence_form_when_weights_vary_within_a_sequence():
    """Documented: with token-level IS weights the token form weights each token's gradient by
    its own w_t; the sequence form spreads the mean weight over the sequence. Same value, other
    gradient — so the equivalence above is not vacuous."""
    lengths, cu, old, lp, adv, w, mask, keep = _random_batch(5, per_sequence_adv=True, per_sequence_w=False)
    cfg = _cfg("gspo", eps_clip=0.05, eps_clip_high=0.08)
    used = (mask.bool() & keep).tolist()
    den = local_denominators(mask.bool(), cu)
    got, grad = _run(cfg, lp, adv, cu, den, mask=mask, old_log_probs=old, is_weights=w, keep_mask=keep)
    x = lp.clone().requires_grad_()
    want = _gspo_sequence_reference(x, old, adv, w, used, lengths, cfg, mask.bool().tolist(), "token_mean", den)
    (want_grad,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(got.loss, want.detach(), rtol=1e-12, atol=1e-15)
    assert not torch.allclose(grad, want_grad, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_cispo_equals_naive_token_reference(mode):
    lengths, cu, old, lp, adv, w, mask, keep = _random_batch(3, per_sequence_adv=False, per_sequence_w=False)
    cfg = _cfg("cispo", loss_aggregation=mode, eps_clip=0.1, eps_clip_high=0.15)
    used = (mask.bool() & keep).tolist()
    den = local_denominators(mask.bool(), cu)
    got, grad = _run(cfg, lp, adv, cu, den, mask=mask, old_log_probs=old, is_weights=w, keep_mask=keep)
    x = lp.clone().requires_grad_()
    per_token = []
    for i in range(len(x)):
        r = math.exp(float(x[i] - old[i]))
        per_token.append(-float(w[i]) * min(max(r, 0.9), 1.15) * float(adv[i]) * x[i])
    want = _aggregate_naive(per_token, used, mask.bool().tolist(), lengths, mode, den)
    (want_grad,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(got.loss, want.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-15)
    assert bool(got.terms.clipped_low.any()) and bool(got.terms.clipped_high.any())


# ============================================================================ CP statistics
def test_gspo_cp_sum_makes_split_sequences_exact():
    """A zigzag-like split of every sequence over two "ranks": with cp_sum adding the other
    rank's statistics, the two shares add up to the whole loss and each rank's gradient equals
    the whole-batch gradient at its tokens; without it (local ratios) they do not."""
    lengths, cu, old, lp, adv, w, mask, keep = _random_batch(8, per_sequence_adv=True, per_sequence_w=False)
    cfg = _cfg("gspo", loss_aggregation="seq_mean_token_mean", eps_clip=0.05, eps_clip_high=0.08)
    den = local_denominators(mask.bool(), cu)
    full_counts = torch.tensor([float(mask[a:b].sum()) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    whole, g_whole = _run(cfg, lp, adv, cu, den, mask=mask, old_log_probs=old, is_weights=w, keep_mask=keep)
    # rank 0: the first half (rounded down) of each sequence, rank 1 the rest
    parts = [[], []]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        mid = a + (b - a) // 2
        parts[0].append(torch.arange(a, mid))
        parts[1].append(torch.arange(mid, b))
    idx = [torch.cat(p) for p in parts]
    cus = [torch.tensor([0] + torch.tensor([len(x) for x in p]).cumsum(0).tolist()) for p in parts]
    stats = [sequence_ratio_stats(lp[i], old[i], adv[i], mask.bool()[i] & keep[i], c) for i, c in zip(idx, cus)]
    total = stats[0] + stats[1]
    for exact in (True, False):
        loss, grad = 0.0, torch.zeros_like(lp)
        for r in range(2):
            i = idx[r]
            calls = []

            def cp_sum(t, r=r):
                calls.append(t.shape)
                torch.testing.assert_close(t, stats[r])  # this rank's own statistics come in
                return total.clone() if exact else t

            out, g = _run(cfg, lp[i], adv[i], cus[r], den, mask=mask[i], old_log_probs=old[i], is_weights=w[i],
                          keep_mask=keep[i], seq_token_counts=full_counts, cp_sum=cp_sum)
            assert calls == [torch.Size([len(lengths), 4])]  # one call per compute_rl_loss
            loss = loss + out.loss.detach()
            grad[i] = g
        if exact:
            torch.testing.assert_close(loss, whole.loss.detach(), rtol=1e-12, atol=1e-15)
            torch.testing.assert_close(grad, g_whole, rtol=1e-12, atol=1e-15)
        else:
            assert abs(float(loss - whole.loss.detach())) > 1e-6


def test_gspo_and_opsm_share_one_cp_sum_call():
    lengths, cu, old, lp, adv, w, mask, keep = _random_batch(2, per_sequence_adv=True, per_sequence_w=True)
    cfg = _cfg("gspo", use_opsm=True, opsm_delta=0.0, **G_CFG)
    calls = []

    def cp_sum(t):
        calls.append(tuple(t.shape))
        return t

    den = local_denominators(mask.bool(), cu)
    out, _ = _run(cfg, lp, adv, cu, den, mask=mask, old_log_probs=old, is_weights=w, keep_mask=keep, cp_sum=cp_sum)
    assert calls == [(len(lengths), 6)]
    ref, _ = _run(cfg, lp, adv, cu, den, mask=mask, old_log_probs=old, is_weights=w, keep_mask=keep)
    assert out.loss.item() == ref.loss.item() and out.pg_mask.tolist() == ref.pg_mask.tolist()
    # neither GSPO nor OPSM: cp_sum is never called
    calls.clear()
    _run(_cfg("cispo", **G_CFG), lp, adv, cu, den, mask=mask, old_log_probs=old, is_weights=w, cp_sum=cp_sum)
    assert calls == []


def test_sequence_ratio_stats_hand_values():
    stats = sequence_ratio_stats(G_LP, G_OLD, G_ADV, torch.ones(7, dtype=torch.bool), G_CU)
    torch.testing.assert_close(
        stats, torch.tensor([[0.3, 3, 3, 0], [-0.8, 2, 0, 2], [0.0, 2, 2, 0]], dtype=F64), rtol=0, atol=1e-15
    )
    torch.testing.assert_close(sequence_log_ratio(stats), torch.tensor([0.1, -0.4, 0.0], dtype=F64), rtol=0, atol=1e-15)
    # an empty sequence has mean 0, not NaN
    empty = sequence_ratio_stats(G_LP, G_OLD, G_ADV, torch.zeros(7, dtype=torch.bool), G_CU)
    assert sequence_log_ratio(empty).tolist() == [0.0, 0.0, 0.0]


# ============================================================================= config, errors
def test_registry_entries():
    gspo, cispo = POLICY_LOSSES.get("gspo"), POLICY_LOSSES.get("cispo")
    assert (gspo.old_policy, gspo.uses_is_weights, gspo.sequence_ratio, gspo.log_prob_term) == ("old", True, True, False)
    assert (cispo.old_policy, cispo.uses_is_weights, cispo.sequence_ratio, cispo.log_prob_term) == ("old", True, False, True)


def test_config_warnings_name_the_papers_clip_ranges():
    with pytest.warns(UserWarning, match=r"gspo.*eps_clip: 3.0e-4, eps_clip_high: 4.0e-4"):
        LossConfig(policy_loss="gspo")
    with pytest.warns(UserWarning, match=r"cispo.*no lower bound: eps_clip: 1.0"):
        LossConfig(policy_loss="cispo")
    with pytest.warns(UserWarning, match="eps_clip_c=3.0 has no effect: policy_loss='cispo' has no dual clip"):
        LossConfig(policy_loss="cispo", eps_clip=1.0, eps_clip_high=0.2, eps_clip_c=3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LossConfig(policy_loss="gspo", eps_clip=3e-4, eps_clip_high=4e-4)
        LossConfig(policy_loss="cispo", eps_clip=1.0, eps_clip_high=0.28)


def test_slime_namespace_selects_gspo_and_cispo_by_advantage_estimator():
    for name in ("gspo", "cispo"):
        ns = argparse.Namespace(advantage_estimator=name, eps_clip=3e-4, eps_clip_high=4e-4)
        cfg = LossConfig.from_namespace(ns)
        assert (cfg.policy_loss, cfg.advantage_estimator) == (name, "grpo")
        assert ns.advantage_estimator == name and not hasattr(ns, "policy_loss")  # args untouched
    ns = argparse.Namespace(advantage_estimator="grpo")
    assert LossConfig.from_namespace(ns).policy_loss == "decoupled_ppo"


def test_bad_input_is_named():
    cfg = _cfg("gspo", **G_CFG)
    with pytest.raises(ValueError, match=r"'gspo' needs is_weights"):
        compute_rl_loss(G_LP, G_ADV, torch.ones(7), G_CU, cfg, Denominators(7, 3), old_log_probs=G_OLD)
    with pytest.raises(ValueError, match=r"'cispo' needs is_weights"):
        compute_rl_loss(C_LP, C_ADV, torch.ones(5), C_CU, _cfg("cispo"), Denominators(5, 1), old_log_probs=C_OLD)
    for bad in (lambda t: t[:, :2], lambda t: None, lambda t: t.sum()):
        with pytest.raises(ValueError, match=r"cp_sum must return the summed \[N, k\] tensor it was given \(N=3\)"):
            compute_rl_loss(G_LP, G_ADV, torch.ones(7), G_CU, cfg, Denominators(7, 3), old_log_probs=G_OLD,
                            is_weights=torch.ones(7, dtype=F64), cp_sum=bad)


def test_cispo_overflow_names_the_log_prob():
    """A log-prob of -3e38 (not a log-probability) times clip(r) A w overflows: a clear error
    naming log pi_theta and the clipped ratio, not inf."""
    lp = torch.tensor([-3e38])
    with pytest.raises(ValueError, match=r"log_probs reach \|log pi_theta\| = 3e\+38.*clipped ratio \(at most 1 \+ eps_clip_high = 1.28\)"):
        compute_rl_loss(lp, torch.tensor([2.0]), torch.ones(1), torch.tensor([0, 1]), _cfg("cispo", **G_CFG),
                        Denominators(1, 1), old_log_probs=lp, is_weights=torch.ones(1))


def test_nonfinite_inputs_leave_the_sequence_ratio():
    """A NaN old log-prob on a loss token drops that token (neutralize) — from the sequence
    ratio too, so the other tokens' ratio stays finite."""
    old = G_OLD.clone()
    old[1] = float("nan")
    with pytest.warns(RuntimeWarning, match=r"old_log_probs: 1"):
        out, grad = _run(_cfg("gspo", **G_CFG), G_LP, G_ADV, G_CU, Denominators(7, 3), old_log_probs=old)
    assert torch.isfinite(grad).all() and grad[1].item() == 0.0
    assert out.terms.ratio[0].item() == pytest.approx(math.exp(0.2))  # (0.3 + 0.1) / 2
