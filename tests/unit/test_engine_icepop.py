"""``tis_mode: icepop`` (issue 27 item 5): Miles' ``icepop_function`` — an out-of-band token gets
IS weight 0 and STAYS in the loss mask — next to ``tis_mode: mask``, which removes it from the
mask. Hand-derived values, the naive reference, and the config rules.

Miles' icepop at commit 31f1ca96 (``miles/backends/training_utils/loss_hub/corrections.py:35``):
``ice_weight = where((r >= tis_clip_low) & (r <= tis_clip), r, 0)``; ``pg_loss * ice_weight``;
``loss_masks`` returned unchanged.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from megatron_mis import MISConfig
from megatron_mis.config.base import ConfigError
from megatron_mis.core.engine import compute_mis, compute_mis_from_lists

from mis_reference import reference_mis

#: two samples; sample 0 has 3 ratios outside [0.5, 1.5] (0.4, 1.6, 2.0), sample 1 none
RATIOS = [[0.4, 0.8, 1.0, 1.2, 1.6, 2.0, 0.9, 1.1], [1.0, 1.3, 0.7, 1.0]]


def _lists(ratios=RATIOS):
    train, rollout, masks = [], [], []
    for rs in ratios:
        b = torch.full((len(rs),), -1.0, dtype=torch.float64)
        a = b + torch.log(torch.tensor(rs, dtype=torch.float64))
        train.append(a.float())
        rollout.append(b.float())
        masks.append(torch.ones(len(rs), dtype=torch.int64))
    return train, rollout, masks


def _cfg(mode, **kw):
    return MISConfig(use_tis=True, tis_level="token", tis_mode=mode, tis_lower_bound=0.5, tis_upper_bound=1.5, **kw)


def _miles_loss(per_token, weights, new_masks, denominator_masks):
    """Miles' sum_of_sample_mean written out: per sample, sum(value * weight * returned mask) over
    the denominator mask's sum, averaged over the samples."""
    total = 0.0
    for x, w, m, d in zip(per_token, weights, new_masks, denominator_masks):
        total += float((x * w * m).sum()) / float(d.sum())
    return total / len(per_token)


