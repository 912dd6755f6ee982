"""megatron_mis.core.bitwise: bit-pattern comparison of training and rollout log-probs
(hand-built cases; the end-to-end true-on-policy check is in test_rollout.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megatron_mis.core.bitwise import assert_bitwise_equal, compare_log_probs


def _seqs():
    g = torch.Generator().manual_seed(0)
    return [-torch.rand(n, generator=g) * 3 for n in (4, 1, 6)]


def test_identical_inputs_are_bitwise_equal():
    a = _seqs()
    r = compare_log_probs(a, [t.clone() for t in a])
    assert r.bitwise_equal and r.dtype_match
    assert (r.num_tokens, r.num_different, r.max_abs_diff, r.mean_abs_diff) == (11, 0, 0.0, 0.0)
    assert r.first_mismatch.tolist() == [-1, -1, -1]
    assert r.summary().startswith("bitwise equal: 11 tokens in 3 sequences")
    assert assert_bitwise_equal(a, a).bitwise_equal


def test_one_ulp_is_found_with_its_position():
    a = _seqs()
    b = [t.clone() for t in a]
    b[2][3] = torch.nextafter(b[2][3], torch.tensor(0.0))
    r = compare_log_probs(a, b)
    assert not r.bitwise_equal
    assert r.num_different == 1 and r.num_sequences_different == 1
    assert r.first_mismatch.tolist() == [-1, -1, 3]
    ulp = abs(float(a[2][3].double() - b[2][3].double()))
    assert r.max_abs_diff == ulp > 0
    assert r.mean_abs_diff == pytest.approx(ulp / 11)
    assert r.fraction_different == pytest.approx(1 / 11)
    with pytest.raises(AssertionError, match="NOT bitwise equal: 1/11 tokens differ"):
        assert_bitwise_equal(a, b)


def test_signed_zero_differs_in_bits_not_in_value():
    r = compare_log_probs([torch.tensor([0.0, -1.0])], [torch.tensor([-0.0, -1.0])])
    assert not r.bitwise_equal and r.num_different == 1 and r.max_abs_diff == 0.0


def test_mask_restricts_the_comparison():
    a = _seqs()
    b = [t.clone() for t in a]
    b[0][1] += 1.0
    mask = [torch.ones_like(t) for t in a]
    mask[0][1] = 0
    r = compare_log_probs(a, b, mask=mask)
    assert r.bitwise_equal and r.num_tokens == 10
    mask[0][1] = 1
    r = compare_log_probs(a, b, mask=mask)
    assert r.first_mismatch.tolist() == [1, -1, -1] and r.max_abs_diff == pytest.approx(1.0)


def test_flat_with_cu_seqlens_equals_lists():
    a = _seqs()
    b = [t.clone() for t in a]
    b[1][0] -= 0.5
    cu = torch.tensor([0, 4, 5, 11])
    flat = compare_log_probs(torch.cat(a), torch.cat(b), cu_seqlens=cu)
    lists = compare_log_probs(a, b)
    assert flat.to_dict() == lists.to_dict()
    assert compare_log_probs(torch.cat(a), torch.cat(b)).num_sequences == 1


def test_dtype_mismatch_is_never_bitwise_equal():
    a = _seqs()
    r = compare_log_probs(a, [t.double() for t in a])
    assert not r.bitwise_equal and not r.dtype_match
    assert r.num_different == 0 and r.max_abs_diff == 0.0  # same values after casting
    assert "dtypes differ" in r.summary()
    json.dumps(r.to_dict())


def test_non_finite_values():
    nan, inf = float("nan"), float("inf")
    r = compare_log_probs([torch.tensor([nan, -inf, -1.0])], [torch.tensor([nan, -inf, nan])])
    assert r.num_different == 1 and r.first_mismatch.tolist() == [2]
    assert r.max_abs_diff == inf
    assert compare_log_probs([torch.tensor([nan, -inf])], [torch.tensor([nan, -inf])]).bitwise_equal


@pytest.mark.parametrize(
    "train, rollout, kwargs, match",
    [
        ([torch.zeros(3)], [torch.zeros(2)], {}, "sequence 0: train has 3 log-probs, rollout 2"),
        ([torch.zeros(3)], [torch.zeros(3), torch.zeros(1)], {}, "got 1 train, 2 rollout"),
        (torch.zeros(4), torch.zeros(4), {"cu_seqlens": torch.tensor([0, 3])}, "offsets from 0 to 4"),
        (torch.zeros(2, 2), torch.zeros(2, 2), {}, "must be flat"),
        ([torch.zeros(2)], [torch.zeros(2)], {"mask": [torch.ones(3)]}, "mask has 3 entries"),
        ([torch.zeros(2), torch.zeros(2).double()], [torch.zeros(2)] * 2, {}, "train_log_probs\\[1\\] has dtype"),
    ],
)
def test_bad_input(train, rollout, kwargs, match):
    with pytest.raises(ValueError, match=match):
        compare_log_probs(train, rollout, **kwargs)


def test_core_module_imports_no_megatron():
    code = "import sys, megatron_mis.core.bitwise; print(any(m.startswith('megatron.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
