"""The host drop-in's list adapter: its C-level fast paths (type sets, ``map`` of tensor
methods, ``itertools.accumulate``) accept exactly what the per-entry paths accept, and the
per-entry paths still name the culprit."""

from __future__ import annotations

from argparse import Namespace

import numpy as np
import pytest
import torch

from megatron_mis.integrations.tis_functions import compute_mis_weights_fsdp, compute_mis_weights_with_cp
from megatron_mis.parallel.cp_mis import lengths_1d
from megatron_mis.parallel.layout import validate_lengths

ARGS = dict(custom_config_path=None, use_tis=True, use_rs=True, rs_level="geometric", tis_upper_bound=1.5,
            rs_lower_bound=0.5, rs_upper_bound=2.0, rs_veto_threshold=1e-4, tis_batch_normalize=True)


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    rollout = [-torch.rand(n, generator=g) * 3 for n in lengths]
    train = [r + torch.randn(n, generator=g) * 0.05 for r, n in zip(rollout, lengths)]
    masks = [(torch.rand(n, generator=g) > 0.1).to(torch.int64) for n in lengths]
    return train, rollout, masks


def test_lengths_of_one_dimensional_tensors_and_minus_one_for_others():
    assert lengths_1d([torch.zeros(3), torch.zeros(0), torch.zeros(5)]) == [3, 0, 5]
    assert lengths_1d([torch.zeros(3), torch.zeros(2, 2), torch.zeros(())]) == [3, -1, -1]
    assert lengths_1d([]) == []


def test_validate_lengths_fast_path_agrees_with_the_per_entry_rules():
    validate_lengths([5, 3, 1, 0], [4, 2, 0, 0])  # 0-length response, even in an empty sequence, is fine
    validate_lengths([np.int64(5), 3], [np.int64(4), 2])  # numpy integers take the per-entry path
    with pytest.raises(ValueError, match="sequence 1: response_length=3 needs a prompt"):
        validate_lengths([5, 3], [4, 3])
    with pytest.raises(ValueError, match=r"sequence 0: total_lengths\[0\]=5 and response_lengths\[0\]=-1 must both be >= 0"):
        validate_lengths([5], [-1])
    with pytest.raises(ValueError, match=r"total_lengths\[1\]=-1"):  # the fuzz finding: the parameter is named
        validate_lengths([3, -1], [1, 0])


def test_parameters_and_numpy_lengths_take_the_slow_path_with_the_same_result():
    lengths = [7, 1, 12, 4]
    train, rollout, masks = _batch(lengths)
    pg = torch.randn(sum(lengths))
    args = Namespace(**ARGS)
    loss, out_masks, metrics = compute_mis_weights_fsdp(args, pg_loss=pg, train_log_probs=train,
                                                        rollout_log_probs=rollout, loss_masks=masks)
    # a Parameter among the tensors, tuples instead of lists, numpy integer lengths
    train_p = tuple(torch.nn.Parameter(t.clone(), requires_grad=False) for t in train)
    loss2, out_masks2, metrics2 = compute_mis_weights_with_cp(
        args, pg_loss=pg, train_log_probs=train_p, rollout_log_probs=tuple(rollout), loss_masks=tuple(masks),
        total_lengths=[np.int64(n + 3) for n in lengths], response_lengths=[np.int64(n) for n in lengths],
        cp_group=None,
    )
    assert torch.equal(loss, loss2)
    assert all(torch.equal(a, b) for a, b in zip(out_masks, out_masks2))
    assert metrics.keys() == metrics2.keys()
    assert all(torch.equal(metrics[k], metrics2[k]) for k in metrics)


def test_the_per_entry_paths_name_the_culprit():
    train, rollout, masks = _batch([3, 4])
    pg = torch.randn(7)
    args = Namespace(**ARGS)
    with pytest.raises(TypeError, match=r"rollout_log_probs\[1\] must be a torch.Tensor, got list"):
        compute_mis_weights_fsdp(args, pg_loss=pg, train_log_probs=train, rollout_log_probs=[rollout[0], [0.1] * 4],
                                 loss_masks=masks)
    with pytest.raises(TypeError, match=r"loss_masks\[0\] must be a torch.Tensor, got str"):
        compute_mis_weights_fsdp(args, pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout,
                                 loss_masks=["abc", masks[1]])
    with pytest.raises(TypeError, match=r"response_lengths\[1\]=True must be an integer"):
        compute_mis_weights_with_cp(args, pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks,
                                    total_lengths=[4, 5], response_lengths=[3, True], cp_group=None)


def test_concat_sequences_is_torch_cat_and_restores_the_thread_count():
    from megatron_mis.core.segments import concat_sequences

    parts = [torch.arange(n, dtype=torch.float32) for n in (3, 0, 5, 1)]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(concat_sequences(parts, "cpu"), torch.cat(parts))
        assert torch.get_num_threads() == 2
        assert concat_sequences([], "cpu").shape == (0,)
        with pytest.raises(TypeError):  # torch.cat refuses a non-tensor entry
            concat_sequences([torch.zeros(2), "not a tensor"], "cpu")
        assert torch.get_num_threads() == 2  # restored on error too
    finally:
        torch.set_num_threads(before)
