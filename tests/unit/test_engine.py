"""The vectorised MIS engine: hand-derived values, equivalence with the naive reference over every
level x mode x RS x veto x normalisation combination, hypothesis properties, and bad input."""

from __future__ import annotations

import itertools
import math
import warnings
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_mis import MISConfig
from megatron_mis.core.engine import compute_mis, compute_mis_from_lists
from mis_reference import reference_mis
from strategies import sample_lists

ln = math.log

# Two sequences with exact ratios: A has r = [2, 1, 0.5] (sum log r = 0), B has r = [3, 3].
TRAIN = [torch.tensor([ln(0.5), ln(0.5), ln(0.2)]), torch.tensor([ln(0.3), ln(0.6)])]
ROLLOUT = [torch.tensor([ln(0.25), ln(0.5), ln(0.4)]), torch.tensor([ln(0.1), ln(0.2)])]
MASKS = [torch.ones(3, dtype=torch.int64), torch.ones(2, dtype=torch.int64)]


def run(**cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = MISConfig(**cfg)
    return compute_mis_from_lists(TRAIN, ROLLOUT, MASKS, config)


def close(actual, expected, rtol=1e-6):
    # fp32 ratios of exact fractions: ~1 ulp (1.2e-7) per exp/log -> 1e-6 relative is tight.
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=rtol, atol=1e-7)


# ----------------------------------------------------------------------------- hand-derived
@pytest.mark.parametrize(
    "cfg, weights, keep",
    [
        (dict(use_tis=True, tis_upper_bound=2.5), [2, 1, 0.5, 2.5, 2.5], [1, 1, 1, 1, 1]),
        (dict(use_tis=True, tis_mode="clip", tis_lower_bound=0.6, tis_upper_bound=2.5), [2, 1, 0.6, 2.5, 2.5], [1] * 5),
        (dict(use_tis=True, tis_mode="mask", tis_lower_bound=0.6, tis_upper_bound=2.5), [2, 1, 0, 0, 0], [1, 1, 0, 0, 0]),
        (dict(use_tis=True, tis_level="sequence", tis_upper_bound=5.0), [1, 1, 1, 5, 5], [1] * 5),
        (dict(use_tis=True, tis_level="sequence", tis_mode="clip", tis_lower_bound=2.0, tis_upper_bound=5.0), [2, 2, 2, 5, 5], [1] * 5),
        (dict(use_tis=True, tis_level="sequence", tis_mode="mask", tis_lower_bound=0.2, tis_upper_bound=5.0), [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]),
        (dict(use_tis=True, tis_level="geometric", tis_upper_bound=2.0), [1, 1, 1, 2, 2], [1] * 5),
        # clip, not truncate: A's geometric ratio 1 is raised to the lower bound 1.5 (truncate keeps 1)
        (dict(use_tis=True, tis_level="geometric", tis_mode="clip", tis_lower_bound=1.5, tis_upper_bound=2.0), [1.5, 1.5, 1.5, 2, 2], [1] * 5),
        (dict(use_tis=True, tis_level="geometric", tis_mode="mask", tis_lower_bound=0.5, tis_upper_bound=3.5), [1, 1, 1, 3, 3], [1] * 5),
        # normalisation: token mean over kept tokens = 8.5 / 5 = 1.7
        (dict(use_tis=True, tis_upper_bound=2.5, tis_batch_normalize=True), [2 / 1.7, 1 / 1.7, 0.5 / 1.7, 2.5 / 1.7, 2.5 / 1.7], [1] * 5),
        # sequence mean over kept sequences = (1 + 5) / 2 = 3
        (dict(use_tis=True, tis_level="sequence", tis_upper_bound=5.0, tis_batch_normalize=True), [1 / 3] * 3 + [5 / 3] * 2, [1] * 5),
        # RS alone (IS off): token ratios outside [0.6, 2.5] are dropped, weights are 1
        (dict(use_rs=True, rs_lower_bound=0.6, rs_upper_bound=2.5), [1, 1, 0, 0, 0], [1, 1, 0, 0, 0]),
        # geometric RS rejects B (geo ratio 3), token IS truncates A
        (dict(use_tis=True, tis_upper_bound=2.5, use_rs=True, rs_level="geometric", rs_lower_bound=0.9, rs_upper_bound=1.1), [2, 1, 0.5, 0, 0], [1, 1, 1, 0, 0]),
        # sequence RS on A's product (1) and B's (9)
        (dict(use_rs=True, rs_level="sequence", rs_lower_bound=0.5, rs_upper_bound=2.0), [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]),
        # ratio veto: A has r = 0.5 < 0.6
        (dict(use_tis=True, tis_upper_bound=2.5, rs_veto_threshold=0.6), [0, 0, 0, 2.5, 2.5], [0, 0, 0, 1, 1]),
        # probability veto on rollout probs: B has 0.1 < 0.15
        (dict(prob_veto_threshold=0.15), [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]),
        # probability veto on train probs: A has 0.2 < 0.25
        (dict(prob_veto_threshold=0.25, prob_veto_source="train"), [0, 0, 0, 1, 1], [0, 0, 0, 1, 1]),
    ],
)
def test_hand_derived_weights(cfg, weights, keep):
    res = run(**cfg)
    close(res.weights, weights)
    assert res.keep_mask.tolist() == [bool(k) for k in keep]
    assert res.weights.dtype == torch.float32 and not res.weights.requires_grad