def test_hand_derived_icepop_against_mask():
    train, rollout, masks = _lists()
    lengths = [len(r) for r in RATIOS]
    out = {}
    for mode in ("mask", "icepop"):
        res = compute_mis_from_lists(train, rollout, masks, _cfg(mode))
        out[mode] = (res.split(res.weights, lengths), res.split(res.keep_mask.long(), lengths), res.scalars())
    ice_w, ice_keep, ice_s = out["icepop"]
    mask_w, mask_keep, mask_s = out["mask"]
    # the weights are the same: r inside [0.5, 1.5], 0 outside
    expected = [[0.0, 0.8, 1.0, 1.2, 0.0, 0.0, 0.9, 1.1], [1.0, 1.3, 0.7, 1.0]]
    for got in (ice_w, mask_w):
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, torch.tensor(e), rtol=1e-6, atol=0)
    # icepop keeps every token in the mask; mask removes the three out-of-band tokens
    assert [k.tolist() for k in ice_keep] == [[1] * 8, [1] * 4]
    assert [k.tolist() for k in mask_keep] == [[0, 1, 1, 1, 0, 0, 1, 1], [1] * 4]
    # metrics: icepop counts its zero-weighted tokens in a metric of its own, not as rejected
    assert ice_s["mis_rejected_token_fraction"] == 0.0
    assert ice_s["mis_tis_zero_weight_fraction_low"] == pytest.approx(1 / 12)
    assert ice_s["mis_tis_zero_weight_fraction_high"] == pytest.approx(2 / 12)
    assert "mis_tis_mask_fraction_low" not in ice_s
    assert mask_s["mis_rejected_token_fraction"] == pytest.approx(3 / 12)
    assert mask_s["mis_tis_mask_fraction_low"] == pytest.approx(1 / 12)
    assert mask_s["mis_tis_mask_fraction_high"] == pytest.approx(2 / 12)
    # the hosts' final-weight statistics see the zero weights of icepop: per sample over its
    # loss-mask tokens, sample 0 mean 5.0 / 8, min 0, max 1.2; sample 1 mean 1, min 0.7, max 1.3
    assert ice_s["mis_is_ratio_mean_final"] == pytest.approx((5.0 / 8 + 1.0) / 2, rel=1e-6)
    assert ice_s["mis_is_ratio_min_final"] == pytest.approx((0.0 + 0.7) / 2, rel=1e-6)
    assert ice_s["mis_is_ratio_max_final"] == pytest.approx((1.2 + 1.3) / 2, rel=1e-6)
    # mask mode: the hosts keep the raw ratio there: min 0.4 and max 2.0 in sample 0
    assert mask_s["mis_is_ratio_min_final"] == pytest.approx((0.4 + 0.7) / 2, rel=1e-6)
    assert mask_s["mis_is_ratio_max_final"] == pytest.approx((2.0 + 1.3) / 2, rel=1e-6)
    # the kept-token batch statistics: icepop keeps the zeros (min 0), mask does not (min 0.7)
    assert ice_s["mis_weight_after_bound_min"] == 0.0 and mask_s["mis_weight_after_bound_min"] == pytest.approx(0.7)
    assert ice_s["mis_weight_after_bound_mean"] == pytest.approx(9.0 / 12, rel=1e-6)
    assert mask_s["mis_weight_after_bound_mean"] == pytest.approx(9.0 / 9, rel=1e-6)

    # The loss as Miles reduces it, with pg_loss -1 per token (advantage 1 at ratio 1) and an
    # entropy of 0.5 per token. In-band weights sum to 5.0 (sample 0) and 4.0 (sample 1).
    pg = [torch.full((n,), -1.0) for n in lengths]
    ent = [torch.full((n,), 0.5) for n in lengths]
    ones = [torch.ones(n) for n in lengths]
    # with rollout_mask_sums (denominators = original mask sums): the pg terms agree ...
    pg_ice = _miles_loss(pg, ice_w, ice_keep, masks)  # (-5/8 - 4/4) / 2
    pg_mask = _miles_loss(pg, mask_w, mask_keep, masks)
    assert pg_ice == pytest.approx(-0.8125, rel=1e-6) and pg_mask == pytest.approx(-0.8125, rel=1e-6)
    # ... the entropy term does not: icepop keeps 0.5 everywhere, mask loses 3 of 8 tokens
    assert _miles_loss(ent, ones, ice_keep, masks) == pytest.approx(0.5)
    assert _miles_loss(ent, ones, mask_keep, masks) == pytest.approx((0.5 * 5 / 8 + 0.5) / 2)  # 0.40625
    # without rollout_mask_sums (Miles: denominators = returned mask sums) the pg terms differ
    assert _miles_loss(pg, ice_w, ice_keep, ice_keep) == pytest.approx(-0.8125, rel=1e-6)
    assert _miles_loss(pg, mask_w, mask_keep, mask_keep) == pytest.approx((-5.0 / 5 - 1.0) / 2, rel=1e-6)  # -1.0


def test_icepop_weights_equal_miles_icepop_function():
    """The weight is Miles' ``where((r >= low) & (r <= high), r, 0)`` on random ratios, bounds
    included, and the returned mask is the loss mask."""
    g = torch.Generator().manual_seed(3)
    train = -torch.rand(400, generator=g) * 3
    rollout = train + torch.randn(400, generator=g) * 0.5
    mask = torch.rand(400, generator=g) > 0.2
    res = compute_mis(train, rollout, mask, [0, 150, 400], _cfg("icepop"))
    r = torch.exp(train - rollout)
    miles = torch.where((r >= 0.5) & (r <= 1.5), r, torch.zeros_like(r))
    torch.testing.assert_close(res.weights, miles * mask, rtol=1e-6, atol=0)
    assert torch.equal(res.keep_mask, mask)


