"""The native kernel (``native_engine: true``) against the torch engine through the host drop-in.

Tier 2 (optimised vs reference): for every configuration the drop-in can run natively, the loss,
the returned masks (values and dtype), the gradient of the loss and the non-finite count equal the
eager engine's BIT FOR BIT, on batches with NaN / inf log-probs, NaN / negative / fractional mask
values, empty samples, samples spanning several of the kernel's work items and block tails; and
the kernel's results do not depend on the thread count. The first test of a process builds the
kernel (about 20 s on 2 cores; cached afterwards).
"""

from __future__ import annotations

import shutil
import sys
import warnings
from argparse import Namespace
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_mis.config.base import ConfigError
from megatron_mis.config.mis import MISConfig
from megatron_mis.core import native
from megatron_mis.integrations.tis_functions import compute_mis_weights_fsdp
from strategies import sample_lists

SEED000 = dict(use_tis=True, use_rs=True, rs_level="geometric", tis_upper_bound=1.5, rs_lower_bound=0.99,
               rs_upper_bound=1.001, rs_veto_threshold=1e-4, tis_batch_normalize=True)

#: every kernel branch: token IS modes, sequence / geometric IS, token / sequence RS, both vetoes,
#: non-finite rejection, a small log-ratio clamp, no IS (rs_without_tis)
CONFIGS = {
    "seed000": SEED000,
    "token clip": dict(use_tis=True, tis_mode="clip", tis_upper_bound=1.2, tis_lower_bound=0.8),
    "token mask + token RS": dict(use_tis=True, tis_mode="mask", tis_upper_bound=1.3, use_rs=True, rs_level="token",
                                  rs_lower_bound=0.9, rs_upper_bound=1.5, tis_batch_normalize=True),
    "sequence truncate, normalised": dict(use_tis=True, tis_level="sequence", tis_upper_bound=2.0, tis_batch_normalize=True),
    "sequence mask + prob veto (train)": dict(use_tis=True, tis_level="sequence", tis_mode="mask", tis_upper_bound=5.0,
                                              prob_veto_threshold=1e-3, prob_veto_source="train"),
    "geometric clip + sequence RS + prob veto": dict(use_tis=True, tis_level="geometric", tis_mode="clip", tis_upper_bound=1.05,
                                                     use_rs=True, rs_level="sequence", rs_lower_bound=0.5, rs_upper_bound=2.0,
                                                     prob_veto_threshold=0.01),
    "reject non-finite, small clamp": dict(use_tis=True, nonfinite_policy="reject", log_ratio_bound=0.3, tis_upper_bound=1.1,
                                          rs_veto_threshold=0.5),
    "no IS, RS applied (rs_without_tis)": dict(use_rs=True, rs_level="token", rs_lower_bound=0.95, rs_upper_bound=1.05,
                                               rs_without_tis=True, rs_veto_threshold=0.2),
}


def _args(**kw) -> Namespace:
    return Namespace(mis_metrics="none", **kw)


def _batch(lengths, *, lp_dtype=torch.float32, mask_dtype=torch.int64, seed=0, special=True):
    """Per-sample log-probs near each other (so RS and the bounds act on some tokens), masks with
    zeros, and where ``special``: NaN / +-inf log-probs and (float masks) NaN, negative and
    fractional mask values."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    rollout = -torch.rand(total, generator=g) * 6
    train = rollout + torch.randn(total, generator=g) * 0.2
    mask = (torch.rand(total, generator=g) > 0.1).to(torch.float64)
    if special and total > 20:
        idx = torch.randperm(total, generator=g)[:12]
        train[idx[0]], rollout[idx[1]], train[idx[2]] = float("nan"), float("inf"), float("-inf")
        rollout[idx[3]] = float("-inf")
        train[idx[4]], rollout[idx[4]] = 3e38, -3e38  # finite, but the difference overflows float32
        if mask_dtype.is_floating_point:
            mask[idx[5]], mask[idx[6]], mask[idx[7]] = float("nan"), -1.0, 0.25
    split = lambda t, dtype: list(torch.split(t.to(dtype), lengths))  # noqa: E731
    return split(train, lp_dtype), split(rollout, lp_dtype), split(mask, mask_dtype)


def _both(cfg: dict, train, rollout, masks, *, pg_dtype=torch.float32, seed=1, **extra):
    """The drop-in's outputs with the torch engine and with the native kernel, and the gradients."""
    total = sum(m.numel() for m in masks)
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(total, generator=g, dtype=torch.float64)
    if total:
        base[0] = float("nan")  # a NaN loss at a token: 0 where rejected, NaN where kept, in both
    out = []
    for flag in (False, True):
        pg = base.to(pg_dtype).requires_grad_(True)
        spy = mock.patch.object(native, "weights_and_masks", wraps=native.weights_and_masks)
        with warnings.catch_warnings(record=True) as caught, spy as called:
            warnings.simplefilter("always")
            loss, new_masks, metrics = compute_mis_weights_fsdp(
                _args(native_engine=flag, **cfg), pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout,
                loss_masks=masks, **extra,
            )
        # the native call really ran the kernel (no fall-back to the torch engine), the other did not
        assert called.call_count == int(flag)
        assert not [w for w in caught if "native_engine is set" in str(w.message)]
        (grad,) = torch.autograd.grad(loss.sum(), pg)
        out.append((loss.detach(), new_masks, metrics, grad))
    return out