def test_hand_derived_metrics():
    res = run(use_tis=True, tis_upper_bound=2.5)
    s = res.scalars()
    k3 = [2 - 1 - ln(2), 0.0, 0.5 - 1 + ln(2), 3 - 1 - ln(3), 3 - 1 - ln(3)]
    assert s["mis_k3_kl"] == pytest.approx(sum(k3) / 5, rel=1e-6)
    assert s["mis_chi2_token"] == pytest.approx(((4 + 1 + 0.25) / 3 - 1 + 8) / 2, rel=1e-6)
    assert s["mis_chi2_seq"] == pytest.approx((0 + 80) / 2, rel=1e-5)
    assert s["mis_ess_token"] == pytest.approx(9.5**2 / (5 * 23.25), rel=1e-6)
    assert s["mis_log_ppl_abs_diff"] == pytest.approx(ln(3) / 2, rel=1e-6)
    assert s["mis_tv"] == pytest.approx((0.5 + 0 + 0.25 + 1 + 1) / 5, rel=1e-6)
    assert s["mis_tis_truncate_fraction"] == pytest.approx(2 / 5)  # the two 3s exceed 2.5
    assert s["mis_weight_before_bound_max"] == pytest.approx(3.0, rel=1e-6)
    assert s["mis_weight_after_bound_max"] == pytest.approx(2.5, rel=1e-6)
    # sequence metrics are repeated over their tokens, token metrics are per token
    close(res.token_metrics["mis_chi2_token"], [0.75] * 3 + [8.0] * 2)
    close(res.token_metrics["mis_k3_kl"], k3)
    close(res.token_metrics["mis_tis_truncate_fraction"], [0, 0, 0, 1, 1])


def test_k3_of_fp32_rounding_level_mismatch_is_exact():
    """Log-probs a few float32 ulps apart (an fp32 engine against an fp32 trainer): k3 ~ d^2/2 of
    ~1e-13. Computed as r - 1 - log r in float32 it would be a multiple of 6e-8 (r - 1 rounds to
    the float32 grid near 1); expm1(log r) - log r keeps it to float32 relative accuracy."""
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(64, generator=g) * 3
    train = rollout + torch.randint(-4, 5, (64,), generator=g).float() * 1.2e-7
    d = (train.double() - rollout.double())  # the exact float32 differences
    res = compute_mis(train, rollout, torch.ones(64), [0, 64], MISConfig())
    expected = (d.square() / 2).mean()
    assert float(expected) < 1e-12
    assert float(res.summary["mis_k3_kl"]) == pytest.approx(float(expected), rel=1e-3)
    torch.testing.assert_close(res.token_metrics["mis_k3_kl"].double(), d.square() / 2, rtol=1e-3, atol=1e-20)


