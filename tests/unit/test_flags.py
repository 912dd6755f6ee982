"""Tier 1: the engine's float32 0/1 flag factors against hand-derived values."""

from __future__ import annotations

import pytest
import torch

from megatron_mis.core.flags import above, as_bool, as_factor, below

NAN, INF = float("nan"), float("inf")


def test_comparisons_write_float32_ones_and_zeros_and_nan_compares_false():
    x = torch.tensor([-INF, -1.0, 0.5, 0.99, 1.0, 1.5, INF, NAN])
    lo = below(x, 1.0)
    hi = above(x, 1.0)
    assert lo.dtype == hi.dtype == torch.float32
    assert lo.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert hi.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]  # the threshold itself is neither


def test_comparisons_of_float64_inputs_are_exact_at_the_threshold():
    # 1 + 2^-40 is above 1 in float64 but rounds to 1 in float32: the comparison reads the input
    x = torch.tensor([1.0 + 2.0**-40, 1.0 - 2.0**-40], dtype=torch.float64)
    assert above(x, 1.0).tolist() == [1.0, 0.0]
    assert below(x, 1.0).tolist() == [0.0, 1.0]


def test_bool_factor_round_trip_and_arithmetic_logic():
    a = torch.tensor([True, True, False, False])
    b = torch.tensor([True, False, True, False])
    fa, fb = as_factor(a), as_factor(b)
    assert fa.dtype == torch.float32 and fa.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert torch.equal(as_bool(fa * fb), a & b)
    assert torch.equal(as_bool(torch.maximum(fa, fb)), a | b)
    assert torch.equal(as_bool(1.0 - fa), ~a)
    assert torch.equal(as_bool(fa * (1.0 - fb)), a & ~b)


def test_as_factor_refuses_a_non_bool_tensor_naming_its_dtype():
    with pytest.raises(TypeError, match="bool tensor, got torch.int64"):
        as_factor(torch.tensor([1, 0]))


def test_factors_of_empty_tensors_are_empty():
    empty = torch.zeros(0)
    assert below(empty, 0.0).shape == (0,) and above(empty, 0.0).shape == (0,)
    assert as_factor(torch.zeros(0, dtype=torch.bool)).shape == (0,)
