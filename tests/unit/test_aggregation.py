"""Loss aggregation: hand values of the three modes, the rejected-in-denominator option, and
independence of the loss from how the batch is split over micro-batches and ranks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_mis.core.aggregation import (
    AGGREGATION_MODES,
    Denominators,
    aggregate,
    denominator_mask,
    local_denominators,
    segment_sum,
)

# two sequences: [1, 2, 3] and [4, 10]; the last token of sequence 0 is masked out.
V = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0])
M = torch.tensor([1, 1, 0, 1, 1], dtype=torch.bool)
CU = torch.tensor([0, 3, 5])


def test_hand_values():
    den = local_denominators(M, CU)
    assert den == Denominators(4.0, 2.0)
    assert aggregate(V, M, CU, "token_mean", den).item() == pytest.approx((1 + 2 + 4 + 10) / 4)
    assert aggregate(V, M, CU, "seq_mean_token_mean", den).item() == pytest.approx(((1 + 2) / 2 + (4 + 10) / 2) / 2)
    assert aggregate(V, M, CU, "seq_mean_token_sum", den).item() == pytest.approx(((1 + 2) + (4 + 10)) / 2)


def test_rejected_in_denominator_option():
    loss_mask = torch.ones(5, dtype=torch.bool)
    keep = torch.tensor([1, 1, 1, 0, 0], dtype=torch.bool)  # sequence 1 fully rejected
    with_rej = denominator_mask(loss_mask, keep, True)
    without = denominator_mask(loss_mask, keep, False)
    assert with_rej.tolist() == [True] * 5 and without.tolist() == keep.tolist()
    d_with, d_without = local_denominators(with_rej, CU), local_denominators(without, CU)
    assert d_with == Denominators(5.0, 2.0) and d_without == Denominators(3.0, 1.0)
    # token mean: rejected tokens still dilute the loss / they do not.
    assert aggregate(V, keep, CU, "token_mean", d_with).item() == pytest.approx(6 / 5)
    assert aggregate(V, keep, CU, "token_mean", d_without).item() == pytest.approx(6 / 3)
    # seq-mean-token-mean: the rejected sequence counts as a 0 / leaves the mean.
    assert aggregate(V, keep, CU, "seq_mean_token_mean", d_with, count_mask=with_rej).item() == pytest.approx((6 / 3) / 2)
    assert aggregate(V, keep, CU, "seq_mean_token_mean", d_without, count_mask=without).item() == pytest.approx(6 / 3)


def test_partial_rejection_per_sequence_counts():
    loss_mask = torch.ones(5, dtype=torch.bool)
    keep = torch.tensor([1, 0, 1, 1, 1], dtype=torch.bool)
    for rej, n0 in ((True, 3), (False, 2)):
        cmask = denominator_mask(loss_mask, keep, rej)
        den = local_denominators(cmask, CU)
        got = aggregate(V, keep, CU, "seq_mean_token_mean", den, count_mask=cmask).item()
        assert got == pytest.approx(((1 + 3) / n0 + 14 / 2) / 2)


def test_masked_nan_and_inf_do_not_leak_into_value_or_gradient():
    v = torch.tensor([1.0, float("nan"), 2.0, float("inf")], requires_grad=True)
    m = torch.tensor([1, 0, 1, 0], dtype=torch.bool)
    cu = torch.tensor([0, 2, 4])
    for mode in AGGREGATION_MODES:
        out = aggregate(v, m, cu, mode, local_denominators(m, cu))
        (g,) = torch.autograd.grad(out, v)
        assert torch.isfinite(out) and torch.isfinite(g).all()
        assert g[1].item() == 0.0 and g[3].item() == 0.0


def test_zero_denominators():
    v = torch.ones(3, requires_grad=True)
    empty = torch.zeros(3, dtype=torch.bool)
    cu = torch.tensor([0, 3])
    for mode in AGGREGATION_MODES:
        out = aggregate(v, empty, cu, mode, Denominators(0, 0))
        assert out.item() == 0.0 and out.requires_grad
    with pytest.raises(ValueError, match="global token_mean denominator is 0"):
        aggregate(v, torch.ones(3, dtype=torch.bool), cu, "token_mean", Denominators(0, 0))


def test_errors():
    with pytest.raises(ValueError, match=r"unknown loss aggregation 'token-mean' \(did you mean 'token_mean'\?\)"):
        aggregate(V, M, CU, "token-mean", Denominators(4, 2))
    with pytest.raises(ValueError, match="same length"):
        aggregate(V, M[:4], CU, "token_mean", Denominators(4, 2))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end"):
        aggregate(V, M, torch.tensor([0, 3, 4]), "token_mean", Denominators(4, 2))
    with pytest.raises(ValueError, match="non-decreasing"):
        aggregate(V, M, torch.tensor([0, 4, 3, 5]), "token_mean", Denominators(4, 2))
    with pytest.raises(ValueError, match="seq_token_counts has shape"):
        aggregate(V, M, CU, "seq_mean_token_mean", Denominators(4, 2), seq_token_counts=torch.ones(3))
    with pytest.raises(ValueError, match="count_mask"):
        aggregate(V, M, CU, "seq_mean_token_mean", Denominators(4, 2), count_mask=torch.zeros(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="finite count >= 0"):
        Denominators(-1, 0)
    with pytest.raises(ValueError, match="finite count >= 0"):
        Denominators(float("nan"), 0)


def test_segment_sum_gradient():
    v = torch.arange(5.0, requires_grad=True)
    s = segment_sum(v, CU)
    assert s.tolist() == [3.0, 7.0]
    (g,) = torch.autograd.grad((s * torch.tensor([2.0, 3.0])).sum(), v)
    assert g.tolist() == [2, 2, 2, 3, 3]


# --------------------------------------------------------- split invariance (micro-batches x ranks)
@st.composite
def _batches(draw):
    num_seq = draw(st.integers(1, 7))
    lengths = draw(st.lists(st.integers(0, 5), min_size=num_seq, max_size=num_seq))
    total = sum(lengths)
    seed = draw(st.integers(0, 2**16))
    cuts = sorted(draw(st.lists(st.integers(0, num_seq), min_size=0, max_size=3)))
    return lengths, total, seed, cuts


@settings(max_examples=60, deadline=None)
@given(_batches(), st.sampled_from(AGGREGATION_MODES), st.booleans())
def test_sum_over_any_split_equals_whole_batch(batch, mode, rejected_in_denominator):
    lengths, total, seed, cuts = batch
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(total, dtype=torch.float64, generator=g).requires_grad_()
    loss_mask = torch.rand(total, generator=g) < 0.8
    keep = loss_mask & (torch.rand(total, generator=g) < 0.7)
    cu = torch.nn.functional.pad(torch.cumsum(torch.tensor(lengths), 0), (1, 0))
    cmask = denominator_mask(loss_mask, keep, rejected_in_denominator)

    whole_den = local_denominators(cmask, cu)
    whole = aggregate(values, keep, cu, mode, whole_den, count_mask=cmask)

    # Split the sequences into consecutive groups (micro-batches on one or several ranks): the
    # global denominators are the sums of the pieces' local counts.
    bounds = [0, *cuts, len(lengths)]
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        t0, t1 = int(cu[a]), int(cu[b])
        pieces.append((slice(t0, t1), cu[a : b + 1] - cu[a]))
    den = Denominators(0, 0)
    for sl, pcu in pieces:
        den = den + local_denominators(cmask[sl], pcu)
    assert den == whole_den
    split = sum(aggregate(values[sl], keep[sl], pcu, mode, den, count_mask=cmask[sl]) for sl, pcu in pieces)
    torch.testing.assert_close(torch.as_tensor(split, dtype=torch.float64), whole, rtol=1e-12, atol=1e-12)
    (g_whole,) = torch.autograd.grad(whole, values, retain_graph=True)
    if isinstance(split, torch.Tensor) and split.requires_grad:
        (g_split,) = torch.autograd.grad(split, values)
        torch.testing.assert_close(g_split, g_whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", ["x", b"7", True, [1, 2], None, torch.ones(2)])
def test_denominators_name_the_field_of_a_bad_count(bad):
    """Issue 27's backlog: ``Denominators('x', 1)`` raised ``could not convert string to float``
    without naming the field; a bool passed as a count was taken as 1."""
    with pytest.raises(ValueError, match=r"Denominators\.num_tokens=.* must be a finite count >= 0"):
        Denominators(bad, 1)
    with pytest.raises(ValueError, match=r"Denominators\.num_sequences=.* must be a finite count >= 0"):
        Denominators(3, bad)
    assert Denominators(torch.tensor(3.0), 2).num_tokens == 3.0