def test_fraction_high_is_computed_from_unbounded_weights():
    """A 'fraction high' from already-clamped weights would always be 0 (DESIGN section 7)."""
    res = run(use_tis=True, tis_mode="clip", tis_lower_bound=0.6, tis_upper_bound=2.5)
    s = res.scalars()
    assert s["mis_tis_clip_fraction_high"] == pytest.approx(2 / 5)
    assert s["mis_tis_clip_fraction_low"] == pytest.approx(1 / 5)


def test_rs_low_and_high_fractions_and_rejections():
    res = run(use_rs=True, rs_lower_bound=0.6, rs_upper_bound=2.5)
    s = res.scalars()
    assert s["mis_rs_mask_fraction_low"] == pytest.approx(1 / 5)
    assert s["mis_rs_mask_fraction_high"] == pytest.approx(2 / 5)
    assert s["mis_rejected_token_fraction"] == pytest.approx(3 / 5)
    assert s["mis_rejected_seq_fraction"] == pytest.approx(1 / 2)  # B has no token left


# ---------------------------------------------------------------- reference equivalence
def _batch(seed: int, n: int = 7, nonfinite: bool = False):
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(0, 12, (n,), generator=g)]
    lengths[0] = 0  # a zero-length response
    lengths[2], lengths[3] = max(lengths[2], 2), max(lengths[3], 3)
    train, rollout, masks = [], [], []
    for length in lengths:
        # multiples of 1/1024 keep fp32 differences exact
        a = torch.round(-torch.rand(length, generator=g) * 3 * 1024) / 1024
        noise = torch.round(torch.randn(length, generator=g) * 0.35 * 1024) / 1024
        m = (torch.rand(length, generator=g) > 0.2).to(torch.int64)  # multi-turn holes
        train.append(a)
        rollout.append(a - noise)
        masks.append(m)
    if nonfinite:
        rollout[2][0] = float("-inf")
        train[3][1] = float("nan")
        masks[2][0] = masks[3][1] = 1
    return train, rollout, masks


LEVELS = ["token", "sequence", "geometric"]
MODES = ["truncate", "clip", "mask"]
RS = [None, "token", "sequence", "geometric"]
COMBOS = list(itertools.product(LEVELS, MODES, RS, [False, True], [False, True]))


def _config(level, mode, rs, veto, norm):
    wide = level == "sequence"
    cfg = dict(
        use_tis=True,
        tis_level=level,
        tis_mode=mode,
        tis_lower_bound=0.3 if wide else 0.7,
        tis_upper_bound=4.0 if wide else 1.4,
        tis_batch_normalize=norm,
        mis_metrics="full",  # the full-only summaries are in the reference too
    )
    if rs is not None:
        cfg.update(use_rs=True, rs_level=rs, rs_lower_bound=0.2 if rs == "sequence" else 0.6,
                   rs_upper_bound=5.0 if rs == "sequence" else 1.6)
    if veto:
        cfg.update(rs_veto_threshold=0.55)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MISConfig(**cfg)


@pytest.mark.parametrize("level, mode, rs, veto, norm", COMBOS)
def test_matches_reference(level, mode, rs, veto, norm):
    cfg = _config(level, mode, rs, veto, norm)
    # a stable seed per case (hash() of strings is salted per process: failures would not reproduce)
    train, rollout, masks = _batch(zlib.crc32(repr((level, mode, rs, veto, norm)).encode()) % 1000)
    _compare(train, rollout, masks, cfg)


