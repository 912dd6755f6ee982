"""The trainer's log-probs: a Megatron-Core GPTModel forward over packed sequences, then a
vocab-parallel log-softmax at the next-token labels.

:func:`vocab_parallel_log_probs` is the one function both the training step and the rollout
engine's true-on-policy path (:mod:`megatron_mis.demo.rollout`) reproduce, operation by
operation, so it is written out explicitly (three TP all-reduces, DESIGN section 4) instead of
calling Megatron's cross-entropy, which reads the global TP group and works in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["vocab_parallel_log_probs", "trainer_log_probs"]


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: Any = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``log softmax(logits / temperature)[label]`` with the vocabulary split over ``tp_group``.

    Args:
        logits: ``[..., V / tp]`` this rank's vocabulary shard (rank ``r`` holds ids
            ``[r * V/tp, (r+1) * V/tp)``); computed in float32.
        labels: ``[...]`` int64 GLOBAL token ids.
        tp_group: the tensor-parallel group (explicit; ``None`` or a group of size 1: no
            communication).
        temperature: positive sampling temperature the logits are divided by (1: no division).

    Returns:
        ``[...]`` float32 log-probs, identical on every TP rank. Differentiable: each rank
        receives the gradient of its own logit shard.

    Collectives (tp > 1): three all-reduces over ``tp_group`` — the max (no gradient needed),
    the sum of exponentials and the target logit (forward all-reduce, backward identity, as
    Megatron's ``reduce_from_tensor_model_parallel_region``).
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits {tuple(logits.shape)}[:-1]")
    tp = 1 if tp_group is None else tp_group.size()
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    shard = x.shape[-1]
    rank = 0 if tp == 1 else tp_group.rank()
    start = rank * shard
    logits_max = x.detach().max(dim=-1).values
    if tp > 1:
        import torch.distributed as dist

        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = x - logits_max.unsqueeze(-1)
    sum_exp = shifted.exp().sum(dim=-1)
    local = labels - start
    in_shard = (local >= 0) & (local < shard)
    picked = shifted.gather(-1, local.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1)
    target = torch.where(in_shard, picked, torch.zeros_like(picked))
    if tp > 1:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp, group=tp_group)
        target = reduce_from_tensor_model_parallel_region(target, group=tp_group)
    return target - torch.log(sum_exp)


def trainer_log_probs(
    model: Any,
    batch: Any,
    response_lengths: Sequence[int] | torch.Tensor,
    *,
    tp_group: Any = None,
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """Forward ``model`` (a Megatron GPTModel, last pipeline stage) on a packed batch and return
    this rank's response log-probs per sequence.

    Args:
        model: the GPTModel.
        batch: a :class:`megatron_mis.models.packing.PackedBatch` for this CP rank.
        response_lengths: ``[N]`` response lengths (the last tokens of every sequence).
        tp_group: the tensor-parallel group.
        temperature: the rollout temperature.

    Returns:
        ``N`` float32 tensors, this CP rank's local response pieces (full responses with
        CP = 1), in :func:`megatron_mis.parallel.layout.local_response_layout` order. Gradients
        flow unless called under ``torch.no_grad()``.
    """
    logits = model(batch.tokens, batch.position_ids, None, packed_seq_params=batch.packed_seq_params)
    logp = vocab_parallel_log_probs(logits, batch.labels, tp_group=tp_group, temperature=temperature)[0]  # [T]
    index = batch.response_index(response_lengths)
    counts = torch.bincount(batch.sequence_ids[index], minlength=batch.num_sequences)[: batch.num_sequences]
    return list(torch.split(logp[index.to(logp.device)], counts.tolist()))
