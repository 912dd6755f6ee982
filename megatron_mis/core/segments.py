"""Segment (per-sequence) reductions over packed token tensors, without Python loops over
sequences and without host-device synchronisation.

A packed batch is a flat ``[T]`` tensor whose sequences are contiguous, described by
``cu_seqlens`` ``[N+1]`` (``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``) or equivalently by
``lengths`` ``[N]``. A context-parallel rank's local pieces are contiguous per sequence too, so
the same description (local lengths) covers them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "as_cu_seqlens",
    "cu_seqlens_from_lengths",
    "expand",
    "segment_max",
    "segment_min",
    "segment_sum",
    "sequence_ids",
    "to_device",
]


def cu_seqlens_from_lengths(lengths: Sequence[int] | torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """``[N+1]`` int64 offsets from ``[N]`` lengths."""
    lengths = torch.as_tensor(lengths, dtype=torch.long, device=device)
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


def _host_offsets(cu_seqlens: Sequence[int]) -> list[int]:
    if isinstance(cu_seqlens, (str, bytes)) or not hasattr(cu_seqlens, "__iter__"):
        raise TypeError(
            f"cu_seqlens must be a list of N+1 integer offsets or a 1-D integer tensor, got "
            f"{type(cu_seqlens).__name__} ({cu_seqlens!r:.60})"
        )
    values = []
    for i, v in enumerate(cu_seqlens):
        if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__index__"):
            raise TypeError(f"cu_seqlens[{i}]={v!r:.40} must be an integer offset, got {type(v).__name__}")
        if isinstance(v, float):
            if not (math.isfinite(v) and v == int(v)):
                raise ValueError(f"cu_seqlens[{i}]={v!r} must be an integer offset (no fraction, NaN or inf)")
            v = int(v)
        values.append(int(v))
    return values


def as_cu_seqlens(cu_seqlens: Sequence[int] | torch.Tensor, num_tokens: int, device: torch.device) -> torch.Tensor:
    """Validate and move ``cu_seqlens`` to ``device`` as int64.

    Validation (integer entries, first entry 0, non-decreasing, last entry ``num_tokens``) runs
    when the offsets are host data (a list or a CPU tensor); offsets already on an accelerator are
    trusted, so the check never forces a device synchronisation. Host offsets reach an
    accelerator by a non-blocking copy from pinned memory.

    Raises:
        TypeError / ValueError: naming ``cu_seqlens``, the offending entry and what is allowed.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens must be a 1-D tensor [N+1], got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype == torch.bool or cu_seqlens.is_complex():
            raise TypeError(f"cu_seqlens must hold integer offsets, got dtype {cu_seqlens.dtype}")
        if cu_seqlens.device.type != "cpu":
            if cu_seqlens.is_floating_point():
                raise TypeError(f"cu_seqlens on {cu_seqlens.device} must be an integer tensor, got {cu_seqlens.dtype}")
            return cu_seqlens.to(device=device, dtype=torch.long)
        values = _host_offsets(cu_seqlens.tolist())  # host memory: reading it is no device sync
    else:
        values = _host_offsets(cu_seqlens)
    if not values:
        raise ValueError("cu_seqlens must have N+1 >= 1 entries, got an empty sequence")
    if values[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(
                f"cu_seqlens must be non-decreasing: cu_seqlens[{i}]={values[i]} < cu_seqlens[{i - 1}]={values[i - 1]}"
            )
    if values[-1] != num_tokens:
        raise ValueError(f"cu_seqlens[-1]={values[-1]} must equal the number of tokens {num_tokens}")
    return to_device(torch.tensor(values, dtype=torch.long), device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without blocking the host (pinned, non-blocking on CUDA)."""
    if torch.device(device).type == "cpu":
        return host
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def sequence_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[T]`` int64 sequence index of every token (one index_add and one cumsum; handles
    zero-length sequences; no synchronisation)."""
    marks = torch.zeros(num_tokens + 1, dtype=torch.long, device=cu_seqlens.device)
    marks.index_add_(0, cu_seqlens[1:-1], torch.ones_like(cu_seqlens[1:-1]))
    return torch.cumsum(marks[:num_tokens], 0)


def segment_sum(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[T]`` -> ``[N]`` sums over contiguous segments of ``lengths`` (empty segments give 0).
    Booleans are summed as float32 counts."""
    if values.dtype == torch.bool:
        values = values.to(torch.float32)
    if lengths.numel() == 0:
        return values.new_zeros(0)
    return torch.segment_reduce(values, "sum", lengths=lengths, initial=0)


def segment_min(values: torch.Tensor, lengths: torch.Tensor, fill: float) -> torch.Tensor:
    """Per-segment minima; empty segments get ``fill``."""
    if lengths.numel() == 0:
        return values.new_zeros(0)
    return torch.segment_reduce(values, "min", lengths=lengths, initial=fill)


def segment_max(values: torch.Tensor, lengths: torch.Tensor, fill: float) -> torch.Tensor:
    """Per-segment maxima; empty segments get ``fill``."""
    if lengths.numel() == 0:
        return values.new_zeros(0)
    return torch.segment_reduce(values, "max", lengths=lengths, initial=fill)


def expand(per_sequence: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """``[N, ...]`` -> ``[T, ...]``: repeat each sequence's value over its tokens."""
    return per_sequence.index_select(0, seq_ids)