@pytest.mark.parametrize(
    "extra",
    [
        dict(use_tis=False),
        dict(use_tis=False, use_rs=True, rs_level="geometric", rs_lower_bound=0.8, rs_upper_bound=1.25),
        dict(use_tis=False, rs_veto_threshold=0.5, prob_veto_threshold=0.02),
        dict(use_tis=True, prob_veto_threshold=0.05, prob_veto_source="train", nonfinite_policy="reject"),
        dict(use_tis=True, tis_level="geometric", nonfinite_policy="reject", tis_batch_normalize=True),
        dict(use_tis=True, tis_level="sequence", log_ratio_bound=1.5, tis_upper_bound=10.0),
    ],
)
@pytest.mark.parametrize("nonfinite", [False, True])
def test_matches_reference_other_settings(extra, nonfinite):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = MISConfig(**extra)
    train, rollout, masks = _batch(11, n=9, nonfinite=nonfinite)
    _compare(train, rollout, masks, cfg)


def _compare(train, rollout, masks, cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = compute_mis_from_lists(train, rollout, masks, cfg)
        scalars = res.scalars()
    ref = reference_mis(train, rollout, masks, cfg)
    lengths = [len(t) for t in train]
    got_w = [w.tolist() for w in res.split(res.weights, lengths)]
    got_k = [k.tolist() for k in res.split(res.keep_mask, lengths)]
    assert got_k == ref["keep"]
    for i, (gw, rw) in enumerate(zip(got_w, ref["weights"])):
        # fp32 weights against float64 arithmetic on the same fp32 ratios: <= a few ulp.
        assert gw == pytest.approx(rw, rel=2e-6, abs=1e-7), f"sequence {i}"
    # every summary the engine reports has an independent definition in the reference
    assert set(scalars) == set(ref["metrics"]), f"no reference for {sorted(set(scalars) - set(ref['metrics']))}, " \
        f"not reported: {sorted(set(ref['metrics']) - set(scalars))}"
    for key, value in ref["metrics"].items():
        assert scalars[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for name, tensor in res.token_metrics.items():
        assert bool(torch.isfinite(tensor).all()), name
        assert tensor.shape == res.weights.shape, name


# -------------------------------------------------------------------- property tests
def batches():
    return sample_lists(max_samples=6, max_len=8)


configs = st.builds(
    lambda level, mode, rs, rs_level, veto, norm, up: _quiet_config(
        use_tis=True, tis_level=level, tis_mode=mode, tis_upper_bound=up, tis_lower_bound=1.0 / up,
        use_rs=rs, rs_level=rs_level, rs_veto_threshold=veto, tis_batch_normalize=norm,
    ),
    st.sampled_from(LEVELS), st.sampled_from(MODES), st.booleans(), st.sampled_from(LEVELS),
    st.sampled_from([None, 1e-3, 0.3]), st.booleans(), st.sampled_from([1.01, 1.5, 3.0, 100.0]),
)


def _quiet_config(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MISConfig(**kw)


@settings(max_examples=120, deadline=None)
@given(batches(), configs)
def test_property_finite_bounded_and_masked(batch, cfg):
    train, rollout, masks = batch
    res = compute_mis_from_lists(train, rollout, masks, cfg)
    w = res.weights
    assert bool(torch.isfinite(w).all())
    assert bool((w >= 0).all())
    assert bool((w[~res.keep_mask] == 0).all())
    mask = torch.cat(masks).bool() if masks else torch.zeros(0, dtype=torch.bool)
    assert bool((res.keep_mask <= mask).all())
    if not cfg.tis_batch_normalize:
        kept = w[res.keep_mask]
        assert bool((kept <= cfg.tis_upper_bound * (1 + 1e-6)).all())
        if cfg.tis_mode != "truncate":
            assert bool((kept >= cfg.tis_lower * (1 - 1e-6)).all())
    else:
        kept = w[res.keep_mask]
        if kept.numel():
            unit = kept.mean() if cfg.tis_level == "token" else res.seq_weights[res.seq_weights > 0].mean()
            assert float(unit) == pytest.approx(1.0, rel=1e-5)
    for value in res.scalars().values():
        assert math.isfinite(value)


@settings(max_examples=60, deadline=None)
@given(batches(), configs, st.randoms(use_true_random=False))
def test_property_permutation_equivariant(batch, cfg, rnd):
    train, rollout, masks = batch
    order = list(range(len(train)))
    rnd.shuffle(order)
    a = compute_mis_from_lists(train, rollout, masks, cfg)
    b = compute_mis_from_lists([train[i] for i in order], [rollout[i] for i in order], [masks[i] for i in order], cfg)
    lengths = [len(t) for t in train]
    wa = a.split(a.weights, lengths)
    wb = b.split(b.weights, [lengths[i] for i in order])
    for j, i in enumerate(order):
        torch.testing.assert_close(wb[j], wa[i], rtol=1e-6, atol=1e-7)  # only summation order differs


@settings(max_examples=60, deadline=None)
@given(batches(), configs, st.integers(0, 6))
def test_property_split_batch_same_per_sequence_values(batch, cfg, cut):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = cfg.replace(tis_batch_normalize=False)
    train, rollout, masks = batch
    cut = min(cut, len(train))
    whole = compute_mis_from_lists(train, rollout, masks, cfg)
    first = compute_mis_from_lists(train[:cut], rollout[:cut], masks[:cut], cfg)
    second = compute_mis_from_lists(train[cut:], rollout[cut:], masks[cut:], cfg)
    assert torch.equal(torch.cat([first.weights, second.weights]), whole.weights)
    assert torch.equal(torch.cat([first.keep_mask, second.keep_mask]), whole.keep_mask)
    for name in ("mis_k3_kl", "mis_training_log_ppl", "mis_chi2_seq"):
        torch.testing.assert_close(
            torch.cat([first.token_metrics[name], second.token_metrics[name]]), whole.token_metrics[name]
        )


# ------------------------------------------------------------------------- bad input
def test_mismatched_lengths_name_the_sequence():
    with pytest.raises(ValueError, match=r"sequence 1: train \(2,\), rollout \(3,\)"):
        compute_mis_from_lists(TRAIN, [ROLLOUT[0], torch.zeros(3)], MASKS, MISConfig())
    with pytest.raises(ValueError, match="2 train_log_probs, 1 rollout_log_probs"):
        compute_mis_from_lists(TRAIN, ROLLOUT[:1], MASKS, MISConfig())
    with pytest.raises(ValueError, match="same shape"):
        compute_mis(torch.zeros(4), torch.zeros(5), torch.ones(4), [0, 4], MISConfig())
    with pytest.raises(ValueError, match=r"1-D \[T\]"):
        compute_mis(torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2, 2), [0, 4], MISConfig())


@pytest.mark.parametrize(
    "cu, message",
    [([0, 2, 1, 5], "non-decreasing"), ([1, 5], r"cu_seqlens\[0\] must be 0"), ([0, 4], "must equal the number of tokens 5")],
)
def test_bad_cu_seqlens(cu, message):
    with pytest.raises(ValueError, match=message):
        compute_mis(torch.zeros(5), torch.zeros(5), torch.ones(5), cu, MISConfig())


def test_nonfinite_neutralised_counted_and_warned():
    train = [torch.tensor([-1.0, float("nan"), -0.5]), torch.tensor([-0.2])]
    rollout = [torch.tensor([float("-inf"), -1.0, -0.5]), torch.tensor([float("inf")])]
    masks = [torch.ones(3), torch.ones(1)]
    res = compute_mis_from_lists(train, rollout, masks, MISConfig(use_tis=True))
    assert res.weights.tolist() == [1.0, 1.0, 1.0, 1.0]  # neutral ratios, still in the loss
    assert res.keep_mask.all()
    with pytest.warns(RuntimeWarning, match="3 loss-mask token"):
        s = res.scalars()
    assert s["mis_nonfinite_token_fraction"] == pytest.approx(3 / 4)
    assert all(math.isfinite(v) for v in s.values())
    for t in res.token_metrics.values():
        assert bool(torch.isfinite(t).all())
    rejected = compute_mis_from_lists(train, rollout, masks, MISConfig(use_tis=True, nonfinite_policy="reject"))
    assert rejected.keep_mask.tolist() == [False, False, True, False]
    with pytest.raises(ValueError, match="3 loss-mask token.*first at flat index 0, sequence 0"):
        compute_mis_from_lists(train, rollout, masks, MISConfig(nonfinite_policy="error"))


def test_nonfinite_outside_the_mask_is_ignored():
    res = compute_mis_from_lists([torch.tensor([float("nan"), -1.0])], [torch.tensor([0.0, -1.0])],
                                 [torch.tensor([0, 1])], MISConfig(nonfinite_policy="error"))
    assert res.keep_mask.tolist() == [False, True]
    assert int(res.num_nonfinite) == 0


@pytest.mark.parametrize("cfg", [MISConfig(), MISConfig(use_tis=True, tis_level="geometric", tis_batch_normalize=True)])
def test_empty_batch_and_zero_length(cfg):
    empty = compute_mis_from_lists([], [], [], cfg)
    assert empty.weights.shape == (0,) and empty.seq_weights.shape == (0,)
    assert all(math.isfinite(v) for v in empty.scalars().values())
    zero = compute_mis_from_lists([torch.zeros(0)] * 3, [torch.zeros(0)] * 3, [torch.zeros(0)] * 3, cfg)
    assert zero.weights.shape == (0,) and zero.seq_weights.tolist() == [0.0, 0.0, 0.0]
    assert all(math.isfinite(v) for v in zero.scalars().values())


def test_all_masked_and_all_rejected_give_zero_weights_not_nan():
    masks0 = [torch.zeros(3), torch.zeros(2)]
    res = compute_mis_from_lists(TRAIN, ROLLOUT, masks0, MISConfig(use_tis=True, tis_batch_normalize=True))
    assert res.weights.tolist() == [0.0] * 5 and not res.keep_mask.any()
    # geometric RS with tight bounds plus veto: every token rejected (DESIGN section 7)
    cfg = MISConfig(use_tis=True, tis_batch_normalize=True, use_rs=True, rs_level="geometric",
                    rs_lower_bound=0.9999, rs_upper_bound=1.0001, rs_veto_threshold=0.9)
    res = compute_mis_from_lists(TRAIN, ROLLOUT, MASKS, cfg)
    assert res.weights.tolist() == [0.0] * 5
    assert float(res.normalizer) == 1.0
    s = res.scalars()
    assert s["mis_rejected_token_fraction"] == 1.0 and s["mis_rejected_seq_fraction"] == 1.0
    assert all(math.isfinite(v) for v in s.values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_are_computed_in_fp32(dtype):
    train = [t.to(dtype) for t in TRAIN]
    rollout = [t.to(dtype) for t in ROLLOUT]
    cfg = MISConfig(use_tis=True, tis_level="geometric", tis_upper_bound=5.0)
    low = compute_mis_from_lists(train, rollout, MASKS, cfg)
    ref = compute_mis_from_lists([t.float() for t in train], [t.float() for t in rollout], MASKS, cfg)
    assert low.weights.dtype == torch.float32
    assert torch.equal(low.weights, ref.weights)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32, torch.int64, torch.float32, torch.bfloat16])
def test_mask_dtypes_agree(mask_dtype):
    masks = [torch.tensor([1, 0, 1]).to(mask_dtype), torch.tensor([1, 1]).to(mask_dtype)]
    cfg = MISConfig(use_tis=True, tis_upper_bound=2.5)
    res = compute_mis_from_lists(TRAIN, ROLLOUT, masks, cfg)
    assert res.keep_mask.tolist() == [True, False, True, True, True]
    close(res.weights, [2, 0, 0.5, 2.5, 2.5])


def test_large_log_ratio_is_clamped_not_overflowing():
    train = [torch.full((50,), -0.01)]
    rollout = [torch.full((50,), -30.0)]  # each token log r ~ 30 > bound 20; sum 1500
    for level in LEVELS:
        res = compute_mis_from_lists(train, rollout, [torch.ones(50)],
                                     MISConfig(use_tis=True, tis_level=level, tis_upper_bound=1e9))
        assert bool(torch.isfinite(res.weights).all())
        assert float(res.weights.max()) == pytest.approx(math.exp(20.0), rel=1e-5)
        assert all(math.isfinite(v) for v in res.scalars().values())


def test_global_scope_requires_a_normalizer():
    cfg = MISConfig(use_tis=True, tis_batch_normalize=True, tis_batch_normalize_scope="global")
    with pytest.raises(ValueError, match="global mean"):
        compute_mis_from_lists(TRAIN, ROLLOUT, MASKS, cfg)
    res = compute_mis_from_lists(TRAIN, ROLLOUT, MASKS, cfg, global_normalizer=2.0)
    close(res.weights, [1.0, 0.5, 0.25, 1.0, 1.0])
    with pytest.raises(ValueError, match="positive finite"):
        compute_mis_from_lists(TRAIN, ROLLOUT, MASKS, cfg, global_normalizer=float("nan"))


def test_bucket_table_counts_and_mismatch():
    probs = [1e-5, 0.05, 0.3, 0.7, 0.95]
    deltas = [0.8, 0.4, 0.2, -0.1, 0.05]  # log r per token
    rollout = torch.tensor([ln(p) for p in probs])
    train = rollout + torch.tensor(deltas)
    res = compute_mis_from_lists([train], [rollout], [torch.ones(5)], MISConfig())
    table = res.bucket_table
    edges = table["edges"].tolist()
    # bucket index -> the log r of the one token that falls in it
    delta_in = {edges.index(lo): d for lo, d in zip([1e-6, 0.01, 0.1, 0.5, 0.9], deltas)}
    for b, count in enumerate(table["num_tokens"].tolist()):
        d = delta_in.get(b)
        assert count == (0.0 if d is None else 1.0)
        want_abs = 0.0 if d is None else abs(d)
        want_k3 = 0.0 if d is None else math.exp(d) - 1 - d
        assert float(table["mean_abs_log_ratio"][b]) == pytest.approx(want_abs, rel=1e-5, abs=1e-7)
        assert float(table["mean_k3"][b]) == pytest.approx(want_k3, rel=1e-4, abs=1e-7)
    with pytest.raises(ValueError, match="prob_bucket_edges"):
        compute_mis_from_lists(TRAIN, ROLLOUT, MASKS, MISConfig(), prob_bucket_edges=[0.5, 0.1])


@pytest.mark.parametrize("policy", ["neutralize", "reject"])
def test_bucket_table_without_metrics_equals_the_table_with_metrics(policy):
    """Without metrics the token stage keeps neither validity nor log r; the bucket table
    recomputes them and must give exactly the table a call with metrics gives (non-finite
    log-probs, masked-out tokens and ratios beyond the clamp included)."""
    g = torch.Generator().manual_seed(11)
    lengths = [40, 1, 25, 60]
    rollout = [-torch.rand(n, generator=g) * 6 for n in lengths]
    train = [r + torch.randn(n, generator=g) * 0.3 for r, n in zip(rollout, lengths)]
    masks = [(torch.rand(n, generator=g) > 0.2).float() for n in lengths]
    train[0][3], rollout[2][7], train[3][9], rollout[3][10] = float("nan"), float("-inf"), float("inf"), -30.0
    train[3][11] = 0.0  # log r = +30 against rollout 0 - 30 below: beyond a bound of 5
    rollout[3][11] = -30.0
    base = dict(use_tis=True, use_rs=True, rs_level="token", log_ratio_bound=5.0, nonfinite_policy=policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = compute_mis_from_lists(train, rollout, masks, MISConfig(**base, mis_metrics="standard"))
        lean = compute_mis_from_lists(train, rollout, masks, MISConfig(**base, mis_metrics="none"))
    assert lean._tokens.valid is None and lean._tokens.log_r is None
    assert torch.equal(full.weights, lean.weights) and torch.equal(full.keep_mask, lean.keep_mask)
    for name, value in full.bucket_table.items():
        assert torch.equal(value, lean.bucket_table[name]), name
    assert float(full.bucket_table["num_tokens"].sum()) > 0
