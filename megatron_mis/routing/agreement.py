"""Routing agreement: how many of the replayed experts the trainer's own router would have chosen.

For a token with replayed (rollout) experts ``R`` and the trainer router's natural top-k ``N``
(both ``k`` distinct ids) the agreement is ``|R ∩ N| / k``; a layer's agreement is its mean over
real (non-padding) tokens. 1.0 means the two engines route identically; the gap is the routing
part of the training-inference mismatch that R3 removes.

The per-layer statistic is kept as ``[sum of per-token agreement, token count]`` so that micro-
batches and ranks combine by summation (:func:`reduce_agreement`: one all-reduce). Ratios are
unchanged when a token is counted on several ranks the same number of times (tensor-parallel
ranks without sequence parallelism all see every token), so any group that spans the data-,
context- and pipeline-parallel ranks gives the global figure.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_mis.core.segments import to_device

__all__ = ["agreement_counts", "reduce_agreement", "agreement_fractions"]


def agreement_counts(
    replayed: torch.Tensor, natural: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """``[2]`` float64 ``(sum over valid tokens of |replayed ∩ natural| / k, number of valid tokens)``.

    Args:
        replayed: ``[N, k]`` expert ids the router used (distinct per row).
        natural: ``[N, k]`` the router's own top-k (distinct per row).
        valid: ``[N]`` bool, False for padding tokens (``None``: all valid).

    Cost: an ``[N, k, k]`` comparison, no host synchronisation.
    """
    if replayed.shape != natural.shape or replayed.dim() != 2:
        raise ValueError(f"replayed {tuple(replayed.shape)} and natural {tuple(natural.shape)} must both be [N, k]")
    k = replayed.shape[1]
    hits = (replayed.unsqueeze(2) == natural.unsqueeze(1)).any(2).sum(1).to(torch.float64) / max(k, 1)  # [N]
    if valid is None:
        count = hits.new_full((), float(hits.numel()))  # a fill on the device, not a host copy
        return torch.stack([hits.sum(), count])
    if valid.device != hits.device:  # host flags: pinned, non-blocking (a plain .to() would block)
        valid = to_device(valid, hits.device) if valid.device.type == "cpu" else valid.to(hits.device)
    valid = valid.to(torch.bool)
    return torch.stack([(hits * valid).sum(), valid.sum().to(torch.float64)])


def reduce_agreement(stats: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum ``[num_layers, 2]`` agreement statistics over ``group`` (one all-reduce, in place on
    a copy; no gradient). ``group`` must be given explicitly."""
    import torch.distributed as dist

    if group is None:
        raise ValueError("reduce_agreement needs an explicit process group")
    out = stats.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def agreement_fractions(stats: torch.Tensor, layer_ids: list[int] | None = None) -> dict[int, float]:
    """``{layer_id: agreement}`` from ``[num_layers, 2]`` statistics (layers with no tokens are
    left out). ``layer_ids`` names the rows (default ``0 .. num_layers-1``)."""
    stats = stats.detach().to("cpu", torch.float64)
    ids = list(range(stats.shape[0])) if layer_ids is None else list(layer_ids)
    return {i: float(s / c) for i, (s, c) in zip(ids, stats.tolist()) if c > 0}
