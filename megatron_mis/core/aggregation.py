"""Loss aggregation from per-token values to one scalar, with global denominators.

Three modes (``values`` per token, ``m`` the numerator mask, ``c`` the denominator mask):

- ``token_mean``: ``sum_t m_t v_t / D_tok``;
- ``seq_mean_token_mean``: ``sum_s (sum_{t in s} m_t v_t / n_s) / D_seq``;
- ``seq_mean_token_sum``: ``sum_s (sum_{t in s} m_t v_t) / D_seq``;

with ``n_s = sum_{t in s} c_t`` the sequence's full token count and ``D_tok`` / ``D_seq`` the
*global* token / sequence counts of the whole optimizer step (every micro-batch, every data- and
context-parallel rank). Because the denominators are passed in, the per-micro-batch results
simply add up to the global loss: the loss does not depend on how the batch is split over
micro-batches and ranks. A sequence counts in ``D_seq`` when it has at least one token in the
denominator mask (empty sequences count nowhere).

Rejected tokens (removed by rejection sampling, mask-mode IS or the veto) never reach the
numerator. Whether they stay in the denominators is an explicit choice
(``rejected_in_denominator``), because frameworks disagree:

- ``True`` (current slime: denominators from the original loss mask, ``rollout_mask_sums``): a
  rejected token still counts, so rejecting tokens shrinks the loss and the step;
- ``False`` (Miles when ``rollout_mask_sums`` is absent): denominators count kept tokens only, so
  the surviving tokens carry the whole step; a fully rejected sequence leaves ``D_seq``.

Under context parallelism a sequence is split over ranks: pass ``seq_token_counts`` (the full
per-sequence counts, summed over the CP group) and count each sequence on one CP rank only
(``count_sequences=False`` elsewhere) when building denominators.

Pure torch; nothing here imports Megatron or torch.distributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import get_args

import torch

from megatron_mis.config.loss import AggregationMode
from megatron_mis.core.checks import reads_values
from megatron_mis.core.segments import segment_sum as _segment_sum, sequence_ids, to_device

__all__ = [
    "AGGREGATION_MODES",
    "Denominators",
    "aggregate",
    "denominator_mask",
    "local_denominators",
    "segment_ids",
    "segment_sum",
]

AGGREGATION_MODES: tuple[str, ...] = get_args(AggregationMode)


@dataclass(frozen=True, slots=True)
class Denominators:
    """Global counts of one optimizer step (all micro-batches, all DP / CP ranks).

    Attributes:
        num_tokens: tokens in the denominator mask (``token_mean`` and all token-mean metrics).
        num_sequences: sequences with at least one token in the denominator mask (``seq_*``).
    """

    num_tokens: float
    num_sequences: float

    def __post_init__(self) -> None:
        for name in ("num_tokens", "num_sequences"):
            raw = getattr(self, name)
            try:
                if isinstance(raw, (str, bytes, bool)):
                    raise TypeError
                value = float(raw)
            except (TypeError, ValueError, OverflowError, RuntimeError):
                raise ValueError(
                    f"Denominators.{name}={raw!r} must be a finite count >= 0 (a number or a one-element "
                    f"tensor), got {type(raw).__name__}"
                ) from None
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"Denominators.{name}={raw!r} must be a finite count >= 0")
            object.__setattr__(self, name, value)

    def __add__(self, other: "Denominators") -> "Denominators":
        return Denominators(self.num_tokens + other.num_tokens, self.num_sequences + other.num_sequences)

    def for_mode(self, mode: str) -> float:
        """The denominator ``mode`` divides by."""
        return self.num_tokens if mode == "token_mean" else self.num_sequences


def _check_cu(cu_seqlens: torch.Tensor, num_tokens: int, what: str = "values") -> None:
    """The shape always; the values where reading them costs no device synchronisation (host
    offsets, or the debug flag: :mod:`megatron_mis.core.checks`)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [N+1], got shape {tuple(cu_seqlens.shape)}")
    if not reads_values(cu_seqlens):
        return
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != num_tokens:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at the number of tokens of {what} ({num_tokens}), "
            f"got {int(cu_seqlens[0])}..{int(cu_seqlens[-1])}"
        )
    if cu_seqlens.numel() > 1 and bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")


def segment_ids(cu_seqlens: torch.Tensor, device: torch.device | None = None, num_tokens: int | None = None) -> torch.Tensor:
    """``[T]`` long: the sequence index of every token, from ``cu_seqlens [N+1]`` — the losses'
    name for :func:`megatron_mis.core.segments.sequence_ids` (one implementation). Host offsets
    reach an accelerator without blocking; pass ``num_tokens`` for offsets on an accelerator
    (else ``T`` is read from them: one synchronisation)."""
    cu = _on(cu_seqlens, device or cu_seqlens.device)
    if num_tokens is None:
        num_tokens = int(cu_seqlens[-1]) if cu_seqlens.numel() else 0
    return sequence_ids(cu, num_tokens)