@pytest.mark.parametrize("extra", [
    {}, dict(tis_batch_normalize=True), dict(use_rs=True, rs_level="geometric", rs_lower_bound=0.7, rs_upper_bound=1.4),
    dict(use_rs=True, rs_level="token", rs_lower_bound=0.3, rs_upper_bound=3.0), dict(rs_veto_threshold=0.2),
    dict(nonfinite_policy="reject"), dict(mis_metrics="full"),
    dict(use_rs=True, rs_criteria={"seq_max_k3": 1.0, "token_k2": 0.5}),
])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_icepop_matches_reference(extra, nonfinite):
    g = torch.Generator().manual_seed(11)
    lengths = [5, 17, 1, 30, 9, 0, 12]
    train, rollout, masks = [], [], []
    for n in lengths:
        a = -torch.rand(n, generator=g) * 2
        b = a + torch.randn(n, generator=g) * 0.6
        if nonfinite and n > 3:
            a[1] = float("nan")
            b[2] = float("-inf")
        train.append(a)
        rollout.append(b)
        masks.append((torch.rand(n, generator=g) > 0.2).long())
    cfg = _cfg("icepop", **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = compute_mis_from_lists(train, rollout, masks, cfg)
        summary = res.scalars()
    ref = reference_mis(train, rollout, masks, cfg)
    torch.testing.assert_close(res.weights, torch.tensor(sum(ref["weights"], [])), rtol=1e-6, atol=1e-7)
    assert res.keep_mask.tolist() == sum(ref["keep"], [])
    for name, value in ref["metrics"].items():
        assert summary[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_icepop_is_token_level_only(level):
    with pytest.raises(ConfigError) as info:
        MISConfig(use_tis=True, tis_mode="icepop", tis_level=level, tis_upper_bound=0.5)
    text = str(info.value)
    # the bad value and the allowed set, and every other problem of the config at once
    assert "tis_mode='icepop' is token-level only" in text and f"tis_level={level!r} is not allowed" in text
    assert "allowed tis_level: 'token'" in text
    assert "tis_lower_bound=2.0 must be < tis_upper_bound=0.5" in text
    assert len(info.value.problems) == 2


def test_icepop_neither_rejects_nor_needs_the_cp_bit_exchange():
    cfg = _cfg("icepop")
    assert not cfg.rejects and not cfg.token_rejects
    assert _cfg("mask").token_rejects


def test_icepop_in_band_weights_are_exact_at_the_bounds():
    """[L, U] is closed, as in Miles: ratios exactly at the bounds keep their weight."""
    train = torch.log(torch.tensor([0.5, 1.5, 0.25, 4.0]))
    rollout = torch.zeros(4)
    res = compute_mis(train, rollout, torch.ones(4, dtype=torch.bool), [0, 4], _cfg("icepop"))
    assert res.weights.tolist() == [0.5, 1.5, 0.0, 0.0]
    assert math.isclose(res.scalars()["mis_tis_zero_weight_fraction_low"], 0.25)


def test_icepop_with_self_normalisation_when_every_weight_is_zero():
    """Every ratio out of band: every kept weight is 0, so the micro-batch's normalising mean is
    0. Dividing by it gave 0 / 0 = NaN weights (a silent NaN in the loss); nothing is scaled then
    (mean taken as 1, as when nothing is kept) and the weights stay 0."""
    train, rollout, masks = _lists([[0.2, 3.0, 0.1], [4.0, 0.3]])
    for over in ("kept", "loss_mask"):
        cfg = _cfg("icepop", tis_batch_normalize=True, tis_batch_normalize_over=over)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = compute_mis_from_lists(train, rollout, masks, cfg)
        assert torch.isfinite(res.weights).all() and res.weights.tolist() == [0.0] * 5, over
        assert res.keep_mask.tolist() == [True] * 5
        assert float(res.normalizer) == 1.0