def _assert_identical(ref, got):
    loss_r, masks_r, metrics_r, grad_r = ref
    loss_n, masks_n, metrics_n, grad_n = got
    assert loss_n.dtype == loss_r.dtype
    assert torch.equal(loss_n.nan_to_num(nan=12345.0), loss_r.nan_to_num(nan=12345.0))
    assert torch.equal(loss_n.isnan(), loss_r.isnan())
    assert len(masks_n) == len(masks_r)
    for a, b in zip(masks_n, masks_r):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert metrics_n == metrics_r == {}
    assert torch.equal(grad_n.nan_to_num(nan=12345.0), grad_r.nan_to_num(nan=12345.0))


#: lengths with an empty sample, single tokens, block tails and one sample over several work items
LENGTHS = [0, 1, 7, 300, 255, 257, 20000, 0, 64, 1000]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_native_equals_the_torch_engine_bit_for_bit(name):
    cfg = CONFIGS[name]
    train, rollout, masks = _batch(LENGTHS, seed=hash(name) % 1000)
    ref, got = _both(cfg, train, rollout, masks)
    _assert_identical(ref, got)
    assert any(int(m.sum()) < int((m0 > 0).sum()) for m, m0 in zip(got[1], masks)) or not MISConfig(**cfg).rejects


@pytest.mark.parametrize(
    "lp_dtype,mask_dtype,pg_dtype",
    [
        (torch.float64, torch.bool, torch.float64),
        (torch.bfloat16, torch.float32, torch.bfloat16),
        (torch.float16, torch.float64, torch.float32),
        (torch.float32, torch.int32, torch.float16),
        (torch.float32, torch.uint8, torch.float32),
        (torch.float32, torch.bfloat16, torch.float32),
    ],
)
def test_native_handles_every_dtype_like_the_engine(lp_dtype, mask_dtype, pg_dtype):
    train, rollout, masks = _batch(LENGTHS, lp_dtype=lp_dtype, mask_dtype=mask_dtype, seed=3)
    ref, got = _both(SEED000, train, rollout, masks, pg_dtype=pg_dtype)
    _assert_identical(ref, got)


def test_native_masks_of_mixed_dtypes_come_back_in_the_joined_dtype():
    train, rollout, masks = _batch([40, 50, 60, 70], seed=13, mask_dtype=torch.float32)
    masks = [masks[0].to(torch.bool), masks[1].to(torch.int8), masks[2], masks[3].to(torch.float16)]
    ref, got = _both(SEED000, train, rollout, masks)
    _assert_identical(ref, got)
    assert {m.dtype for m in got[1]} == {torch.float32}  # what torch.cat makes of bool, int8, float32, float16