def _on(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``cu_seqlens`` as int64 on ``device``; host offsets go through a non-blocking copy."""
    cu = cu_seqlens.to(torch.long)
    if cu.device.type == "cpu" and torch.device(device).type != "cpu":
        return to_device(cu, device)
    return cu.to(device)


def segment_sum(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[N]``: the sum of ``values [T]`` over each sequence of ``cu_seqlens [N+1]`` (differentiable;
    validates ``cu_seqlens``, then :func:`megatron_mis.core.segments.segment_sum`)."""
    _check_cu(cu_seqlens, values.shape[0])
    return _segment_sum(values, cu_seqlens)


def denominator_mask(loss_mask: torch.Tensor, keep_mask: torch.Tensor | None, rejected_in_denominator: bool) -> torch.Tensor:
    """``[T]`` bool: the tokens the denominators count.

    Args:
        loss_mask: ``[T]`` the original loss mask (any dtype; nonzero = in the loss).
        keep_mask: ``[T]`` bool, the loss mask minus rejected tokens (``MISResult.keep_mask``);
            ``None``: nothing rejected.
        rejected_in_denominator: keep rejected tokens in the denominators.
    """
    base = loss_mask.bool()
    if keep_mask is None or rejected_in_denominator:
        return base
    if keep_mask.shape != base.shape:
        raise ValueError(f"keep_mask {tuple(keep_mask.shape)} and loss_mask {tuple(base.shape)} must have the same shape")
    return base & keep_mask.bool()


def local_denominators(
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    seq_token_counts: torch.Tensor | None = None,
    count_sequences: bool = True,
) -> Denominators:
    """This micro-batch's contribution to the step's :class:`Denominators` (sum these over
    micro-batches and ranks; one host sync).

    Args:
        mask: ``[T]`` the denominator mask (see :func:`denominator_mask`).
        cu_seqlens: ``[N+1]`` sequence boundaries in ``mask``.
        seq_token_counts: ``[N]`` full per-sequence counts (context parallelism); default:
            counted from ``mask``.
        count_sequences: count sequences here (``False`` on all but one CP rank).
    """
    mask = mask.bool()
    _check_cu(cu_seqlens, mask.shape[0], "mask")
    counts = segment_sum(mask.float(), cu_seqlens) if seq_token_counts is None else seq_token_counts
    num_seq = (counts > 0).sum().to(torch.float64) if count_sequences else torch.zeros((), dtype=torch.float64, device=counts.device)
    num_tok, num_seq = torch.stack([mask.sum().to(torch.float64), num_seq.to(mask.device)]).tolist()  # the one read
    return Denominators(num_tok, num_seq)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mode: str,
    denominators: Denominators,
    *,
    seq_token_counts: torch.Tensor | None = None,
    count_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the step loss (the shares of all micro-batches and ranks sum
    to the global value).

    Args:
        values: ``[T]`` per-token values (float, may carry grad). Entries outside ``mask`` may
            be NaN / inf: they are selected away with ``torch.where``, never multiplied by 0.
        mask: ``[T]`` numerator mask (bool or 0/1).
        cu_seqlens: ``[N+1]`` sequence boundaries in ``values``.
        mode: ``token_mean``, ``seq_mean_token_mean`` or ``seq_mean_token_sum``.
        denominators: global step counts.
        seq_token_counts: ``[N]`` full per-sequence denominator counts (for
            ``seq_mean_token_mean`` under context parallelism); default: counted from
            ``count_mask``.
        count_mask: ``[T]`` denominator mask used to count ``n_s`` when ``seq_token_counts``
            is not given; default ``mask``.

    Returns:
        0-dim tensor. A zero denominator (no token anywhere in the step) gives an exact 0 that
        still carries the graph.

    Raises:
        ValueError: unknown mode, shape mismatches, or local tokens with a zero global
            denominator (the denominators do not describe this data).
    """
    if mode not in AGGREGATION_MODES:
        from megatron_mis.registry import suggest

        raise ValueError(f"unknown loss aggregation {mode!r}{suggest(mode, AGGREGATION_MODES)}; valid: {', '.join(AGGREGATION_MODES)}")
    if values.dim() != 1 or mask.shape != values.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must be 1-D tensors of the same length")
    _check_cu(cu_seqlens, values.shape[0])
    mask = mask.bool()
    masked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    denom = denominators.for_mode(mode)
    if denom == 0.0:
        if reads_values(mask) and bool(mask.any()):
            raise ValueError(
                f"{int(mask.sum())} local token(s) in the loss but the global {mode} denominator is 0: "
                "the denominators were not computed from this data"
            )
        return masked.sum() * 0.0
    if mode == "token_mean":
        return masked.sum() / denom
    per_seq = segment_sum(masked, cu_seqlens)
    if mode == "seq_mean_token_sum":
        return per_seq.sum() / denom
    if seq_token_counts is None:
        cmask = mask if count_mask is None else count_mask.bool()
        if cmask.shape != mask.shape:
            raise ValueError(f"count_mask {tuple(cmask.shape)} and mask {tuple(mask.shape)} must have the same shape")
        if reads_values(mask, cmask) and bool((mask & ~cmask).any()):
            raise ValueError("every token of the numerator mask must also be in count_mask (the denominator mask)")
        seq_token_counts = segment_sum(cmask.to(values.dtype), cu_seqlens)
    elif seq_token_counts.shape != per_seq.shape:
        raise ValueError(
            f"seq_token_counts has shape {tuple(seq_token_counts.shape)}, expected [{per_seq.shape[0]}] (one per sequence)"
        )
    counts = seq_token_counts.to(device=values.device, dtype=values.dtype)
    safe = torch.where(counts > 0, counts, torch.ones_like(counts))
    return torch.where(counts > 0, per_seq / safe, torch.zeros_like(per_seq)).sum() / denom
