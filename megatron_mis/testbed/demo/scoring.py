"""The trainer's log-probs outside a training step: a Megatron-Core GPTModel forward over packed
sequences, then :func:`megatron_mis.parallel.tp_logprobs.vocab_parallel_log_probs` at the
response rows.

This is the arithmetic :class:`megatron_mis.integrations.megatron_loss.MegatronRLLoss` runs in
its loss function and in its pi_old recompute (one log-prob function for the whole package);
the rollout engine's true-on-policy path records the same numbers through
:func:`megatron_mis.parallel.tp_logprobs.log_probs_from_shards`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_mis.parallel.tp_logprobs import vocab_parallel_log_probs

__all__ = ["trainer_log_probs"]


def trainer_log_probs(
    model: Any,
    batch: Any,
    response_lengths: Sequence[int] | torch.Tensor,
    *,
    tp_group: Any = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> list[torch.Tensor]:
    """Forward ``model`` (a Megatron GPTModel, last pipeline stage) on a packed batch and return
    this rank's response log-probs per sequence.

    Args:
        model: the GPTModel.
        batch: a :class:`megatron_mis.parallel.packing.PackedBatch` for this CP rank.
        response_lengths: ``[N]`` response lengths (the last tokens of every sequence).
        tp_group: the tensor-parallel group (explicit; ``None``: full vocabulary here).
        temperature: the rollout temperature.
        chunk_size: tokens per chunk of the log-prob computation.

    Returns:
        ``N`` float32 tensors, this CP rank's local response pieces (full responses with
        CP = 1), in :func:`megatron_mis.parallel.layout.local_response_layout` order. Gradients
        flow unless called under ``torch.no_grad()``. Collectives: those of the model's forward
        and ``2 * ceil(R_local / chunk_size)`` over ``tp_group``.
    """
    logits = model(batch.tokens, batch.position_ids, None, packed_seq_params=batch.packed_seq_params)
    index = batch.response_index(response_lengths).to(logits.device)
    logp, _ = vocab_parallel_log_probs(
        logits[0].index_select(0, index),
        batch.labels[0].to(logits.device)[index],
        group=tp_group,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    counts = torch.bincount(batch.sequence_ids[index.cpu()], minlength=batch.num_sequences)[: batch.num_sequences]
    return list(torch.split(logp, counts.tolist()))