def test_native_without_train_log_probs_and_with_a_global_mean():
    train, rollout, masks = _batch(LENGTHS, seed=5)
    cfg = dict(SEED000, tis_batch_normalize_scope="global")
    args = [_args(native_engine=flag, **cfg) for flag in (False, True)]
    for a in args:
        a._megatron_mis_global_normalizer = (0, 1.25)  # what prepare_global_normalizer leaves
    pg = torch.randn(sum(LENGTHS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = [compute_mis_weights_fsdp(a, pg_loss=pg, train_log_probs=t, rollout_log_probs=rollout, loss_masks=masks)
                for a in args for t in (train, None)]
    for ref, got in ((outs[0], outs[2]), (outs[1], outs[3])):
        assert torch.equal(got[0], ref[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))


def test_native_results_do_not_depend_on_the_thread_count():
    from megatron_mis.core.statistics import Plan

    train, rollout, masks = _batch([5000, 9000, 17000, 3], seed=7)
    pg = torch.randn(31003)
    plan = Plan.of(MISConfig(mis_metrics="none", **SEED000))
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(native.weights_and_masks(train, rollout, masks, pg, plan))
    finally:
        torch.set_num_threads(before)
    one, two = results
    assert torch.equal(one.stats.sums, two.stats.sums)
    assert torch.equal(one.loss, two.loss)
    assert all(torch.equal(a, b) for a, b in zip(one.masks, two.masks))


_configs = st.builds(
    lambda level, mode, rs, rs_level, veto, norm, up, policy: dict(
        use_tis=True, tis_level=level, tis_mode=mode, tis_upper_bound=up, tis_lower_bound=1.0 / up, use_rs=rs,
        rs_level=rs_level, rs_veto_threshold=veto, tis_batch_normalize=norm, nonfinite_policy=policy,
    ),
    st.sampled_from(["token", "sequence", "geometric"]), st.sampled_from(["truncate", "clip", "mask"]), st.booleans(),
    st.sampled_from(["token", "sequence", "geometric"]), st.sampled_from([None, 1e-3, 0.3]), st.booleans(),
    st.sampled_from([1.01, 1.5, 3.0, 100.0]), st.sampled_from(["neutralize", "reject"]),
)


@settings(max_examples=150, deadline=None)
@given(sample_lists(max_samples=5, max_len=12, min_samples=1, mask_range=(-1, 2)), _configs)
def test_property_native_equals_the_torch_engine(batch, cfg):
    ref, got = _both(cfg, *batch)
    _assert_identical(ref, got)


def test_calls_the_kernel_cannot_take_warn_once_and_run_the_torch_engine():
    train, rollout, masks = _batch([30, 40], seed=9, special=False)
    args = _args(native_engine=True, nonfinite_policy="error", **SEED000)
    pg = torch.randn(70)
    with pytest.warns(RuntimeWarning, match="nonfinite_policy='error'.*torch engine computes it"):
        first = compute_mis_weights_fsdp(args, pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per args object
        compute_mis_weights_fsdp(args, pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    ref = compute_mis_weights_fsdp(_args(nonfinite_policy="error", **SEED000), pg_loss=pg, train_log_probs=train,
                                   rollout_log_probs=rollout, loss_masks=masks)
    assert torch.equal(first[0], ref[0])
    # an integer loss is not one the kernel writes: same route
    with pytest.warns(RuntimeWarning, match="pg_loss of dtype torch.int64"):
        compute_mis_weights_fsdp(_args(native_engine=True, **SEED000), pg_loss=torch.ones(70, dtype=torch.int64),
                                 train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)


def test_native_reports_the_wrong_loss_length_and_the_nonfinite_count():
    train, rollout, masks = _batch([30, 40], seed=11, special=False)
    train[0][3] = float("nan")
    args = _args(native_engine=True, **SEED000)
    with pytest.raises(ValueError, match=r"pg_loss has shape \(69,\) but this rank holds 70 response tokens"):
        compute_mis_weights_fsdp(args, pg_loss=torch.randn(69), train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    compute_mis_weights_fsdp(args, pg_loss=torch.randn(70), train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    with pytest.warns(RuntimeWarning, match="1 loss-mask token"):  # the deferred warning of the previous call
        compute_mis_weights_fsdp(args, pg_loss=torch.randn(70), train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)


def test_native_engine_needs_mis_metrics_none():
    with pytest.raises(ConfigError, match="native_engine=true computes weights and masks only, but mis_metrics='standard'"):
        MISConfig(native_engine=True, use_tis=True)


def test_a_missing_compiler_or_ninja_is_named(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(native.NativeBuildError, match="needs a C\\+\\+ compiler"):
        native._build()
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "ninja" else "/usr/bin/" + name)
    monkeypatch.setitem(sys.modules, "ninja", None)  # the PyPI package absent too
    with pytest.raises(native.NativeBuildError, match="pip install ninja"):
        native._build()


def test_tokens_exactly_at_the_veto_thresholds_are_not_vetoed():
    # a log-ratio (or log-prob) equal to float32(log(threshold)) is not below it: kept, as in torch
    ratio_thr, prob_thr = 0.5, 0.25
    at_ratio = torch.tensor(ratio_thr).log().float()  # train - rollout == float32(log 0.5) exactly
    at_prob = torch.tensor(prob_thr).log().float()
    rollout = [torch.tensor([-at_ratio, -0.1, -0.2]), torch.tensor([at_prob, -0.1, -0.3]), torch.tensor([-at_ratio * 1.0001, -0.2, -0.1])]
    train = [torch.tensor([0.0, -0.1, -0.2]), torch.tensor([at_prob, -0.1, -0.3]), torch.tensor([0.0, -0.2, -0.1])]
    masks = [torch.ones(3, dtype=torch.int64) for _ in range(3)]
    cfg = dict(use_tis=True, tis_upper_bound=2.0, rs_veto_threshold=ratio_thr, prob_veto_threshold=prob_thr)
    ref, got = _both(cfg, train, rollout, masks)
    _assert_identical(ref, got)
    assert [int(m.sum()) for m in got[1]] == [3, 3, 0]  # only the third sample's ratio is below


def test_pieces_the_kernel_does_not_read_run_the_torch_engine():
    # float8 log-probs: the torch engine converts them to float32; the kernel names the first piece
    train, rollout, masks = _batch([30, 40], seed=15, special=False)
    rollout = [r.to(torch.float8_e4m3fn) for r in rollout]
    pg = torch.randn(70)
    with pytest.warns(RuntimeWarning, match=r"rollout_log_probs\[0\] of dtype Float8_e4m3fn; the torch engine computes it"):
        got = compute_mis_weights_fsdp(_args(native_engine=True, **SEED000), pg_loss=pg, train_log_probs=train,
                                       rollout_log_probs=rollout, loss_masks=masks)
    ref = compute_mis_weights_fsdp(_args(**SEED000), pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout,
                                   loss_masks=masks)
    assert torch.equal(got[0], ref[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))
